"""HF Llama (`transformers.LlamaForCausalLM`): RoPE (half-split pairs), RMSNorm, SwiGLU, GQA.

The Llama layout itself, its conversion and the float64-faithful RMSNorm and RoPE are shared with
Qwen2 and Mistral (engine/models/hf_decoder.py). Llama's own: `attention_bias` puts biases on all four
attention projections (o_proj too), `mlp_bias` on all three MLP projections (the gate's is the
canonical `mlp.b_gate` [m]), and attention never slides.
"""

from __future__ import annotations

from engine.models import native as nat
from engine.models.hf_decoder import LlamaLayout


def _biases(config) -> tuple[bool, bool, bool]:
    return bool(config.attention_bias), bool(config.attention_bias), bool(config.mlp_bias)


LAYOUT = LlamaLayout(
    family="hf_llama", model_type="llama", prefix="Llama", display="Llama (Hugging Face transformers)",
    reference="LLaMA (2023); RoPE: RoFormer (2021); transformers.LlamaForCausalLM", biases=_biases,
)
FAMILY, MODEL_TYPE, DISPLAY = LAYOUT.family, LAYOUT.model_type, LAYOUT.display

arch, wrap, build, detect, load, save = LAYOUT.arch, LAYOUT.wrap, LAYOUT.build, LAYOUT.detect, LAYOUT.load, LAYOUT.save
to_canonical, from_canonical = LAYOUT.to_canonical, LAYOUT.from_canonical
logits = nat.causal_lm_logits

ENTRY = LAYOUT.entry()
