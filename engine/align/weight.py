"""Weight matching: data-free coordinate descent on ||theta_A - g.theta_B||^2 (MATH.md section 4).

One sweep solves every per-layer problem given the residual map Omega, then Omega given the
per-layer transforms, and sweeps repeat until no permutation changes and Omega stops moving:

    heads   sigma: assignment on C_ij = ||Mbar_i^A - Mbar_j^B||^2 + ||N_i^A - N_j^B||^2 with the
            invariant circuits M = W_Q W_K^T (row-centred: the softmax ignores a constant per query)
            and N = W_V W_O; under GQA whole KV groups map to KV groups (solvers.gqa_assignment)
    qk      A per KV group: GL(d) by Procrustes start + L-BFGS; RoPE: per-pair closed-form phase and
            Brent on log r; partial RoPE: H(r) x GL(d - r)
    vo      B per KV group: the GL(d) problem with W_O^T in place of W_K
    mlp     pi: assignment on <W_in^A, W_in^B pi> + <W_out^A, pi^T W_out^B> (+ gate, + biases)
    mlp_scale  per-neuron s after pi (solvers.fit_scale); with scaling the assignment uses
            scale-invariant similarities
    residual   Omega: Procrustes on every residual-path weight stacked (orthogonal), or an
            assignment (permutation)

The per-layer problems only need Omega, not each other (sigma uses invariants of A and B), and
every action is on its own axis, so the order inside a sweep does not matter. Omega starts from
the terms no per-layer transform touches (embeddings, head, output biases) plus the per-layer
circuits that are invariant to everything but Omega (sum_i M_i, sum_i N_i, W_in W_out), which
transform as Omega^T X Omega; a few linearised two-sided Procrustes steps fit them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.align.common import F64, RESIDUAL, AlignContext, AlignOutput, Pair, tick, to_f64
from engine.align.solvers import (
    assignment,
    fit_gl,
    fit_rope,
    fit_scale,
    gqa_assignment,
    procrustes,
    residual_perm_from_scores,
    residual_perm_of,
)
from engine.models.base import Arch, Params
from engine.spec import Spec
from engine.symmetry import GroupElement, LayerElement, apply, identity, rope_commutant

MAX_SWEEPS = 30
REL_TOL = 1e-6  # relative objective decrease below which a sweep counts as no change
INIT_STEPS = 50  # linearised two-sided Procrustes steps for the starting Omega


# ---------------------------------------------------------------------------------------------
# Per-layer problems


def _rows(p: Params, key: str, bias: str | None) -> Tensor:
    """W [n, D, d] with its bias [n, d] appended as a last row -> [n, D (+1), d]."""
    W = p[key]
    return torch.cat([W, p[bias][:, None]], 1) if bias and bias in p else W  # [n, D+1, d]


def circuits(arch: Arch, p: Params, layer: int) -> tuple[Tensor, Tensor]:
    """Per query head: Mbar [h, D+, D] (W_Q W_K^T, row-centred) and N [h, D+, D] (W_V W_O)."""
    b, rep = f"blocks.{layer}.attn", arch.n_heads // arch.n_kv_heads
    Q = _rows(p, f"{b}.W_Q", f"{b}.b_Q")  # [h, D+, d]
    K = p[f"{b}.W_K"].repeat_interleave(rep, 0)  # [h, D, d]
    V = _rows(p, f"{b}.W_V", f"{b}.b_V").repeat_interleave(rep, 0)  # [h, D+, d]
    M = Q @ K.mT  # [h, D+, D]
    M = M - M.mean(-1, keepdim=True)  # row-centred: a constant score per query is invisible to softmax
    N = V @ p[f"{b}.W_O"]  # [h, D+, D]
    return M, N


def summed_circuits(arch: Arch, p: Params, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """sum_i W_Q^i W_K^iT, sum_i W_V^i W_O^i and W_in W_out [D, D]: invariant to every per-layer
    transform of MATH.md sections 1-2, and conjugated by the residual map (Omega^T X Omega)."""
    b, rep = f"blocks.{layer}", arch.n_heads // arch.n_kv_heads
    K = p[f"{b}.attn.W_K"].repeat_interleave(rep, 0)  # [h, D, d]
    V = p[f"{b}.attn.W_V"].repeat_interleave(rep, 0)  # [h, D, d]
    M = (p[f"{b}.attn.W_Q"] @ K.mT).sum(0)  # [D, D]
    N = (V @ p[f"{b}.attn.W_O"]).sum(0)  # [D, D]
    return M, N, p[f"{b}.mlp.W_in"] @ p[f"{b}.mlp.W_out"]


def _sqdist(X: Tensor, Y: Tensor) -> Tensor:
    """||X_i - Y_j||^2 for stacks X [n, ...], Y [n, ...] -> [n, n]."""
    X, Y = X.flatten(1), Y.flatten(1)  # [n, k]
    return X.square().sum(1)[:, None] + Y.square().sum(1)[None] - 2 * X @ Y.T


def match_heads(arch: Arch, pa: Params, pb: Params, layer: int) -> Tensor:
    """sigma [h]: A's head i takes B's head sigma(i), by the distance of their invariant circuits."""
    Ma, Na = circuits(arch, pa, layer)
    Mb, Nb = circuits(arch, pb, layer)
    cost = _sqdist(Ma, Mb) + _sqdist(Na, Nb)  # [h_A, h_B]
    return gqa_assignment(-cost, arch.n_heads // arch.n_kv_heads)


def _group_rows(X: Tensor, rep: int) -> Tensor:
    """Query-head stacks [h, N, d] -> one stack per KV group [h_kv, rep * N, d]."""
    h, N, d = X.shape
    return X.reshape(h // rep, rep * N, d)  # [h_kv, rep*N, d]


def fit_qk(arch: Arch, structure: str, Qa: Tensor, Qb: Tensor, Ka: Tensor, Kb: Tensor,
           start: Tensor | None = None) -> Tensor:
    """A [h_kv, d, d] with Qb A ~ Qa and Kb A^{-T} ~ Ka, in the Q/K group of `structure`."""
    if structure == "gl":
        return fit_gl(Qa, Qb, Ka, Kb, start)
    r, d = arch.rotary_dim, arch.d_head
    z = fit_rope(Qa[..., :r], Qb[..., :r], Ka[..., :r], Kb[..., :r], arch.rope_layout, r)  # [h_kv, r/2]
    A = rope_commutant(z, arch.rope_layout, d)  # [h_kv, d, d]
    if r < d:  # partial RoPE: the unrotated dims are a free GL(d - r) block
        A[:, r:, r:] = fit_gl(Qa[..., r:], Qb[..., r:], Ka[..., r:], Kb[..., r:])
    return A


def within_head(arch: Arch, structure: str, pa: Params, pb: Params, layer: int, perm: Tensor,
                kinds: frozenset[str], warm: LayerElement | None = None) -> tuple[Tensor, Tensor]:
    """A (Q/K) and B (V/O) per KV group for B's heads already matched by `perm` (warm: last sweep's)."""
    warm = warm if warm is not None and torch.equal(warm.head_perm, perm) else None
    b, rep = f"blocks.{layer}.attn", arch.n_heads // arch.n_kv_heads
    kv = perm[::rep] // rep  # [h_kv]
    eye = torch.eye(arch.d_head, dtype=F64).repeat(arch.n_kv_heads, 1, 1)  # [h_kv, d, d]
    A = B = eye
    if "qk" in kinds:
        Qa = _group_rows(_rows(pa, f"{b}.W_Q", f"{b}.b_Q"), rep)  # [h_kv, rep*D+, d]
        Qb = _group_rows(_rows(pb, f"{b}.W_Q", f"{b}.b_Q")[perm], rep)
        Ka, Kb = _rows(pa, f"{b}.W_K", f"{b}.b_K"), _rows(pb, f"{b}.W_K", f"{b}.b_K")[kv]  # [h_kv, D+, d]
        A = fit_qk(arch, structure, Qa, Qb, Ka, Kb, warm.qk if warm else None)
    if "vo" in kinds:
        Va, Vb = _rows(pa, f"{b}.W_V", f"{b}.b_V"), _rows(pb, f"{b}.W_V", f"{b}.b_V")[kv]  # [h_kv, D+, d]
        Oa = _group_rows(pa[f"{b}.W_O"].mT, rep)  # [h_kv, rep*D, d]: W_O <- B^{-1} W_O is W_O^T B^{-T}
        Ob = _group_rows(pb[f"{b}.W_O"][perm].mT, rep)
        B = fit_gl(Va, Vb, Oa, Ob, warm.vo if warm else None)
    return A, B


def neurons(arch: Arch, p: Params, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per hidden neuron: incoming up-branch weights [m, D(+1)], outgoing [m, D], gate [m, D] or None."""
    b = f"blocks.{layer}.mlp"
    inc = p[f"{b}.W_in"].T  # [m, D]
    if f"{b}.b_in" in p:
        inc = torch.cat([inc, p[f"{b}.b_in"][:, None]], 1)  # [m, D+1]
    gate = p[f"{b}.W_gate"].T if f"{b}.W_gate" in p else None  # [m, D]
    return inc, p[f"{b}.W_out"], gate


