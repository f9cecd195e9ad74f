"""HF Mistral (`transformers.MistralForCausalLM`): the Llama layout without biases, GQA, `head_dim`.

The layout, its conversion and the float64-faithful RMSNorm and RoPE are shared with Llama and Qwen2
(engine/models/hf_decoder.py). Mistral's own: no projection has a bias, and `sliding_window`, when
set, masks keys more than that many tokens back on every layer; a window at least as long as the
context (max_position_embeddings) is full causal attention, a shorter one is refused.
"""

from __future__ import annotations

from engine.models import native as nat
from engine.models.hf_decoder import LlamaLayout


def _biases(config) -> tuple[bool, bool, bool]:
    return False, False, False


def _window(config, refuse) -> int | None:
    return config.sliding_window  # MistralModel masks every layer alike (it ignores layer_types)


LAYOUT = LlamaLayout(
    family="hf_mistral", model_type="mistral", prefix="Mistral", display="Mistral (Hugging Face transformers)",
    reference="Mistral 7B (2023); RoPE: RoFormer (2021); transformers.MistralForCausalLM",
    biases=_biases, window=_window,
)
FAMILY, MODEL_TYPE, DISPLAY = LAYOUT.family, LAYOUT.model_type, LAYOUT.display

arch, wrap, build, detect, load, save = LAYOUT.arch, LAYOUT.wrap, LAYOUT.build, LAYOUT.detect, LAYOUT.load, LAYOUT.save
to_canonical, from_canonical = LAYOUT.to_canonical, LAYOUT.from_canonical
logits = nat.causal_lm_logits

ENTRY = LAYOUT.entry()
