"""HF decoders in the Llama layout (Llama, Qwen2, Qwen3, Mistral): one key map and one HFFamily factory.

These families share the module tree `model.embed_tokens`, `model.layers[i].{input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`,
and the maths: RMSNorm, RoPE with half-split pairs, SwiGLU, grouped-query attention. They differ in
which projections carry biases, whether attention may slide, whether queries and keys are normalised
per head before RoPE (QK-norm: `self_attn.q_norm`, `self_attn.k_norm`, Qwen3), and their transformers
classes; a family's adapter file names those in one `decoder_family(...)` call (engine/models/hf_family.py
does the rest).

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- `rotate_half` pairs coordinate j with j + d/2 (docs/MATH.md section 1): Arch.rope_layout "half";
- grouped-query attention: k_proj/v_proj have n_kv_heads heads, query head i reads KV head
  i // (n_heads / n_kv_heads) (HF's repeat_kv), the same convention as the reference family;
- SwiGLU `down(silu(gate(x)) * up(x))`: gate_proj -> W_gate, up_proj -> W_in, down_proj -> W_out.
  With an MLP bias the gate has a bias too; the canonical key for it is `mlp.b_gate` [m].
- QK-norm: q_norm.weight, k_norm.weight [d] -> attn.q_norm.g, attn.k_norm.g (one gain per layer, shared
  by every head).

Float64 exactness. Stock HF normalises in float32 (its RMSNorm casts up to float32, which for a
float64 input is a cast down) and builds its RoPE tables in float32, so a float64 model is only
float32-accurate and no symmetry check could reach 1e-10. Every module this adapter hands out has
those two submodules switched to subclasses that compute in float64 when the input is float64 (same
formulas; other dtypes take HF's own path unchanged); the QK-norms are RMSNorm modules of the same
class and are switched too. Nothing about the weights changes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from engine.models import native as nat
from engine.models.base import Arch
from engine.models.hf_family import (
    KEY_VALUE,
    KEY_VALUE_BIAS,
    LINEAR,
    QUERY,
    QUERY_BIAS,
    SCALED_ROPE,
    WRITER,
    HFFamily,
    Key,
    KeyMap,
    Refuse,
    activation,
)
from engine.models.reference import rope_scaling

# ---------------------------------------------------------------------------------------------
# Float64-faithful RMSNorm and RoPE (see the module docstring)


@functools.cache
def hf_class(model_type: str, name: str) -> type:
    """A class of transformers' modeling module of one family, e.g. ("llama", "LlamaRMSNorm")."""
    return getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)


