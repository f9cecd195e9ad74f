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

from engine.models import native as nat
from engine.models.hf_decoder import LlamaLayout, sliding_layers_window


def _biases(config) -> tuple[bool, bool, bool]:
    return bool(config.attention_bias), bool(config.attention_bias), False


LAYOUT = LlamaLayout(
    family="hf_qwen3", model_type="qwen3", prefix="Qwen3", display="Qwen3 (Hugging Face transformers)",
    reference="Qwen3 Technical Report (2025); RoPE: RoFormer (2021); transformers.Qwen3ForCausalLM",
    biases=_biases, window=sliding_layers_window, qk_norm=True,
)
FAMILY, MODEL_TYPE, DISPLAY = LAYOUT.family, LAYOUT.model_type, LAYOUT.display

arch, wrap, build, detect, load, save = LAYOUT.arch, LAYOUT.wrap, LAYOUT.build, LAYOUT.detect, LAYOUT.load, LAYOUT.save
to_canonical, from_canonical = LAYOUT.to_canonical, LAYOUT.from_canonical
logits = nat.causal_lm_logits

ENTRY = LAYOUT.entry()
