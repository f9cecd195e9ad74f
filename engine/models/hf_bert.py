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

Families with this encoder under other names (RoBERTa, engine/models/hf_roberta.py) are a `Variant`: the key
prefixes, the layouts, where positions start and the head's activation; `hf_family` makes the adapter of one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelError
from engine.models.base import Arch, Model
from engine.models.hf_family import LINEAR, QUERY, QUERY_BIAS, WRITER, HFFamily, Key, KeyMap, Refusal, activation
from engine.models.io import read_config

if TYPE_CHECKING:
    from transformers import BertConfig

FAMILY = "hf_bert"
DISPLAY = "BERT (Hugging Face transformers)"
CLASS = "BertForMaskedLM"
PRETRAINING, ENCODER = "BertForPreTraining", "BertModel"
LAYOUTS = (CLASS, PRETRAINING, ENCODER)  # transformers class names, as a directory's `architectures` gives them

# HF activation name -> Arch.mlp (also the head transform's activation); "gelu" is the exact erf GELU.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class Variant:
    """A family with BERT's encoder: its names, and what it stores or computes differently from BERT. None of
    it touches the symmetry group (docs/MATH.md section 9)."""

    family: str  # registry name, "hf_bert"
    model_type: str
    config_name: str  # the config in sentences, "BERT"
    display: str
    reference: str
    config_class: str
    layouts: tuple[str, ...]  # transformers classes read: the masked LM first, the encoder without a head last
    prefix: str  # the encoder's attribute in a model with a head ("bert"), its native key prefix with a dot
    head: tuple[str, str, str]  # native names of the masked-LM head's dense layer, its norm (prefixes) and its bias
    pretraining: str = ""  # the layout with the pooler and the next-sentence head ("" none)
    nsp: str = ""  # native prefix of the next-sentence head
    offset: bool = False  # positions start at pad_token_id + 1 (RoBERTa), not 0
    head_act: str = ""  # the head's activation (Arch.mlp name) when it ignores hidden_act; "" hidden_act's

    @property
    def masked_lm(self) -> str:
        return self.layouts[0]

    @property
    def encoder(self) -> str:
        return self.layouts[-1]


BERT = Variant(
    family=FAMILY, model_type="bert", config_name="BERT", display=DISPLAY,
    reference="BERT (Devlin et al., 2019); transformers.BertForMaskedLM, BertForPreTraining, BertModel",
    config_class="BertConfig", layouts=LAYOUTS, prefix="bert",
    head=("cls.predictions.transform.dense.", "cls.predictions.transform.LayerNorm.", "cls.predictions.bias"),
    pretraining=PRETRAINING, nsp="cls.seq_relationship.",
)
VARIANTS: dict[str, Variant] = {}  # family name -> its variant, filled by hf_family


def layout_of(config: BertConfig | dict, v: Variant = BERT) -> str:
    """The layout a config names in `architectures` (v.layouts; none named: the masked LM)."""
    archs = (config.get("architectures") if isinstance(config, dict) else config.architectures) or [v.masked_lm]
    return archs[0] if len(archs) == 1 and archs[0] in v.layouts else v.masked_lm


def first_position(config, v: Variant = BERT) -> int:
    """The position id of a sequence's first token: 0, or pad_token_id + 1 when positions start after the
    padding id (RoBERTa); the rows below it hold no position of an unpadded sequence."""
    return config.pad_token_id + 1 if v.offset else 0


def is_encoder(a: Arch) -> bool:
    """A BERT without a masked-LM head (BertModel): post-norm and no head bias."""
    return a.post_norm and not a.head_bias


def no_loss(name: str, family: str = FAMILY) -> str:
    """The one sentence every loss-based view gives for an encoder without a head (engine.represent)."""
    v = VARIANTS[family]
    return (f"Model {name} is a {v.config_name} encoder without a head ({v.encoder}), so it has no loss to walk a "
            "path on; "
            "`python -m engine align A B` compares its hidden states along the path instead (docs/MATH.md "
            "section 9).")


def _summary(v: Variant, config, refuse) -> Arch:
    D, h = config.hidden_size, config.num_attention_heads
    n_ctx = config.max_position_embeddings - first_position(config, v)  # the positions of an unpadded sequence
    if n_ctx < 1:
        refuse(f"max_position_embeddings={config.max_position_embeddings} with pad_token_id={config.pad_token_id}",
               "positions start after the padding id, which leaves no position")
    return Arch(
        family=v.family, task="lm", n_layers=config.num_hidden_layers, d_model=D, n_heads=h, n_kv_heads=h,
        d_head=D // h, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=n_ctx, pe="learned", rope_layout=None, rotary_dim=0, rope_base=0.0,
        norm="layernorm", norm_bias=True, norm_eps=config.layer_norm_eps, mlp=ACTIVATIONS[config.hidden_act],
        attn_bias=True, out_bias=True, mlp_bias=True, head_bias=layout_of(config, v) != v.encoder,
        tied_embeddings=True, causal=False, post_norm=True,
    )


