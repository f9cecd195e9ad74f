"""HF Gemma (`transformers.GemmaForCausalLM`: gemma-2b, gemma-7b): the Llama layout with a GeGLU MLP, norm gains
stored as offsets from 1 and a scaled token embedding.

The module tree, RoPE with half-split pairs and grouped-query attention (multi-query on gemma-2b) are Llama's
(engine/models/hf_decoder.py). Gemma's own:
- the MLP is GeGLU, `down(gelu_tanh(gate(x)) * up(x))` (`hidden_act` gelu_pytorch_tanh; transformers reads the
  legacy "gelu" as that): the same neuron permutation and up-branch scaling as SwiGLU (docs/MATH.md section 2);
- every RMSNorm multiplies by `1 + weight`: the canonical gain is weight + 1 and is written back as gain - 1,
  an affine conversion, so interpolating native or canonical weights is still the same path;
- the token embedding enters the stream times sqrt(hidden_size), rounded to float32 as transformers stores it
  (Arch.embed_scale), while the tied head reads the embedding unscaled;
- `head_dim` is its own (256 on the released models), not hidden_size / heads; `attention_bias` puts biases on
  all four attention projections, the MLP has none.

Float64 exactness: GemmaRMSNorm normalises in float32 and the rotary tables are float32; both are switched to
float64-faithful subclasses (engine/models/native.py), which compute the same formulas. In bfloat16 the
canonical gains 1 + weight are rounded to bfloat16 where Gemma's own norm adds the 1 in float32, so a bfloat16
Gemma's endpoints are close to, not exactly, its own (the record's endpoint check says by how much: 1.7e-5
relative on a tiny pair with norm weights of 0.05, within the 4.5e-5 a bfloat16 Llama pair shows).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import replace

import torch

from engine.models import hf_decoder
from engine.models import native as nat
from engine.models.hf_family import SCALED_ROPE, Conv, HFFamily, KeyMap, activation

NORMS = ("norm1.g", "norm2.g", "norm_f.g")
OFFSET = Conv(lambda t, a: (t + 1,), lambda ts, a: ts[0] - 1)  # native weight w <-> canonical gain 1 + w

# Llama's key map with every norm gain stored as its offset from 1
KEYS = KeyMap(
    embed=hf_decoder.KEYS.embed, block_native=hf_decoder.KEYS.block_native,
    block=tuple(replace(k, conv=OFFSET) if k.canonical in NORMS else k for k in hf_decoder.KEYS.block),
    final=tuple(replace(k, conv=OFFSET) if k.canonical in NORMS else k for k in hf_decoder.KEYS.final),
)


def embed_scale(d_model: int) -> float:
    """sqrt(d_model) as Gemma's embedding holds it: a float32 tensor, cast to the weights' dtype."""
    return struct.unpack("f", struct.pack("f", d_model**0.5))[0]  # rounded to float32 (no tensor: any device context)


def _summary(config, refuse):
    a = hf_decoder.summary("hf_gemma", _biases, hf_decoder.no_window, False, config, refuse)
    return replace(a, mlp="geglu", embed_scale=embed_scale(a.d_model))


def _biases(c) -> tuple[bool, bool, bool]:
    return bool(c.attention_bias), bool(c.attention_bias), False


@functools.cache
def _rmsnorm64() -> type:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    class GemmaRMSNorm64(GemmaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float64:
                return super().forward(x)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    return GemmaRMSNorm64


def _make_exact(module) -> None:
    """The float64-faithful norms and RoPE, and the embedding scale at its float32 value however the module was
    made (a module built under a float64 default dtype holds sqrt(D) unrounded)."""
    from transformers.models.gemma.modeling_gemma import (
        GemmaRMSNorm,
        GemmaRotaryEmbedding,
        GemmaTextScaledWordEmbedding,
    )

    nat.switch_classes(module, {GemmaRMSNorm: _rmsnorm64(), GemmaRotaryEmbedding: nat.rotary64(GemmaRotaryEmbedding)})
    for m in module.modules():
        if isinstance(m, GemmaTextScaledWordEmbedding):
            m.embed_scale.fill_(embed_scale(m.embedding_dim))


HF = HFFamily(
    name="hf_gemma", model_type="gemma", config_name="Gemma", display="Gemma (Hugging Face transformers)",
    reference="Gemma: Open Models Based on Gemini Research and Technology (2024); RoPE: RoFormer (2021); "
              "transformers.GemmaForCausalLM",
    config_class="GemmaConfig", model_class="GemmaForCausalLM", keys=KEYS, summary=_summary,
    refusals=(SCALED_ROPE,
              activation("hidden_act", ("gelu_pytorch_tanh",), "the gated MLP must be GeGLU (gelu_pytorch_tanh)")),
    prepare=_make_exact,
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
