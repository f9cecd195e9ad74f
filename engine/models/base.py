"""What every model family shares: the architecture summary, the loaded-model handle, the adapter.

Canonical layout
----------------
Every adapter converts its native weights, once, to one head-explicit, row-vector (`x @ W`) layout,
the `Params` dict that symmetry specs, group actions and aligners work on (docs/MATH.md, notation):

    embed.tok        [V, D]      token embedding (LM)
    embed.patch.W    [P, D]      patch embedding, P = C * p * p (ViT); embed.patch.b [D]
    embed.cls        [D]         class token (ViT)
    embed.pos        [T, D]      learned position embedding (pe == "learned" only)
    blocks.{l}.norm1.g [D]       pre-attention norm gain; .norm1.b [D] its bias (LayerNorm)
    blocks.{l}.attn.W_Q [h, D, d]     blocks.{l}.attn.b_Q [h, d]
    blocks.{l}.attn.W_K [h_kv, D, d]  blocks.{l}.attn.b_K [h_kv, d]
    blocks.{l}.attn.W_V [h_kv, D, d]  blocks.{l}.attn.b_V [h_kv, d]
    blocks.{l}.attn.W_O [h, d, D]     blocks.{l}.attn.b_O [D]
    blocks.{l}.attn.q_norm.g [d]      blocks.{l}.attn.k_norm.g [d]   QK-norm gains (qk_norm), every head's
    blocks.{l}.norm2.g [D]       pre-MLP norm; .norm2.b [D]
    blocks.{l}.mlp.W_in [D, m]   first layer (the "up" branch for SwiGLU); .b_in [m]
    blocks.{l}.mlp.W_gate [D, m] SwiGLU gate branch only
    blocks.{l}.mlp.W_out [m, D]  second layer; .b_out [D]
    norm_f.g [D], norm_f.b [D]   final norm
    head.W [D, n_out], head.b [n_out]   unembedding / classifier (absent when tied to embed.tok)

Post-norm encoders (BERT, docs/MATH.md section 9) add embed.segment [n_types, D] (token types) and
embed.norm.g / .b [D] (the norm of the embedding sum); norm1 and norm2 are the norms after the attention
and MLP adds; there is no norm_f, and the masked-LM head is head.dense.W [D, D], head.dense.b [D],
head.norm.g / .b [D] before the decoder (tied to embed.tok) and its bias head.b [n_out]; the pre-training
layout adds the pooler head.pool.W [D, D], head.pool.b [D] and the next-sentence head head.nsp.W [D, 2],
head.nsp.b [2]; an encoder without a head (BertModel) has none of the head.dense / head.norm / head.b keys.
Their embed.pos is the whole position table, which may start with rows before the first position
(RoBERTa numbers positions from pad_token_id + 1): [T0 + T, D].

Biases are present exactly when the architecture has them. Conversion is linear, so interpolating
in native or canonical coordinates is the same path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from engine.errors import ArchitectureMismatch

Params = dict[str, torch.Tensor]

PE_KINDS = ("none", "learned", "sinusoidal", "rope")
ROPE_LAYOUTS = ("interleaved", "half")
NORM_KINDS = ("layernorm", "rmsnorm")
MLP_KINDS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu")
GATED_MLPS = ("swiglu", "geglu")  # act(x W_gate) * (x W_in): silu (SwiGLU) or tanh-approximated gelu (GeGLU)
SCALED_MLPS = ("relu", *GATED_MLPS)  # the MLPs with a neuron scaling group (docs/MATH.md section 2)


@dataclass(frozen=True)
class Arch:
    """Family-independent summary of an architecture: all a symmetry spec needs to know."""

    family: str
    task: str  # "lm" | "vit"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    n_out: int  # vocabulary size or number of classes
    n_ctx: int  # positions the model supports (tokens, or patches + class token)
    pe: str  # PE_KINDS
    rope_layout: str | None  # ROPE_LAYOUTS when pe == "rope"
    rotary_dim: int  # dims of each head that RoPE rotates (0 without RoPE)
    rope_base: float
    norm: str  # NORM_KINDS
    norm_bias: bool
    norm_eps: float
    mlp: str  # MLP_KINDS
    attn_bias: bool  # b_Q, b_K, b_V
    out_bias: bool  # b_O
    mlp_bias: bool  # b_in, b_out
    head_bias: bool
    tied_embeddings: bool
    causal: bool
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-J / GPT-NeoX) instead of sequential
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE, one gain [d] each per layer (Qwen3)
    post_norm: bool = False  # LayerNorm after each residual add, LN(x + sublayer(x)), and on the embeddings (BERT)
    # RoPE frequencies scaled beyond the base (Llama 3's "llama3", "linear"): reference.rope_scaling's canonical
    # JSON; "" for standard RoPE. The group is the same (the scaled frequencies stay distinct); the function differs
    rope_scaling: str = ""
    embed_scale: float = 1.0  # the token embedding times this as it enters the stream (Gemma: sqrt(D)); the head reads E

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (GATED_MLPS): a gate branch beside the up branch, permuted with it."""
        return self.mlp in GATED_MLPS

    def to_dict(self) -> dict:
        # rope_scaling and embed_scale only when set: the records and reports of other models read and compare as
        # they were written
        unset = {"rope_scaling": "", "embed_scale": 1.0}
        return {k: v for k, v in asdict(self).items() if k not in unset or v != unset[k]}

    def mismatch(self, other: Arch) -> str | None:
        """The first field in which two architectures differ, as a phrase, or None."""
        for k, v in asdict(self).items():
            w = getattr(other, k)
            if v != w:
                return f"{k} is {v!r} vs {w!r}"
        return None


