"""Numerical verifications of the symmetry group, on a float64 copy of the model.

- invariance checks: k random elements of each group kind, the largest relative change of the logits;
  translations (key bias, value-bias folding, learned-PE shift) too;
- break tests: maps from larger groups that are NOT symmetries (GL(d) on a RoPE model's Q/K, the other
  pairing's commutant, orthogonal Q/K maps, GL(D) on the residual, scaling a non-homogeneous MLP; under
  QK-norm also the plain RoPE commutant on W_Q / W_K and gain scalings the group does not hold) and
  how much they change the output;
- RoPE breaking strength per frequency pair against omega * context, measured on the model too;
- the group dimension measured as the nullity of the Jacobian of the logits w.r.t. the parameters,
  against the formula of engine/groups.py.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from engine.errors import SpecError
from engine.groups import group_dimension
from engine.models import canonical, model_logits, set_canonical
from engine.models.base import Arch, Model, Params
from engine.models.reference import RefConfig, build, rope_frequencies, rope_pairs
from engine.spec import build_spec, is_qk_gain
from engine.surgery import fold_norms, layernorm_to_rmsnorm, reference_config_from_arch
from engine.symmetry import (
    GroupElement,
    LayerElement,
    apply,
    identity,
    random_gl,
    random_orthogonal,
    rope_commutant,
    sample,
)

__all__ = ["EXACT_TOL", "break_tests", "float64_copy", "invariance_checks", "jacobian_nullity", "reference_model",
           "rope_breaking"]

EXACT_TOL = 1e-10  # relative logit change below which a float64 check counts as exact (docs/DESIGN.md section 10)


# ---------------------------------------------------------------------------------------------
# Evaluating canonical Params in float64


def float64_copy(model: Model) -> Model:
    """A deep copy of the model with its module in float64 (the original is left alone)."""
    return Model(model.family, model.arch, copy.deepcopy(model.module).to(torch.float64), dict(model.config),
                 model.name, model.path)


def _geometry(model: Model, params: Params) -> dict:
    """A ViT's image geometry (not part of an Arch): from the config or module, else inferred."""
    if model.arch.task != "vit":
        return {}
    c = model.config
    if "patch_size" in c and "in_chans" in c:
        return {"in_chans": c["in_chans"], "patch_size": c["patch_size"]}
    pe = getattr(model.module, "patch_embed", None)
    if pe is not None and hasattr(pe, "proj"):
        p = pe.proj.weight.shape  # [D, C, p, p]
        return {"in_chans": int(p[1]), "patch_size": int(p[-1])}
    return {"patch_dim": int(params["embed.patch.W"].shape[0])}


def example_inputs(model: Model, batch: int = 2, seed: int = 0, n_tokens: int = 32) -> Tensor:
    """Random token ids [B, T] (T = min(n_ctx, n_tokens)) or images [B, C, H, W] for this model."""
    a, g = model.arch, torch.Generator().manual_seed(seed)
    if a.task == "lm":
        return torch.randint(0, a.n_out, (batch, min(a.n_ctx, n_tokens)), generator=g)
    geo = reference_config_from_arch(a, **_geometry(model, canonical(model)))
    return torch.rand(batch, geo.in_chans, geo.image_size, geo.image_size, generator=g, dtype=torch.float64)


def _evaluator(model64: Model, arch: Arch, inputs: Tensor) -> Callable[[Params], Tensor]:
    """Params of `arch` -> logits on `inputs`: in the model itself when `arch` is its own, else in a
    reference-family module built from `arch` (after layernorm_to_rmsnorm or an untying fold)."""
    if arch == model64.arch:
        target = model64
    else:
        target = reference_model(reference_config_from_arch(arch, **_geometry(model64, canonical(model64))))

    def f(params: Params) -> Tensor:
        with torch.no_grad():
            set_canonical(target, params)
            return model_logits(target, inputs).to(torch.float64)

    return f


@functools.lru_cache(maxsize=1)
def reference_model(cfg: RefConfig) -> Model:
    """A float64 reference model to evaluate rewritten params in; kept for the next check of the same
    config (its weights are always overwritten whole by set_canonical before use)."""
    return build(cfg, dtype=torch.float64)


