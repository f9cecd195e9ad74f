"""HF Qwen2 / Qwen2.5 (`transformers.Qwen2ForCausalLM`): the Llama layout with biases on Q, K and V.

The layout, its conversion and the float64-faithful RMSNorm and RoPE are shared with Llama, Qwen3 and
Mistral (engine/models/hf_decoder.py). Qwen2's own: q_proj, k_proj and v_proj always carry biases,
o_proj and the MLP never (Arch attn_bias without out_bias; the reference family expresses this with
`qkv_bias`). Under RoPE the query and key biases move with the Q/K map A and the value bias with the
V/O map B, per KV group, and a head permutation permutes all three (engine/spec.py).

Sliding-window attention (`use_sliding_window`, on the layers from `max_window_layers` on, as
`layer_types` lists them) masks keys more than `sliding_window` tokens back; a window at least as long
as the context is full causal attention, a shorter one is refused.
"""

from __future__ import annotations

from engine.models.hf_decoder import decoder_family, sliding_layers_window

HF = decoder_family(
    "hf_qwen2", "qwen2", "Qwen2",
    "Qwen2 Technical Report (2024); RoPE: RoFormer (2021); transformers.Qwen2ForCausalLM",
    biases=lambda c: (True, False, False), window=sliding_layers_window,
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
