"""Symmetry diagnostics: does the declared group leave the model's function unchanged, and how big is it?

- invariance checks: k random elements of each group kind, the largest relative change of the logits
  (float64 copy of the model); translations (key bias, value-bias folding, learned-PE shift) too;
- break tests: maps from larger groups that are NOT symmetries (GL(d) on a RoPE model's Q/K, the other
  pairing's commutant, orthogonal Q/K maps, GL(D) on the residual, scaling a non-homogeneous MLP) and
  how much they change the output;
- group dimension from the formulas of MATH.md sections 1-3, from an Arch alone (so from a config.json);
- the same dimension measured as the nullity of the Jacobian of the logits w.r.t. the parameters;
- RoPE breaking strength per frequency pair against omega * context, and the sinusoidal table spectrum.

`symmetry_report` bundles these as JSON for `python -m engine symmetry`; `format_report` prints it.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

from engine.errors import ModelError, SpecError
from engine.models import canonical, load_model, model_logits, set_canonical
from engine.models.base import Arch, Model, Params
from engine.models.io import read_json_object
from engine.models.native import check_hf_config
from engine.models.reference import RefConfig, build, rope_frequencies, rope_pairs, sinusoidal_table
from engine.spec import KINDS, Spec, build_spec, check_arch
from engine.symmetry import (
    GroupElement,
    LayerElement,
    apply,
    fold_norms,
    identity,
    layernorm_to_rmsnorm,
    random_gl,
    random_orthogonal,
    reference_config_from_arch,
    rope_commutant,
    sample,
)

__all__ = ["arch_from_config", "break_tests", "float64_copy", "format_report", "group_dimension",
           "invariance_checks", "jacobian_nullity", "reference_config_from_arch", "rope_breaking",
           "sinusoidal_spectrum", "symmetry_report"]

EXACT_TOL = 1e-10  # relative logit change below which a float64 check counts as exact (DESIGN.md)


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
        target = _reference_model(reference_config_from_arch(arch, **_geometry(model64, canonical(model64))))

    def f(params: Params) -> Tensor:
        with torch.no_grad():
            set_canonical(target, params)
            return model_logits(target, inputs).to(torch.float64)

    return f


@functools.lru_cache(maxsize=1)
def _reference_model(cfg: RefConfig) -> Model:
    """A float64 reference model to evaluate rewritten params in; kept for the next check of the same
    config (its weights are always overwritten whole by set_canonical before use)."""
    return build(cfg, dtype=torch.float64)


def _rel(y: Tensor, y0: Tensor) -> float:
    return float((y - y0).norm() / y0.norm().clamp_min(1e-300))


def _residual_ready(arch: Arch, params: Params) -> tuple[Arch, Params, str]:
    """The model in a form whose residual stream may be rotated (MATH.md section 3)."""
    if arch.norm == "layernorm":
        a2, p2 = layernorm_to_rmsnorm(arch, params)
        return a2, p2, "after layernorm_to_rmsnorm"
    a2, p2 = fold_norms(arch, params)
    return a2, p2, "after fold_norms"


# ---------------------------------------------------------------------------------------------
# Invariance checks


def _translations(arch: Arch, params: Params, seed: int) -> dict[str, Params]:
    """The additive symmetries the group dimension counts (MATH.md sections 1 and 3), one draw each."""
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
        # every input row is (embedding + position): shift one, unshift the other (MATH.md section 3)
        p = dict(params)
        pos = params["embed.pos"].to(torch.float64).clone()
        c = rnd(arch.d_model)
        if arch.task == "lm":
            p["embed.tok"] = params["embed.tok"] + c.to(params["embed.tok"].dtype)
            pos -= c
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
        changes = [_rel(f2(apply(a2, sample(a2, [kind], seed + i), p2)), y0) for i in range(k)]
        row = {"group": kind, "kind": spec.describe(kind), "max_rel_change": max(changes),
               "exact": kind not in spec.approximate, "note": note}
        if kind in spec.approximate:
            row["note"] = ("approximate: Omega would have to fix every difference of fixed sinusoidal "
                           "table rows (MATH.md section 3)")
        rows.append(row)
    if translations:
        for name, p in _translations(arch, theta, seed).items():
            rows.append({"group": name, "kind": TRANSLATIONS[name], "max_rel_change": _rel(f(p), y0),
                         "exact": True, "note": "translation"})
    return rows


# ---------------------------------------------------------------------------------------------
# Break tests: the converse


def _with_layers(g: GroupElement, **parts: Callable[[int], Tensor]) -> GroupElement:
    layers = tuple(LayerElement(el.head_perm, parts["qk"](i) if "qk" in parts else el.qk, el.vo, el.mlp_perm,
                                parts["mlp_scale"](i) if "mlp_scale" in parts else el.mlp_scale)
                   for i, el in enumerate(g.layers))
    return GroupElement(layers, g.residual)


def _break_transforms(arch: Arch, params: Params, seed: int) -> list[tuple[str, str, Arch, Params | None, str]]:
    """(name, description, arch, transformed params or None, note) for every break test of `arch`."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d, r, m = arch.n_kv_heads, arch.d_head, arch.rotary_dim, arch.d_mlp
    e = identity(arch)
    out = []

    def act(g: GroupElement, a: Arch = arch, p: Params = params) -> Params:
        return apply(a, g, p, strict=False)

    if arch.pe == "rope":
        out.append(("qk_gl", f"GL({d}) on Q/K of a RoPE model", arch,
                    act(_with_layers(e, qk=lambda i: random_gl(d, hkv, gen))), ""))
        other = "half" if arch.rope_layout == "interleaved" else "interleaved"
        def pairs(layout: str) -> set[tuple[int, int]]:
            return set(zip(*(ix.tolist() for ix in rope_pairs(r, layout))))

        if pairs(other) != pairs(arch.rope_layout):  # r = 2: both layouts pair (0, 1), nothing to break
            def wrong(i: int) -> Tensor:
                mod = ((torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()
                ph = (torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pi
                return rope_commutant(torch.polar(mod, ph), other, d)  # [h_kv, d, d]
            out.append(("qk_other_layout", f"RoPE commutant of the {other} pairing", arch,
                        act(_with_layers(e, qk=wrong)), ""))
        out.append(("qk_orthogonal", "orthogonal Q/K maps on a RoPE model", arch,
                    act(_with_layers(e, qk=lambda i: random_orthogonal(d, hkv, gen))), ""))
    try:
        a2, p2, note = _residual_ready(arch, params)
        M = random_gl(arch.d_model, 1, gen)[0]  # [D, D] not orthogonal: norms do not commute with it
        out.append(("residual_gl", f"GL({arch.d_model}) on the residual stream", a2,
                    act(GroupElement(identity(a2).layers, M), a2, p2),
                    note))
    except SpecError as err:
        out.append(("residual_gl", f"GL({arch.d_model}) on the residual stream", arch, None, str(err)))
    s = ((torch.rand(arch.n_layers, m, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).exp()  # [L, m]
    if arch.mlp == "relu":
        s = s * torch.where(torch.arange(m) % 2 == 0, -1.0, 1.0).to(torch.float64)  # half the neurons flipped
    branch = "W_gate" if arch.mlp == "swiglu" else "W_in"  # SwiGLU: the gate, whose silu is not homogeneous
    p = dict(params)
    for i in range(arch.n_layers):
        b = f"blocks.{i}.mlp"
        for key in (f"{b}.{branch}", f"{b}.b_in" if branch == "W_in" else ""):
            if key in p:
                p[key] = params[key] * s[i].to(params[key].dtype)
        p[f"{b}.W_out"] = params[f"{b}.W_out"] / s[i, :, None].to(params[f"{b}.W_out"].dtype)
    name, desc = {"relu": ("relu_negative_scale", "negative neuron scaling of a ReLU MLP"),
                  "swiglu": ("swiglu_gate_scale", "scaling the SwiGLU gate branch")}.get(
        arch.mlp, ("mlp_scale_nonhomogeneous", f"positive neuron scaling of a {arch.mlp} MLP"))
    out.append((name, desc, arch, p, ""))
    if hkv < arch.n_heads:
        # query heads moved between KV groups (with their W_O): GQA shares K and V within a group
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
# Group dimension from the formulas (MATH.md sections 1-3)


def group_dimension(arch: Arch, centred: bool | None = None) -> dict:
    """Continuous dimension of the symmetry group, per component, per layer and in total.

    Counted for the folded form (RMSNorm gains in the readers; LayerNorm rewritten as RMSNorm), with
    the logits as the function (the log-softmax would add the head's constant-column gauge).
      qk   h_kv (r + (d - r)^2)   GL(d) without RoPE (r = 0), H(r) x GL(d - r) with it
      vo   h_kv d^2
      key_bias    h_kv (d - r)   b_K + t on unrotated dims (MATH.md says h d without RoPE, 0 with)
      value_bias  h_kv d         b_V + t folded into b_O (needs b_O)
      mlp_scale   m              ReLU or SwiGLU
      residual_orth  D(D-1)/2    O(D); sinusoidal: only rotations fixing P_sin's row differences are exact
      pe_shift    D (LM) or 2D (ViT: class token / row 0 and patch bias / rows 1..N); untied only
      ln_reader_gauge            `centred` (default: a LayerNorm model): the stream lies in the hyperplane
                                 orthogonal to 1, so every reader column may add a multiple of 1 there:
                                 per layer h d + 2 h_kv d + m (2m for SwiGLU), plus n_out for an untied head
    Permutations are discrete (dimension 0).
    """
    check_arch(arch)
    D, hkv, d, m, r, L = arch.d_model, arch.n_kv_heads, arch.d_head, arch.d_mlp, arch.rotary_dim, arch.n_layers
    centred = arch.norm == "layernorm" if centred is None else centred
    qk = hkv * (r + (d - r) ** 2)
    vo = hkv * d * d
    kb = hkv * (d - r) if arch.attn_bias else 0
    vb = hkv * d if arch.attn_bias and arch.out_bias else 0
    ms = m if arch.mlp in ("relu", "swiglu") else 0
    gauge = arch.n_heads * d + 2 * hkv * d + m * (2 if arch.mlp == "swiglu" else 1) if centred else 0
    head_gauge = arch.n_out if centred and not arch.tied_embeddings else 0
    notes = []
    if arch.pe == "sinusoidal":
        # Omega must fix every difference P_sin[t] - P_sin[t0] (the embedding absorbs a constant shift):
        # LM rows 0..T-1, ViT patch rows 1..N (the class token absorbs row 0); distinct frequencies make
        # these differences independent, so their rank is min(#differences, D)
        k = min(arch.n_ctx - (1 if arch.task == "lm" else 2), D)
        res = (D - k) * (D - k - 1) // 2
        notes.append(f"sinusoidal PE: exact residual rotations must fix {k} independent differences of P_sin "
                     f"rows (dim {res}); O({D}) is only approximate")
    else:
        res = D * (D - 1) // 2
    pe = (D if arch.task == "lm" else 2 * D) if arch.pe == "learned" and not arch.tied_embeddings else 0
    if arch.pe == "learned" and arch.tied_embeddings:
        notes.append("tied embeddings: the embedding shift moves the logits by a per-position constant, a "
                     "symmetry of the log-probabilities only, not counted")
    if arch.norm == "layernorm":
        notes.append("LayerNorm: counted for the RMSNorm rewrite; as given, the gains and biases add per-norm "
                     "scalings and bias shifts, every writer row's mean is a free gauge, and only rotations "
                     "fixing the all-ones vector are exact")
    per_layer = [{"layer": i, "qk": qk, "vo": vo, "key_bias": kb, "value_bias": vb, "attention": qk + vo + kb + vb,
                  "mlp": ms, "ln_reader_gauge": gauge, "total": qk + vo + kb + vb + ms + gauge} for i in range(L)]
    by_kind = {"heads": 0, "mlp": 0, "mlp_scale": L * ms, "qk": L * qk, "vo": L * vo, "residual_perm": 0,
               "residual_orth": res, "key_bias": L * kb, "value_bias": L * vb, "pe_shift": pe}
    if centred:
        by_kind["ln_reader_gauge"] = L * gauge + head_gauge
    return {"per_layer": per_layer, "total": sum(by_kind.values()), "by_kind": by_kind, "notes": notes}


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
    fixed = {k: v for k, v in p2.items() if k.endswith(".g")}
    keys = [k for k in p2 if not k.endswith(".g")]
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


# ---------------------------------------------------------------------------------------------
# RoPE breaking per frequency pair, sinusoidal spectrum


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
    w = rope_frequencies(r, arch.rope_base)  # [r/2]
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


def sinusoidal_spectrum(n_pos: int, d_model: int, rtol: float = 1e-6) -> dict:
    """Singular values of P_sin[:n_pos] (MATH.md section 3): rank, and how many are below rtol * sigma_max."""
    s = torch.linalg.svdvals(sinusoidal_table(n_pos, d_model, torch.float64))  # [min(T, D)]
    small = int((s < rtol * s[0]).sum())
    return {"n_pos": n_pos, "d_model": d_model, "singular_values": [float(v) for v in s],
            "sigma_max": float(s[0]), "sigma_min": float(s[-1]), "condition": float(s[0] / s[-1]),
            "n_below_rtol": small, "rtol": rtol, "numerical_rank": len(s) - small}


# ---------------------------------------------------------------------------------------------
# Config -> Arch without weights, and the report


def arch_from_config(config: dict, source: str = "config.json") -> Arch:
    """The Arch of a reference, HF GPT-2, HF Llama, HF GPT-NeoX or timm ViT config dict (no weights needed)."""
    fam = config.get("family")
    if "model_type" in config:
        check_hf_config(config, source)  # sizes and flags typed before transformers builds anything
    if fam == "reference":
        return RefConfig.from_dict(config).arch()
    mt = config.get("model_type")
    if mt == "gpt2":
        from transformers import GPT2Config

        from engine.models import hf_gpt2

        return hf_gpt2.arch(GPT2Config(**{k: v for k, v in config.items() if k != "model_type"}), source)
    if mt == "llama":
        from transformers import LlamaConfig

        from engine.models import hf_llama

        return hf_llama.arch(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}), source)
    if mt == "gpt_neox":
        from engine.models import hf_neox

        return hf_neox.arch(hf_neox.config_from_dict(config, source), source)
    if fam == "timm_vit" or "architecture" in config:
        from engine.models import timm_vit

        return timm_vit.arch(timm_vit._create(config, source), source)
    raise ModelError(f"{source} is not a reference, GPT-2, Llama, GPT-NeoX or timm ViT config.")


def _target(model_or_config_path, dims_only: bool) -> tuple[Model | None, Arch, str]:
    """(model or None, arch, display name): weights are loaded only when they exist and are wanted."""
    if isinstance(model_or_config_path, Model):
        m = model_or_config_path
        return m, m.arch, m.name or m.family
    if isinstance(model_or_config_path, dict):
        return None, arch_from_config(model_or_config_path), "config"
    path = Path(model_or_config_path)
    if not path.exists():
        from engine.zoo import resolve

        path = resolve(str(model_or_config_path))
    if path.is_dir() and not dims_only and any(path.glob("*.safetensors")):
        m = load_model(path, dtype=torch.float64)
        return m, m.arch, str(path)
    cfg_file = path if path.is_file() else path / "config.json"
    return None, arch_from_config(read_json_object(cfg_file), str(cfg_file)), str(path)


def symmetry_report(model_or_config_path, dims_only: bool = False, k: int = 3, seed: int = 0) -> dict:
    """JSON-ready symmetry diagnostics of a Model, a model directory, a config.json path or a config dict.

    {"model", "family", "arch", "kinds", "approximate", "requires", "checks": [{group, kind,
    max_rel_change, exact, note}], "breaks": [same], "group_dim": {per_layer, total, by_kind, notes},
    "rope": [per pair], "sinusoidal": {spectrum}, "dims_only"}. Without weights (a bare config, or
    dims_only) checks and breaks are empty.
    """
    model, arch, name = _target(model_or_config_path, dims_only)
    weights = model is not None and not dims_only
    rep: dict = {"model": name, "family": arch.family, "arch": arch.to_dict(), "dims_only": not weights,
                 "checks": [], "breaks": []}
    if weights:
        spec: Spec = build_spec(arch, canonical(model))
        rep |= {"kinds": list(spec.kinds), "approximate": sorted(spec.approximate), "requires": dict(spec.requires)}
        try:
            rep["checks"] = invariance_checks(model, k=k, seed=seed)
            rep["breaks"] = break_tests(model, seed=seed)
        finally:
            _reference_model.cache_clear()  # a float64 copy of a big model is not worth keeping around
    else:
        check_arch(arch)
        kinds = [kk for kk in KINDS if kk != "mlp_scale" or arch.mlp in ("relu", "swiglu")]
        rep |= {"kinds": kinds, "approximate": ["residual_orth", "residual_perm"] if arch.pe == "sinusoidal" else [],
                "requires": {}}
    rep["group_dim"] = group_dimension(arch)
    if arch.pe == "rope":
        rep["rope"] = rope_breaking(arch)
    if arch.pe == "sinusoidal":
        sp = sinusoidal_spectrum(arch.n_ctx, arch.d_model)
        rep["sinusoidal"] = {k2: v for k2, v in sp.items() if k2 != "singular_values"} | {
            "singular_values": sp["singular_values"][:8] + sp["singular_values"][-8:]}
    return rep


def format_report(report: dict) -> str:
    """A human-readable table of a symmetry_report."""
    a = report["arch"]
    lines = [f"{report['model']} ({report['family']}): {a['task']}, {a['n_layers']} layers, D={a['d_model']}, "
             f"h={a['n_heads']} (kv {a['n_kv_heads']}), d={a['d_head']}, m={a['d_mlp']}, pe={a['pe']}"
             + (f" ({a['rope_layout']}, rotary {a['rotary_dim']})" if a["pe"] == "rope" else "")
             + f", {a['norm']}, {a['mlp']}"]

    def table(title: str, rows: list[dict]) -> None:
        if not rows:
            return
        lines.append("")
        lines.append(f"{title:<26} {'group':<60} {'max rel change':>15}  exact")
        for r in rows:
            c = "-" if r["max_rel_change"] is None else f"{r['max_rel_change']:.2e}"
            lines.append(f"{r['group']:<26} {r['kind'][:60]:<60} {c:>15}  {'yes' if r['exact'] else 'no'}"
                         + (f"  ({r['note']})" if r.get("note") else ""))

    table("invariance check", report["checks"])
    table("break test", report["breaks"])
    gd = report["group_dim"]
    lines.append("")
    lines.append("group dimension (continuous)")
    for k, v in gd["by_kind"].items():
        lines.append(f"  {k:<16} {v:>14,}")
    if gd["per_layer"]:
        lines.append(f"  per layer: attention {gd['per_layer'][0]['attention']:,}, mlp {gd['per_layer'][0]['mlp']:,}")
    lines.append(f"  total            {gd['total']:>14,}")
    lines += [f"  note: {n}" for n in gd["notes"]]
    if report.get("rope"):
        lines.append("")
        lines.append("RoPE breaking per pair (max |sin(omega n)|, n < context)")
        rows = report["rope"]
        for r in rows if len(rows) <= 8 else rows[:4] + rows[-4:]:
            lines.append(f"  pair {r['pair']:>3}  omega {r['omega']:.3e}  omega*T {r['omega_ctx']:10.3g}  "
                         f"strength {r['strength']:.3f}")
    if report.get("sinusoidal"):
        s = report["sinusoidal"]
        lines.append("")
        lines.append(f"sinusoidal table {s['n_pos']}x{s['d_model']}: sigma_max {s['sigma_max']:.3g}, "
                     f"sigma_min {s['sigma_min']:.3g}, {s['n_below_rtol']} below {s['rtol']:g} sigma_max")
    if report["dims_only"]:
        lines.append("")
        lines.append("dimensions from the config only: no invariance checks or break tests were run")
    return "\n".join(lines)
