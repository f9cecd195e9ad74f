"""The small exact problems every aligner reduces to (docs/MATH.md section 4.1), as pure functions.

Each solver moves B onto A: it returns the transform that, applied to B's rows, best matches A's.
Row stacks are `[N, k]` matrices whose rows are samples (weight rows or activations) and whose
columns are the axis the transform acts on. Permutations follow engine/symmetry.py: new index i
takes old index perm[i]. Everything here is float64 and deterministic.

    assignment       S_n: Hungarian on a similarity matrix (scipy's linear_sum_assignment)
    gqa_assignment   S_h restricted to grouped-query attention: groups to groups, heads within
    procrustes       O(n): polar factor of the cross-correlation (orthogonal Procrustes, SVD)
    fit_gl           GL(d): argmin ||P_A - P_B A||^2 + ||Q_A - Q_B A^{-T}||^2, best start + preconditioned L-BFGS
    fit_rope         H(r): per frequency pair, closed-form phase + a vectorised search on log r
    fit_qk_norm      the QK-norm group: per pair a quarter turn, a sign per stack and a modulus (quartic)
    fit_scale        per-neuron scale s: argmin ||a - s b||^2 + ||c - e / s||^2 (roots of a quartic)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment, minimize
from threadpoolctl import threadpool_limits
from torch import Tensor

from engine.models.reference import rope_pairs

F64 = torch.float64
LBFGS = {"gtol": 1e-10, "ftol": 1e-10}  # L-BFGS stopping rule of fit_gl (scipy options)
GL_ITERS = 40  # L-BFGS steps of a cold GL(d) fit (the Gauss-Newton frame gets there: bench/RESULTS.md)
GL_WARM_ITERS = 20  # ... and of a warm-started one: weight matching's sweeps refine last sweep's maps


# ---------------------------------------------------------------------------------------------
# Permutations


def assignment(score: Tensor) -> Tensor:
    """perm maximising sum_i score[i, perm[i]]: A's unit i is matched with B's unit perm[i].

    When every row's best column is a different one, those columns are the optimum (their sum bounds
    every assignment's from above): planted pairs and settled sweeps skip the O(n^3) solver.
    """
    best, idx = score.detach().max(1)  # [n], [n]
    if not bool(best.isnan().any()) and int(torch.unique(idx).numel()) == score.shape[0] == score.shape[1]:
        return idx.cpu()
    rows, cols = linear_sum_assignment(score.detach().to(F64).cpu().numpy(), maximize=True)
    perm = torch.empty(score.shape[0], dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return perm


def gqa_assignment(score: Tensor, rep: int) -> Tensor:
    """Best head perm [h] that maps KV groups to KV groups (docs/MATH.md section 1, grouped-query attention).

    The value of sending B's group c' to A's group c is itself an assignment of their `rep` query
    heads; the outer assignment over groups then uses those values. With rep == 1 (or one group)
    this is plain `assignment`.
    """
    h = score.shape[0]
    if rep == 1 or rep == h:  # plain multi-head attention, or a single KV group
        return assignment(score)
    g = h // rep
    blocks = score.reshape(g, rep, g, rep).permute(0, 2, 1, 3)  # [g_A, g_B, rep, rep]
    inner = [[assignment(blocks[c, c2]) for c2 in range(g)] for c in range(g)]
    value = torch.tensor([[float(blocks[c, c2][torch.arange(rep), inner[c][c2]].sum()) for c2 in range(g)]
                          for c in range(g)], dtype=F64)  # [g_A, g_B]
    groups = assignment(value)  # [g]
    return torch.cat([groups[c] * rep + inner[c][int(groups[c])] for c in range(g)])  # [h]


def perm_matrix(perm: Tensor, dtype: torch.dtype = F64) -> Tensor:
    """P with (P @ x)[i] = x[perm[i]]: P[i, perm[i]] = 1."""
    return torch.eye(len(perm), dtype=dtype)[perm]  # [n, n]


def residual_perm_matrix(perm: Tensor, dtype: torch.dtype = F64) -> Tensor:
    """Omega with (x @ Omega)[i] = x[perm[i]] along the residual axis, the form GroupElement stores."""
    return perm_matrix(perm, dtype).T  # [D, D]


def residual_perm_from_scores(M: Tensor) -> Tensor:
    """The residual permutation matrix Omega maximising tr(Omega^T M) = sum_i M[pi(i), i]."""
    return residual_perm_matrix(assignment(M.T))


def residual_perm_of(Omega: Tensor) -> Tensor | None:
    """The index form of a residual permutation matrix, or None if Omega is not one."""
    O = Omega.detach()
    if not bool(((O == 0) | (O == 1)).all()):
        return None
    return O.argmax(0)  # column i has its 1 in row perm[i]


# ---------------------------------------------------------------------------------------------
# Orthogonal maps


_single = threading.local()  # depth of nested single_thread blocks in this thread


@contextmanager
def single_thread() -> Iterator[None]:
    """Small d x d solves on one thread: on a busy machine extra BLAS / OpenMP threads only wait (20x slower).

    Re-entrant: inside another single_thread block it costs nothing (threadpoolctl's limiter inspects
    every loaded library, a few ms)."""
    depth = getattr(_single, "depth", 0)
    if depth:
        _single.depth = depth + 1
        try:
            yield
        finally:
            _single.depth = depth
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    _single.depth = 1
    try:
        with threadpool_limits(1):
            yield
    finally:
        _single.depth = 0
        torch.set_num_threads(n)


NULL_RTOL = 1e-9  # singular values below this fraction of the largest are M's null space (procrustes)


def procrustes(M: Tensor) -> Tensor:
    """argmax over O(n) of tr(Omega^T M): the polar factor U V^T of M = U S V^T.

    Where M is singular the maximiser is not unique: on M's null space (singular values at most NULL_RTOL of the
    largest) any orthogonal map between the left and right null vectors scores the same. That choice is made as
    near the identity as it can be, not left to the SVD's arbitrary signs: a centred residual stream (a LayerNorm
    model rewritten to RMSNorm) never sees the all-ones direction, and its Omega maps that direction to itself,
    on every machine (LAPACK builds differ in the signs they return)."""
    U, S, Vh = torch.linalg.svd(M.to(F64))
    out = U @ Vh
    null = S <= NULL_RTOL * S[..., :1]  # [..., n]
    if not null.any():
        return out
    flat, Us, Vs, nulls = (t.reshape(-1, *t.shape[-k:]) for t, k in ((out, 2), (U, 2), (Vh, 2), (null, 1)))
    for i in nulls.any(1).nonzero().flatten().tolist():  # each singular matrix of a stack on its own
        flat[i] = _nearest_identity(Us[i], Vs[i], nulls[i])
    return flat.reshape(out.shape)


def _nearest_identity(U: Tensor, Vh: Tensor, null: Tensor) -> Tensor:
    """procrustes' U V^T with the map between M's left and right null vectors (`null`: which singular values are
    zero) as near the identity as it can be."""
    Un, Vn = U[:, null], Vh[null].mT  # [n, k]: Omega maps span(Vn) onto span(Un) by some R in O(k)
    R = Un.mT @ Vn  # tr(Omega) = ... + tr(Un R Vn^T) is largest at the polar factor of Un^T Vn
    if torch.linalg.matrix_rank(R) < R.shape[0]:
        return U @ Vh
    Ur, _, Vrh = torch.linalg.svd(R)
    return torch.cat([U[:, ~null], Un @ Ur @ Vrh], 1) @ torch.cat([Vh[~null], Vn.mT], 0)


# ---------------------------------------------------------------------------------------------
# GL(d): Q/K and V/O maps of a head (docs/MATH.md section 4.1, within-head maps)


def fit_gl(P_A: Tensor, P_B: Tensor, Q_A: Tensor, Q_B: Tensor, start: Tensor | None = None,
           max_iter: int | None = None) -> Tensor:
    """A [n, d, d] in GL(d) minimising ||P_A - P_B A||^2 + ||Q_A - Q_B A^{-T}||^2 for each of n independent stacks
    (rows [n, N, d]).

    P rows move by A (W_Q, or W_V), Q rows by A^{-T} (W_K, or W_O^T). Start: the best of the
    orthogonal Procrustes solution on the stacked [P; Q] (exact when A is orthogonal), the same in
    balanced coordinates (exact when A = S X with X orthogonal; usually the best start), the two
    one-sided least-squares fits (exact for a planted GL map) and `start` (a warm start); then
    L-BFGS on the true objective in the Gauss-Newton frame of that start (`gauss_newton_frame`), for
    GL_ITERS steps from a cold start and GL_WARM_ITERS from a warm one. Everything after the four
    d x d Gram matrices per stack is d x d work in float64, run on one thread (small problems: more
    threads only wait on each other). Products over the rows (the Gram matrices, the objective on the
    rows) stay in the dtype of float32 rows, like weight matching's other products at scale.
    """
    rd = torch.float32 if P_A.dtype == torch.float32 else F64
    P_A, P_B, Q_A, Q_B = (x.to(rd) for x in (P_A, P_B, Q_A, Q_B))
    g = {"pp": P_B.mT @ P_B, "pa": P_B.mT @ P_A, "qq": Q_B.mT @ Q_B, "qa": Q_B.mT @ Q_A}  # [n, d, d] each
    g = {k: v.to(F64) for k, v in g.items()}
    with single_thread():
        return _fit_gl(P_A, P_B, Q_A, Q_B, g, start,
                       max_iter if max_iter is not None else GL_ITERS if start is None else GL_WARM_ITERS)


def _sym_pow(G: Tensor, *ps: float) -> list[Tensor]:
    """G^p for each p, G symmetric positive semi-definite [n, d, d] (one eigendecomposition), eigenvalues
    floored at 1e-12 of the largest."""
    w, V = torch.linalg.eigh(G)
    w = w.clamp_min(1e-12 * w[..., -1:].clamp_min(1e-300))
    return [(V * w.pow(p)[..., None, :]) @ V.mT for p in ps]


def balance(G_P: Tensor, G_Q: Tensor, roots: list[Tensor] | None = None) -> Tensor:
    """S [n, d, d] with S^T G_P S = S^{-1} G_Q S^{-T} = (G_P^{1/2} G_Q G_P^{1/2})^{1/2}.

    A = S X turns ||P_A - P_B A||^2 + ||Q_A - Q_B A^{-T}||^2 into the same problem in X with the two
    design Gram matrices equal; Procrustes there is exact when A = S X with X orthogonal, one of
    fit_gl's starts. `roots`: G_P^{1/2} and G_P^{-1/2} when the caller has them.
    """
    R, R_inv = roots or _sym_pow(G_P, 0.5, -0.5)
    return R_inv @ _sym_pow(R @ G_Q @ R, 0.25)[0]


def gauss_newton_frame(G_P: Tensor, G_Q: Tensor, A0: Tensor, L: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """W, V, D [n, d, d] with A = A0 + W (X * D) V^T turning f's Gauss-Newton model at A0 into |X|^2.

    Linearising the residuals of f at A0 (B = A0^{-T}, dB = -B dA^T B) gives the quadratic
    <dA, G_P dA + C dA N> with C = B B^T and N = B^T G_Q B. With W^T G_P W = I, W^T C W = diag(lam)
    (W = G_P^{-1/2} U, U the eigenvectors of G_P^{-1/2} C G_P^{-1/2}) and N = V diag(sig) V^T it is
    sum_ij X_ij^2 for dA = W (X * D) V^T, D_ij = (1 + lam_i sig_j)^{-1/2}: L-BFGS then starts from the
    right curvature in every direction (all of it near a small residual) instead of learning it.
    `L`: G_P^{-1/2} when the caller has it.
    """
    B = torch.linalg.inv(A0).mT  # [n, d, d]
    L = _sym_pow(G_P, -0.5)[0] if L is None else L
    lam, U = torch.linalg.eigh(L @ (B @ B.mT) @ L)  # [n, d], [n, d, d]
    sig, V = torch.linalg.eigh(B.mT @ G_Q @ B)  # [n, d], [n, d, d]
    D = (1 + lam.clamp_min(0)[..., :, None] * sig.clamp_min(0)[..., None, :]).rsqrt()  # [n, d, d]
    return L @ U, V, D


def _solve(G: Tensor, R: Tensor) -> Tensor:
    """G^{-1} R per stack (normal equations of a least-squares fit); the minimum-norm fit where G is singular."""
    X, info = torch.linalg.solve_ex(G, R)  # [n, d, d]
    if bool((info != 0).any()):
        X = torch.where((info == 0)[:, None, None], X, torch.linalg.pinv(G, hermitian=True) @ R)
    return X


def _inv_or_nan(X: Tensor) -> Tensor:
    Y, info = torch.linalg.inv_ex(X)  # [n, d, d]
    return torch.where((info == 0)[:, None, None], Y, torch.full_like(Y, float("nan")))


def _fit_gl(P_A: Tensor, P_B: Tensor, Q_A: Tensor, Q_B: Tensor, g: dict[str, Tensor], start: Tensor | None,
            max_iter: int) -> Tensor:
    if Q_A.shape[-2] == 0:
        return _solve(g["pp"], g["pa"])  # [n, d, d]: plain least squares
    n, d = P_A.shape[0], P_A.shape[-1]
    roots = _sym_pow(g["pp"], 0.5, -0.5)  # G_pp^{1/2}, G_pp^{-1/2}
    S = balance(g["pp"], g["qq"], roots)  # [n, d, d]
    S_inv = torch.linalg.inv(S)
    cands = [procrustes(g["pa"] + g["qa"]),  # [n, d, d]
             S @ procrustes(S.mT @ g["pa"] + S_inv @ g["qa"]),  # [n, d, d]: the same in balanced coordinates
             _solve(g["pp"], g["pa"]),  # [n, d, d]
             _inv_or_nan(_solve(g["qq"], g["qa"])).mT]  # [n, d, d], fitted as A^{-T}
    if start is not None:
        cands.append(start.to(F64))

    def per_stack(A: Tensor) -> Tensor:  # [n], evaluated on the rows: exact near a zero residual
        f = (P_A - P_B @ A.to(P_A.dtype)).square().sum((-2, -1))
        return (f + (Q_A - Q_B @ torch.linalg.inv(A).mT.to(P_A.dtype)).square().sum((-2, -1))).to(F64)

    c0 = (P_A.square().sum((-2, -1)) + Q_A.square().sum((-2, -1))).to(F64)  # [n]

    def gram_objective(A: Tensor) -> Tensor:  # [n], from the d x d Gram matrices: cheap, for ranking
        B = torch.linalg.inv(A).mT
        return (c0 - 2 * (A * g["pa"]).sum((-2, -1)) + (A * (g["pp"] @ A)).sum((-2, -1))
                - 2 * (B * g["qa"]).sum((-2, -1)) + (B * (g["qq"] @ B)).sum((-2, -1)))

    eye = torch.eye(d, dtype=F64).expand(n, d, d)
    vals = []
    for k, c in enumerate(cands):
        good = torch.isfinite(c).all((-2, -1))
        c = torch.where(good[:, None, None], c, eye)
        if k:  # the first candidate is orthogonal
            good &= torch.linalg.cond(c) < 1e8
        c = torch.where(good[:, None, None], c, eye)  # [n, d, d]
        vals.append(gram_objective(c))
    pick = torch.stack(vals).argmin(0)  # [n]
    A0 = torch.stack([cands[int(k)][i] for i, k in enumerate(pick)])  # [n, d, d]
    A0 = torch.where(torch.isfinite(A0).all((-2, -1))[:, None, None], A0, eye)
    f0 = per_stack(A0)
    if float(f0.max()) <= 1e-24:
        return A0
    # L-BFGS on Gram matrices (scipy, analytic gradient), every evaluation a few d x d products, in
    # coordinates where the Gauss-Newton model at A0 is the identity (`gauss_newton_frame`)
    W, V, D = gauss_newton_frame(g["pp"], g["qq"], A0, roots[1])  # [n, d, d], [n, d, d], [n, d, d]
    g = {k: v.numpy() for k, v in g.items()}  # [n, d, d] each
    Wn, Vn, Dn, A0n = W.numpy(), V.numpy(), D.numpy(), A0.numpy()
    c0 = float(c0.sum())

    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        A = A0n + Wn @ (x.reshape(n, d, d) * Dn) @ Vn.transpose(0, 2, 1)  # [n, d, d] from scipy's flat vector
        try:
            B = np.linalg.inv(A).transpose(0, 2, 1)  # A^{-T}
        except np.linalg.LinAlgError:
            return np.inf, np.zeros_like(x)
        f = (c0 - 2 * (A * g["pa"]).sum() + (A * (g["pp"] @ A)).sum()
             - 2 * (B * g["qa"]).sum() + (B * (g["qq"] @ B)).sum())
        G_B = 2 * (g["qq"] @ B - g["qa"])
        G = 2 * (g["pp"] @ A - g["pa"]) - B @ G_B.transpose(0, 2, 1) @ B  # d/dA of the B term: -B G_B^T B
        return float(f), (Dn * (Wn.transpose(0, 2, 1) @ G @ Vn)).reshape(-1)  # [n*d*d], chained to x

    res = minimize(fg, np.zeros(n * d * d), jac=True, method="L-BFGS-B",  # [n*d*d]
                   options={"maxiter": max_iter, **LBFGS})
    A = A0 + W @ (torch.from_numpy(res.x.reshape(n, d, d)) * D) @ V.mT  # [n, d, d]
    ok = torch.isfinite(A).all((-2, -1))
    A = torch.where(ok[:, None, None], A, A0)
    ok = (torch.linalg.cond(A) < 1e10) & (per_stack(A) < f0)  # [n]: each stack keeps the better of the two
    return torch.where(ok[:, None, None], A, A0)


# ---------------------------------------------------------------------------------------------
# RoPE commutant H(r): one complex scalar per frequency pair


def complex_pairs(X: Tensor, layout: str, r: int) -> Tensor:
    """Rows [..., N, d] -> complex [..., N, r/2]: pair j of the RoPE layout as x_i1 + i x_i2."""
    i1, i2 = rope_pairs(r, layout)
    return torch.complex(X[..., i1].to(F64), X[..., i2].to(F64))  # [..., N, r/2]


def fit_rope(P_A: Tensor, P_B: Tensor, Q_A: Tensor, Q_B: Tensor, layout: str, r: int) -> Tensor:
    """z [n, r/2] complex: the H(r) part of the Q/K map, q_j <- z_j q_j and k_j <- k_j / conj(z_j).

    Per pair (docs/MATH.md section 4.1), with c_q = <q_A, q_B>, c_k = <k_A, k_B> (Hermitian, conjugating A):
    the cross terms are 2 Re(e^{i phi} (r c_q + c_k / r)), so phi* = -arg(r c_q + c_k / r) in closed
    form, and r minimises f(r) = r^2 ||q_B||^2 + ||k_B||^2 / r^2 - 2 |r c_q + c_k / r|, found for all pairs
    at once: a coarse grid on t = log r (f need not be unimodal), golden-section search within one grid
    step of the best point, and bisection on f'(t) to polish t to machine precision.
    """
    qa, qb = complex_pairs(P_A, layout, r), complex_pairs(P_B, layout, r)  # [n, N, r/2]
    ka, kb = complex_pairs(Q_A, layout, r), complex_pairs(Q_B, layout, r)  # [n, M, r/2]
    cq = (qa.conj() * qb).sum(-2).numpy().reshape(-1)  # [n*r/2]
    ck = (ka.conj() * kb).sum(-2).numpy().reshape(-1)
    a = qb.abs().square().sum(-2).numpy().reshape(-1)
    b = kb.abs().square().sum(-2).numpy().reshape(-1)

    def f(t: np.ndarray) -> np.ndarray:  # t broadcasts against the pairs
        s = np.exp(t)
        return s * s * a + b / (s * s) - 2 * np.abs(s * cq + ck / s)

    def df(t: np.ndarray) -> np.ndarray:
        s = np.exp(t)
        w, dw = s * cq + ck / s, s * cq - ck / s
        return 2 * a * s * s - 2 * b / (s * s) - 2 * (np.conj(w) * dw).real / np.maximum(np.abs(w), 1e-300)

    grid = np.linspace(-6.0, 6.0, 49)  # step 0.25
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t0 = grid[np.argmin(f(grid[:, None]), 0)]  # [n*r/2]
        lo, hi = t0 - 0.25, t0 + 0.25
        invphi = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - invphi * (hi - lo), lo + invphi * (hi - lo)
        f1, f2 = f(x1), f(x2)
        for _ in range(45):  # golden section: the bracket shrinks to 0.5 * 0.618^45 ~ 2e-10
            left = f1 <= f2  # the minimum lies in [lo, x2]
            hi, lo = np.where(left, x2, hi), np.where(left, lo, x1)
            x1, x2 = np.where(left, hi - invphi * (hi - lo), x2), np.where(left, x1, lo + invphi * (hi - lo))
            f1, f2 = f(x1), f(x2)
        t = (lo + hi) / 2
        t = np.where(f(t) <= f(t0), t, t0)
        # f is flat at its minimum, so comparing values pins t only to ~1e-8: polish on f'(t) = 0
        lo, hi = t - 1e-4, t + 1e-4
        polish = (df(lo) < 0) & (df(hi) > 0)
        for _ in range(60):
            mid = (lo + hi) / 2
            up = df(mid) > 0
            hi, lo = np.where(up, mid, hi), np.where(up, lo, mid)
        t = np.where(polish, (lo + hi) / 2, t)
    s = np.exp(t)
    w = s * cq + ck / s
    z = np.where(np.abs(w) > 0, s * np.exp(-1j * np.angle(w)), s + 0j)
    dead = (a + b == 0) | (np.abs(cq) + np.abs(ck) == 0)  # a dead pair: any z is optimal, keep the identity
    z = np.where(dead, 1.0 + 0j, z)
    return torch.from_numpy(z.reshape(qa.shape[0], -1))  # [n, r/2]


def rope_scalars(A: Tensor, layout: str, r: int) -> Tensor:
    """The complex scalars z [..., r/2] of a map in H(r) (inverse of symmetry.rope_commutant)."""
    i1, i2 = rope_pairs(r, layout)
    return torch.complex(A[..., i1, i1], A[..., i1, i2])  # [..., r/2]


# ---------------------------------------------------------------------------------------------
# Per-neuron scales (ReLU: s > 0; SwiGLU up branch: s != 0), docs/MATH.md section 2


def fit_scale(a_in: Tensor, b_in: Tensor, a_out: Tensor, b_out: Tensor, positive: bool) -> Tensor:
    """s [m] minimising ||a_in_j - s_j b_in_j||^2 + ||a_out_j - b_out_j / s_j||^2 per neuron j.

    Inputs are [m, k] (neuron j's incoming weights, then its outgoing ones). With alpha = ||b_in||^2,
    beta = <a_in, b_in>, gamma = ||b_out||^2, delta = <a_out, b_out>, a stationary point solves
    alpha s^4 - beta s^3 + delta s - gamma = 0; the best real root (positive for ReLU) wins.
    """
    al = b_in.to(F64).square().sum(-1).numpy()
    be = (a_in.to(F64) * b_in.to(F64)).sum(-1).numpy()
    ga = b_out.to(F64).square().sum(-1).numpy()
    de = (a_out.to(F64) * b_out.to(F64)).sum(-1).numpy()
    return torch.from_numpy(_quartic_scale(al, be, ga, de, positive)[0])  # [m]


def _quartic_scale(al: np.ndarray, be: np.ndarray, ga: np.ndarray, de: np.ndarray,
                   positive: bool) -> tuple[np.ndarray, np.ndarray]:
    """s minimising al s^2 - 2 be s + ga / s^2 - 2 de / s elementwise (1 where no real root qualifies), and
    that value: the best real nonzero root (positive if asked) of al s^4 - be s^3 + de s - ga = 0."""
    s, f = np.ones(len(al)), al - 2 * be + ga - 2 * de
    for j in range(len(al)):
        roots = np.roots([al[j], -be[j], 0.0, de[j], -ga[j]]) if al[j] > 0 else np.array([])
        real = [x.real for x in roots if abs(x.imag) < 1e-9 * max(1.0, abs(x)) and x.real != 0]
        if positive:
            real = [x for x in real if x > 0]
        if real:
            cost = [al[j] * x * x - 2 * be[j] * x + ga[j] / (x * x) - 2 * de[j] / x for x in real]
            s[j], f[j] = real[int(np.argmin(cost))], min(cost)
    return s, f


# ---------------------------------------------------------------------------------------------
# The QK-norm group: RoPE-commutant maps that are scaled signed permutations (docs/MATH.md section 1)


def fit_qk_norm(P_A: Tensor, P_B: Tensor, Q_A: Tensor, Q_B: Tensor, layout: str, r: int,
                gains: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """z [n, r/2] complex in the QK-norm group: z_cj = s_cj m_j i^(t_j), a sign s per stack c and pair, a
    modulus m_j > 0 and a quarter turn t_j in {0, 1} per pair shared by the n stacks (docs/MATH.md section 4.1).

    Without `gains` (activation matching) the rows are the normalised q and k, moved in full: q_j <- z_j q_j,
    k_j <- k_j / conj(z_j). Per turn t, with c_q = <q_A, q_B>, c_k = <k_A, k_B> per stack (Hermitian,
    conjugating A): the signs s_c = sign(m Re(i^t c_q) + Re(i^t c_k) / m), started at m = 1, and m from the
    quartic of fit_scale given the signs, alternated three times. With gains (g_q^A, g_q^B, g_k^A, g_k^B
    [d], weight matching) the rows (W_Q, W_K) move by the sign and the turn alone, so s_c = sign(Re(i^t (c_q
    + c_k))) in closed form, and the modulus acts on the gains: g_q^B's pair (swapped by a quarter turn)
    times m, g_k^B's over m, m again from the quartic. The turn with the lower total cost wins.
    """
    qa, qb = complex_pairs(P_A, layout, r), complex_pairs(P_B, layout, r)  # [n, N, r/2]
    ka, kb = complex_pairs(Q_A, layout, r), complex_pairs(Q_B, layout, r)  # [n, M, r/2]
    cq, ck = (qa.conj() * qb).sum(-2).numpy(), (ka.conj() * kb).sum(-2).numpy()  # [n, r/2]
    nq, nk = qb.abs().square().sum(-2).numpy().sum(0), kb.abs().square().sum(-2).numpy().sum(0)  # [r/2]
    if gains is not None:
        i1, i2 = (i.numpy() for i in rope_pairs(r, layout))
        ga_q, gb_q, ga_k, gb_k = (g.detach().to("cpu", F64).numpy() for g in gains)  # [d] each
    best_cost, best = None, None
    for t in (0, 1):
        bq, bk = ((1j ** t) * cq).real, ((1j ** t) * ck).real  # [n, r/2]
        if gains is None:
            m = np.ones(r // 2)
            for _ in range(3):
                s = np.where(m * bq + bk / m < 0, -1.0, 1.0)  # [n, r/2]
                m, cost = _quartic_scale(nq, (s * bq).sum(0), nk, (s * bk).sum(0), positive=True)
        else:
            s = np.where(bq + bk < 0, -1.0, 1.0)
            j1, j2 = (i1, i2) if t == 0 else (i2, i1)  # B's gains of pair j, swapped by a quarter turn
            pa_q, pb_q = np.stack([ga_q[i1], ga_q[i2]], 1), np.stack([gb_q[j1], gb_q[j2]], 1)  # [r/2, 2]
            pa_k, pb_k = np.stack([ga_k[i1], ga_k[i2]], 1), np.stack([gb_k[j1], gb_k[j2]], 1)
            m, cost = _quartic_scale((pb_q ** 2).sum(1), (pa_q * pb_q).sum(1), (pb_k ** 2).sum(1),
                                     (pa_k * pb_k).sum(1), positive=True)
            cost = cost - 2 * np.abs(bq + bk).sum(0)
        z = s * m * (1j ** t)  # [n, r/2]
        if best is None:
            best_cost, best = cost, z
        else:
            best = np.where(cost < best_cost, z, best)
            best_cost = np.minimum(cost, best_cost)
    z = torch.from_numpy(best)  # [n, r/2]
    return torch.complex(z.real.contiguous(), z.imag.contiguous())  # exact zeros: a quarter turn is 1j * real