def _cos(X: Tensor, Y: Tensor) -> Tensor:
    Xn = X / X.norm(dim=1, keepdim=True).clamp_min(1e-30)
    Yn = Y / Y.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return Xn @ Yn.T  # [m, m]


def match_mlp(arch: Arch, pa: Params, pb: Params, layer: int, kinds: frozenset[str]) -> tuple[Tensor, Tensor]:
    """pi [m] and the scales s [m] of B's neurons (ones unless mlp_scale is used)."""
    ia, oa, ga = neurons(arch, pa, layer)
    ib, ob, gb = neurons(arch, pb, layer)
    m = ia.shape[0]
    scaled = "mlp_scale" in kinds
    if "mlp" in kinds:
        if not scaled:
            score = ia @ ib.T + oa @ ob.T + (ga @ gb.T if ga is not None else 0)  # [m, m]
        elif arch.mlp == "relu":  # s > 0 keeps the directions: cosines are invariant
            score = _cos(ia, ib) + _cos(oa, ob)
        else:  # SwiGLU: the up branch may flip sign with its outgoing row; their product may not
            score = _cos(ia, ib) * _cos(oa, ob) + _cos(ga, gb)
        perm = assignment(score)
    else:
        perm = torch.arange(m)
    s = fit_scale(ia, ib[perm], oa, ob[perm], positive=arch.mlp == "relu") if scaled else torch.ones(m, dtype=F64)
    return perm, s


