"""HF OLMo (`transformers.OlmoForCausalLM`: OLMo-1B-hf, OLMo-7B-hf): the Llama layout with LayerNorms that
have no parameters.

The module tree, RoPE with half-split pairs, SwiGLU and grouped-query attention are Llama's
(engine/models/hf_decoder.py). OLMo's own:
- every norm (`input_layernorm`, `post_attention_layernorm`, `model.norm`) is a LayerNorm without gain or
  bias, eps 1e-5 (fixed in transformers' OlmoLayerNorm): canonically a LayerNorm whose gains are 1 (keys
  without a native tensor: engine/models/hf_family.py), so the aligners rewrite it as an RMSNorm model with
  centred writers, as they do GPT-2 and Pythia (engine/surgery.py), and a model with other gains cannot be
  written back as OLMo;
- `attention_bias` puts biases on all four attention projections; the MLP has none;
- `clip_qkv` clamps every query, key and value coordinate: a map inside a head no longer commutes with it,
  so such a config (OLMo-7B-0424) is refused.

Float64 exactness: OlmoLayerNorm normalises in float32 and the rotary tables are float32; both are switched
to float64-faithful subclasses (engine/models/native.py), which compute the same formulas.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.models import hf_decoder
from engine.models import native as nat
from engine.models.hf_family import HFFamily, KeyMap, Refusal

EPS = 1e-5  # transformers' OlmoLayerNorm
NORMS = ("norm1.g", "norm2.g", "norm_f.g")

# Llama's key map with the norm gains stored nowhere (a gain of 1)
KEYS = KeyMap(
    embed=hf_decoder.KEYS.embed, block_native=hf_decoder.KEYS.block_native,
    block=tuple(replace(k, native=None) if k.canonical in NORMS else k for k in hf_decoder.KEYS.block),
    final=tuple(replace(k, native=None) if k.canonical in NORMS else k for k in hf_decoder.KEYS.final),
)
CLIP_QKV = Refusal(lambda c: c.clip_qkv is not None, "clip_qkv={c.clip_qkv!r}",
                   "queries, keys and values clamped coordinate by coordinate: no map inside a head commutes with "
                   "the clamp")


@functools.cache
def _layernorm64() -> type:
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    class OlmoLayerNorm64(OlmoLayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float64:
                return super().forward(x)
            return F.layer_norm(x, self.normalized_shape, None, None, eps=EPS)

    return OlmoLayerNorm64


def _make_exact(module) -> None:
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm, OlmoRotaryEmbedding

    nat.switch_classes(module, {OlmoLayerNorm: _layernorm64(), OlmoRotaryEmbedding: nat.rotary64(OlmoRotaryEmbedding)})


def _biases(c) -> tuple[bool, bool, bool]:
    return bool(c.attention_bias), bool(c.attention_bias), False


HF = HFFamily(
    name="hf_olmo", model_type="olmo", config_name="OLMo", display="OLMo (Hugging Face transformers)",
    reference="OLMo: Accelerating the Science of Language Models (2024); RoPE: RoFormer (2021); "
              "transformers.OlmoForCausalLM",
    config_class="OlmoConfig", model_class="OlmoForCausalLM", keys=KEYS,
    summary=functools.partial(hf_decoder.summary, "hf_olmo", _biases, hf_decoder.no_window, False, layernorm_eps=EPS),
    refusals=(*hf_decoder.REFUSALS, CLIP_QKV), prepare=_make_exact,
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
