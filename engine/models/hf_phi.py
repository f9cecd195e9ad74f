"""HF Phi (`transformers.PhiForCausalLM`: phi-1, phi-1.5, phi-2): a parallel block under one LayerNorm, partial
RoPE, biases everywhere.

The block is x + attn(ln(x)) + mlp(ln(x)): GPT-NeoX's parallel residual (Arch.parallel_residual), except that
both branches read one `input_layernorm`. Canonically that norm is two equal norms (norm1 and norm2, the
reference family's parallel block), and only equal ones are written back: every element of the group moves
both alike, so an aligned or interpolated model keeps them equal.
Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form; q_proj,
  k_proj and v_proj are separate, with biases, and the output projection is `dense`, with a bias;
- RoPE rotates only the first r = int(d * partial_rotary_factor) dims of each head (phi-2: 32 of 80) with
  `rotate_half` pairs (j, j + r/2) inside those r dims: Arch.rope_layout "half", rotary_dim r;
- the MLP is fc1 / fc2 with biases (`hidden_act` gelu_new: the tanh approximation); the LayerNorms have
  biases; the head `lm_head` has a bias and is untied from the embedding unless tie_word_embeddings.
`qk_layernorm` (a LayerNorm over each head's queries and keys, centred: not the RMSNorm whose group Qwen3's
QK-norm keeps) is refused.

Float64 exactness: the rotary tables are float32 in stock HF; they are switched to a float64-faithful subclass
(engine/models/native.py). LayerNorm is torch's own and already exact.
"""

from __future__ import annotations

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch
from engine.models.hf_family import (
    KEY_VALUE,
    KEY_VALUE_BIAS,
    LINEAR,
    QUERY,
    QUERY_BIAS,
    ROPE_SCALING,
    WRITER,
    Conv,
    HFFamily,
    Key,
    KeyMap,
    Refusal,
    activation,
)
from engine.models.hf_gpt2 import ACTIVATIONS


def _one_norm(ts, a: Arch):
    if not torch.equal(ts[0], ts[1]):
        raise ModelError("The Phi family has one LayerNorm for both branches of a block, so only equal norm1 and norm2 "
                         "can be written into this model.")
    return ts[0]


# one native norm tensor <-> the two canonical norms that read it (the attention's and the MLP's), written back only
# when they are equal, as every element of the group and every path keeps them. The second is a copy, not a second
# view of the same storage: a move written into the views in place (engine.align.run.move_in_place) would
# otherwise apply itself twice to the one tensor
SHARED = Conv(lambda t, a: (t, t.clone()), _one_norm)
QK_LAYERNORM = Refusal(lambda c: bool(c.qk_layernorm), "qk_layernorm=True",
                       "a LayerNorm over each head's queries and keys commutes with no map inside a head the engine "
                       "models")


def _summary(config, refuse) -> Arch:
    rp = nat.rope_parameters(config)
    h = config.num_attention_heads
    hkv = config.num_key_value_heads or h
    d = config.hidden_size // h
    r = nat.rotary_dims(config, d, refuse)
    return Arch(
        family="hf_phi", task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=h, n_kv_heads=hkv, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=config.max_position_embeddings, pe="rope", rope_layout="half", rotary_dim=r,
        rope_base=float(rp.get("rope_theta", 10000.0)), norm="layernorm", norm_bias=True,
        norm_eps=config.layer_norm_eps, mlp=ACTIVATIONS[config.hidden_act], attn_bias=True, out_bias=True,
        mlp_bias=True, head_bias=True, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
        parallel_residual=True,
    )


def _make_exact(module) -> None:
    """Switch the float32-only rotary embedding to its float64-faithful subclass (same buffers)."""
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

    nat.switch_classes(module, {PhiRotaryEmbedding: nat.rotary64(PhiRotaryEmbedding)})


KEYS = KeyMap(
    embed=(Key("embed.tok", "model.embed_tokens.weight"),),
    block_native="model.layers.{l}.",
    block=(
        Key(("norm1.g", "norm2.g"), "input_layernorm.weight", SHARED),
        Key(("norm1.b", "norm2.b"), "input_layernorm.bias", SHARED),
        Key("attn.W_Q", "self_attn.q_proj.weight", QUERY),  # [h, D, d]
        Key("attn.W_K", "self_attn.k_proj.weight", KEY_VALUE),  # [h_kv, D, d]
        Key("attn.W_V", "self_attn.v_proj.weight", KEY_VALUE),
        Key("attn.W_O", "self_attn.dense.weight", WRITER),  # [h, d, D]
        Key("attn.b_Q", "self_attn.q_proj.bias", QUERY_BIAS),
        Key("attn.b_K", "self_attn.k_proj.bias", KEY_VALUE_BIAS),
        Key("attn.b_V", "self_attn.v_proj.bias", KEY_VALUE_BIAS),
        Key("attn.b_O", "self_attn.dense.bias"),
        Key("mlp.W_in", "mlp.fc1.weight", LINEAR), Key("mlp.b_in", "mlp.fc1.bias"),
        Key("mlp.W_out", "mlp.fc2.weight", LINEAR), Key("mlp.b_out", "mlp.fc2.bias"),
    ),
    final=(Key("norm_f.g", "model.final_layernorm.weight"), Key("norm_f.b", "model.final_layernorm.bias"),
           Key("head.W", "lm_head.weight", LINEAR, when="!tied_embeddings"), Key("head.b", "lm_head.bias")),
)

HF = HFFamily(
    name="hf_phi", model_type="phi", config_name="Phi", display="Phi (Hugging Face transformers)",
    reference="Textbooks Are All You Need II: phi-1.5 (2023); RoPE: RoFormer (2021); transformers.PhiForCausalLM",
    config_class="PhiConfig", model_class="PhiForCausalLM", keys=KEYS, summary=_summary,
    refusals=(ROPE_SCALING, QK_LAYERNORM, activation("hidden_act", ACTIVATIONS)), prepare=_make_exact,
)
FAMILY, MODEL_TYPE, ENTRY = HF.name, HF.model_type, HF.entry()
build, to_canonical, from_canonical, logits = HF.build, HF.to_canonical, HF.from_canonical, HF.logits
