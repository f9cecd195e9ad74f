"""HF Qwen3 (`transformers.Qwen3ForCausalLM`): the Llama layout with QK-norm.

The layout, its conversion and the float64-faithful RMSNorm and RoPE are shared with Llama, Qwen2 and
Mistral (engine/models/hf_decoder.py). Qwen3's own: `q_norm` and `k_norm`, an RMSNorm over each head's
query and key (eps `rms_norm_eps`) applied before RoPE, each with one gain [head_dim] shared by every head
of the layer (canonical `attn.q_norm.g`, `attn.k_norm.g`). The norm changes the Q/K symmetry group: only
the RoPE-commutant maps that are scaled signed permutations survive, their moduli moved into the gains
(docs/MATH.md section 1, QK-norm). `attention_bias` puts biases on all four attention projections, the
MLP has none. Sliding-window layers are handled as for Qwen2: a window shorter than the context is refused.
"""

from __future__ import annotations

from engine.models.hf_decoder import decoder_family, sliding_layers_window

HF = decoder_family(
    "hf_qwen3", "qwen3", "Qwen3",
    "Qwen3 Technical Report (2025); RoPE: RoFormer (2021); transformers.Qwen3ForCausalLM",
    biases=lambda c: (bool(c.attention_bias), bool(c.attention_bias), False), window=sliding_layers_window,
    qk_norm=True,
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