# ---------------------------------------------------------------------------------------------
# The residual stream


def residual_rows(spec: Spec, p: Params, with_norms: bool) -> list[tuple[str, Tensor]]:
    """Every parameter the residual map acts on, as rows [N, D] moving by x <- x Omega.

    Writers (W Omega) and readers (Omega^{-1} W = Omega^T W, i.e. the rows of W^T times Omega) both
    move as rows times Omega along their residual axis once Omega is orthogonal (MATH.md section 3).
    Norm gains follow only permutations (they are folded away before any rotation).
    """
    out = []
    for key, axis, act in spec.axes_of("residual"):
        if act.role == "norm" and not with_norms:
            continue
        X = p[key].movedim(axis, -1)  # [..., D]
        out.append((key, X.reshape(-1, X.shape[-1])))  # [N, D]
    return out


def residual_cross(spec: Spec, pa: Params, pb: Params, perm: bool) -> Tensor:
    """sum over residual-path parameters of X_B^T X_A [D, D] (solvers.cross)."""
    rb = dict(residual_rows(spec, pb, perm))
    D = spec.arch.d_model
    M = torch.zeros(D, D, dtype=F64)
    for key, Xa in residual_rows(spec, pa, perm):
        M += rb[key].to(F64).T @ Xa.to(F64)
    return M


def solve_residual(M: Tensor, perm: bool) -> Tensor:
    """Omega maximising tr(Omega^T M): a permutation matrix or the Procrustes rotation."""
    return residual_perm_from_scores(M) if perm else procrustes(M)


def _outer_only(spec: Spec) -> set[str]:
    """Parameters only the residual map acts on: embeddings, head, output biases (and norms)."""
    return {k for k, ps in spec.params.items() if ps.axes and
            all(a.group == "residual" for acts in ps.axes for a in acts)}


