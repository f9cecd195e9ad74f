"""Weight matching: data-free coordinate descent on ||theta_A - g.theta_B||^2 (docs/MATH.md section 4.2).

One sweep solves every per-layer problem given the residual map Omega, then Omega given the
per-layer transforms, and sweeps repeat until no permutation changes and Omega stops moving:

    heads   sigma: assignment on C_ij = ||Mbar_i^A - Mbar_j^B||^2 + ||N_i^A - N_j^B||^2 with the
            invariant circuits M = W_Q W_K^T (row-centred: the softmax ignores a constant per query)
            and N = W_V W_O; under GQA whole KV groups map to KV groups (solvers.gqa_assignment)
    qk      A per KV group: GL(d) by Procrustes start + L-BFGS; RoPE: per-pair closed-form phase and
            a search on log r; partial RoPE: H(r) x GL(d - r); QK-norm: per pair a quarter turn, a sign
            per KV group and the gains' modulus (solvers.fit_qk_norm)
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

import math
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.align.context import F64, AlignContext, AlignOutput, tick
from engine.align.diagnostics import slices
from engine.align.pair import Pair
from engine.align.solvers import (
    assignment,
    fit_gl,
    fit_qk_norm,
    fit_rope,
    fit_scale,
    gqa_assignment,
    procrustes,
    residual_perm_from_scores,
    residual_perm_of,
    single_thread,
)
from engine.cancel import CancelToken, check
from engine.classes import RESIDUAL
from engine.errors import LMCError
from engine.interpolate import Progress
from engine.memory import reuse_freed_memory
from engine.models.base import Arch, Params
from engine.spec import Spec
from engine.symmetry import GroupElement, LayerElement, act, element_maps, identity, layer_maps, rope_commutant

MAX_SWEEPS = 100  # a safety bound, not a budget: reaching it is reported as not converged
# A sweep that lowers the objective by at most REL_TOL[work dtype] relative ends the descent. Small models
# (float64 products, a sweep in well under a second) run to 1e-4: on the zoo that lowers five of six
# barriers, the RoPE ViT's by 0.59, at twice the sweeps; 1e-5 is mixed at 2-3 times more. At GPT-2 scale
# (float32 products, 15 s a sweep) what lies past 1e-3 is slow creep of the alternating continuous maps,
# and 1e-3 ends an independent pair's descent after 3 sweeps (bench/RESULTS.md, "Stopping where the
# barrier stops").
REL_TOL = {torch.float64: 1e-4, torch.float32: 1e-3}
INIT_STEPS = 50  # at most this many linearised two-sided Procrustes steps for the starting Omega
INIT_REL_TOL = 1e-3  # ... which stop once the linearised objective rises by less than this, relatively
SETTLED = {torch.float64: 1e-11, torch.float32: 1e-6}  # residual map change (max entry) that ends the descent
KEEP_BYTES = 1 << 28  # working copies up to this size are kept, not recomputed (small models: all of them)
HEAD_COSTS = ("squared", "unsquared", "normalised")
MLP_SCORES = ("inner", "normalised")
TOKEN_AXIS = {"embed.tok": 0, "head.W": 1}  # the token axis of the embedding and the unembedding


@dataclass(frozen=True)
class WeightSettings:
    """How weight matching scores its per-layer problems and weighs the residual fit (docs/MATH.md section 4.2).

    head_cost: "squared" ||Mbar_i^A - Mbar_j^B||^2 + ||N_i^A - N_j^B||^2, "unsquared" the sum of the two
    Frobenius distances, "normalised" the squared distance of the circuits scaled to unit norm (cosines).
    mlp_score: "inner" <in> + <out> (+ <gate>) as one product, "normalised" the sum of the cosines of each
    neuron's incoming, outgoing (and gate) weight vectors (with mlp_scale the score is cosines anyway).
    block_scale: every residual parameter's term of the residual fit weighted by 1 / its fan-in.
    seen_tokens: token ids whose embedding / unembedding rows enter the residual fit (None: every row).
    stop_tol: a sweep lowering the objective by at most this, relatively, ends the descent (None: REL_TOL of
    the work dtype, 1e-4 for float64 products, 1e-3 for float32 ones).
    """

    head_cost: str = "squared"
    mlp_score: str = "inner"
    block_scale: bool = False
    seen_tokens: frozenset[int] | None = None
    stop_tol: float | None = None

    def __post_init__(self) -> None:
        if self.head_cost not in HEAD_COSTS:
            raise LMCError(f"Weight matching: head cost {self.head_cost!r} is not available; choose one of "
                           f"{', '.join(HEAD_COSTS)}.")
        if self.mlp_score not in MLP_SCORES:
            raise LMCError(f"Weight matching: MLP score {self.mlp_score!r} is not available; choose one of "
                           f"{', '.join(MLP_SCORES)}.")
        if not isinstance(self.block_scale, bool):
            raise LMCError(f"Weight matching: block_scale must be True or False, not {self.block_scale!r}.")
        if self.stop_tol is not None and (isinstance(self.stop_tol, bool) or not isinstance(self.stop_tol, (int, float))
                                          or not 0 < self.stop_tol < 1):
            raise LMCError(f"Weight matching: stop_tol must be a number between 0 and 1, not {self.stop_tol!r}.")
        if self.seen_tokens is not None:
            ids = _token_ids(self.seen_tokens)
            object.__setattr__(self, "seen_tokens", ids)

    def record(self) -> dict:
        """JSON-ready, the seen tokens as their count."""
        return {"head_cost": self.head_cost, "mlp_score": self.mlp_score, "block_scale": self.block_scale,
                "seen_tokens": None if self.seen_tokens is None else len(self.seen_tokens), "stop_tol": self.stop_tol}


def _token_ids(tokens: Iterable) -> frozenset[int]:
    """A non-empty set of non-negative integer token ids (a tensor's entries or any iterable of ints)."""
    ids = tokens.flatten().tolist() if isinstance(tokens, Tensor) else list(tokens)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise LMCError("Weight matching: seen_tokens must be a non-empty set of non-negative integer token ids.")
    return frozenset(ids)


# ---------------------------------------------------------------------------------------------
# Per-layer problems


def bias_rows(p: Params, key: str, bias: str | None) -> Tensor:
    """W [n, D, d] with its bias [n, d] appended as a last row -> [n, D (+1), d]."""
    W = p[key]
    return torch.cat([W, p[bias][:, None]], 1) if bias and bias in p else W  # [n, D+1, d]


def _per_query_head(x: Tensor, rep: int) -> Tensor:
    """A KV group's stack [h_kv, ...] repeated for each of its `rep` query heads [h, ...]; x itself without
    GQA (rep 1), where a repeat would only copy it."""
    return x if rep == 1 else x.repeat_interleave(rep, 0)


def head_factors(arch: Arch, p: Params, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The factors of every query head's circuits, heads side by side: Q [D+, h*d] and Kbar [D, h*d]
    with Mbar_i = Q_i Kbar_i^T (W_Q W_K^T, row-centred: K centred over the residual axis, since a constant
    score per query is invisible to softmax), V [D+, h*d] and O [h*d, D] with N_i = V_i O_i (W_V W_O)."""
    b, rep = f"blocks.{layer}.attn", arch.n_heads // arch.n_kv_heads
    Q = bias_rows(p, f"{b}.W_Q", f"{b}.b_Q").transpose(0, 1).flatten(1)  # [D+, h*d]
    K = _per_query_head(p[f"{b}.W_K"], rep)  # [h, D, d]
    K = (K - K.mean(1, keepdim=True)).transpose(0, 1).flatten(1)  # [D, h*d]
    V = _per_query_head(bias_rows(p, f"{b}.W_V", f"{b}.b_V"), rep).transpose(0, 1).flatten(1)  # [D+, h*d]
    return Q, K, V, p[f"{b}.W_O"].flatten(0, 1)  # ..., [h*d, D]


def _blocks(G: Tensor, h: int) -> Tensor:
    """[h*d, h*d] -> [h, h, d, d]: block (i, j) of a Gram matrix."""
    d = G.shape[0] // h
    return G.reshape(h, d, h, d).transpose(1, 2)  # [h, h, d, d]


def circuit_inner(Xa: Tensor, Ya: Tensor, Xb: Tensor, Yb: Tensor, h: int) -> Tensor:
    """<X_i^A Y_i^A^T, X_j^B Y_j^B^T> for all head pairs [h, h], without forming a D x D circuit:
    tr(Y_i^A X_i^A^T X_j^B Y_j^B^T) = sum of the elementwise product of the d x d blocks (i, j) of the
    Gram matrices X_A^T X_B and Y_A^T Y_B. Memory (h d)^2 instead of h D^2; the same flops."""
    return (_blocks(Xa.mT @ Xb, h) * _blocks(Ya.mT @ Yb, h)).sum((-2, -1))  # [h, h]


def circuit_norms(X: Tensor, Y: Tensor, h: int) -> Tensor:
    """||X_i Y_i^T||^2 for each head [h]: circuit_inner's diagonal from the heads' own d x d Gram blocks
    (1/h of the full Gram matrices' work)."""
    Xh, Yh = (Z.reshape(Z.shape[0], h, -1).transpose(0, 1) for Z in (X, Y))  # [h, D, d]
    return ((Xh.mT @ Xh) * (Yh.mT @ Yh)).sum((-2, -1))  # [h]


def match_heads(arch: Arch, pa: Params, pb: Params, layer: int, cost: str = "squared") -> Tensor:
    """sigma [h]: A's head i takes B's head sigma(i), by the distance of their invariant circuits,
    C_ij = ||Mbar_i^A - Mbar_j^B||^2 + ||N_i^A - N_j^B||^2 (or a HEAD_COSTS variant), from Gram matrices."""
    return gqa_assignment(-head_cost(arch, pa, pb, layer, cost), arch.n_heads // arch.n_kv_heads)


def head_cost(arch: Arch, pa: Params, pb: Params, layer: int, cost: str = "squared") -> Tensor:
    """C [h_A, h_B], the cost match_heads assigns on: `cost` of HEAD_COSTS (WeightSettings.head_cost)."""
    h = arch.n_heads
    Qa, Ka, Va, Oa = head_factors(arch, pa, layer)
    Qb, Kb, Vb, Ob = head_factors(arch, pb, layer)
    cross_qk, cross_ov = circuit_inner(Qa, Ka, Qb, Kb, h), circuit_inner(Va, Oa.mT, Vb, Ob.mT, h)  # [h_A, h_B]
    na_qk, na_ov = circuit_norms(Qa, Ka, h), circuit_norms(Va, Oa.mT, h)
    nb_qk, nb_ov = circuit_norms(Qb, Kb, h), circuit_norms(Vb, Ob.mT, h)
    if cost == "squared":
        return (na_qk + na_ov)[:, None] + (nb_qk + nb_ov)[None] - 2 * (cross_qk + cross_ov)  # [h_A, h_B]
    if cost == "unsquared":
        d_qk = (na_qk[:, None] + nb_qk[None] - 2 * cross_qk).clamp_min(0).sqrt()  # [h_A, h_B]
        d_ov = (na_ov[:, None] + nb_ov[None] - 2 * cross_ov).clamp_min(0).sqrt()
        return d_qk + d_ov
    # normalised: ||X/|X| - Y/|Y|||^2 = 2 - 2 cos(X, Y) per circuit
    cos_qk = cross_qk / (na_qk[:, None] * nb_qk[None]).sqrt().clamp_min(1e-300)
    cos_ov = cross_ov / (na_ov[:, None] * nb_ov[None]).sqrt().clamp_min(1e-300)
    return 4 - 2 * (cos_qk + cos_ov)


Circuit = tuple[Tensor, Tensor | None]  # X [D, D] as its factors (U, V) with X = U V^T, or (X, None) when dense


def summed_circuits(arch: Arch, p: Params, layer: int, wd: torch.dtype = F64) -> tuple[Circuit, Circuit, Circuit]:
    """sum_i W_Q^i W_K^iT, sum_i W_V^i W_O^i and W_in W_out [D, D]: invariant to every per-layer
    transform of docs/MATH.md sections 1-2, and conjugated by the residual map (Omega^T X Omega).

    Under grouped-query attention the query heads of a KV group share its K and V, so the sums run over the
    groups: (sum of the group's W_Q^i) W_K^T, W_V (sum of its W_O^i), rank r = h_kv d. A circuit of rank at
    most D / 2 is kept as its factors [D, r] (a 1.1B Llama's: r = 256 of D = 2,048), the rest as [D, D]."""
    b, g = f"blocks.{layer}", arch.n_kv_heads
    w = {k: p[f"{b}.{k}"].detach().to("cpu", wd) for k in ("attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O",
                                                            "mlp.W_in", "mlp.W_out")}
    h, D, d = w["attn.W_Q"].shape
    Q = w["attn.W_Q"].reshape(g, h // g, D, d).sum(1).transpose(0, 1).flatten(1)  # [D, h_kv*d]
    O = w["attn.W_O"].reshape(g, h // g, d, D).sum(1).flatten(0, 1)  # [h_kv*d, D]
    K, V = (w[k].transpose(0, 1).flatten(1) for k in ("attn.W_K", "attn.W_V"))  # [D, h_kv*d]
    return _circuit(Q, K), _circuit(V, O.T), _circuit(w["mlp.W_in"], w["mlp.W_out"].T)


def _circuit(U: Tensor, V: Tensor) -> Circuit:
    return (U, V) if 2 * U.shape[1] <= U.shape[0] else (U @ V.T, None)


def circuit_bytes(arch: Arch, itemsize: int) -> int:
    """What summed_circuits keeps of one model's layers, all of them (bytes)."""
    D, r = arch.d_model, arch.n_kv_heads * arch.d_head
    attn = 2 * (2 * D * r if 2 * r <= D else D * D)
    return arch.n_layers * itemsize * (attn + (2 * D * arch.d_mlp if 2 * arch.d_mlp <= D else D * D))


def conjugate_products(xa: Circuit, xb: Circuit, Ow: Tensor, first: bool, second: bool
                       ) -> tuple[Tensor | None, Tensor | None]:
    """X_B Omega X_A^T and X_B^T Omega X_A [D, D], each when asked: the starting residual fit's linearised
    terms of one circuit pair. Factored circuits (X = U V^T, r <= D / 2) never form X: U_B (V_B^T Omega V_A) U_A^T
    costs r / D of the dense product."""
    (Ua, Va), (Ub, Vb) = xa, xb
    if Va is None:
        return (Ub @ Ow @ Ua.mT if first else None), (Ub.mT @ Ow @ Ua if second else None)
    return ((Ub @ (Vb.mT @ Ow @ Va)) @ Ua.mT if first else None), ((Vb @ (Ub.mT @ Ow @ Ua)) @ Va.mT if second else None)


def group_rows(X: Tensor, rep: int) -> Tensor:
    """Query-head stacks [h, N, d] -> one stack per KV group [h_kv, rep * N, d]."""
    h, N, d = X.shape
    return X.reshape(h // rep, rep * N, d)  # [h_kv, rep*N, d]


def fit_qk(arch: Arch, structure: str, Qa: Tensor, Qb: Tensor, Ka: Tensor, Kb: Tensor,
           start: Tensor | None = None, gains: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """A [h_kv, d, d] with Qb A ~ Qa and Kb A^{-T} ~ Ka, in the Q/K group of `structure`; under QK-norm
    `gains` (g_q^A, g_q^B, g_k^A, g_k^B) are the norm gains the modulus moves (weight rows move by the signs
    and turns alone), None when the rows are normalised activations (solvers.fit_qk_norm)."""
    if structure == "gl":
        return fit_gl(Qa, Qb, Ka, Kb, start)
    r, d = arch.rotary_dim, arch.d_head
    if structure == "rope_qk_norm":
        return rope_commutant(fit_qk_norm(Qa, Qb, Ka, Kb, arch.rope_layout, r, gains), arch.rope_layout, d)
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
        Qa = group_rows(bias_rows(pa, f"{b}.W_Q", f"{b}.b_Q"), rep)  # [h_kv, rep*D+, d]
        Qb = group_rows(bias_rows(pb, f"{b}.W_Q", f"{b}.b_Q")[perm], rep)
        Ka, Kb = bias_rows(pa, f"{b}.W_K", f"{b}.b_K"), bias_rows(pb, f"{b}.W_K", f"{b}.b_K")[kv]  # [h_kv, D+, d]
        gains = tuple(p[f"{b}.{n}_norm.g"] for n in "qk" for p in (pa, pb)) if arch.qk_norm else None
        A = fit_qk(arch, structure, Qa, Qb, Ka, Kb, warm.qk if warm else None, gains)
    if "vo" in kinds:
        Va, Vb = bias_rows(pa, f"{b}.W_V", f"{b}.b_V"), bias_rows(pb, f"{b}.W_V", f"{b}.b_V")[kv]  # [h_kv, D+, d]
        Oa = group_rows(pa[f"{b}.W_O"].mT, rep)  # [h_kv, rep*D, d]: W_O <- B^{-1} W_O is W_O^T B^{-T}
        Ob = group_rows(pb[f"{b}.W_O"][perm].mT, rep)
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


def match_mlp(arch: Arch, pa: Params, pb: Params, layer: int, kinds: frozenset[str],
              score_kind: str = "inner") -> tuple[Tensor, Tensor]:
    """pi [m] and the scales s [m] of B's neurons (ones unless mlp_scale is used); `score_kind` of
    MLP_SCORES (WeightSettings.mlp_score) when the neurons are not rescaled."""
    ia, oa, ga = neurons(arch, pa, layer)
    ib, ob, gb = neurons(arch, pb, layer)
    m = ia.shape[0]
    scaled = "mlp_scale" in kinds
    if "mlp" in kinds:
        if not scaled and score_kind == "normalised":
            score = _cos(ia, ib) + _cos(oa, ob) + (_cos(ga, gb) if ga is not None else 0)  # [m, m]
        elif not scaled:
            xa, xb = [torch.cat([i, o] + ([g] if g is not None else []), 1) for i, o, g in ((ia, oa, ga), (ib, ob, gb))]
            score = xa @ xb.T  # [m, m]: <in> + <out> (+ <gate>) in one product
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
# Streaming: one layer at a time, big products in the work dtype, small solves in float64


SMALL_MODEL = 20_000_000  # parameters: below this every product runs in float64 (the zoo, the tests)


def work_dtype(p: Params) -> torch.dtype:
    """float64 for small models (exact answers, nothing to save); float32 products at scale."""
    return F64 if sum(v.numel() for v in p.values()) <= SMALL_MODEL else torch.float32


def scratch_bytes(arch: Arch, params: int, layer_params: int, itemsize: int) -> int:
    """Peak scratch beyond the two models (bytes), from the config alone (registry entry `weight`; the
    arithmetic is engine.resources'): B's block moved twice, both models' head circuits [h, D+1, D], the
    MLP cost [m, m] (and its float64 copy), the summed circuits of every layer per model (circuit_bytes: at
    most [3L, D, D]), residual cross products, and the largest parameter moved, in the work dtype (work_dtype)."""
    D, h, m, V = arch.d_model, arch.n_heads, arch.d_mlp, arch.n_out
    w, f = (F64 if params <= SMALL_MODEL else torch.float32).itemsize, F64.itemsize
    return (w * (2 * layer_params + 4 * h * (D + 1) * D + m * m) + 2 * circuit_bytes(arch, w)
            + 2 * f * (m * m + 2 * D * D) + 2 * w * max(V * D, D * m))


def layer_keys(spec: Spec) -> tuple[list[str], list[list[str]]]:
    """Keys outside every block (embeddings, final norm, head) and the keys of each block."""
    blocks: list[list[str]] = [[] for _ in range(spec.arch.n_layers)]
    outer = []
    for k in spec.params:
        parts = k.split(".")
        (blocks[int(parts[1])] if parts[0] == "blocks" else outer).append(k)
    return outer, blocks


def residual_axes(spec: Spec, with_norms: bool) -> dict[str, int]:
    """Every parameter the residual map acts on, with its residual axis.

    Writers (W Omega) and readers (Omega^{-1} W = Omega^T W, i.e. the rows of W^T times Omega) both
    move as rows times Omega along their residual axis once Omega is orthogonal (docs/MATH.md section 3).
    Norm gains follow only permutations (they are folded away before any rotation).
    """
    return {key: axis for key, axis, a in spec.axes_of("residual") if with_norms or a.role != "norm"}


def two_sided(spec: Spec) -> frozenset[str]:
    """Parameters the residual map acts on along two axes, a reader's and a writer's (BERT's head.dense.W,
    moved to Omega^T W Omega): their term of the fit is quadratic in Omega, not linear (Terms)."""
    axes: dict[str, set[int]] = {}
    for key, ax, _ in spec.axes_of("residual"):
        axes.setdefault(key, set()).add(ax)
    return frozenset(k for k, s in axes.items() if len(s) > 1)


def _residual_rows(x: Tensor, axis: int) -> Tensor:
    X = x.movedim(axis, -1)  # [..., D]
    return X.reshape(-1, X.shape[-1])  # [N, D]


def _only_residual(spec: Spec) -> set[str]:
    """Parameters only the residual map acts on: embeddings, head, output biases (and norms)."""
    return {k for k, ps in spec.params.items() if ps.axes and
            all(a.group == "residual" for acts in ps.axes for a in acts)}


@dataclass(frozen=True)
class Part:
    """One parameter's contribution to Terms: its cross matrix X_B^T X_A [D, D] (float64) and squared norms
    (a residual parameter), its kept pair (a two-sided one) or its squared difference (any other)."""

    M: Tensor | None = None
    sq: float = 0.0
    rest: float = 0.0
    pair: tuple[Tensor, Tensor, float] | None = None


class Terms:
    """What the residual fit and the objective need of a set of parameters, accumulated as they stream by.

    For residual parameters ||X_A - X_B Omega||^2 = ||X_A||^2 + ||X_B||^2 - 2 tr(Omega^T X_B^T X_A), so the
    cross matrix M = sum X_B^T X_A [D, D] (float64) and the squared norms give the objective for any
    orthogonal Omega; every other parameter adds its squared difference directly. A parameter in `two`
    (two_sided) is kept whole: ||W_A - Omega^T W_B Omega||^2 = ||W_A||^2 + ||W_B||^2 - 2 <W_A, Omega^T W_B Omega>,
    which `objective` evaluates exactly and `linear` linearises around a given Omega, as initial_residual does
    for the summed circuits.
    """

    def __init__(self, D: int, two: frozenset[str] = frozenset()):
        self.M = torch.zeros(D, D, dtype=F64)
        self.sq = 0.0  # sum ||X_A||^2 + ||X_B||^2 over residual parameters
        self.rest = 0.0  # sum ||A - B||^2 over the others
        self.two, self.pairs = two, []  # (W_A, W_B, weight) of the two-sided parameters

    def copy(self) -> Terms:
        t = Terms(self.M.shape[0], self.two)
        t.M, t.sq, t.rest, t.pairs = self.M.clone(), self.sq, self.rest, list(self.pairs)
        return t

    def add(self, res: dict[str, int], key: str, a: Tensor, b: Tensor, w: float = 1.0) -> None:
        """The terms of one parameter; a residual one weighted by `w` (ResidualFit)."""
        self.add_part(self.part(res, key, a, b, w))

    def part(self, res: dict[str, int], key: str, a: Tensor, b: Tensor, w: float = 1.0) -> Part:
        """What `add` adds for one parameter, computed but not added (ResidualFit keeps some for reuse)."""
        if key in res and key in self.two:
            sq = w * (float(torch.linalg.vector_norm(a)) ** 2 + float(torch.linalg.vector_norm(b)) ** 2)
            return Part(sq=sq, pair=(a, b, w))
        if key in res:
            ax = res[key]
            if a.dim() == 2 and ax == 0:  # a reader [D, n]: X^T X_A without a transposed copy
                M = (b @ a.mT).to(F64)
            else:
                Xa, Xb = _residual_rows(a, ax), _residual_rows(b, ax)  # [N, D]
                M = (Xb.mT @ Xa).to(F64)
            sq = float(torch.linalg.vector_norm(a)) ** 2 + float(torch.linalg.vector_norm(b)) ** 2
            return Part(M=M if w == 1.0 else w * M, sq=sq if w == 1.0 else w * sq)
        return Part(rest=sum(float(torch.linalg.vector_norm(x - y)) ** 2 for x, y in zip(slices(a), slices(b))))

    def add_part(self, part: Part) -> None:
        if part.pair is not None:
            self.pairs.append(part.pair)
        if part.M is not None:
            self.M += part.M
        self.sq += part.sq
        self.rest += part.rest

    def noise(self, wd: torch.dtype) -> float:
        """The objective's rounding floor: below it, objective changes say nothing."""
        return 10 * torch.finfo(wd).eps * self.sq

    def quadratic(self, O: Tensor) -> float:
        """sum w <W_A, Omega^T W_B Omega> over the two-sided parameters."""
        return sum(w * float((a * (O.to(a.dtype).mT @ b @ O.to(a.dtype))).sum()) for a, b, w in self.pairs)

    def linear(self, O: Tensor) -> Tensor:
        """The score [D, D] whose tr(Omega^T .) maximiser fits every term, the two-sided ones linearised at O:
        d<W_A, Omega^T W_B Omega> = <dOmega, W_B Omega W_A^T + W_B^T Omega W_A>."""
        S = self.M.clone()
        for a, b, w in self.pairs:
            Ow = O.to(a.dtype)
            S += w * (b @ Ow @ a.mT + b.mT @ Ow @ a).to(F64)
        return S

    def objective(self, O: Tensor) -> float:
        return max(0.0, self.rest + self.sq - 2 * float((O * self.M).sum()) - 2 * self.quadratic(O))


class ResidualFit:
    """What WeightSettings change in the residual fit: each residual parameter's weight (1 / fan-in with
    block_scale: a reader's fan-in is D, a writer's the size of its other axes, a vector's 1) and the
    embedding / unembedding rows of the seen tokens only (embed.tok rows, head.W columns)."""

    def __init__(self, spec: Spec, settings: WeightSettings, res: dict[str, int]):
        arch = spec.arch
        self.weights: dict[str, float] = {}
        if settings.block_scale:
            for key, ax, a in spec.axes_of("residual"):
                if key in res:
                    shape = spec.params[key].shape
                    fan_in = shape[ax] if a.role == "right_inv_t" else max(1, math.prod(shape) // shape[ax])
                    self.weights[key] = 1.0 / fan_in
        self.rows: Tensor | None = None
        if settings.seen_tokens is not None:
            if arch.task != "lm":
                raise LMCError("Weight matching: seen_tokens applies to language models only, "
                               f"not to this {arch.task} model.")
            bad = max(settings.seen_tokens)
            if bad >= arch.n_out:
                raise LMCError(f"Weight matching: seen token id {bad} is outside the vocabulary of {arch.n_out} tokens.")
            self.rows = torch.tensor(sorted(settings.seen_tokens))  # [V_seen]
        self.outer = frozenset(layer_keys(spec)[0])
        self.kept: dict[str, Part] = {}

    def add(self, terms: Terms, res: dict[str, int], key: str, a: Tensor, b: Tensor) -> None:
        terms.add_part(self.part(terms, res, key, a, b))

    def part(self, terms: Terms, res: dict[str, int], key: str, a: Tensor, b: Tensor) -> Part:
        if self.rows is not None and key in TOKEN_AXIS:
            ax = TOKEN_AXIS[key]
            a, b = a.index_select(ax, self.rows), b.index_select(ax, self.rows)  # seen tokens only
        return terms.part(res, key, a, b, self.weights.get(key, 1.0))

    def add_unmoved(self, terms: Terms, res: dict[str, int], key: str, pa: Params, pb: Params,
                    wd: torch.dtype) -> None:
        """The terms of a parameter of A and of B as it stands, before any move. A parameter outside every block
        (embeddings, final norm, head) is computed once and kept: the starting residual fit and the descent
        both add it, and the token embedding's product [D, V] x [V, D] costs as much as five GPT-2 blocks'."""
        part = self.kept.get(key)
        if part is None:
            part = self.part(terms, res, key, pa[key].detach().to("cpu", wd), pb[key].detach().to("cpu", wd))
            if key in self.outer:
                self.kept[key] = part
        terms.add_part(part)


def solve_residual(M: Tensor, perm: bool) -> Tensor:
    """Omega maximising tr(Omega^T M): a permutation matrix or the Procrustes rotation."""
    return residual_perm_from_scores(M) if perm else procrustes(M)


class Blocks:
    """One model's blocks in the work dtype, converted when asked for; kept when `keep` (a small model:
    its float64 copy is a few MB, converting it again every sweep would cost more than the sweep)."""

    def __init__(self, p: Params, wd: torch.dtype, keep: bool):
        self.p, self.wd, self.kept = p, wd, {} if keep else None

    def get(self, keys: list[str]) -> Params:
        if self.kept is None:
            return {k: self.p[k].detach().to("cpu", self.wd) for k in keys}
        for k in keys:
            if k not in self.kept:
                self.kept[k] = self.p[k].detach().to("cpu", self.wd)
        return {k: self.kept[k] for k in keys}


def _moved(spec: Spec, mats: dict, block: Params) -> Params:
    """The parameters of `block` moved by the maps `mats` (symmetry.element_maps)."""
    return {k: act(spec.params[k], mats, v) for k, v in block.items()}


def initial_residual(spec: Spec, pa: Params, pb: Params, perm: bool, wd: torch.dtype = F64,
                     progress: Progress | None = None, cancel: CancelToken | None = None,
                     settings: WeightSettings | None = None, fit: ResidualFit | None = None) -> tuple[Tensor, dict]:
    """Omega from what no per-layer transform touches (docs/MATH.md section 4.2; see the module docstring).

    Linear terms: parameters acted on by Omega alone. Two-sided terms Omega^T X_B Omega ~ X_A for
    the invariant circuits sum_i M_i, sum_i N_i, W_in W_out per layer, linearised around the current
    Omega: <X_A, Omega^T X_B Omega_k> + <X_A, Omega_k^T X_B Omega> gives X_B Omega_k X_A^T + X_B^T Omega_k X_A.
    The linearised objective q(Omega) = <lin, Omega> + sum <Omega, X_B Omega X_A^T> comes for free with
    each step; the fit stops when Omega repeats (permutations), or q stops rising or Omega settles
    (rotations: the same SETTLED bound as the descent). `settings` weigh and select the linear terms; `fit`
    (the descent's ResidualFit, built from the same settings) shares the terms of the parameters outside
    every block, which the descent adds too.
    """
    arch = spec.arch
    res = residual_axes(spec, perm)
    fit = fit or ResidualFit(spec, settings or WeightSettings(), res)
    lin = Terms(arch.d_model, two_sided(spec))
    only = _only_residual(spec)
    for k in (k for k in res if k in only):  # a fixed order: a set's would vary with the hash seed
        fit.add_unmoved(lin, res, k, pa, pb, wd)
    D, L = arch.d_model, arch.n_layers
    # Keep the 3L circuits of both models (what the memory estimate counts) while they take at most one model's
    # bytes in the work dtype, whatever dtype its endpoints are kept in (GPT-2-small: 170 MB; a 1.1B Llama, its
    # attention circuits factored: 1.1 GB; Llama-2-7B: 12.9 GB of 27); beyond, recompute them at every step.
    width = torch.finfo(wd).bits // 8
    kept = 2 * circuit_bytes(arch, width) <= max(sum(v.numel() for v in pa.values()) * width, KEEP_BYTES)

    def circuit_pairs() -> Iterator[tuple[Circuit, Circuit]]:
        for layer in range(L):
            yield from zip(summed_circuits(arch, pa, layer, wd), summed_circuits(arch, pb, layer, wd))

    stacked = list(circuit_pairs()) if kept else None

    def cross(Ow: Tensor, first: bool, second: bool) -> tuple[Tensor | None, Tensor | None]:
        """S1 = sum X_B Omega X_A^T (the linearised objective's own term) and S2 = sum X_B^T Omega X_A (its
        gradient's other half) [D, D], each when asked; one circuit pair at a time: temporaries of D x D."""
        S1 = torch.zeros(D, D, dtype=wd) if first else None
        S2 = torch.zeros(D, D, dtype=wd) if second else None
        for xa, xb in stacked or circuit_pairs():
            s1, s2 = conjugate_products(xa, xb, Ow, first, second)
            if first:
                S1 += s1
            if second:
                S2 += s2
        return (None if S1 is None else S1.to(F64)), (None if S2 is None else S2.to(F64))

    O = solve_residual(lin.M, perm) if lin.M.abs().sum() > 0 else torch.eye(D, dtype=F64)
    best, best_q, seen, steps = O, -float("inf"), [], 0
    for steps in range(1, INIT_STEPS + 1):
        check(cancel, f"weight matching of the residual stream, step {steps}")
        Ow = O.to(wd)
        # a rotation fit whose circuits are kept decides from S1 alone whether to stop, and forms S2 only to go on
        # (a quarter of the fit's products on the usual two-step fit); a permutation's stop needs the next Omega
        lazy = kept and not perm
        S1, S2 = cross(Ow, True, not lazy)  # [D, D]
        q = float((O * lin.M).sum() + (O * S1).sum()) + lin.quadratic(O)
        if progress:
            progress(steps, INIT_STEPS, f"matching the residual stream, step {steps} (of at most {INIT_STEPS})")
        if q > best_q:
            gain, best, best_q = q - best_q, O, q
        else:
            break  # the linearisation stopped paying off: keep the best Omega seen
        if not perm and gain <= INIT_REL_TOL * abs(q):
            break
        if lazy:
            S2 = cross(Ow, False, True)[1]
        O_new = solve_residual(lin.linear(O) + S1 + S2, perm)
        if (perm and any(torch.equal(O_new, P) for P in seen + [O])) or (
                not perm and float((O_new - O).abs().max()) < SETTLED[wd]):
            break
        seen.append(O)
        O = O_new
    return best, {"steps": steps, "objective": best_q, "circuits_kept": kept}


# ---------------------------------------------------------------------------------------------
# Coordinate descent


def weight_match(pair: Pair, kinds: frozenset[str], qk_structure: str | None = None,
                 max_sweeps: int = MAX_SWEEPS, progress: Progress | None = None,
                 cancel: CancelToken | None = None,
                 settings: WeightSettings | None = None) -> tuple[GroupElement, dict]:
    """The weight-matching element g (g.theta_B ~ theta_A) and its sweep history; `settings`
    (WeightSettings, None: the defaults) choose the head cost, MLP score and residual weighting.

    `progress` hears of every step of the starting residual fit and every layer of every sweep;
    `cancel` is checked before each (Cancelled).

    Streams: each sweep visits one block at a time, moving only that block's parameters of B (by the
    residual map for the per-layer problems, by the block's own transform for the residual fit); the
    whole model is never copied, except a small model's float64 blocks (KEEP_BYTES). Every per-layer problem depends on Omega alone (their invariants do
    not see each other), so a sweep whose new Omega equals the old one is a fixed point.
    """
    wd = work_dtype(pair.params_a)
    st = settings or WeightSettings()
    with ThreadPoolExecutor(1) as beside:  # one side thread for the whole descent (see _weight_match)
        if wd != F64:
            with reuse_freed_memory():  # per-layer blocks reused, not mapped afresh at every step
                return _weight_match(pair, kinds, wd, qk_structure, max_sweeps, progress, cancel, st, beside)
        with single_thread():  # a small model: nothing but small products, which extra threads only slow down
            return _weight_match(pair, kinds, wd, qk_structure, max_sweeps, progress, cancel, st, beside)


def _weight_match(pair: Pair, kinds: frozenset[str], wd: torch.dtype, qk_structure: str | None, max_sweeps: int,
                  progress: Progress | None, cancel: CancelToken | None, st: WeightSettings,
                  beside: ThreadPoolExecutor) -> tuple[GroupElement, dict]:
    t = tick()
    arch, spec = pair.arch, pair.spec
    pa, pb = pair.params_a, pair.params_b
    keep = 2 * sum(v.numel() for v in pa.values()) * torch.finfo(wd).bits // 8 <= KEEP_BYTES
    ba, bb = Blocks(pa, wd, keep), Blocks(pb, wd, keep)
    structure = qk_structure or spec.groups["blocks.0.qk"].structure
    # GL(d) fits on Q/K (no RoPE, or the unrotated dims of a partial one) cost about what the MLP's product does
    # on one thread (GPT-2-small: 1.2 s against 0.5 s a layer), so the two overlap on two cores; RoPE's maps are
    # closed-form and what is left (V/O per KV group) small, so the MLP's product then runs on every core
    # (a 1.1B Llama: 4.8 s of its 8.3 s a layer on one thread). Deterministic: the model decides, not a clock.
    overlap = structure == "gl" or 0 < arch.rotary_dim < arch.d_head
    res_kinds = [k for k in RESIDUAL if k in kinds]
    perm_res = res_kinds == ["residual_perm"]
    res = residual_axes(spec, perm_res) if res_kinds else {}
    fit = ResidualFit(spec, st, res)
    tol = REL_TOL[wd] if st.stop_tol is None else st.stop_tol
    D = arch.d_model
    outer_keys, block_keys = layer_keys(spec)
    outer = Terms(D, two_sided(spec))  # embeddings, final norm, head: no per-layer transform touches them
    for k in outer_keys:
        fit.add_unmoved(outer, res, k, pa, pb, wd)
    init: dict = {}
    O = torch.eye(D, dtype=F64)
    if res_kinds:
        O, init = initial_residual(spec, pa, pb, perm_res, wd, progress, cancel, st, fit)
    fit.kept.clear()  # both sums that needed them hold them now
    init["seconds"] = t()
    history, prev, stop = [], None, ""
    g = identity(arch)
    for sweep in range(max_sweeps):
        mats_o = element_maps(GroupElement((), O)) if res_kinds else {}
        terms = outer.copy()
        layers = []
        for layer, keys in enumerate(block_keys):
            check(cancel, f"weight matching, sweep {sweep + 1}, layer {layer + 1}/{arch.n_layers}")
            la = ba.get(keys)
            lb = _moved(spec, mats_o, bb.get(keys))  # B's block seen through Omega
            hp = match_heads(arch, la, lb, layer, st.head_cost) if "heads" in kinds else torch.arange(arch.n_heads)
            warm = g.layers[layer] if sweep else None
            if overlap:
                with single_thread():
                    # the within-head d x d solves run on one thread; the MLP's big product and assignment,
                    # which do not depend on them, run beside them on the other core (one thread each)
                    heads = beside.submit(within_head, arch, structure, la, lb, layer, hp, kinds, warm)
                    mp, s = match_mlp(arch, la, lb, layer, kinds, st.mlp_score)
                    A, B = heads.result()
            else:  # closed-form Q/K maps: the within-head work is small, and the MLP's product takes every core
                with single_thread():
                    A, B = within_head(arch, structure, la, lb, layer, hp, kinds, warm)
                mp, s = match_mlp(arch, la, lb, layer, kinds, st.mlp_score)
            el = LayerElement(hp, A, B, mp, s)
            layers.append(el)
            del lb
            with single_thread():
                maps = layer_maps(layer, el)
            for k, v in _moved(spec, maps, bb.get(keys)).items():  # B's block moved by el alone
                fit.add(terms, res, k, la[k], v)
            if progress:
                progress(layer + 1, arch.n_layers, f"sweep {sweep + 1}: layer {layer + 1}/{arch.n_layers}")
        O_new = solve_residual(terms.linear(O), perm_res) if res_kinds else O
        g = GroupElement(tuple(layers), O_new)
        f = terms.objective(O_new)
        key = torch.cat([torch.cat([el.head_perm, el.mlp_perm]) for el in layers])
        dO = float((O_new - O).abs().max())
        flips = 0 if prev is None else int((key != prev[0]).sum())  # units whose partner changed this sweep
        history.append({"sweep": sweep + 1, "objective": f, "residual_change": dO, "seconds": t(),
                        "permutation_changes": flips})
        # alternating continuous maps creep: stop once a sweep no longer pays
        if dO == 0.0 and res_kinds:
            stop = "fixed point (the residual map did not change)"
        elif not res_kinds:
            stop = "no residual map: one sweep solves every layer"
        elif wd != F64 and f <= terms.noise(wd):  # float64 runs on to the fixed point: its maps are exact
            stop = "objective at the float32 rounding floor: B matches A"
        elif prev is not None and torch.equal(key, prev[0]) and dO < SETTLED[wd]:
            stop = "permutations unchanged and the residual map settled"
        elif prev is not None and f > terms.noise(wd) and prev[1] - f <= tol * f:
            held = "permutations unchanged" if not flips else f"{flips} units still changed partner"
            stop = f"objective decrease {(prev[1] - f) / f:.1e} relative, below {tol:g} ({held})"
        elif sweep + 1 == max_sweeps:
            change = "" if prev is None else f" by {(prev[1] - f) / max(abs(f), 1e-300):.1e} relative"
            stop = f"sweep cap ({max_sweeps}) reached while the objective still changed{change}"
        O, prev = O_new, (key, f)
        if stop:
            break
    return g, {"sweeps": history, "converged": not stop.startswith("sweep cap"), "stop": stop, "stop_tol": tol,
               "initial_residual": init, "work_dtype": str(wd).removeprefix("torch.")}


def align_weights(ctx: AlignContext) -> AlignOutput:
    """Data-free weight matching over ctx.classes (registry entry `weight`)."""
    t = tick()
    g, info = weight_match(ctx.pair, ctx.classes, ctx.qk_structure, progress=ctx.progress, cancel=ctx.cancel,
                           settings=ctx.weight)
    perm = residual_perm_of(g.residual)
    info |= {"seconds": t(), "residual_is_permutation": perm is not None}
    if ctx.weight is not None and ctx.weight != WeightSettings():
        info["settings"] = ctx.weight.record()
    return AlignOutput(g, info)
