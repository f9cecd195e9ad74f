"""Width-heterogeneous pairs: lift a narrower model into a wider shape, computing the same function
(docs/MATH.md section 8).

A lift embeds every axis of the narrow model A into the wider one's by an injective coordinate map
and pads the rest with zeros: the residual stream into the first D_A of D_B coordinates, query heads
into KV groups of the same index, head dimensions (under RoPE onto the wide head's pairs of the same
frequency), MLP neurons into the first m_A of m_B. Three scales keep it exact:

    writers       x sqrt(D_B / D_A)    the lifted stream has A's mean square over D_B coordinates, so
                                       RMSNorm's eps acts as in A (no per-model eps needed)
    norm gains    / sqrt(D_B / D_A)    the readers then see A's normalised input, padded
                                       (tied embeddings: the final gain / (D_B / D_A))
    W_Q, W_K      x (d_B / d_A)^(1/4)  the scores keep their 1 / sqrt(d) temperature
                                       (QK-norm: x sqrt(d_B / d_A), its gains x (d_A / d_B)^(1/4))

Every padded unit has zero weights in and out: padded MLP neurons, head dimensions and heads read
nothing and write nothing, and the padded stream coordinates stay zero. A LayerNorm model is first
rewritten as RMSNorm (engine.surgery); a fixed sinusoidal table is width-specific and is refused.
The result is a reference-family model of the wide shape; `widen_models` makes a narrow model and a
wide one a pair of one architecture, which any aligner then aligns like any other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from engine.errors import ArchitectureMismatch, SpecError
from engine.models import Model, canonical
from engine.models.base import Arch, Params
from engine.models.reference import RefConfig, Transformer, rope_pairs
from engine.surgery import layernorm_to_rmsnorm, reference_config_from_arch

__all__ = ["Widths", "lift", "lift_info", "lift_refusal", "rms_form", "widen_models", "widths"]

F64 = torch.float64


@dataclass(frozen=True)
class Widths:
    """The sizes a lift may grow; every other part of the architecture stays as it is."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    rotary_dim: int  # 0 without RoPE
    d_mlp: int

    def to_dict(self) -> dict:
        return asdict(self)


def widths(arch: Arch) -> Widths:
    return Widths(arch.d_model, arch.n_heads, arch.n_kv_heads, arch.d_head, arch.rotary_dim, arch.d_mlp)


NAMES = {"d_model": "residual width D", "n_heads": "query heads", "n_kv_heads": "KV groups",
         "d_head": "head dimension", "rotary_dim": "rotary dimensions", "d_mlp": "MLP width"}


def _widths_refusal(a: Widths, b: Widths, pe: str) -> str | None:
    """Why `a` cannot be lifted into `b` (one phrase), or None."""
    for k in ("d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp"):
        if getattr(a, k) > getattr(b, k):
            return f"its {NAMES[k]} is {getattr(a, k)}, more than the {getattr(b, k)} it would be lifted into"
    if a == b:
        return "it already has the wider shape; align the two models directly"
    rep_a, rep_b = a.n_heads // a.n_kv_heads, b.n_heads // b.n_kv_heads
    if rep_a > rep_b:
        return (f"its KV groups hold {rep_a} query heads each and the wider model's {rep_b}, so its groups cannot "
                "be embedded whole")
    if pe == "sinusoidal":
        return "a fixed sinusoidal table is different at every width, so no padding of it computes the same function"
    if pe == "rope":
        if b.rotary_dim % a.rotary_dim:
            return (f"RoPE on {a.rotary_dim} of its head dimensions has frequencies that {b.rotary_dim} rotary "
                    "dimensions lack (the wider count must be a multiple)")
        if a.d_head - a.rotary_dim > b.d_head - b.rotary_dim:
            return (f"its {a.d_head - a.rotary_dim} unrotated head dimensions do not fit into the wider head's "
                    f"{b.d_head - b.rotary_dim}")
    return None


