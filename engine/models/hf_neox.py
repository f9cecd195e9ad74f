"""HF GPT-NeoX / Pythia (`transformers.GPTNeoXForCausalLM`): partial RoPE, parallel residual, LayerNorm.

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- `query_key_value` is one fused projection whose output rows run PER HEAD, [h, 3, d]: q, k, v of
  head 0, then of head 1, ... (HF views the output as [B, T, h, 3d] and chunks the last axis in 3),
  unlike GPT-2's Q | K | V blocks; its bias follows the same [h, 3, d] order;
- RoPE rotates only the first r = int(d * partial_rotary_factor) dims of each head (Pythia: 25%)
  with `rotate_half` pairs (j, j + r/2) inside those r dims: Arch.rope_layout "half", rotary_dim r;
- `use_parallel_residual` (the default): x + attn(ln1(x)) + mlp(ln2(x)), both norms reading the same
  x (Arch.parallel_residual); False gives the usual sequential pre-norm block;
- `attention_bias` covers query_key_value and the output projection `dense`; the MLP and both
  LayerNorms always have biases; the unembedding (`embed_out` in hub checkpoints, `lm_head` in the
  module) is untied from `embed_in` unless tie_word_embeddings.

Float64 exactness. Stock HF GPT-NeoX builds its RoPE tables in float32, so a float64 model is only
float32-accurate. Every module this adapter hands out has its rotary embedding switched to a
subclass that computes in float64 when the input is float64 (same formula; other dtypes take HF's
own path unchanged). LayerNorm is torch's own and already exact. Nothing about the weights changes.
"""

from __future__ import annotations

import torch

from engine.models import native as nat
from engine.models.base import Arch
from engine.models.hf_family import LINEAR, ROPE_SCALING, SAME, WRITER, Conv, HFFamily, Key, KeyMap, activation
from engine.models.hf_gpt2 import ACTIVATIONS


def _summary(config, refuse) -> Arch:
    rp = nat.rope_parameters(config)
    h = config.num_attention_heads
    d = config.hidden_size // h
    r = nat.rotary_dims(config, d, refuse)
    bias = bool(config.attention_bias)
    return Arch(
        family="hf_neox", task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=h, n_kv_heads=h, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=config.max_position_embeddings, pe="rope", rope_layout="half", rotary_dim=r,
        rope_base=float(rp.get("rope_theta", 10000.0)), norm="layernorm", norm_bias=True,
        norm_eps=config.layer_norm_eps, mlp=ACTIVATIONS[config.hidden_act], attn_bias=bias,
        out_bias=bias,  # HF's attention_bias covers the output projection `dense` too
        mlp_bias=True, head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
        parallel_residual=bool(config.use_parallel_residual),
    )


# ---------------------------------------------------------------------------------------------
# Float64-faithful RoPE (see the module docstring)


def _make_exact(module) -> None:
    """Switch the float32-only rotary embedding to its float64-faithful subclass (same buffers)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    nat.switch_classes(module, {GPTNeoXRotaryEmbedding: nat.rotary64(GPTNeoXRotaryEmbedding)})


# ---------------------------------------------------------------------------------------------
# Adapter


def _qkv_to(W: torch.Tensor, a: Arch) -> tuple[torch.Tensor, ...]:
    qkv = W.T.reshape(a.d_model, a.n_heads, 3, -1)  # [D, h, 3, d]: per-head q, k, v
    return tuple(qkv[:, :, i].permute(1, 0, 2) for i in range(3))  # 3 x [h, D, d]


# query_key_value's output rows run [h, 3, d], its bias too
QKV = Conv(_qkv_to, lambda ts, a: torch.stack(list(ts), 1).permute(0, 1, 3, 2).reshape(-1, a.d_model))  # [h*3*d, D]
QKV_BIAS = Conv(lambda b, a: tuple(b.reshape(a.n_heads, 3, -1).unbind(1)), lambda ts, a: torch.stack(list(ts), 1).reshape(-1))

KEYS = KeyMap(
    embed=(Key("embed.tok", "gpt_neox.embed_in.weight"),),
    block_native="gpt_neox.layers.{l}.",
    block=(
        Key("norm1.g", "input_layernorm.weight"), Key("norm1.b", "input_layernorm.bias"),
        Key(("attn.W_Q", "attn.W_K", "attn.W_V"), "attention.query_key_value.weight", QKV),
        Key("attn.W_O", "attention.dense.weight", WRITER),
        Key("norm2.g", "post_attention_layernorm.weight"), Key("norm2.b", "post_attention_layernorm.bias"),
        Key("mlp.W_in", "mlp.dense_h_to_4h.weight", LINEAR), Key("mlp.b_in", "mlp.dense_h_to_4h.bias", SAME),
        Key("mlp.W_out", "mlp.dense_4h_to_h.weight", LINEAR), Key("mlp.b_out", "mlp.dense_4h_to_h.bias", SAME),
        Key(("attn.b_Q", "attn.b_K", "attn.b_V"), "attention.query_key_value.bias", QKV_BIAS, when="attn_bias"),
        Key("attn.b_O", "attention.dense.bias", when="attn_bias"),
    ),
    final=(Key("norm_f.g", "gpt_neox.final_layer_norm.weight"), Key("norm_f.b", "gpt_neox.final_layer_norm.bias"),
           Key("head.W", "lm_head.weight", LINEAR, when="!tied_embeddings")),  # tied: lm_head is embed_in
)

HF = HFFamily(
    name="hf_neox", model_type="gpt_neox", config_name="GPT-NeoX",
    display="GPT-NeoX / Pythia (Hugging Face transformers)",
    reference="GPT-NeoX-20B (2022); Pythia (2023); RoPE: RoFormer (2021); transformers.GPTNeoXForCausalLM",
    config_class="GPTNeoXConfig", model_class="GPTNeoXForCausalLM", keys=KEYS, summary=_summary,
    refusals=(ROPE_SCALING, activation("hidden_act", ACTIVATIONS)), prepare=_make_exact,
)
FAMILY, MODEL_TYPE, DISPLAY = HF.name, HF.model_type, HF.display
arch, config_from_dict, wrap, build, detect, load, save = (HF.arch, HF.config_from_dict, HF.wrap, HF.build, HF.detect,
                                                            HF.load, HF.save)
to_canonical, from_canonical, logits = HF.to_canonical, HF.from_canonical, HF.logits

ENTRY = HF.entry()
