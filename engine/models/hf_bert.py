"""HF BERT masked LMs (`transformers.BertForMaskedLM`): a post-LayerNorm encoder (docs/MATH.md section 9).

The block normalises after each residual add, LN(x + attn(x)) then LN(x + mlp(x)); the embedding sum
word + learned position + token type is normalised too; attention is bidirectional; every projection
has a bias. The masked-LM head is dense -> activation -> LayerNorm -> decoder, the decoder tied to the
word embedding (one shared Parameter) with its own bias; untied decoders are refused (HF then keeps a
second, unused bias Parameter beside the one the decoder adds). Inputs are one segment: token type 0 everywhere,
no padding mask.

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- query / key / value are separate [h*d, D] projections, head-major;
- `attention.output.LayerNorm` (after the attention add) is canonical norm1, `output.LayerNorm` (after the
  MLP add) norm2; the embedding norm is embed.norm, the head's head.norm (engine/models/base.py).

Loading accepts a directory saved from BertForMaskedLM (safetensors); the pre-training layout with a
pooler and a next-sentence head, and encoder-only BertModel directories, are refused by name. Saved with
`save_pretrained`, so a saved directory is an ordinary HF checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params
from engine.models.io import read_config

if TYPE_CHECKING:
    from transformers import BertConfig

FAMILY = "hf_bert"
MODEL_TYPE = "bert"
DISPLAY = "BERT masked LM (Hugging Face transformers)"
CLASS = "BertForMaskedLM"

# HF activation name -> Arch.mlp (also the head transform's activation); "gelu" is the exact erf GELU.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def arch(config: BertConfig, source: str = "BERT config") -> Arch:
    """The architecture summary; refuses BERT options the canonical layout cannot express."""
    def refuse(option: str, why: str) -> None:
        raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

    if config.is_decoder or config.add_cross_attention:
        refuse("is_decoder or add_cross_attention", "a causal or cross-attending BERT is not a masked-LM encoder")
    pe = getattr(config, "position_embedding_type", "absolute")
    if pe != "absolute":
        refuse(f"position_embedding_type={pe!r}", "only absolute learned positions are supported")
    if not config.tie_word_embeddings:
        refuse("tie_word_embeddings=False", "an untied decoder keeps a second, unused bias beside the one it adds")
    if config.hidden_act not in ACTIVATIONS:
        refuse(f"hidden_act={config.hidden_act!r}", f"supported: {sorted(ACTIVATIONS)}")
    D, h = config.hidden_size, config.num_attention_heads
    if D % h:
        refuse(f"hidden_size={D} with {h} heads", "the heads must split the hidden size evenly")
    return Arch(
        family=FAMILY, task="lm", n_layers=config.num_hidden_layers, d_model=D, n_heads=h, n_kv_heads=h,
        d_head=D // h, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=config.max_position_embeddings, pe="learned", rope_layout=None, rotary_dim=0, rope_base=0.0,
        norm="layernorm", norm_bias=True, norm_eps=config.layer_norm_eps, mlp=ACTIVATIONS[config.hidden_act],
        attn_bias=True, out_bias=True, mlp_bias=True, head_bias=True,
        tied_embeddings=True, causal=False, post_norm=True,
    )


def wrap(module, name: str = "", path: Path | None = None, source: str = "BERT config") -> Model:
    """A Model handle around a BertForMaskedLM (checks the architecture is supported)."""
    return Model(FAMILY, arch(module.config, source), module.eval(), module.config.to_dict(), name=name, path=path)


def build(config: BertConfig | dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A freshly initialised BertForMaskedLM (HF's own init) for tests."""
    from transformers import BertConfig, BertForMaskedLM

    if isinstance(config, dict):
        config = BertConfig(**config)
    arch(config)  # refuse before spending time on construction
    config._attn_implementation = "sdpa"  # the kernel load_hf asks for: a built model computes as a loaded one
    with nat.seeded(seed):
        module = BertForMaskedLM(config)
    return wrap(module.to(dtype))


def detect(path: Path) -> bool:
    return nat.hf_model_type(path) == MODEL_TYPE


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    from transformers import BertForMaskedLM

    path = Path(path)
    archs = read_config(path).get("architectures") or [CLASS]
    if archs != [CLASS]:
        raise ModelError(f"Model directory {path} holds {', '.join(map(str, archs))}; of BERT the engine reads "
                         f"{CLASS} checkpoints only (a masked-LM head and no pooler or next-sentence head).")
    module = nat.load_hf(BertForMaskedLM, path, dtype, MODEL_TYPE, DISPLAY)
    return wrap(module, name=path.name, path=path, source=f"Model directory {path}")