@dataclass
class Model:
    """A loaded model: its family, architecture summary, torch module and native config."""

    family: str
    arch: Arch
    module: nn.Module
    config: dict  # the family's own config, JSON-serialisable
    name: str = ""  # zoo name or directory, for display and records
    path: Path | None = None


def check_same_architecture(a: Model, b: Model) -> None:
    """Raise with the first difference if `a` and `b` cannot be interpolated (both paths check it first:
    engine.interpolate, engine.circuits; so does alignment)."""
    if a.family != b.family:
        raise ArchitectureMismatch(f"Models {a.name or 'A'} and {b.name or 'B'} are of different families: {a.family} vs {b.family}.")
    diff = a.arch.mismatch(b.arch)
    if diff is not None:
        raise ArchitectureMismatch(f"Models {a.name or 'A'} and {b.name or 'B'} differ in architecture: {diff}.")
    sa, sb = a.module.state_dict(), b.module.state_dict()
    for k in sa:
        if k not in sb or sa[k].shape != sb[k].shape:
            got = tuple(sb[k].shape) if k in sb else "missing"
            raise ArchitectureMismatch(f"Models {a.name or 'A'} and {b.name or 'B'} differ at tensor {k}: {tuple(sa[k].shape)} vs {got}.")


@dataclass(frozen=True)
class Family:
    """A registry entry: one adapter file provides all of these for its family."""

    name: str
    display_name: str
    reference: str  # where the architecture comes from
    detect: Callable[[Path], bool]  # does this directory hold a checkpoint of this family
    load: Callable[..., Model]  # load(path, dtype=torch.float32) -> Model
    save: Callable[[Model, Path], None]
    to_canonical: Callable[[Model], Params]  # views of the module's tensors (engine.models.canonical copies)
    from_canonical: Callable[[Model, Params], None]  # in place: copies into the module's tensors
    logits: Callable[[Model, torch.Tensor], torch.Tensor]  # inputs -> [..., n_out]
    # a module over the canonical params (parameter names = canonical keys) computing the same function, for a
    # family the reference family cannot express (engine.align.forward.twin); None: the reference-family twin
    twin: Callable[[Model], Model] | None = None
    model_type: str | None = None  # config.json's model_type of an HF family
    # the Arch of a config.json dict without weights (engine.models.arch_from_config); None: not read this way
    config_arch: Callable[[dict, str], Arch] | None = None