def _bad_pad(c) -> bool:
    p = c.pad_token_id
    return type(p) is not int or not 0 <= p < c.vocab_size


def _refusals(v: Variant) -> tuple[Refusal, ...]:
    out = (
        Refusal(lambda c: c.is_decoder or c.add_cross_attention, "is_decoder or add_cross_attention",
                f"a causal or cross-attending {v.config_name} is not a masked-LM encoder"),
        Refusal(lambda c: getattr(c, "position_embedding_type", "absolute") != "absolute",
                "position_embedding_type={c.position_embedding_type!r}", "only absolute learned positions are supported"),
        Refusal(lambda c: not c.tie_word_embeddings, "tie_word_embeddings=False",
                "an untied decoder keeps a second, unused bias beside the one it adds"),
        activation("hidden_act", ACTIVATIONS),
        Refusal(lambda c: c.hidden_size % c.num_attention_heads, "hidden_size={c.hidden_size} with "
                "{c.num_attention_heads} heads", "the heads must split the hidden size evenly"),
    )
    if v.offset:
        out += (Refusal(_bad_pad, "pad_token_id={c.pad_token_id!r}",
                        "positions start after the padding id, which must be a token id below vocab_size"),)
    return out


REFUSALS = _refusals(BERT)


def _name_layout(module) -> None:
    """A built module's config names its layout (its class) as a saved one does."""
    module.config.architectures = [type(module).__name__]


def _load_class(v: Variant, path: Path) -> str:
    """The layout to read a directory as: the one `architectures` names (v.layouts only), except a masked LM
    whose weights also hold the next-sentence head (bert-base names BertForMaskedLM but stores the pre-training
    heads), read as the pre-training layout."""
    from safetensors import safe_open

    archs = read_config(path).get("architectures") or [v.masked_lm]
    if len(archs) != 1 or archs[0] not in v.layouts:
        raise ModelError(f"Model directory {path} holds {', '.join(map(str, archs))}; of {v.config_name} the engine "
                         f"reads {', '.join(v.layouts)} checkpoints only.")
    if archs[0] != v.masked_lm or not v.pretraining:
        return archs[0]
    try:
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:  # the header only
                if v.nsp + "weight" in fh.keys():  # noqa: SIM118 - a handle, not a dict
                    return v.pretraining
    except (OSError, ValueError, RuntimeError):  # a broken file: load_hf names the problem
        pass
    return v.masked_lm


@functools.cache
def _keymap(v: Variant, enc: str, pooler: bool, nsp: bool) -> KeyMap:
    """The key map of one layout: `enc` the native prefix of the encoder ("" for an encoder without a head,
    which has no head keys either), with or without the pooler and the next-sentence head."""
    e, (dense, norm, bias) = enc + "embeddings.", v.head
    final = (
        Key("head.dense.W", dense + "weight", LINEAR, when="head_bias"),  # [D, D]
        Key("head.dense.b", dense + "bias", when="head_bias"),
        Key("head.norm.g", norm + "weight", when="head_bias"),
        Key("head.norm.b", norm + "bias", when="head_bias"),
        Key("head.b", bias, when="head_bias"),  # the decoder's bias is this Parameter, its weight the word embedding
    )
    if pooler:
        final += (Key("head.pool.W", enc + "pooler.dense.weight", LINEAR), Key("head.pool.b", enc + "pooler.dense.bias"))
    if nsp:
        final += (Key("head.nsp.W", v.nsp + "weight", LINEAR),  # [D, 2]
                  Key("head.nsp.b", v.nsp + "bias"))
    return KeyMap(
        embed=(Key("embed.tok", e + "word_embeddings.weight"), Key("embed.pos", e + "position_embeddings.weight"),
               Key("embed.segment", e + "token_type_embeddings.weight"),
               Key("embed.norm.g", e + "LayerNorm.weight"), Key("embed.norm.b", e + "LayerNorm.bias")),
        block_native=enc + "encoder.layer.{l}.",
        block=(
            Key("attn.W_Q", "attention.self.query.weight", QUERY), Key("attn.W_K", "attention.self.key.weight", QUERY),
            Key("attn.W_V", "attention.self.value.weight", QUERY),  # [h, D, d]
            Key("attn.b_Q", "attention.self.query.bias", QUERY_BIAS), Key("attn.b_K", "attention.self.key.bias", QUERY_BIAS),
            Key("attn.b_V", "attention.self.value.bias", QUERY_BIAS),  # [h, d]
            Key("attn.W_O", "attention.output.dense.weight", WRITER), Key("attn.b_O", "attention.output.dense.bias"),
            Key("norm1.g", "attention.output.LayerNorm.weight"), Key("norm1.b", "attention.output.LayerNorm.bias"),
            Key("mlp.W_in", "intermediate.dense.weight", LINEAR), Key("mlp.b_in", "intermediate.dense.bias"),  # [D, m]
            Key("mlp.W_out", "output.dense.weight", LINEAR), Key("mlp.b_out", "output.dense.bias"),  # [m, D]
            Key("norm2.g", "output.LayerNorm.weight"), Key("norm2.b", "output.LayerNorm.bias"),
        ),
        final=final,
    )