def lift_refusal(a: Arch, b: Arch, name_a: str = "A", name_b: str = "B") -> str | None:
    """Why model A cannot be lifted into model B's shape and compared with it, as one sentence, or None.

    From the architectures alone (a config is enough): the same family, task and positional encoding,
    the same depth, A at most as wide as B in every size and narrower in one, and nothing else different.
    """
    for field, what in (("family", "family"), ("task", "task"), ("pe", "positional encoding")):
        if getattr(a, field) != getattr(b, field):
            return (f"Model {name_a} and model {name_b} differ in {what} ({getattr(a, field)} vs {getattr(b, field)}); "
                    "a lift only widens a model of the same kind.")
    if a.n_layers != b.n_layers:
        return (f"Model {name_a} has {a.n_layers} layers and model {name_b} {b.n_layers}; a lift adds width, "
                "not depth.")
    why = _widths_refusal(widths(a), widths(b), a.pe)
    if why:
        return f"Model {name_a} cannot be lifted into model {name_b}'s shape: {why}."
    if a.embed_scale != b.embed_scale:
        return (f"Model {name_a}'s token embedding enters the stream times {a.embed_scale:.6g} and model {name_b}'s "
                f"times {b.embed_scale:.6g} (Gemma's sqrt(D)); a lift cannot rescale it while the tied head reads "
                "it unscaled.")
    diff = replace(a, **widths(b).to_dict()).mismatch(b)
    if diff:
        return f"Model {name_a} and model {name_b} differ beyond their widths ({diff}), so their weights cannot be compared."
    return None


# ---------------------------------------------------------------------------------------------
# The coordinate maps and scales (docs/MATH.md section 8)