def save(model: Model, path: Path) -> None:
    nat.save_hf(model.module, Path(path))


def to_canonical(model: Model) -> Params:
    a, bert, head = model.arch, model.module.bert, model.module.cls.predictions
    h, emb = a.n_heads, bert.embeddings
    p: Params = {
        "embed.tok": emb.word_embeddings.weight, "embed.pos": emb.position_embeddings.weight,
        "embed.segment": emb.token_type_embeddings.weight,
        "embed.norm.g": emb.LayerNorm.weight, "embed.norm.b": emb.LayerNorm.bias,
    }
    for l, layer in enumerate(bert.encoder.layer):
        pre, sa, ao = f"blocks.{l}.", layer.attention.self, layer.attention.output
        p |= {
            pre + "attn.W_Q": nat.heads_in(sa.query.weight.T, h),  # [h, D, d]
            pre + "attn.W_K": nat.heads_in(sa.key.weight.T, h),  # [h, D, d]
            pre + "attn.W_V": nat.heads_in(sa.value.weight.T, h),  # [h, D, d]
            pre + "attn.b_Q": sa.query.bias.reshape(h, -1),  # [h, d]
            pre + "attn.b_K": sa.key.bias.reshape(h, -1),  # [h, d]
            pre + "attn.b_V": sa.value.bias.reshape(h, -1),  # [h, d]
            pre + "attn.W_O": nat.heads_out(ao.dense.weight.T, h),  # [h, d, D]
            pre + "attn.b_O": ao.dense.bias,
            pre + "norm1.g": ao.LayerNorm.weight, pre + "norm1.b": ao.LayerNorm.bias,
            pre + "mlp.W_in": layer.intermediate.dense.weight.T, pre + "mlp.b_in": layer.intermediate.dense.bias,  # [D, m]
            pre + "mlp.W_out": layer.output.dense.weight.T, pre + "mlp.b_out": layer.output.dense.bias,  # [m, D]
            pre + "norm2.g": layer.output.LayerNorm.weight, pre + "norm2.b": layer.output.LayerNorm.bias,
        }
    p |= {
        "head.dense.W": head.transform.dense.weight.T, "head.dense.b": head.transform.dense.bias,  # [D, D]
        "head.norm.g": head.transform.LayerNorm.weight, "head.norm.b": head.transform.LayerNorm.bias,
        "head.b": head.bias,
    }
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a = model.arch
    e, c = "bert.embeddings.", "cls.predictions."
    n: dict[str, torch.Tensor] = {
        e + "word_embeddings.weight": params["embed.tok"], e + "position_embeddings.weight": params["embed.pos"],
        e + "token_type_embeddings.weight": params["embed.segment"],
        e + "LayerNorm.weight": params["embed.norm.g"], e + "LayerNorm.bias": params["embed.norm.b"],
    }
    for l in range(a.n_layers):
        pre, hf = f"blocks.{l}.", f"bert.encoder.layer.{l}."
        for r, name in zip("QKV", ("query", "key", "value")):
            n[hf + f"attention.self.{name}.weight"] = nat.heads_in_native(params[pre + f"attn.W_{r}"]).T  # [h*d, D]
            n[hf + f"attention.self.{name}.bias"] = params[pre + f"attn.b_{r}"].reshape(-1)  # [h*d]
        n |= {
            hf + "attention.output.dense.weight": nat.heads_out_native(params[pre + "attn.W_O"]).T,  # [D, h*d]
            hf + "attention.output.dense.bias": params[pre + "attn.b_O"],
            hf + "attention.output.LayerNorm.weight": params[pre + "norm1.g"],
            hf + "attention.output.LayerNorm.bias": params[pre + "norm1.b"],
            hf + "intermediate.dense.weight": params[pre + "mlp.W_in"].T,  # [m, D]
            hf + "intermediate.dense.bias": params[pre + "mlp.b_in"],
            hf + "output.dense.weight": params[pre + "mlp.W_out"].T,  # [D, m]
            hf + "output.dense.bias": params[pre + "mlp.b_out"],
            hf + "output.LayerNorm.weight": params[pre + "norm2.g"], hf + "output.LayerNorm.bias": params[pre + "norm2.b"],
        }
    n |= {
        c + "transform.dense.weight": params["head.dense.W"].T, c + "transform.dense.bias": params["head.dense.b"],  # [D, D]
        c + "transform.LayerNorm.weight": params["head.norm.g"], c + "transform.LayerNorm.bias": params["head.norm.b"],
        c + "bias": params["head.b"],  # the decoder's bias is this same Parameter, its weight word_embeddings'
    }
    nat.copy_into(model.module, n)


def logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> masked-LM logits [B, T, V]: one segment (token type 0), every position attended."""
    T = inputs.shape[-1]
    if T > model.arch.n_ctx:
        raise ModelError(f"Input length {T} exceeds the model's context of {model.arch.n_ctx}.")
    if isinstance(model.module, Twin):
        return model.module(inputs)
    return model.module(input_ids=inputs).logits


# ---------------------------------------------------------------------------------------------
# The twin: the same function from the canonical params, for the data-driven aligners


class _Norm(nn.Module):
    def __init__(self, D: int, eps: float):
        super().__init__()
        self.g, self.b, self.eps = nn.Parameter(torch.empty(D)), nn.Parameter(torch.empty(D)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.g, self.b, self.eps)


class _Attention(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        h, D, d = a.n_heads, a.d_model, a.d_head
        for r in "QKV":
            self.register_parameter(f"W_{r}", nn.Parameter(torch.empty(h, D, d)))
            self.register_parameter(f"b_{r}", nn.Parameter(torch.empty(h, d)))
        self.W_O, self.b_O = nn.Parameter(torch.empty(h, d, D)), nn.Parameter(torch.empty(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.einsum("btD,hDd->bhtd", x, getattr(self, f"W_{r}")) + getattr(self, f"b_{r}")[:, None]
                   for r in "QKV")  # [B, h, T, d] each
        o = F.scaled_dot_product_attention(q, k, v)  # [B, h, T, d], bidirectional
        return torch.einsum("bhtd,hdD->btD", o, self.W_O) + self.b_O  # [B, T, D]


class _MLP(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.kind = a.mlp
        self.W_in, self.b_in = nn.Parameter(torch.empty(a.d_model, a.d_mlp)), nn.Parameter(torch.empty(a.d_mlp))
        self.W_out, self.b_out = nn.Parameter(torch.empty(a.d_mlp, a.d_model)), nn.Parameter(torch.empty(a.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.models.reference import mlp_activation

        return mlp_activation(self.kind, x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class _Block(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.attn, self.norm1, self.mlp, self.norm2 = _Attention(a), _Norm(a.d_model, a.norm_eps), _MLP(a), _Norm(
            a.d_model, a.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))  # post-norm: the add, then the norm (docs/MATH.md section 9)
        return self.norm2(x + self.mlp(x))


class Twin(nn.Module):
    """BERT as a module over the canonical params (its parameter names are the canonical keys), with the
    reference family's hook points: `blocks[l].attn` and `.mlp` see their inputs (here the stream itself,
    and the stream after the attention norm), `norm_f` (no parameters, the identity) the last stream before
    the head. Data-driven aligners run their forward passes, hooks and functional calls on it."""

    def __init__(self, a: Arch, n_types: int):
        super().__init__()
        self.embed = nn.Module()
        self.embed.tok = nn.Parameter(torch.empty(a.n_out, a.d_model))
        self.embed.pos = nn.Parameter(torch.empty(a.n_ctx, a.d_model))
        self.embed.segment = nn.Parameter(torch.empty(n_types, a.d_model))
        self.embed.norm = _Norm(a.d_model, a.norm_eps)
        self.blocks = nn.ModuleList(_Block(a) for _ in range(a.n_layers))
        self.norm_f = nn.Identity()
        self.head = nn.Module()
        self.head.dense = nn.Module()
        self.head.dense.W, self.head.dense.b = nn.Parameter(torch.empty(a.d_model, a.d_model)), nn.Parameter(
            torch.empty(a.d_model))
        self.head.norm = _Norm(a.d_model, a.norm_eps)
        self.head.b = nn.Parameter(torch.empty(a.n_out))
        self.kind = a.mlp

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from engine.models.reference import mlp_activation

        e = self.embed
        x = e.norm(e.tok[inputs] + e.pos[: inputs.shape[-1]] + e.segment[0])  # [B, T, D]: one segment
        for blk in self.blocks:
            x = blk(x)
        u = self.head.norm(mlp_activation(self.kind, self.norm_f(x) @ self.head.dense.W + self.head.dense.b))
        return u @ e.tok.T + self.head.b  # [B, T, V]: the decoder is tied to the word embedding


def twin(model: Model) -> Model:
    """The model's Twin sharing its canonical tensors (no memory; to be used read-only)."""
    p = to_canonical(model)
    with torch.device("meta"):
        module = Twin(model.arch, p["embed.segment"].shape[0])
    module.load_state_dict(p, strict=True, assign=True)
    return Model(FAMILY, model.arch, module.eval(), model.config, name=model.name, path=model.path)


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="BERT (Devlin et al., 2019); transformers.BertForMaskedLM",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits, twin=twin,
)