def initial_residual(spec: Spec, pa: Params, pb: Params, perm: bool) -> Tensor:
    """Omega from what no per-layer transform touches (MATH.md section 4; see the module docstring).

    Linear terms: parameters acted on by Omega alone. Two-sided terms Omega^T X_B Omega ~ X_A for
    the invariant circuits sum_i M_i, sum_i N_i, W_in W_out per layer, linearised around the current
    Omega: <X_A, Omega^T X_B Omega_k> + <X_A, Omega_k^T X_B Omega> gives X_B Omega_k X_A^T + X_B^T Omega_k X_A.
    """
    arch = spec.arch
    keep = _outer_only(spec)
    rb = dict(residual_rows(spec, pb, perm))
    D = arch.d_model
    lin = torch.zeros(D, D, dtype=F64)
    for key, Xa in residual_rows(spec, pa, perm):
        if key in keep:
            lin += rb[key].to(F64).T @ Xa.to(F64)
    quad = []
    for layer in range(arch.n_layers):
        quad += list(zip(summed_circuits(arch, pa, layer), summed_circuits(arch, pb, layer)))
    O = solve_residual(lin, perm) if lin.abs().sum() > 0 else torch.eye(D, dtype=F64)
    for _ in range(INIT_STEPS):
        M = lin.clone()
        for Xa, Xb in quad:
            M += Xb @ O @ Xa.T + Xb.T @ O @ Xa
        O_new = solve_residual(M, perm)
        if torch.allclose(O_new, O, atol=1e-13, rtol=0):
            break
        O = O_new
    return O


# ---------------------------------------------------------------------------------------------
# Coordinate descent


def _with_residual(arch: Arch, O: Tensor) -> GroupElement:
    g = identity(arch)
    return GroupElement(g.layers, O)


def weight_match(pair: Pair, kinds: frozenset[str], qk_structure: str | None = None,
                 max_sweeps: int = MAX_SWEEPS) -> tuple[GroupElement, dict]:
    """The weight-matching element g (g.theta_B ~ theta_A) and its sweep history."""
    arch, spec = pair.arch, pair.spec
    pa, pb = to_f64(pair.params_a), to_f64(pair.params_b)
    structure = qk_structure or spec.groups["blocks.0.qk"].structure
    res = [k for k in RESIDUAL if k in kinds]
    perm_res = res == ["residual_perm"]
    D = arch.d_model
    O = initial_residual(spec, pa, pb, perm_res) if res else torch.eye(D, dtype=F64)
    history, prev = [], None
    g = identity(arch)
    for sweep in range(max_sweeps):
        pb_o = apply(arch, _with_residual(arch, O), pb, strict=False) if res else pb
        layers = []
        for layer in range(arch.n_layers):
            hp = match_heads(arch, pa, pb_o, layer) if "heads" in kinds else torch.arange(arch.n_heads)
            A, B = within_head(arch, structure, pa, pb_o, layer, hp, kinds, g.layers[layer] if sweep else None)
            mp, s = match_mlp(arch, pa, pb_o, layer, kinds)
            layers.append(LayerElement(hp, A, B, mp, s))
        g_layers = GroupElement(tuple(layers), torch.eye(D, dtype=F64))
        # strict=False: membership is the exactness guard's job (and a test may force GL on RoPE)
        O_new = solve_residual(residual_cross(spec, pa, apply(arch, g_layers, pb, strict=False), perm_res),
                               perm_res) if res else O
        g = GroupElement(tuple(layers), O_new)
        moved = apply(arch, g, pb, strict=False)
        f = float(sum((pa[k] - moved[k]).square().sum() for k in pa))
        key = torch.cat([torch.cat([el.head_perm, el.mlp_perm]) for el in layers])
        dO = float((O_new - O).abs().max())
        history.append({"sweep": sweep + 1, "objective": f, "residual_change": dO})
        # alternating continuous maps creep: stop once the permutations hold and the objective stalls
        settled = prev is not None and torch.equal(key, prev[0]) and (dO < 1e-8 or prev[1] - f <= REL_TOL * f)
        O, prev = O_new, (key, f)
        if settled:
            break
    return g, {"sweeps": history}


def align_weights(ctx: AlignContext) -> AlignOutput:
    """Data-free weight matching over ctx.classes (registry entry `weight`)."""
    t = tick()
    g, info = weight_match(ctx.pair, ctx.classes, ctx.qk_structure)
    perm = residual_perm_of(g.residual)
    info |= {"seconds": t(), "residual_is_permutation": perm is not None}
    return AlignOutput(g, info)