@functools.cache
def _rmsnorm64(RMSNorm: type) -> type:
    class RMSNorm64(RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float64:
                return super().forward(x)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    RMSNorm64.__name__ = RMSNorm64.__qualname__ = f"{RMSNorm.__name__}64"
    return RMSNorm64


# ---------------------------------------------------------------------------------------------
# One family of the layout


# (config, refuse) -> the sliding-attention window, None if attention never slides
Window = Callable[[object, Refuse], int | None]


def no_window(config, refuse: Refuse) -> int | None:
    return None


def sliding_layers_window(config, refuse: Refuse) -> int | None:
    """The window of the layers `layer_types` marks sliding (Qwen2, Qwen3: their configs set sliding_window to
    None without use_sliding_window), None when no layer slides."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    if config.sliding_window is None:
        refuse("layer_types with sliding_attention layers", "they have no window: use_sliding_window is false "
               "or sliding_window is null, and transformers cannot run them")
    return config.sliding_window


def summary(family: str, biases: Callable[[object], tuple[bool, bool, bool]], window: Window, qk_norm: bool,
            config, refuse: Refuse, layernorm_eps: float | None = None) -> Arch:
    """The Arch of a Llama-layout config; `layernorm_eps`: its norms are LayerNorms without parameters of
    that eps (OLMo), not the config's RMSNorms."""
    n_ctx, w = config.max_position_embeddings, window(config, refuse)
    if w is not None and w < n_ctx:
        refuse(f"sliding_window={w}", f"attention to the last {w} tokens only, shorter than its context of "
               f"max_position_embeddings={n_ctx}, is not full causal attention")
    rp = nat.rope_parameters(config)
    h, hkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    attn_bias, out_bias, mlp_bias = biases(config)
    return Arch(
        family=family, task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=h, n_kv_heads=hkv, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=n_ctx, pe="rope", rope_layout="half", rotary_dim=d,
        rope_base=float(rp.get("rope_theta", 10000.0)), norm="rmsnorm" if layernorm_eps is None else "layernorm",
        norm_bias=False, norm_eps=config.rms_norm_eps if layernorm_eps is None else layernorm_eps, mlp="swiglu", attn_bias=attn_bias, out_bias=out_bias,
        mlp_bias=mlp_bias, head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
        qk_norm=qk_norm, rope_scaling=rope_scaling(rp),
    )


def make_exact(model_type: str, prefix: str, module) -> None:
    """Switch the float32-only submodules to their float64-faithful subclasses (same parameters)."""
    RMSNorm, Rotary = (hf_class(model_type, f"{prefix}{n}") for n in ("RMSNorm", "RotaryEmbedding"))
    nat.switch_classes(module, {RMSNorm: _rmsnorm64(RMSNorm), Rotary: nat.rotary64(Rotary)})


KEYS = KeyMap(
    embed=(Key("embed.tok", "model.embed_tokens.weight"),),
    block_native="model.layers.{l}.",
    block=(
        Key("norm1.g", "input_layernorm.weight"),
        Key("attn.W_Q", "self_attn.q_proj.weight", QUERY),  # [h, D, d]
        Key("attn.W_K", "self_attn.k_proj.weight", KEY_VALUE),  # [h_kv, D, d]
        Key("attn.W_V", "self_attn.v_proj.weight", KEY_VALUE),  # [h_kv, D, d]
        Key("attn.W_O", "self_attn.o_proj.weight", WRITER),  # [h, d, D]
        Key("norm2.g", "post_attention_layernorm.weight"),
        Key("mlp.W_in", "mlp.up_proj.weight", LINEAR),  # [D, m]
        Key("mlp.W_gate", "mlp.gate_proj.weight", LINEAR),  # [D, m]
        Key("mlp.W_out", "mlp.down_proj.weight", LINEAR),  # [m, D]
        Key("attn.q_norm.g", "self_attn.q_norm.weight", when="qk_norm"),  # [d]
        Key("attn.k_norm.g", "self_attn.k_norm.weight", when="qk_norm"),  # [d]
        Key("attn.b_Q", "self_attn.q_proj.bias", QUERY_BIAS, when="attn_bias"),  # [h, d]
        Key("attn.b_K", "self_attn.k_proj.bias", KEY_VALUE_BIAS, when="attn_bias"),  # [h_kv, d]
        Key("attn.b_V", "self_attn.v_proj.bias", KEY_VALUE_BIAS, when="attn_bias"),  # [h_kv, d]
        Key("attn.b_O", "self_attn.o_proj.bias", when="out_bias"),
        Key("mlp.b_in", "mlp.up_proj.bias", when="mlp_bias"),
        Key("mlp.b_gate", "mlp.gate_proj.bias", when="mlp_bias"),
        Key("mlp.b_out", "mlp.down_proj.bias", when="mlp_bias"),
    ),
    final=(Key("norm_f.g", "model.norm.weight"),
           Key("head.W", "lm_head.weight", LINEAR, when="!tied_embeddings")),  # tied: lm_head is embed_tokens
)


REFUSALS = (SCALED_ROPE, activation("hidden_act", ("silu",), "the gated MLP must be SwiGLU (silu)"))


def decoder_family(name: str, model_type: str, prefix: str, reference: str,
                   biases: Callable[[object], tuple[bool, bool, bool]], window: Window = no_window,
                   qk_norm: bool = False) -> HFFamily:
    """A Llama-layout family: `prefix` names transformers' classes (LlamaConfig, LlamaForCausalLM,
    LlamaRMSNorm), `biases(config)` which of (q/k/v_proj, o_proj, the MLP) carry biases, `window` its
    sliding-attention window, `qk_norm` whether queries and keys are normalised per head before RoPE."""
    return HFFamily(
        name=name, model_type=model_type, config_name=prefix, display=f"{prefix} (Hugging Face transformers)",
        reference=reference, config_class=f"{prefix}Config", model_class=f"{prefix}ForCausalLM", keys=KEYS,
        summary=functools.partial(summary, name, biases, window, qk_norm),
        refusals=REFUSALS,
        prepare=functools.partial(make_exact, model_type, prefix),
    )
