"""HF Llama (`transformers.LlamaForCausalLM`): RoPE (half-split pairs), RMSNorm, SwiGLU, GQA.

The Llama layout itself, its conversion and the float64-faithful RMSNorm and RoPE are shared with
Qwen2, Qwen3 and Mistral (engine/models/hf_decoder.py). Llama's own: `attention_bias` puts biases on all
four attention projections (o_proj too), `mlp_bias` on all three MLP projections (the gate's is the
canonical `mlp.b_gate` [m]), and attention never slides.
"""

from __future__ import annotations

from engine.models.hf_decoder import decoder_family

HF = decoder_family(
    "hf_llama", "llama", "Llama", "LLaMA (2023); RoPE: RoFormer (2021); transformers.LlamaForCausalLM",
    biases=lambda c: (bool(c.attention_bias), bool(c.attention_bias), bool(c.mlp_bias)),
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