def _keys(v: Variant, model: Model) -> KeyMap:
    mod = model.module
    if not hasattr(mod, v.prefix):  # the encoder without a head: the module is the encoder
        return _keymap(v, "", mod.pooler is not None, False)
    nsp = bool(v.pretraining) and hasattr(getattr(mod, "cls", None), "seq_relationship")
    return _keymap(v, v.prefix + ".", getattr(mod, v.prefix).pooler is not None, nsp)


def _encoder(model: Model):
    """The encoder of a model with a head (its transformers base model), or the module itself."""
    return getattr(model.module, model.module.base_model_prefix, model.module)


def _check_len(model: Model, inputs: torch.Tensor) -> None:
    T = inputs.shape[-1]
    if T > model.arch.n_ctx:
        raise ModelError(f"Input length {T} exceeds the model's context of {model.arch.n_ctx}.")


def hidden(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> the last hidden states [B, T, D] (the stream after the last norm)."""
    _check_len(model, inputs)
    if isinstance(model.module, Twin):
        return model.module.encode(inputs)
    return _encoder(model)(input_ids=inputs).last_hidden_state


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
    head (`pooler`, `nsp`) are carried as parameters, which the masked-LM logits do not read. `pad` (RoBERTa)
    numbers positions as HF does from the padding id: pad + 1, pad + 2, ... over the other tokens, pad for a
    padding token; the position table then has `n_pos` rows (None: a.n_ctx). `head_act` is the head's
    activation when it is not the blocks' a.mlp."""

    def __init__(self, a: Arch, n_types: int, pooler: bool = False, nsp: bool = False, pad: int | None = None,
                 n_pos: int | None = None, head_act: str | None = None):
        super().__init__()
        D = a.d_model
        self.embed = nn.Module()
        self.embed.tok = nn.Parameter(torch.empty(a.n_out, D))
        self.embed.pos = nn.Parameter(torch.empty(a.n_ctx if n_pos is None else n_pos, D))
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
        self.kind, self.pad = head_act or a.mlp, pad

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the last hidden states [B, T, D]."""
        e = self.embed
        if self.pad is None:
            pos = e.pos[: inputs.shape[-1]]  # [T, D]
        else:  # HF's create_position_ids_from_input_ids
            keep = inputs.ne(self.pad)
            pos = e.pos[torch.cumsum(keep, -1) * keep + self.pad]  # [B, T, D]
        x = e.norm(e.tok[inputs] + pos + e.segment[0])  # [B, T, D]: one segment
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
    v = VARIANTS[model.family]
    p = ADAPTERS[model.family].to_canonical(model)
    pad = model.config["pad_token_id"] if v.offset else None
    with torch.device("meta"):
        module = Twin(model.arch, p["embed.segment"].shape[0], "head.pool.W" in p, "head.nsp.W" in p, pad=pad,
                      n_pos=p["embed.pos"].shape[0], head_act=v.head_act or None)
    module.load_state_dict(p, strict=True, assign=True)
    return Model(model.family, model.arch, module.eval(), model.config, name=model.name, path=model.path)


ADAPTERS: dict[str, HFFamily] = {}  # family name -> its adapter, filled by hf_family


def hf_family(v: Variant) -> HFFamily:
    """The adapter of a family with BERT's encoder; registers it (VARIANTS, ADAPTERS)."""
    fam = HFFamily(
        name=v.family, model_type=v.model_type, config_name=v.config_name, display=v.display, reference=v.reference,
        config_class=v.config_class, model_class=v.masked_lm, keys=functools.partial(_keys, v),
        summary=functools.partial(_summary, v), refusals=_refusals(v), prepare=_name_layout,
        load_class=functools.partial(_load_class, v), logits=logits, twin=twin,
    )
    VARIANTS[v.family], ADAPTERS[v.family] = v, fam
    return fam


HF = hf_family(BERT)
MODEL_TYPE = HF.model_type
arch, wrap, detect, load, save = HF.arch, HF.wrap, HF.detect, HF.load, HF.save
to_canonical, from_canonical = HF.to_canonical, HF.from_canonical


def build(config: BertConfig | dict, seed: int = 0, dtype: torch.dtype = torch.float32, layout: str = CLASS) -> Model:
    """A freshly initialised BERT of `layout` (LAYOUTS; HF's own init) for tests."""
    return HF.build(config, seed, dtype, model_class=layout)


ENTRY = HF.entry()