def _rel(y: Tensor, y0: Tensor) -> float:
    return float((y - y0).norm() / y0.norm().clamp_min(1e-300))


def _residual_ready(arch: Arch, params: Params) -> tuple[Arch, Params, str]:
    """The model in a form whose residual stream may be rotated (docs/MATH.md section 3)."""
    if arch.norm == "layernorm":
        a2, p2 = layernorm_to_rmsnorm(arch, params)
        return a2, p2, "after layernorm_to_rmsnorm"
    a2, p2 = fold_norms(arch, params)
    return a2, p2, "after fold_norms"


# ---------------------------------------------------------------------------------------------
# Invariance checks


def _translations(arch: Arch, params: Params, seed: int) -> dict[str, Params]:
    """The additive symmetries the group dimension counts (docs/MATH.md sections 1 and 3), one draw each."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d, r, rep = arch.n_kv_heads, arch.d_head, arch.rotary_dim, arch.n_heads // arch.n_kv_heads

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out: dict[str, Params] = {}
    if arch.attn_bias and r < d:
        # q . (k + t) = q . k + q . t: the same for every key of a query, so softmax ignores it;
        # under RoPE only the d - r unrotated dims (the rotated part of t meets R_{n-m})
        p = dict(params)
        for i in range(arch.n_layers):
            k = f"blocks.{i}.attn.b_K"
            t = torch.zeros(hkv, d, dtype=torch.float64)
            t[:, r:] = rnd(hkv, d - r)
            p[k] = params[k] + t.to(params[k].dtype)
        out["key_bias_shift"] = p
    if arch.attn_bias and arch.out_bias:
        # attention rows sum to 1: b_V + t adds t W_O per head, which b_O takes back
        p = dict(params)
        for i in range(arch.n_layers):
            b = f"blocks.{i}.attn"
            t = rnd(hkv, d)  # [h_kv, d]
            W_O = params[f"{b}.W_O"].to(torch.float64)  # [h, d, D]
            p[f"{b}.b_V"] = params[f"{b}.b_V"] + t.to(params[f"{b}.b_V"].dtype)
            shift = torch.einsum("hd,hdD->D", t.repeat_interleave(rep, 0), W_O)  # [D]
            p[f"{b}.b_O"] = params[f"{b}.b_O"] - shift.to(params[f"{b}.b_O"].dtype)
        out["value_bias_fold"] = p
    if arch.pe == "learned" and not arch.tied_embeddings:
        # every input row is (embedding + position): shift one, unshift the other (docs/MATH.md section 3)
        p = dict(params)
        pos = params["embed.pos"].to(torch.float64).clone()
        c = rnd(arch.d_model)
        if arch.task == "lm":
            p["embed.tok"] = params["embed.tok"] + c.to(params["embed.tok"].dtype)
            pos -= arch.embed_scale * c  # the row is s E + P: a scaled embedding moves s c
        else:  # ViT: the class token pairs with row 0, the patch bias with rows 1..N
            c2 = rnd(arch.d_model)
            p["embed.cls"] = params["embed.cls"] + c.to(params["embed.cls"].dtype)
            p["embed.patch.b"] = params["embed.patch.b"] + c2.to(params["embed.patch.b"].dtype)
            pos[0] -= c
            pos[1:] -= c2
        p["embed.pos"] = pos.to(params["embed.pos"].dtype)
        out["pe_shift"] = p
    return out


TRANSLATIONS = {
    "key_bias_shift": "key-bias translation (unrotated dims)",
    "value_bias_fold": "value-bias fold into b_O",
    "pe_shift": "embedding / learned-PE shift",
}


def invariance_checks(model: Model, kinds: Iterable[str] | None = None, k: int = 3, seed: int = 0,
                      inputs: Tensor | None = None, translations: bool = True) -> list[dict]:
    """Per group kind of the model's spec: the largest relative logit change over k random elements.

    `exact` says whether the spec claims an exact symmetry (False: sinusoidal residual maps, which are
    measured and reported, never pretended exact). Residual rotations act on the folded / rewritten
    model, evaluated against the original logits, so the row includes the rewrite's own float error.
    """
    m64 = float64_copy(model)
    arch, theta = m64.arch, canonical(m64)
    spec = build_spec(arch, theta)
    x = example_inputs(m64) if inputs is None else inputs
    f = _evaluator(m64, arch, x)
    y0 = f(theta)
    want = spec.kinds if kinds is None else tuple(kk for kk in spec.kinds if kk in set(kinds))
    rows = []
    for kind in want:
        a2, p2, note = arch, theta, ""
        if kind == "residual_orth" and kind in spec.requires:
            try:
                a2, p2, note = _residual_ready(arch, theta)
            except SpecError as e:
                rows.append({"group": kind, "kind": spec.describe(kind), "max_rel_change": None, "exact": False,
                             "note": str(e)})
                continue
        f2 = f if a2 == arch else _evaluator(m64, a2, x)
        if kind in spec.approximate:  # sinusoidal PE: only maps that fix the table's rows can be symmetries
            rows.append(_table_fixing_check(kind, a2, p2, f2, y0, k, seed, getattr(m64.module, "pos_sin", None)))
            continue
        changes = [_rel(f2(apply(a2, sample(a2, [kind], seed + i), p2)), y0) for i in range(k)]
        rows.append({"group": kind, "kind": spec.describe(kind), "max_rel_change": max(changes), "exact": True,
                     "note": note})
    if translations:
        for name, p in _translations(arch, theta, seed).items():
            rows.append({"group": name, "kind": TRANSLATIONS[name], "max_rel_change": _rel(f(p), y0),
                         "exact": True, "note": "translation"})
    return rows


SINUSOIDAL_RTOL = 1e-6  # table directions below this share of sigma_max count as "barely reached"


def table_fixing_rotation(arch: Arch, seed: int, rtol: float = SINUSOIDAL_RTOL,
                          table: Tensor | None = None) -> tuple[Tensor | None, int, int]:
    """(Omega, free, barely): a random rotation of the residual stream that fixes every row of the fixed
    sinusoidal table P [T, D] up to its directions below rtol * sigma_max, or None when no direction is free.

    The model adds P to the residual stream without rotating it, so Omega is a symmetry exactly when
    P Omega = P: Omega is the identity on the rows' span and any rotation on its complement (docs/MATH.md
    section 3). `free` directions are rotated; `barely` of them are reached by P below rtol (their
    rotation changes the output at about that level), the rest not at all (exact). `table` is the model's
    own P when it holds one (a float32 buffer differs from the float64 formula by float32 rounding).
    """
    from engine.models.reference import sinusoidal_table

    P = sinusoidal_table(arch.n_ctx, arch.d_model, torch.float64) if table is None else table.to(torch.float64)
    _, sv, Vh = torch.linalg.svd(P, full_matrices=True)  # sv [min(T, D)], Vh [D, D]
    strong = int((sv >= rtol * sv[0]).sum())
    free = arch.d_model - strong
    if free == 0:
        return None, 0, 0
    U, W = Vh[:strong].T, Vh[strong:].T  # the rows' span [D, strong], its complement [D, free]
    R = random_orthogonal(free, 1, torch.Generator().manual_seed(seed))[0]  # [free, free]
    return U @ U.T + W @ R @ W.T, free, len(sv) - strong


def _table_fixing_check(kind: str, arch: Arch, params: Params, f: Callable, y0: Tensor, k: int, seed: int,
                        table: Tensor | None) -> dict:
    """The residual check of a sinusoidal model: an element of the (nearly) exact subgroup, never a generic
    one (a random rotation or permutation moves the table: that is a break test, not an approximation)."""
    D = arch.d_model
    if kind == "residual_perm":
        return {"group": kind, "kind": f"permutation of the {D} residual coordinates", "max_rel_change": None,
                "exact": False, "note": "no coordinate permutation fixes the sinusoidal table's rows, so the exact "
                                        "group has no permutation part; a random one is a break test"}
    changes, free, barely = [], 0, 0
    for i in range(k):
        O, free, barely = table_fixing_rotation(arch, seed + i, table=table)
        if O is None:
            return {"group": kind, "kind": f"rotation Ω ∈ O({D}) fixing the sinusoidal table's rows",
                    "max_rel_change": None, "exact": False,
                    "note": f"the table's rows reach all {D} directions, so only the identity fixes them; a "
                            "generic rotation is a break test"}
        changes.append(_rel(f(apply(arch, GroupElement(identity(arch).layers, O), params)), y0))
    exact_dims = free - barely
    note = (f"rotates the {exact_dims} directions the table does not reach: exact" if not barely else
            f"rotates {free} directions: {exact_dims} the table does not reach and {barely} it reaches below "
            f"{SINUSOIDAL_RTOL:g} σ_max, so the change is of that order: approximate")
    return {"group": kind, "kind": f"rotation Ω ∈ O({D}) fixing the sinusoidal table's rows ({free} free directions)",
            "max_rel_change": max(changes), "exact": not barely, "note": note + "; a generic rotation is a break test"}


# ---------------------------------------------------------------------------------------------
# Break tests: the converse


def _with_layers(g: GroupElement, **parts: Callable[[int], Tensor]) -> GroupElement:
    layers = tuple(LayerElement(el.head_perm, parts["qk"](i) if "qk" in parts else el.qk, el.vo, el.mlp_perm,
                                parts["mlp_scale"](i) if "mlp_scale" in parts else el.mlp_scale)
                   for i, el in enumerate(g.layers))
    return GroupElement(layers, g.residual)


def _plain_qk(arch: Arch, params: Params, qk: Callable[[int], Tensor]) -> Params:
    """Q/K maps A [h_kv, d, d] per layer acting as on a model without QK-norm: W_Q A, W_K A^{-T} (biases
    too), the QK-norm gains left as they are (the break tests of a QK-norm model, docs/MATH.md section 1)."""
    rep, p = arch.n_heads // arch.n_kv_heads, dict(params)
    for i in range(arch.n_layers):
        b, A = f"blocks.{i}.attn", qk(i).to(torch.float64)  # [h_kv, d, d]
        for key, M in (("Q", A.repeat_interleave(rep, 0)), ("K", torch.linalg.inv(A).mT)):  # [h or h_kv, d, d]
            W = params[f"{b}.W_{key}"]
            p[f"{b}.W_{key}"] = (W.to(torch.float64) @ M).to(W.dtype)  # [n, D, d]
            if f"{b}.b_{key}" in params:
                bias = params[f"{b}.b_{key}"]
                p[f"{b}.b_{key}"] = (bias.to(torch.float64)[:, None] @ M).squeeze(1).to(bias.dtype)  # [n, d]
    return p


def _qk_norm_breaks(arch: Arch, params: Params, gen: torch.Generator) -> list[tuple[str, str, Arch, Params, str]]:
    """Under QK-norm: the plain RoPE commutant's phases and moduli on W_Q / W_K, gain scales that differ
    within a pair, a quarter turn in one KV group only (docs/MATH.md section 1, QK-norm)."""
    hkv, d, r, L = arch.n_kv_heads, arch.d_head, arch.rotary_dim, arch.n_layers
    n = r // 2
    out = []

    def phase(i: int) -> Tensor:  # unit moduli, random phases, per KV group: orthogonal on every pair
        ang = (torch.rand(hkv, n, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pi  # [h_kv, r/2]
        return rope_commutant(torch.polar(torch.ones_like(ang), ang), arch.rope_layout, d)

    def modulus(i: int) -> Tensor:  # positive real scalars, per KV group
        mod = ((torch.rand(hkv, n, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()  # [h_kv, r/2]
        return rope_commutant(torch.complex(mod, torch.zeros_like(mod)), arch.rope_layout, d)

    out.append(("qk_rope_phase", "RoPE commutant phases on W_Q / W_K (orthogonal, commutes with the norm)", arch,
                _plain_qk(arch, params, phase), "the gains differ within a pair, so a phase does not pass them"))
    out.append(("qk_rope_modulus", "RoPE commutant moduli on W_Q / W_K, per KV group", arch,
                _plain_qk(arch, params, modulus), "scaling before the norm: the norm divides most of it away"))
    p = dict(params)
    for i in range(L):
        c = ((torch.rand(d, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()  # [d], not constant on pairs
        for key, s in (("q_norm", c), ("k_norm", 1 / c)):
            g = params[f"blocks.{i}.attn.{key}.g"]
            p[f"blocks.{i}.attn.{key}.g"] = g * s.to(g.dtype)
    out.append(("qk_gain_within_pair", "q / k gains scaled by c and 1/c unequal within a RoPE pair", arch, p, ""))
    if hkv > 1:  # a quarter turn of pair 0 in KV group 0 only: the shared gains swap for every group
        def turn(i: int) -> Tensor:
            z = torch.ones(hkv, n, dtype=torch.complex128)
            z[0, 0] = 1j
            return rope_commutant(z, arch.rope_layout, d)  # [h_kv, d, d]

        out.append(("qk_turn_one_kv_group", "a quarter turn of one RoPE pair in one KV group only", arch,
                    apply(arch, _with_layers(identity(arch), qk=turn), params, strict=False),
                    "the gains are shared, so the pair's orientation must be too"))
    return out


def _break_transforms(arch: Arch, params: Params, seed: int) -> list[tuple[str, str, Arch, Params | None, str]]:
    """(name, description, arch, transformed params or None, note) for every break test of `arch`."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d, r, m = arch.n_kv_heads, arch.d_head, arch.rotary_dim, arch.d_mlp
    e = identity(arch)
    out = []

    def act(g: GroupElement, a: Arch = arch, p: Params = params) -> Params:
        return apply(a, g, p, strict=False)

    def qk(maps: Callable[[int], Tensor]) -> Params:  # under QK-norm as on W_Q / W_K without it
        return _plain_qk(arch, params, maps) if arch.qk_norm else act(_with_layers(e, qk=maps))

    if arch.pe == "rope":
        model = "QK-norm" if arch.qk_norm else "RoPE"
        out.append(("qk_gl", f"GL({d}) on Q/K of a {model} model", arch, qk(lambda i: random_gl(d, hkv, gen)), ""))
        other = "half" if arch.rope_layout == "interleaved" else "interleaved"
        def pairs(layout: str) -> set[tuple[int, int]]:
            return set(zip(*(ix.tolist() for ix in rope_pairs(r, layout))))

        if pairs(other) != pairs(arch.rope_layout):  # r = 2: both layouts pair (0, 1), nothing to break
            def wrong(i: int) -> Tensor:
                mod = ((torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()
                ph = (torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pi
                return rope_commutant(torch.polar(mod, ph), other, d)  # [h_kv, d, d]
            out.append(("qk_other_layout", f"RoPE commutant of the {other} pairing", arch, qk(wrong), ""))
        out.append(("qk_orthogonal", f"orthogonal Q/K maps on a {model} model", arch,
                    qk(lambda i: random_orthogonal(d, hkv, gen)), ""))
    if arch.qk_norm:
        out += _qk_norm_breaks(arch, params, gen)
    if arch.post_norm:  # the stream norms' gains break any non-permutation map (docs/MATH.md section 9)
        O = random_orthogonal(arch.d_model, 1, gen)[0]
        out.append(("residual_orth_post_norm", f"a random rotation of O({arch.d_model}) on a post-norm stream", arch,
                    act(GroupElement(e.layers, O)), ""))
    try:
        a2, p2, note = _residual_ready(arch, params)
        M = random_gl(arch.d_model, 1, gen)[0]  # [D, D] not orthogonal: norms do not commute with it
        out.append(("residual_gl", f"GL({arch.d_model}) on the residual stream", a2,
                    act(GroupElement(identity(a2).layers, M), a2, p2),
                    note))
        if arch.pe == "sinusoidal":  # any rotation or permutation moves the fixed table (docs/MATH.md section 3)
            D = arch.d_model
            O = random_orthogonal(D, 1, gen)[0]
            out.append(("residual_orth_any", f"a random rotation of O({D}): moves the sinusoidal table", a2,
                        act(GroupElement(identity(a2).layers, O), a2, p2), note))
            Pm = torch.eye(D, dtype=torch.float64)[torch.randperm(D, generator=gen)]
            out.append(("residual_perm_any", "a random permutation of the residual coordinates: moves the table",
                        a2, act(GroupElement(identity(a2).layers, Pm), a2, p2), note))
    except SpecError as err:
        out.append(("residual_gl", f"GL({arch.d_model}) on the residual stream", arch, None, str(err)))
    s = ((torch.rand(arch.n_layers, m, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()  # [L, m]
    if arch.mlp == "relu":
        s = s * torch.where(torch.arange(m) % 2 == 0, -1.0, 1.0).to(torch.float64)  # half the neurons flipped
    branch = "W_gate" if arch.gated else "W_in"  # gated: the gate, whose silu / gelu is not homogeneous
    p = dict(params)
    for i in range(arch.n_layers):
        b = f"blocks.{i}.mlp"
        for key in (f"{b}.{branch}", f"{b}.b_in" if branch == "W_in" else ""):
            if key in p:
                p[key] = params[key] * s[i].to(params[key].dtype)
        p[f"{b}.W_out"] = params[f"{b}.W_out"] / s[i, :, None].to(params[f"{b}.W_out"].dtype)
    name, desc = {"relu": ("relu_negative_scale", "negative neuron scaling of a ReLU MLP"),
                  "swiglu": ("swiglu_gate_scale", "scaling the SwiGLU gate branch"),
                  "geglu": ("geglu_gate_scale", "scaling the GeGLU gate branch")}.get(
        arch.mlp, ("mlp_scale_nonhomogeneous", f"positive neuron scaling of a {arch.mlp} MLP"))
    out.append((name, desc, arch, p, ""))
    if 1 < hkv < arch.n_heads:
        # query heads moved between KV groups (with their W_O): GQA shares K and V within a group (multi-query
        # attention has one group, whose query heads any permutation may move: the head class itself)
        cross = torch.roll(torch.arange(arch.n_heads), 1)  # [h] head i takes head i-1: crosses groups
        p = dict(params)
        for i in range(arch.n_layers):
            for key in ("W_Q", "b_Q", "W_O"):
                kk = f"blocks.{i}.attn.{key}"
                if kk in p:
                    p[kk] = params[kk][cross]
        out.append(("heads_across_kv_groups", "query-head permutation across KV groups", arch, p, ""))
    return out


def break_tests(model: Model, seed: int = 0, inputs: Tensor | None = None) -> list[dict]:
    """Transforms from larger groups that are not symmetries, and the relative logit change they cause."""
    m64 = float64_copy(model)
    arch, theta = m64.arch, canonical(m64)
    x = example_inputs(m64) if inputs is None else inputs
    f = _evaluator(m64, arch, x)
    y0 = f(theta)
    rows = []
    for name, desc, a2, p2, note in _break_transforms(arch, theta, seed):
        change = None if p2 is None else _rel((f if a2 == arch else _evaluator(m64, a2, x))(p2), y0)
        rows.append({"group": name, "kind": desc, "max_rel_change": change, "exact": False, "note": note})
    return rows


# ---------------------------------------------------------------------------------------------
# RoPE breaking per frequency pair


def rope_breaking(arch: Arch, n_ctx: int | None = None, model: Model | None = None, eps: float = 0.1) -> list[dict]:
    """How strongly RoPE pair j breaks GL(2) on that pair, against omega_j * context length.

    A traceless symmetric generator X on pair j (the part of gl(2) outside the commutant) is conjugated
    by R(omega n) into a copy rotated by 2 omega n, so ||[X, R(omega n)]||_F = 2 |sin(omega n)| ||X||_F.
    `strength` = max over relative offsets n < T of |sin(omega_j n)| (and its RMS over n): about
    omega_j T when omega_j T << 1, so slow pairs are almost GL(2)-symmetric over a short context.
    With `model`, `measured` is the relative logit change of A = exp(eps X) on pair j
    in every KV group of every layer.
    """
    if arch.pe != "rope":
        return []
    T = n_ctx or arch.n_ctx
    r, d = arch.rotary_dim, arch.d_head
    w = rope_frequencies(r, arch.rope_base, arch.rope_scaling)  # [r/2]
    n = torch.arange(T, dtype=torch.float64)  # relative offsets 0..T-1
    sin = (w[:, None] * n).sin().abs()  # [r/2, T]
    rows = [{"pair": j, "omega": float(w[j]), "omega_ctx": float(w[j] * T), "strength": float(sin[j].max()),
             "rms": float(sin[j].pow(2).mean().sqrt())} for j in range(r // 2)]
    if model is not None:
        m64 = float64_copy(model)
        theta = canonical(m64)
        x = example_inputs(m64, n_tokens=T)
        f = _evaluator(m64, m64.arch, x)
        y0 = f(theta)
        i1, i2 = rope_pairs(r, arch.rope_layout)
        e = identity(arch)
        for j in range(r // 2):
            A = torch.eye(d, dtype=torch.float64)
            A[i1[j], i1[j]], A[i2[j], i2[j]] = math.exp(eps), math.exp(-eps)  # exp(eps diag(1, -1)) on pair j
            g = _with_layers(e, qk=lambda i, A=A: A.repeat(arch.n_kv_heads, 1, 1))
            rows[j]["measured"] = _rel(f(apply(arch, g, theta, strict=False)), y0)
    return rows


# ---------------------------------------------------------------------------------------------
# Group dimension measured: nullity of the Jacobian of the logits


def _covering_inputs(arch: Arch, n_rows: int, gen: torch.Generator, geometry: RefConfig | None) -> Tensor:
    """Inputs with at least n_rows logit entries; an LM batch uses every token at every position."""
    if arch.task == "lm":
        T, V = arch.n_ctx, arch.n_out
        # position 0 sees one token only (V distinct rows at most), so count T - 1 useful positions
        B = max(math.ceil(n_rows / (max(T - 1, 1) * V)), math.ceil(V / T) + 1)
        x = torch.randint(0, V, (B, T), generator=gen)
        x.view(-1)[:V] = torch.arange(V)  # every token occurs (an unused embedding row is a fake null direction)
        return x
    B = math.ceil(n_rows / arch.n_out)
    return torch.rand(B, geometry.in_chans, geometry.image_size, geometry.image_size, generator=gen,
                      dtype=torch.float64)


def jacobian_nullity(model: Model, seed: int = 0, rtol: float = 1e-9, oversample: float = 2.0) -> dict:
    """dim ker d(logits)/d(theta) at random inputs, on a tiny model in float64, vs group_dimension.

    The model is first folded (or LayerNorm-rewritten) and the gains, then all 1, are held fixed: the
    formula counts the folded form. Permutations are discrete and do not show. rank = #singular values
    above rtol * sigma_max; `gap` = sigma_rank / sigma_(rank+1), the spectral gap that makes the count
    trustworthy (large is good). Needs a generic point: every token used, enough inputs (`oversample`
    logits per parameter), vocabulary larger than D (else the embeddings lie on an affine hyperplane
    and fake bias directions appear), ReLU neurons that switch on the batch (a neuron always on or
    off adds null directions of the data, not of the group).
    """
    from torch.func import functional_call, jacfwd
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m64 = float64_copy(model)
    arch, theta = m64.arch, canonical(m64)
    a2, p2, _ = _residual_ready(arch, theta)
    geo = reference_config_from_arch(a2, **_geometry(m64, theta))
    module = build(geo, dtype=torch.float64).module
    fixed = {k: v for k, v in p2.items() if k.endswith(".g") and not is_qk_gain(k)}  # QK-norm gains stay free
    keys = [k for k in p2 if k not in fixed]
    n = sum(p2[k].numel() for k in keys)
    x = _covering_inputs(a2, int(oversample * n), torch.Generator().manual_seed(seed), geo)

    def f(*vals: Tensor) -> Tensor:
        return functional_call(module, {**fixed, **dict(zip(keys, vals))}, (x,)).reshape(-1)  # [n_out]

    # the math SDPA backend is plain matmul + softmax, which forward-mode AD differentiates
    with sdpa_kernel(SDPBackend.MATH):
        J = jacfwd(f, argnums=tuple(range(len(keys))))(*[p2[k] for k in keys])
    J = torch.cat([j.reshape(j.shape[0], -1) for j in J], 1)  # [n_out, n_params]
    s = torch.linalg.svdvals(J)  # descending
    rank = int((s > rtol * s[0]).sum())
    gap = float(s[rank - 1] / s[rank]) if rank < len(s) and s[rank] > 0 else math.inf
    formula = group_dimension(a2, centred=arch.norm == "layernorm")["total"]
    return {"n_params": n, "n_outputs": int(J.shape[0]), "rank": rank, "nullity": n - rank, "formula": formula,
            "gap": gap, "rtol": rtol, "sigma_max": float(s[0])}
