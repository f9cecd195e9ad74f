"""HF BERT (`transformers.BertForMaskedLM`, `BertForPreTraining`, `BertModel`): a post-LayerNorm encoder
(docs/MATH.md section 9).

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

Three layouts (`LAYOUTS`, chosen by the directory's `architectures`):
- BertForMaskedLM: the masked-LM head; its logits are the function and the masked-LM loss the path's loss;
- BertForPreTraining (MultiBERTs, the original bert-base): the same head, plus the pooler (dense + tanh on the
  [CLS] hidden state, canonical head.pool.{W,b}) and the next-sentence head on the pooled vector (head.nsp.{W,b});
  the loss stays the masked-LM loss, `nsp_logits` gives the other output;
- BertModel (no head, `Arch.head_bias` False: `is_encoder`): the output has no vocabulary, so `logits` gives a
  basis-free one, the Gram matrix of the last hidden states (and the pooled vector when there is a pooler),
  which the symmetry checks compare; there is no loss, and engine.represent compares the hidden states
  along a path instead (docs/MATH.md section 9).
Other BERT heads are refused by name. Saved with `save_pretrained`, so a saved directory is an ordinary HF
checkpoint.
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
DISPLAY = "BERT (Hugging Face transformers)"
CLASS = "BertForMaskedLM"
PRETRAINING, ENCODER = "BertForPreTraining", "BertModel"
LAYOUTS = (CLASS, PRETRAINING, ENCODER)  # transformers class names, as a directory's `architectures` gives them

# HF activation name -> Arch.mlp (also the head transform's activation); "gelu" is the exact erf GELU.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def layout_of(config: BertConfig | dict) -> str:
    """The layout a config names in `architectures` (LAYOUTS; none named: the masked LM)."""
    archs = (config.get("architectures") if isinstance(config, dict) else config.architectures) or [CLASS]
    return archs[0] if len(archs) == 1 and archs[0] in LAYOUTS else CLASS


def is_encoder(a: Arch) -> bool:
    """A BERT without a masked-LM head (BertModel): post-norm and no head bias."""
    return a.post_norm and not a.head_bias


def no_loss(name: str) -> str:
    """The one sentence every loss-based view gives for an encoder without a head (engine.represent)."""
    return (f"Model {name} is a BERT encoder without a head (BertModel), so it has no loss to walk a path on; "
            "`python -m engine align A B` compares its hidden states along the path instead (docs/MATH.md "
            "section 9).")


def arch(config: BertConfig, source: str = "BERT config", layout: str | None = None) -> Arch:
    """The architecture summary of `layout` (default: the config's own, layout_of); refuses BERT options the
    canonical layout cannot express."""
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
        attn_bias=True, out_bias=True, mlp_bias=True, head_bias=(layout or layout_of(config)) != ENCODER,
        tied_embeddings=True, causal=False, post_norm=True,
    )


def wrap(module, name: str = "", path: Path | None = None, source: str = "BERT config") -> Model:
    """A Model handle around a BertForMaskedLM, BertForPreTraining or BertModel (checks the architecture is
    supported)."""
    layout = type(module).__name__
    module.config.architectures = [layout]  # a built module's config names its layout as a saved one does
    return Model(FAMILY, arch(module.config, source, layout), module.eval(), module.config.to_dict(), name=name,
                 path=path)


def _class(layout: str):
    import transformers

    return getattr(transformers, layout)


def build(config: BertConfig | dict, seed: int = 0, dtype: torch.dtype = torch.float32, layout: str = CLASS) -> Model:
    """A freshly initialised BERT of `layout` (LAYOUTS; HF's own init) for tests."""
    from transformers import BertConfig

    if isinstance(config, dict):
        config = BertConfig(**config)
    arch(config, layout=layout)  # refuse before spending time on construction
    config._attn_implementation = "sdpa"  # the kernel load_hf asks for: a built model computes as a loaded one
    with nat.seeded(seed):
        module = _class(layout)(config)
    return wrap(module.to(dtype))


def detect(path: Path) -> bool:
    return nat.hf_model_type(path) == MODEL_TYPE


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    path = Path(path)
    archs = read_config(path).get("architectures") or [CLASS]
    if len(archs) != 1 or archs[0] not in LAYOUTS:
        raise ModelError(f"Model directory {path} holds {', '.join(map(str, archs))}; of BERT the engine reads "
                         f"{', '.join(LAYOUTS)} checkpoints only.")
    module = nat.load_hf(_class(_stored_layout(path, archs[0])), path, dtype, MODEL_TYPE, DISPLAY)
    return wrap(module, name=path.name, path=path, source=f"Model directory {path}")


def _stored_layout(path: Path, named: str) -> str:
    """The layout to read: the named one, except a masked LM whose weights also hold the next-sentence head
    (bert-base names BertForMaskedLM but stores the pre-training heads), read as BertForPreTraining."""
    from safetensors import safe_open

    if named != CLASS:
        return named
    try:
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:  # the header only
                if "cls.seq_relationship.weight" in fh.keys():  # noqa: SIM118 - a handle, not a dict
                    return PRETRAINING
    except (OSError, ValueError, RuntimeError):  # a broken file: load_hf names the problem
        pass
    return named


def save(model: Model, path: Path) -> None:
    nat.save_hf(model.module, Path(path))


def _parts(model: Model):
    """(the encoder, the masked-LM head or None, the next-sentence head or None, the native key prefix of
    the encoder and of the heads)."""
    mod = model.module
    if isinstance(mod, Twin) or not hasattr(mod, "bert"):  # BertModel: the module is the encoder
        return mod, None, None, "", ""
    nsp = getattr(mod.cls, "seq_relationship", None)  # BertForPreTraining
    return mod.bert, mod.cls.predictions, nsp, "bert.", "cls."


def to_canonical(model: Model) -> Params:
    a = model.arch
    bert, head, nsp, _, _ = _parts(model)
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
    if head is not None:
        p |= {
            "head.dense.W": head.transform.dense.weight.T, "head.dense.b": head.transform.dense.bias,  # [D, D]
            "head.norm.g": head.transform.LayerNorm.weight, "head.norm.b": head.transform.LayerNorm.bias,
            "head.b": head.bias,
        }
    if bert.pooler is not None:
        p |= {"head.pool.W": bert.pooler.dense.weight.T, "head.pool.b": bert.pooler.dense.bias}  # [D, D], [D]
    if nsp is not None:
        p |= {"head.nsp.W": nsp.weight.T, "head.nsp.b": nsp.bias}  # [D, 2], [2]
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a = model.arch
    bert, head, nsp, pre_b, pre_c = _parts(model)
    e, c = pre_b + "embeddings.", pre_c + "predictions."
    n: dict[str, torch.Tensor] = {
        e + "word_embeddings.weight": params["embed.tok"], e + "position_embeddings.weight": params["embed.pos"],
        e + "token_type_embeddings.weight": params["embed.segment"],
        e + "LayerNorm.weight": params["embed.norm.g"], e + "LayerNorm.bias": params["embed.norm.b"],
    }
    for l in range(a.n_layers):
        pre, hf = f"blocks.{l}.", f"{pre_b}encoder.layer.{l}."
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
    if head is not None:
        n |= {
            c + "transform.dense.weight": params["head.dense.W"].T, c + "transform.dense.bias": params["head.dense.b"],
            c + "transform.LayerNorm.weight": params["head.norm.g"], c + "transform.LayerNorm.bias": params["head.norm.b"],
            c + "bias": params["head.b"],  # the decoder's bias is this same Parameter, its weight word_embeddings'
        }
    if bert.pooler is not None:
        n |= {pre_b + "pooler.dense.weight": params["head.pool.W"].T, pre_b + "pooler.dense.bias": params["head.pool.b"]}
    if nsp is not None:
        n |= {pre_c + "seq_relationship.weight": params["head.nsp.W"].T, pre_c + "seq_relationship.bias": params["head.nsp.b"]}
    nat.copy_into(model.module, n)


def _check_len(model: Model, inputs: torch.Tensor) -> None:
    T = inputs.shape[-1]
    if T > model.arch.n_ctx:
        raise ModelError(f"Input length {T} exceeds the model's context of {model.arch.n_ctx}.")


def hidden(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> the last hidden states [B, T, D] (the stream after the last norm)."""
    _check_len(model, inputs)
    if isinstance(model.module, Twin):
        return model.module.encode(inputs)
    bert = _parts(model)[0]
    return bert(input_ids=inputs).last_hidden_state


def logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> masked-LM logits [B, T, V]: one segment (token type 0), every position attended.
    An encoder without a head (is_encoder) gives its basis-free output instead, [B, T*T (+ D)]: the Gram
    matrix H H^T / D of its last hidden states H, flattened, then the pooled [CLS] vector when it has a pooler;
    a residual permutation moves H (H -> H P) but neither of these."""
    _check_len(model, inputs)
    if isinstance(model.module, Twin):
        return model.module(inputs)
    if is_encoder(model.arch):
        out = model.module(input_ids=inputs)
        H = out.last_hidden_state  # [B, T, D]
        G = (H @ H.mT / H.shape[-1]).flatten(1)  # [B, T*T]
        return G if out.pooler_output is None else torch.cat([G, out.pooler_output], 1)  # [B, T*T (+ D)]
    out = model.module(input_ids=inputs)
    return out.prediction_logits if hasattr(out, "prediction_logits") else out.logits


def nsp_logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> the next-sentence logits [B, 2] of a BertForPreTraining (one segment, so these
    score the sequence as it is; a symmetry check compares them like the masked-LM logits)."""
    _check_len(model, inputs)
    if not hasattr(model.module, "cls") or not hasattr(model.module.cls, "seq_relationship"):
        raise ModelError(f"Model {model.name or model.path or 'BERT'} has no next-sentence head ({PRETRAINING} "
                         "has one).")
    return model.module(input_ids=inputs).seq_relationship_logits


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


def _dense(D: int, n: int) -> nn.Module:
    m = nn.Module()
    m.W, m.b = nn.Parameter(torch.empty(D, n)), nn.Parameter(torch.empty(n))
    return m


class Twin(nn.Module):
    """BERT as a module over the canonical params (its parameter names are the canonical keys), with the
    reference family's hook points: `blocks[l].attn` and `.mlp` see their inputs (here the stream itself,
    and the stream after the attention norm), `norm_f` (no parameters, the identity) the last stream before
    the head. Data-driven aligners run their forward passes, hooks and functional calls on it. It computes
    what `logits` does: the masked-LM logits, or an encoder's Gram output; the pooler and the next-sentence
    head (`pooler`, `nsp`) are carried as parameters, which the masked-LM logits do not read."""

    def __init__(self, a: Arch, n_types: int, pooler: bool = False, nsp: bool = False):
        super().__init__()
        D = a.d_model
        self.embed = nn.Module()
        self.embed.tok = nn.Parameter(torch.empty(a.n_out, D))
        self.embed.pos = nn.Parameter(torch.empty(a.n_ctx, D))
        self.embed.segment = nn.Parameter(torch.empty(n_types, D))
        self.embed.norm = _Norm(D, a.norm_eps)
        self.blocks = nn.ModuleList(_Block(a) for _ in range(a.n_layers))
        self.norm_f = nn.Identity()
        self.head = nn.Module()
        self.mlm = a.head_bias  # is_encoder: no masked-LM head
        if self.mlm:
            self.head.dense = _dense(D, D)
            self.head.norm = _Norm(D, a.norm_eps)
            self.head.b = nn.Parameter(torch.empty(a.n_out))
        if pooler:
            self.head.pool = _dense(D, D)
        if nsp:
            self.head.nsp = _dense(D, 2)
        self.kind = a.mlp

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the last hidden states [B, T, D]."""
        e = self.embed
        x = e.norm(e.tok[inputs] + e.pos[: inputs.shape[-1]] + e.segment[0])  # [B, T, D]: one segment
        for blk in self.blocks:
            x = blk(x)
        return self.norm_f(x)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from engine.models.reference import mlp_activation

        x = self.encode(inputs)  # [B, T, D]
        if not self.mlm:  # an encoder's basis-free output, as `logits` gives it
            G = (x @ x.mT / x.shape[-1]).flatten(1)  # [B, T*T]
            if not hasattr(self.head, "pool"):
                return G
            return torch.cat([G, torch.tanh(x[:, 0] @ self.head.pool.W + self.head.pool.b)], 1)  # [B, T*T + D]
        u = self.head.norm(mlp_activation(self.kind, x @ self.head.dense.W + self.head.dense.b))
        return u @ self.embed.tok.T + self.head.b  # [B, T, V]: the decoder is tied to the word embedding


def twin(model: Model) -> Model:
    """The model's Twin sharing its canonical tensors (no memory; to be used read-only)."""
    p = to_canonical(model)
    with torch.device("meta"):
        module = Twin(model.arch, p["embed.segment"].shape[0], "head.pool.W" in p, "head.nsp.W" in p)
    module.load_state_dict(p, strict=True, assign=True)
    return Model(FAMILY, model.arch, module.eval(), model.config, name=model.name, path=model.path)


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="BERT (Devlin et al., 2019); transformers.BertForMaskedLM, BertForPreTraining, BertModel",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits, twin=twin,
)
