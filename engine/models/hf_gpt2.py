"""HF GPT-2 (`transformers.GPT2LMHeadModel`): learned absolute PE, LayerNorm, tanh-GELU MLP.

Native layout quirks the canonical conversion undoes:
- `Conv1D` stores weights in x out, i.e. already the row-vector `x @ W` orientation of docs/MATH.md;
- `c_attn` is one fused [D, 3D] projection whose columns are Q | K | V, each head-major;
- `gelu_new` is the tanh approximation of GELU (same formula as torch's approximate="tanh");
- the unembedding is tied to `wte` by default (one shared Parameter), so the canonical params then
  carry no `head.W`.

Detection, loading, saving and building are the shared HF ones (engine/models/hf_family.py): a saved
directory is an ordinary HF checkpoint; loading accepts any local GPT-2 checkpoint stored as safetensors.
"""

from __future__ import annotations

import torch

from engine.models import native as nat
from engine.models.base import Arch
from engine.models.hf_family import LINEAR, Conv, HFFamily, Key, KeyMap, Refusal, activation

# HF activation name -> Arch.mlp; only those that are exactly one of the engine's MLP kinds.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def _summary(config, refuse) -> Arch:
    D, h = config.n_embd, config.n_head
    return Arch(
        family="hf_gpt2", task="lm", n_layers=config.n_layer, d_model=D, n_heads=h, n_kv_heads=h,
        d_head=D // h, d_mlp=config.n_inner or 4 * D, n_out=config.vocab_size, n_ctx=config.n_positions,
        pe="learned", rope_layout=None, rotary_dim=0, rope_base=0.0,  # rope_base unused without RoPE
        norm="layernorm", norm_bias=True, norm_eps=config.layer_norm_epsilon,
        mlp=ACTIVATIONS[config.activation_function], attn_bias=True, out_bias=True, mlp_bias=True,
        head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
    )


def _qkv_to(W: torch.Tensor, a: Arch) -> tuple[torch.Tensor, ...]:
    D, h = a.d_model, a.n_heads
    return tuple(nat.heads_in(W[:, i * D:(i + 1) * D], h) for i in range(3))  # [D, 3D] -> 3 x [h, D, d]


# Conv1D weights are [in, out] already: c_attn's columns Q | K | V, each head-major; c_proj's rows head-major
QKV = Conv(_qkv_to, lambda ts, a: torch.cat([nat.heads_in_native(t) for t in ts], 1))
QKV_BIAS = Conv(lambda b, a: tuple(b.reshape(3, a.n_heads, -1)), lambda ts, a: torch.cat([t.reshape(-1) for t in ts]))
OUT = Conv(lambda W, a: (nat.heads_out(W, a.n_heads),), lambda ts, a: nat.heads_out_native(ts[0]))

KEYS = KeyMap(
    embed=(Key("embed.tok", "transformer.wte.weight"), Key("embed.pos", "transformer.wpe.weight")),
    block_native="transformer.h.{l}.",
    block=(
        Key("norm1.g", "ln_1.weight"), Key("norm1.b", "ln_1.bias"),
        Key(("attn.W_Q", "attn.W_K", "attn.W_V"), "attn.c_attn.weight", QKV),
        Key(("attn.b_Q", "attn.b_K", "attn.b_V"), "attn.c_attn.bias", QKV_BIAS),
        Key("attn.W_O", "attn.c_proj.weight", OUT), Key("attn.b_O", "attn.c_proj.bias"),
        Key("norm2.g", "ln_2.weight"), Key("norm2.b", "ln_2.bias"),
        Key("mlp.W_in", "mlp.c_fc.weight"), Key("mlp.b_in", "mlp.c_fc.bias"),  # Conv1D: already [D, m]
        Key("mlp.W_out", "mlp.c_proj.weight"), Key("mlp.b_out", "mlp.c_proj.bias"),  # [m, D]
    ),
    final=(Key("norm_f.g", "transformer.ln_f.weight"), Key("norm_f.b", "transformer.ln_f.bias"),
           Key("head.W", "lm_head.weight", LINEAR, when="!tied_embeddings")),  # tied: lm_head.weight is wte's
)

HF = HFFamily(
    name="hf_gpt2", model_type="gpt2", config_name="GPT-2", display="GPT-2 (Hugging Face transformers)",
    reference="GPT-2 (2019); transformers.GPT2LMHeadModel", config_class="GPT2Config",
    model_class="GPT2LMHeadModel", keys=KEYS, summary=_summary,
    refusals=(
        Refusal(lambda c: c.add_cross_attention, "add_cross_attention=True", "encoder-decoder cross-attention"),
        Refusal(lambda c: not c.scale_attn_weights, "scale_attn_weights=False",
                "attention logits without the 1/sqrt(d) scale"),
        Refusal(lambda c: c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True",
                "a per-layer attention temperature"),
        activation("activation_function", ACTIVATIONS),
    ),
)
FAMILY, MODEL_TYPE, DISPLAY = HF.name, HF.model_type, HF.display
arch, wrap, build, detect, load, save = HF.arch, HF.wrap, HF.build, HF.detect, HF.load, HF.save
to_canonical, from_canonical, logits = HF.to_canonical, HF.from_canonical, HF.logits

ENTRY = HF.entry()
