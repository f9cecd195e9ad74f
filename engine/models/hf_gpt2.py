"""HF GPT-2 (`transformers.GPT2LMHeadModel`): learned absolute PE, LayerNorm, tanh-GELU MLP.

Native layout quirks the canonical conversion undoes:
- `Conv1D` stores weights in x out, i.e. already the row-vector `x @ W` orientation of docs/MATH.md;
- `c_attn` is one fused [D, 3D] projection whose columns are Q | K | V, each head-major;
- `gelu_new` is the tanh approximation of GELU (same formula as torch's approximate="tanh");
- the unembedding is tied to `wte` by default (one shared Parameter), so the canonical params then
  carry no `head.W`.

Saved with `save_pretrained` (config.json + model.safetensors), so a saved directory is an ordinary
HF checkpoint; loading accepts any local GPT-2 checkpoint directory stored as safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params

if TYPE_CHECKING:
    from transformers import GPT2Config

FAMILY = "hf_gpt2"
MODEL_TYPE = "gpt2"
DISPLAY = "GPT-2 (Hugging Face transformers)"

# HF activation name -> Arch.mlp; only those that are exactly one of the engine's MLP kinds.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def arch(config: GPT2Config, source: str = "GPT-2 config") -> Arch:
    """The architecture summary; refuses GPT-2 options the canonical layout cannot express."""
    def refuse(option: str, why: str) -> None:
        raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

    if config.add_cross_attention:
        refuse("add_cross_attention=True", "encoder-decoder cross-attention")
    if not config.scale_attn_weights:
        refuse("scale_attn_weights=False", "attention logits without the 1/sqrt(d) scale")
    if config.scale_attn_by_inverse_layer_idx:
        refuse("scale_attn_by_inverse_layer_idx=True", "a per-layer attention temperature")
    if config.activation_function not in ACTIVATIONS:
        refuse(f"activation_function={config.activation_function!r}", f"supported: {sorted(ACTIVATIONS)}")
    D, h = config.n_embd, config.n_head
    return Arch(
        family=FAMILY, task="lm", n_layers=config.n_layer, d_model=D, n_heads=h, n_kv_heads=h,
        d_head=D // h, d_mlp=config.n_inner or 4 * D, n_out=config.vocab_size, n_ctx=config.n_positions,
        pe="learned", rope_layout=None, rotary_dim=0, rope_base=0.0,  # rope_base unused without RoPE
        norm="layernorm", norm_bias=True, norm_eps=config.layer_norm_epsilon,
        mlp=ACTIVATIONS[config.activation_function], attn_bias=True, out_bias=True, mlp_bias=True,
        head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
    )


def wrap(module, name: str = "", path: Path | None = None, source: str = "GPT-2 config") -> Model:
    """A Model handle around a GPT2LMHeadModel (checks the architecture is supported)."""
    return Model(FAMILY, arch(module.config, source), module.eval(), module.config.to_dict(), name=name, path=path)


def build(config: GPT2Config | dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A freshly initialised GPT-2 (HF's own init) for tests and the model zoo."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if isinstance(config, dict):
        config = GPT2Config(**config)
    arch(config)  # refuse before spending time on construction
    with nat.seeded(seed):
        module = GPT2LMHeadModel(config)
    return wrap(module.to(dtype))


def detect(path: Path) -> bool:
    return nat.hf_model_type(path) == MODEL_TYPE


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    from transformers import GPT2LMHeadModel

    path = Path(path)
    module = nat.load_hf(GPT2LMHeadModel, path, dtype, MODEL_TYPE, DISPLAY)
    return wrap(module, name=path.name, path=path, source=f"Model directory {path}")


def save(model: Model, path: Path) -> None:
    nat.save_hf(model.module, Path(path))


def to_canonical(model: Model) -> Params:
    a, tf = model.arch, model.module.transformer
    D, h = a.d_model, a.n_heads
    p: Params = {"embed.tok": tf.wte.weight, "embed.pos": tf.wpe.weight}
    for l, blk in enumerate(tf.h):
        pre = f"blocks.{l}."
        W = blk.attn.c_attn.weight  # [D, 3D], columns Q | K | V
        b = blk.attn.c_attn.bias.reshape(3, h, -1)  # [3, h, d]
        p |= {
            pre + "norm1.g": blk.ln_1.weight, pre + "norm1.b": blk.ln_1.bias,
            pre + "attn.W_Q": nat.heads_in(W[:, :D], h),  # [h, D, d]
            pre + "attn.W_K": nat.heads_in(W[:, D:2 * D], h),  # [h, D, d]
            pre + "attn.W_V": nat.heads_in(W[:, 2 * D:], h),  # [h, D, d]
            pre + "attn.b_Q": b[0], pre + "attn.b_K": b[1], pre + "attn.b_V": b[2],
            pre + "attn.W_O": nat.heads_out(blk.attn.c_proj.weight, h),  # [h, d, D]
            pre + "attn.b_O": blk.attn.c_proj.bias,
            pre + "norm2.g": blk.ln_2.weight, pre + "norm2.b": blk.ln_2.bias,
            pre + "mlp.W_in": blk.mlp.c_fc.weight, pre + "mlp.b_in": blk.mlp.c_fc.bias,  # Conv1D: already [D, m]
            pre + "mlp.W_out": blk.mlp.c_proj.weight, pre + "mlp.b_out": blk.mlp.c_proj.bias,  # [m, D]
        }
    p |= {"norm_f.g": tf.ln_f.weight, "norm_f.b": tf.ln_f.bias}
    if not a.tied_embeddings:
        p["head.W"] = model.module.lm_head.weight.T  # [D, V]
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a = model.arch
    n: dict[str, torch.Tensor] = {
        "transformer.wte.weight": params["embed.tok"], "transformer.wpe.weight": params["embed.pos"],
    }
    for l in range(a.n_layers):
        pre, hf = f"blocks.{l}.", f"transformer.h.{l}."
        n |= {
            hf + "ln_1.weight": params[pre + "norm1.g"], hf + "ln_1.bias": params[pre + "norm1.b"],
            hf + "attn.c_attn.weight": torch.cat(
                [nat.heads_in_native(params[pre + f"attn.W_{r}"]) for r in "QKV"], 1),  # [D, 3D]
            hf + "attn.c_attn.bias": torch.cat(
                [params[pre + f"attn.b_{r}"].reshape(-1) for r in "QKV"]),  # [3D]
            hf + "attn.c_proj.weight": nat.heads_out_native(params[pre + "attn.W_O"]),  # [D, D]
            hf + "attn.c_proj.bias": params[pre + "attn.b_O"],
            hf + "ln_2.weight": params[pre + "norm2.g"], hf + "ln_2.bias": params[pre + "norm2.b"],
            hf + "mlp.c_fc.weight": params[pre + "mlp.W_in"], hf + "mlp.c_fc.bias": params[pre + "mlp.b_in"],
            hf + "mlp.c_proj.weight": params[pre + "mlp.W_out"], hf + "mlp.c_proj.bias": params[pre + "mlp.b_out"],
        }
    n |= {"transformer.ln_f.weight": params["norm_f.g"], "transformer.ln_f.bias": params["norm_f.b"]}
    if not a.tied_embeddings:  # tied: lm_head.weight is wte.weight, already written above
        n["lm_head.weight"] = params["head.W"].T  # [V, D]
    nat.copy_into(model.module, n)


logits = nat.causal_lm_logits


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="GPT-2 (2019); transformers.GPT2LMHeadModel",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits,
)