def head_map(a: Widths, b: Widths) -> Tensor:
    """[h_A]: the wide query head of each narrow one; head i of KV group c keeps its place in group c."""
    rep_a, rep_b = a.n_heads // a.n_kv_heads, b.n_heads // b.n_kv_heads
    i = torch.arange(a.n_heads)
    return (i // rep_a) * rep_b + i % rep_a  # [h_A]


def head_dim_map(a: Widths, b: Widths, layout: str | None) -> Tensor:
    """[d_A]: the wide head coordinate of each narrow one. Under RoPE, A's pair j (frequency
    base^(-2j / r_A)) goes to B's pair j r_B / r_A, which turns at the same frequency; the unrotated
    dimensions follow the wide head's rotated ones."""
    if not a.rotary_dim:
        return torch.arange(a.d_head)
    phi = torch.empty(a.d_head, dtype=torch.long)
    (i1, i2), (k1, k2) = rope_pairs(a.rotary_dim, layout), rope_pairs(b.rotary_dim, layout)
    step = b.rotary_dim // a.rotary_dim
    phi[i1], phi[i2] = k1[::step][: a.rotary_dim // 2], k2[::step][: a.rotary_dim // 2]
    phi[a.rotary_dim:] = b.rotary_dim + torch.arange(a.d_head - a.rotary_dim)
    return phi


@dataclass(frozen=True)
class Scales:
    stream: float  # c = sqrt(D_B / D_A): writers x c, residual norm gains / c
    qk: float  # W_Q, b_Q, W_K, b_K x qk
    qk_gain: float  # QK-norm gains x qk_gain (1 without QK-norm)


def scales(a: Widths, b: Widths, qk_norm: bool) -> Scales:
    """The scales that make the lift exact (docs/MATH.md section 8)."""
    r = b.d_head / a.d_head
    if qk_norm:  # the head norm's input keeps its mean square, its gains carry the temperature
        return Scales(math.sqrt(b.d_model / a.d_model), math.sqrt(r), r ** -0.25)
    return Scales(math.sqrt(b.d_model / a.d_model), r ** 0.25, 1.0)


def _embed(x: Tensor, shape: tuple[int, ...], maps: list[Tensor | None], scale: float = 1.0,
           fill: float = 0.0) -> Tensor:
    """A tensor of `shape` filled with `fill`, and x * scale written at the coordinates maps give per axis
    (None: the same index)."""
    out = torch.full(shape, fill, dtype=F64)
    idx = []
    for ax, (n, m) in enumerate(zip(x.shape, maps)):
        view = [1] * x.dim()
        view[ax] = n
        idx.append((torch.arange(n) if m is None else m).reshape(view))
    out[tuple(idx)] = x.to(F64) * scale
    return out


def _lift_params(arch: Arch, p: Params, b: Widths) -> Params:
    """The lifted canonical params (float64) of an RMSNorm model `arch` with params `p`."""
    a = widths(arch)
    s = scales(a, b, arch.qk_norm)
    R = torch.arange(a.d_model)  # stream coordinates: the first D_A of D_B
    H, Phi, M = head_map(a, b), head_dim_map(a, b, arch.rope_layout), torch.arange(a.d_mlp)
    D, h, hkv, d, m = b.d_model, b.n_heads, b.n_kv_heads, b.d_head, b.d_mlp
    out: Params = {}
    for k, x in p.items():
        name = k.split(".", 2)[-1] if k.startswith("blocks.") else k
        if k.startswith("embed."):  # writers: [..., D]
            out[k] = _embed(x, (*x.shape[:-1], D), [None] * (x.dim() - 1) + [R], s.stream)
        elif name in ("norm1.g", "norm2.g", "norm_f.g"):
            g = 1 / s.stream ** (2 if k == "norm_f.g" and arch.tied_embeddings else 1)
            out[k] = _embed(x, (D,), [R], g, fill=g)
        elif name == "attn.W_Q":
            out[k] = _embed(x, (h, D, d), [H, R, Phi], s.qk)
        elif name == "attn.b_Q":
            out[k] = _embed(x, (h, d), [H, Phi], s.qk)
        elif name == "attn.W_K":
            out[k] = _embed(x, (hkv, D, d), [None, R, Phi], s.qk)
        elif name == "attn.b_K":
            out[k] = _embed(x, (hkv, d), [None, Phi], s.qk)
        elif name == "attn.W_V":
            out[k] = _embed(x, (hkv, D, d), [None, R, Phi])
        elif name == "attn.b_V":
            out[k] = _embed(x, (hkv, d), [None, Phi])
        elif name == "attn.W_O":
            out[k] = _embed(x, (h, d, D), [H, Phi, R], s.stream)
        elif name in ("attn.b_O", "mlp.b_out"):
            out[k] = _embed(x, (D,), [R], s.stream)
        elif name in ("attn.q_norm.g", "attn.k_norm.g"):
            out[k] = _embed(x, (d,), [Phi], s.qk_gain, fill=s.qk_gain)
        elif name in ("mlp.W_in", "mlp.W_gate"):
            out[k] = _embed(x, (D, m), [R, M])
        elif name == "mlp.b_in":
            out[k] = _embed(x, (m,), [M])
        elif name == "mlp.W_out":
            out[k] = _embed(x, (m, D), [M, R], s.stream)
        elif k == "head.W":
            out[k] = _embed(x, (D, x.shape[1]), [R, None])
        elif k == "head.b":
            out[k] = x.to(F64).clone()
        else:  # a bug: every canonical key of an RMSNorm model is listed above
            raise SpecError(f"The lift does not know where parameter {k!r} goes.")
    return out


# ---------------------------------------------------------------------------------------------
# Models


def _rms_params(model: Model) -> tuple[Arch, Params, RefConfig, str]:
    """(arch, canonical params, reference config, rewrite) of `model` as a reference-family RMSNorm model:
    LayerNorm rewritten (docs/MATH.md section 3), other families expressed in the reference family."""
    arch, p, rewrite = model.arch, canonical(model), ""
    if arch.norm == "layernorm":
        arch, p = layernorm_to_rmsnorm(arch, p)
        rewrite = "layernorm_to_rmsnorm"
    if model.family == "reference" and not rewrite:
        cfg = RefConfig.from_dict(model.config)
    else:
        patch = p["embed.patch.W"].shape[0] if "embed.patch.W" in p else None
        cfg = reference_config_from_arch(arch, patch_dim=patch)
    return cfg.arch(), p, cfg, rewrite


def _model(cfg: RefConfig, params: Params, dtype: torch.dtype, device: torch.device, name: str) -> Model:
    module = Transformer(cfg, init=False).to(dtype=dtype, device=device)
    module.load_state_dict({k: v.to(dtype=dtype, device=device) for k, v in params.items()}, strict=True)
    return Model("reference", cfg.arch(), module, cfg.to_dict(), name=name, path=None)


def rms_form(model: Model) -> Model:
    """`model` itself when it is a reference-family RMSNorm model, else a reference-family RMSNorm model
    computing the same function (a copy: LayerNorm rewritten, other families re-expressed)."""
    if model.family == "reference" and model.arch.norm == "rmsnorm":
        return model
    _, p, cfg, _ = _rms_params(model)
    q = next(model.module.parameters())
    return _model(cfg, p, q.dtype, q.device, model.name)


def lift(model: Model, d_model: int | None = None, d_mlp: int | None = None, n_heads: int | None = None,
         d_head: int | None = None, n_kv_heads: int | None = None, rotary_dim: int | None = None) -> Model:
    """A reference-family model of the wider shape computing exactly the function of `model`
    (docs/MATH.md section 8); sizes left None keep the model's own. A smaller size, a shape that is not
    wider anywhere, an embedding the maps cannot make (KV groups, RoPE frequencies) or a sinusoidal
    table is refused with one sentence (SpecError). Computed in float64, returned in the model's dtype."""
    arch, p, cfg, _ = _rms_params(model)
    a = widths(arch)
    h = n_heads or a.n_heads
    hkv = n_kv_heads or (h if a.n_kv_heads == a.n_heads else a.n_kv_heads)  # MHA stays MHA
    d = d_head or a.d_head
    r = (rotary_dim or (d if a.rotary_dim == a.d_head else a.rotary_dim)) if arch.pe == "rope" else 0
    b = Widths(d_model or a.d_model, h, hkv, d, r, d_mlp or a.d_mlp)
    if b.n_heads % b.n_kv_heads:
        raise SpecError(f"A lift into {b.n_heads} query heads cannot have {b.n_kv_heads} KV groups.")
    why = _widths_refusal(a, b, arch.pe)
    if why:
        raise SpecError(f"Model {model.name or 'A'} cannot be lifted: {why}.")
    wide = replace(cfg, d_model=b.d_model, n_heads=b.n_heads, n_kv_heads=b.n_kv_heads, d_head=b.d_head,
                   d_mlp=b.d_mlp, rotary_dim=b.rotary_dim if arch.pe == "rope" else 0)
    q = next(model.module.parameters())
    return _model(wide, _lift_params(arch, p, b), q.dtype, q.device, model.name)


def _untie(model: Model) -> Model:
    """A tied reference-family model with its own head (E^T): the same function, one more parameter."""
    cfg = replace(RefConfig.from_dict(model.config), tied_embeddings=False)
    p = canonical(model)
    p["head.W"] = p["embed.tok"].T.clone()  # [D, V]
    q = next(model.module.parameters())
    return _model(cfg, p, q.dtype, q.device, model.name)


def widen_models(a: Model, b: Model) -> tuple[Model, Model]:
    """(A lifted into B's shape, B): two reference-family RMSNorm models of one architecture, computing
    A's and B's functions, ready for any aligner; refused with one sentence when lift_refusal says so."""
    why = lift_refusal(a.arch, b.arch, a.name or "A", b.name or "B")
    if why:
        raise ArchitectureMismatch(why)
    b = rms_form(b)
    wide = widths(b.arch)
    lifted = lift(a, wide.d_model, wide.d_mlp, wide.n_heads, wide.d_head, wide.n_kv_heads, wide.rotary_dim or None)
    if lifted.arch.tied_embeddings != b.arch.tied_embeddings:  # the LayerNorm rewrite unties where the gain is not 1
        lifted, b = (_untie(m) if m.arch.tied_embeddings else m for m in (lifted, b))
    diff = lifted.arch.mismatch(b.arch)
    if diff:
        raise ArchitectureMismatch(f"Model {a.name or 'A'} lifted and model {b.name or 'B'} differ ({diff}).")
    return lifted, b


def lift_info(a: Arch, b: Arch) -> dict:
    """The record's description of a lift of `a` into `b`'s widths: the widths, maps and scales."""
    wa, wb = widths(a), widths(b)
    s = scales(wa, wb, a.qk_norm)
    return {
        "widths_a": wa.to_dict(), "widths_b": wb.to_dict(),
        "rewrite": "layernorm_to_rmsnorm" if a.norm == "layernorm" else "",
        "stream_scale": s.stream, "qk_scale": s.qk, "qk_norm_gain_scale": s.qk_gain if a.qk_norm else None,
        "maps": {"residual": f"coordinates 0..{wa.d_model - 1} of {wb.d_model}",
                 "heads": head_map(wa, wb).tolist(), "head_dims": head_dim_map(wa, wb, a.rope_layout).tolist(),
                 "mlp": f"neurons 0..{wa.d_mlp - 1} of {wb.d_mlp}"},
        "padding": {"residual": wb.d_model - wa.d_model, "heads": wb.n_heads - wa.n_heads,
                    "head_dims": wb.d_head - wa.d_head, "mlp": wb.d_mlp - wa.d_mlp},
    }
