"""HF Mistral (`transformers.MistralForCausalLM`): the Llama layout without biases, GQA, `head_dim`.

The layout, its conversion and the float64-faithful RMSNorm and RoPE are shared with Llama and Qwen2
(engine/models/hf_decoder.py). Mistral's own: no projection has a bias, and `sliding_window`, when
set, masks keys more than that many tokens back on every layer; a window at least as long as the
context (max_position_embeddings) is full causal attention, a shorter one is refused.
"""

from __future__ import annotations

from engine.models.hf_decoder import decoder_family

HF = decoder_family(
    "hf_mistral", "mistral", "Mistral", "Mistral 7B (2023); RoPE: RoFormer (2021); transformers.MistralForCausalLM",
    biases=lambda c: (False, False, False),
    window=lambda c, refuse: c.sliding_window,  # MistralModel masks every layer alike (it ignores layer_types)
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
