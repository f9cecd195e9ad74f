"""Learned matching: optimise the transform on the task loss of the interpolated model
(docs/MATH.md section 4.4; "Git Re-Basin", ICLR 2023, straight-through estimator).

    min over latents  E_lam  L((1 - lam) theta_A + lam g(theta_B))   (lam: `Settings.lambdas`)

with the model weights frozen and Adam on the latents only, initialised at the weight-matching
solution. Each class has its own latent:

    heads, residual_perm        Z [n, n]; forward the permutation Hungarian(Z) (GQA-aware for heads),
                                backward the straight-through gradient dL/dZ = dL/dP
    mlp                         Z [m, k] on a candidate graph: row i scores only its k candidate
                                partners cand[i] (the weight-matching partner and the k - 1 next best
                                by the weight-matching cost); forward the maximum-weight perfect
                                matching on that graph (always a real permutation: the start is one),
                                backward dL/dP at the candidate entries. O(m k), not O(m^2), per layer
    residual_orth               Omega = polar(Omega_0 (I + E)); Newton-Schulz iterations in the forward
                                pass (torch's SVD gradient is undefined at repeated singular values,
                                which is exactly the start), the exact SVD polar factor at the end
    qk, vo (GL)                 A = A_0 (I + E)
    qk (RoPE)                   z_j = z_j0 exp(e_r + i e_phi) per pair, times A_0 (I + E) on the
                                unrotated dims of a partial RoPE
    qk (QK-norm)                z_cj = z_cj0 exp(e_r), one e_r per pair for every KV group: the gain
                                scales are learned, the quarter turns and signs stay the start's
    mlp_scale                   s = s_0 exp(e)

The loss needs gradients through the group action, so `act_ste` runs engine/symmetry.act, the one
interpreter of a spec, with each permutation a gather (`PermuteSTE`) whose backward also hands its
latent the dense straight-through gradient dL/dP, a matmul, so no permutation matrix ever multiplies a
weight; the continuous maps are differentiable functions of their latents. For hard elements `act_ste`
equals apply (tests/engine/test_align.py). The forward pass is torch.func.functional_call on the
reference-family twin (common.twin). The element returned is always the hard, exact one: the best
seen on a fixed validation batch (midpoint loss), the weight-matching start included.

Cost, so that a 1.1B-parameter pair fits 24 GiB (docs/DESIGN.md section 5, docs/SCALE.md): the weights
stay in their stored dtype, latents and products in the compute dtype (float32 at least: bfloat16 weights
are widened a block at a time; float64 models stay float64 for exactness tests); MLP latents on
candidate graphs (a dense 3072 x 3072 latent per layer, with its gradient and Adam moments, was 14x
one model at GPT-2-small); no whole moved or interpolated model: the forward pass runs a stage at a
time (`stages`: the embedding, each block, the readout), each block's moved copies and their mix
formed inside it under activation checkpointing (`Midpoint`, `backward_loss`) and formed again in the
backward pass (from SMALL_MODEL parameters up; a smaller model keeps every block's graph instead, which
saves the recomputation and changes no bit: `blocks_checkpointed`), and the validation checks and the
dual identity mix each block when they reach it (`path_losses`); the solves (heads and residual: scipy's Hungarian; MLP: scipy's sparse matching on the candidate graph)
re-run every RESOLVE_EVERY steps and at each validation check, and only for layers whose permutation
a one-pass check cannot certify; the readout over micro-batches whose logits stay under LOGIT_BYTES, in
the logits' dtype. Latent, candidate, Adam-state and peak resident bytes go into the record, and a
time budget can end the run.

Convergence (`Settings`): Adam's step sizes follow a linear warm-up and a cosine decay over the step
budget; lam is drawn from a narrow band around 0.5 (the default), from U(0, 1), or fixed at 0.5; the
run stops early when the validation midpoint loss has not improved for `patience` checks. The record
keeps the curve: training loss, step size and lam per step, the validation midpoint loss per check,
and how many units each re-solve moved (flips).
"""

from __future__ import annotations

import math
import random
import resource
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from engine import distributed
from engine.align import resume
from engine.align.activation import ACT_BATCH, activation_match
from engine.align.batches import train_batches, val_batch
from engine.align.context import F64, AlignContext, AlignOutput, tick
from engine.align.forward import check_twin, task_loss, twin
from engine.align.solvers import (
    assignment,
    gqa_assignment,
    perm_matrix,
    procrustes,
    residual_perm_matrix,
    residual_perm_of,
    rope_scalars,
)
from engine.align.start import SUFFIX, is_file_start, read_element
from engine.align.weight import SMALL_MODEL, weight_match
from engine.align.weight import scratch_bytes as weight_scratch
from engine.cancel import check
from engine.classes import RESIDUAL
from engine.data import IGNORE_INDEX
from engine.errors import LMCError
from engine.evaluate import seq_len
from engine.models import Model
from engine.models.base import Arch, Params
from engine.progress import Progress, relabel
from engine.results import MAX_STEPS
from engine.spec import Spec
from engine.symmetry import (
    GroupElement,
    LayerElement,
    act,
    compose,
    element_maps,
    identity,
    invert,
    qk_norm_part,
    rope_commutant,
)

DEFAULT_STEPS = 400  # the step cap of `learned` and `dual` when a run asks for 0 steps (and gives no time budget)
# ViT runs are cheap (a step takes 0.1-0.3 s on the zoo pairs) and keep improving past 400 steps:
# doubling the budget halved the zoo ViTs' dual barriers (bench/RESULTS.md, "Validating on the path")
TASK_STEPS = {"lm": DEFAULT_STEPS, "vit": 2 * DEFAULT_STEPS}
LR = {"perm": 0.05, "map": 1e-2}  # peak Adam step sizes: permutation latents, continuous latents
WARMUP = 0.1  # fraction of the step budget with a linearly rising step size; a cosine decay follows
LAMBDAS = {"narrow": (0.4, 0.6), "uniform": (0.0, 1.0), "fixed": (0.5, 0.5), "adaptive": (0.0, 1.0)}  # lam modes
ADAPTIVE_BAND = 0.1  # `adaptive`: half-width of the band around the worst validation lam
VAL_LAMBDAS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where each validation check measures the path
MID = VAL_LAMBDAS.index(0.5)
# lam sampling per task when a run names none: LM paths rise in one bump at the middle, which U(0.4,
# 0.6) removes fastest; ViT paths fitted there grow shoulders at lam 0.1-0.3 and 0.7-0.9, which
# `adaptive` follows (bench/RESULTS.md, "Validating on the path"). So do LM paths without a residual map
# (default_lambdas).
DEFAULT_LAMBDAS = {"lm": "narrow", "vit": "adaptive"}
STARTS = ("weight", "activation")  # the aligner whose element the latents start from, or an element file
CANDIDATES = 16  # the most candidate partners per MLP neuron a default gives (the latent is [m, k] per layer)
# MLP candidates per task when a run names none. On the LMs learning the MLP permutation costs barrier:
# the hard permutation flips about a tenth of the units every re-solve to the last step, and the other
# classes chase it; keeping weight matching's (k = 1) gave the lowest barrier on the learned-PE pair at
# every budget measured (400 steps: k = 1, 4, 8, 16, 512 -> 0.185, 0.187, 0.195, 0.199, 0.252 nats/byte;
# 1,600 steps of 16: 0.143 against 0.162, below k = 16 with four times the batch, 0.147). bench/RESULTS.md,
# "Learning the MLP permutation"
DEFAULT_CANDIDATES = {"lm": 1, "vit": CANDIDATES}
CANDIDATE_ROWS = 1024  # rows of the candidate scores computed at once: O(rows x m) scratch
VAL_ITEMS = {"lm": 4096, "vit": 512}  # validation tokens / images for picking the best element
EVALS = 20  # validation checks per run (every steps // EVALS steps, or every EVALS-th of a time budget)
PATIENCE = 8  # checks in a row without a gain of MIN_IMPROVEMENT that end a run (40% of its budget)
MIN_IMPROVEMENT = 0.01  # fall of the validation midpoint excess over the chord, relative to it, that counts as progress
# Hard permutations are re-solved from the latents every RESOLVE_EVERY steps and at every
# validation check (a layer whose permutation `still_optimal` certifies skips its Hungarian); in
# between, the forward keeps the last ones while Adam moves the latents. Stale permutations let
# the latents overshoot: on the zoo's learned-PE LM pair (100 steps, one weight-matching start) the
# best validation midpoint loss was 1.803 re-solving every step, 1.799 every 2, 1.800 every 5 (on
# a worse trajectory) and 1.854 every 10.
RESOLVE_EVERY = 2
LOGIT_BYTES = 128 * 2**20  # logits of one forward pass: 10 windows of 128 at GPT-2's 50,257 tokens


@dataclass(frozen=True)
class Settings:
    """How learned and dual matching optimise (the record keeps them).

    lr_perm, lr_map: peak Adam step sizes of the permutation and continuous latents; warmup: the
    fraction of the steps over which they rise linearly, a cosine decay to the last step follows;
    lambdas: a key of LAMBDAS (None: default_lambdas of the task and classes); patience: validation checks in a
    row that do not lower the validation barrier by min_improvement of itself (from the last check
    that did) before the run stops, once the step size has decayed to half its peak (None: never);
    eval_every: steps between validation checks (None: steps // EVALS);
    candidates: partners per MLP neuron in its latent (None: DEFAULT_CANDIDATES of the task; 1 keeps the
    start's MLP permutation);
    keep_heads: keep the start's head permutation (the other classes are learned around it);
    start: a key of STARTS, the element the latents start from (weight matching, or activation
    matching on one training batch), or the path of an element file an earlier run saved
    (engine.align.start: `align --save-element`);
    batch: sequences / images per step (None: the context's, 16); a larger one costs more per step and
    lowers the plateau a long run reaches (bench/RESULTS.md, "To convergence").
    """

    lr_perm: float = LR["perm"]
    lr_map: float = LR["map"]
    warmup: float = WARMUP
    lambdas: str | None = None
    patience: int | None = PATIENCE
    min_improvement: float = MIN_IMPROVEMENT
    eval_every: int | None = None
    candidates: int | None = None
    keep_heads: bool = False
    start: str = "weight"
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.lambdas is not None and self.lambdas not in LAMBDAS:
            raise LMCError(f"Lambda sampling {self.lambdas!r} is not available; choose one of {', '.join(LAMBDAS)}.")
        if self.start not in STARTS and not is_file_start(self.start):
            raise LMCError(f"Learned matching start {self.start!r} is not available; choose one of {', '.join(STARTS)} "
                           f"or an element file ({SUFFIX}).")
        for name in ("lr_perm", "lr_map"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise LMCError(f"Learned matching: {name} must be a finite step size of at least 0, not {v!r}.")
        if not (isinstance(self.min_improvement, (int, float)) and 0 <= self.min_improvement < 1):
            raise LMCError(f"Learned matching: min_improvement must be a fraction in [0, 1), not {self.min_improvement!r}.")
        if not (isinstance(self.warmup, (int, float)) and 0 <= self.warmup < 1):
            raise LMCError(f"Learned matching: warmup must be a fraction in [0, 1), not {self.warmup!r}.")
        for name in ("patience", "eval_every", "batch"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise LMCError(f"Learned matching: {name} must be a positive integer or None, not {v!r}.")
        if self.candidates is not None and not (isinstance(self.candidates, int) and self.candidates >= 1):
            raise LMCError(f"Learned matching: candidates must be a positive integer, not {self.candidates!r}.")
        if not isinstance(self.keep_heads, bool):
            raise LMCError(f"Learned matching: keep_heads must be true or false, not {self.keep_heads!r}.")


def step_budget(steps: int, time_budget_s: float | None, default: int) -> int:
    """The step cap of a run: the one asked for; none (MAX_STEPS) when only a time budget is given, so
    that the time budget ends the run, not the step default; else the method's default (0 for a method
    without steps, whatever the budget)."""
    if steps or not default:
        return steps
    return MAX_STEPS if time_budget_s is not None else default


def budget_fraction(step: int, steps: int, seconds: float, time_budget_s: float | None) -> float:
    """How much of its budget a run has used after `step` steps and `seconds` of optimisation: the
    larger of the step and the time fractions (the time one only under a time budget)."""
    p = step / steps
    return max(p, seconds / time_budget_s) if time_budget_s is not None else p


def fraction_factor(p: float, warmup: float) -> float:
    """The step size at budget fraction p as a fraction of the peak: linear warm-up over the first
    `warmup` of the budget, then a cosine decay to 0 at its end (a run under a time budget follows
    the clock, so its schedule fits the time it has)."""
    p = min(max(p, 0.0), 1.0)
    if p <= warmup:
        return p / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (p - warmup) / (1.0 - warmup)))


def lr_factor(step: int, steps: int, warmup: float) -> float:
    """The step size of step `step` (1-based) of `steps` as a fraction of the peak: linear warm-up over
    the first round(warmup * steps) steps (at least one), then a cosine decay that reaches 0 one step
    after the last."""
    w = max(1, round(warmup * steps))
    if step <= w:
        return step / w
    return 0.5 * (1.0 + math.cos(math.pi * (step - w) / (steps - w + 1)))


def default_lambdas(task: str, kinds: Iterable[str]) -> str:
    """The lam sampling of a run that names none: DEFAULT_LAMBDAS of the task, but `adaptive` for an LM
    aligned without a residual map (the sinusoidal pair by default). Its blocks then meet in unrelated
    residual coordinates and a path fitted at the middle grows shoulders near its ends: on lm-sinusoidal, dual
    matching's test path peaked at lam 0.2 (1.463 nats/byte, against 0.609 at the middle), between two
    validation points; sampled adaptively its barrier is 0.860 against 1.339 at 1,600 steps
    (bench/RESULTS.md, "The sinusoidal LM pair: lambda where the path rises")."""
    if task == "lm" and not set(RESIDUAL) & set(kinds):
        return "adaptive"
    return DEFAULT_LAMBDAS[task]


def sample_lambda(rng: random.Random, mode: str, worst: float = 0.5) -> float:
    """One interpolation weight for a training step: U(LAMBDAS[mode]), `fixed` always 0.5; `adaptive`
    draws from U(0, 1) half the time and otherwise within ADAPTIVE_BAND of `worst`, the lam of the
    largest validation excess at the last check."""
    if mode == "adaptive":
        if rng.random() < 0.5:
            return rng.uniform(0.0, 1.0)
        return min(max(worst + rng.uniform(-ADAPTIVE_BAND, ADAPTIVE_BAND), 0.0), 1.0)
    lo, hi = LAMBDAS[mode]
    return lo if lo == hi else rng.uniform(lo, hi)


# ---------------------------------------------------------------------------------------------
# Sparse permutation latents: a candidate graph per MLP layer


def dense_latent(values: Tensor, cand: Tensor) -> Tensor:
    """The [n, n] matrix with values[i, c] at (i, cand[i, c]) and 0 elsewhere (differentiable in values);
    for tests and small models only: the point of the candidate graph is never to build it."""
    n = cand.shape[0]
    return torch.zeros(n, n, dtype=values.dtype, device=values.device).scatter(1, cand.to(values.device), values)


def sparse_assignment(values: Tensor, cand: Tensor) -> Tensor:
    """perm maximising sum_i Z[i, perm[i]] over the perfect matchings of the candidate graph (row i
    may take only cand[i]); Z[i, cand[i, c]] = values[i, c]. Raises if the graph has no perfect
    matching (a graph built by `candidates` always has one: its first column is a permutation).

    The weights are shifted to be at least 1: every perfect matching gains the same n x shift, so the
    argmax is unchanged, and scipy's sparse solver drops zero weights as absent edges.
    """
    n, k = cand.shape
    v = values.detach().to("cpu", F64).numpy()
    w = v - v.min() + 1.0  # [n, k]
    rows = np.repeat(np.arange(n), k)
    graph = csr_matrix((w.ravel(), (rows, cand.cpu().numpy().ravel())), shape=(n, n))
    try:
        r, c = min_weight_full_bipartite_matching(graph, maximize=True)
    except ValueError:
        raise LMCError("The candidate graph of a permutation latent has no perfect matching; its first "
                       "candidate of every row must form a permutation.") from None
    perm = torch.empty(n, dtype=torch.long)
    perm[torch.as_tensor(r, dtype=torch.long)] = torch.as_tensor(c, dtype=torch.long)
    return perm


@torch.no_grad()
def mlp_candidates(spec: Spec, ref: Params, other: Params, g_other: GroupElement, k: int,
                   g_ref: GroupElement | None = None) -> list[Tensor]:
    """cand [m, k] per layer for the latent of `other`'s MLP permutation, started at g_other.

    Row i holds g_other's partner of the reference's neuron i first, then the k - 1 other neurons of
    `other` with the largest weight-matching score <(g_ref ref)_i, (g_other other)_j>: the sum over
    every weight the neuron axis indexes, both sides moved by their whole element (g_ref None: the
    reference as it is). Scores are computed CANDIDATE_ROWS rows at a time: O(CANDIDATE_ROWS m) scratch.
    """
    mats = element_maps(g_other)
    mats_ref = element_maps(g_ref) if g_ref is not None else None
    out = []
    for layer, el in enumerate(g_other.layers):
        feats_r, feats_o = [], []
        for key, axis, a in spec.axes_of(f"blocks.{layer}.mlp"):
            if a.role != "perm":
                continue
            ps = spec.params[key]
            r, o = (compute(p[key].detach()) for p in (ref, other))  # the weights' dtype, float32 at least
            r = act(ps, mats_ref, r) if mats_ref else r
            o = act(ps, mats, o)
            feats_r.append(r.movedim(axis, 0).reshape(r.shape[axis], -1))  # [m, rest]
            feats_o.append(o.movedim(axis, 0).reshape(o.shape[axis], -1))  # [m, rest]
        m = feats_r[0].shape[0]
        kk = min(k, m)
        perm0 = el.mlp_perm.to(feats_r[0].device)
        cand = torch.empty(m, kk, dtype=torch.long)
        for i0 in range(0, m, CANDIDATE_ROWS):
            i1 = min(m, i0 + CANDIDATE_ROWS)
            S = sum(fr[i0:i1] @ fo.mT for fr, fo in zip(feats_r, feats_o))  # [rows, m], moved index
            S[torch.arange(i1 - i0), torch.arange(i0, i1)] = torch.inf  # g_other's own partner comes first
            cand[i0:i1] = perm0[S.topk(kk, dim=1).indices].cpu()  # moved index j is the neuron perm0[j]
        out.append(cand)
        del feats_r, feats_o
    return out


# ---------------------------------------------------------------------------------------------
# The differentiable action


class PermuteSTE(torch.autograd.Function):
    """x.index_select(axis, perm) in the forward pass; the backward also gives perm's latent Z the
    straight-through gradient dL/dZ = dL/dP (the permutation's value, Z's gradient).

    With P[i, perm[i]] = 1 the gather is x <- P x along `axis` (new i = old perm[i]), so
    dL/dP[i, j] = <dL/dnew_i, old_j> summed over every other axis: one matmul in x's dtype. With a
    candidate graph cand [n, k] the latent is Z [n, k] and only the entries (i, cand[i, c]) are
    formed, one gathered row product per column c: O(n k) memory, never [n, n].
    """

    @staticmethod
    def forward(ctx, x: Tensor, Z: Tensor, perm: Tensor, axis: int, cand: Tensor | None) -> Tensor:
        perm = perm.to(x.device)
        cand = cand.to(x.device) if cand is not None else None
        ctx.save_for_backward(x, perm, cand)
        ctx.axis, ctx.z_to = axis, (Z.device, Z.dtype)
        return x.index_select(axis, perm)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        x, perm, cand = ctx.saved_tensors
        axis = ctx.axis
        g_x = g_Z = None
        if ctx.needs_input_grad[0]:
            g_x = grad.index_select(axis, torch.argsort(perm))  # scatter back: old perm[i] <- new i
        if ctx.needs_input_grad[1]:
            n = x.shape[axis]
            G = grad.movedim(axis, 0).reshape(n, -1)  # [n, rest]
            X = x.movedim(axis, 0).reshape(n, -1)  # [n, rest]
            if cand is None:
                g_Z = (G @ X.mT).to(*ctx.z_to)  # [n, n]
            else:
                g_Z = torch.stack([(G * X.index_select(0, cand[:, c])).sum(1) for c in range(cand.shape[1])],
                                  1).to(*ctx.z_to)  # [n, k]
        return g_x, g_Z, None, None, None


def permute(x: Tensor, axis: int, entry: tuple[Tensor, Tensor, Tensor | None]) -> Tensor:
    """x with index i of `axis` taking old index perm[i], entry = (perm, Z, cand): symmetry.act's
    permutation step for a latent, with the straight-through gradient to Z (dense [n, n], or [n, k] on
    the candidate graph cand; None: dense)."""
    perm, Z, cand = entry
    return PermuteSTE.apply(x, Z, perm, axis, cand)


def act_ste(spec: Spec, maps: dict[str, dict], params: Params) -> Params:
    """g.theta by engine/symmetry.act for the parameters in `params`, differentiable in the latents
    behind `maps`.

    maps[group] as Transform.maps gives it: "perm" / "perm_kv" (and "index" for a residual
    permutation, which moves writers, readers and norms alike) are (hard index, latent of P,
    candidate graph or None) triples, applied by `permute`; "right" and "right_inv_t" [.., s, s];
    "scale" [m]. Groups absent act as the identity. Every product runs in the weights' dtype.

    With gradients on, each parameter's chain of actions runs under activation checkpointing: the
    intermediate copies (a weight permuted along one axis, then another, then rotated) are recomputed
    in the backward pass instead of kept, so a side's action holds one moved copy of the model, not
    one per action in its chains.
    """
    out: Params = {}
    for key, x in params.items():
        ps = spec.params[key]
        if torch.is_grad_enabled() and not ps.invariant:
            out[key] = checkpoint(act, ps, maps, x, permute, use_reentrant=False)
        else:
            out[key] = act(ps, maps, x, permute)
    return out


def newton_schulz_polar(M: Tensor, iters: int = 12) -> Tensor:
    """The orthogonal polar factor of M, differentiable everywhere (X <- 1.5 X - 0.5 X X^T X)."""
    X = M / torch.linalg.matrix_norm(M.detach(), 2)  # singular values in (0, 1]: the iteration converges
    for _ in range(iters):
        X = 1.5 * X - 0.5 * X @ X.mT @ X
    return X


def rope_basis(layout: str, r: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """rope_commutant is affine in (Re z, Im z): A(z) = A(0) + sum_j Re z_j C_j + Im z_j S_j.

    Built from symmetry.rope_commutant itself, so the convention is the one apply checks; the
    affine form keeps A differentiable in z (rope_commutant writes into a tensor in place).
    """
    n = r // 2
    zero = rope_commutant(torch.zeros(n, dtype=torch.complex128), layout, d)  # [d, d]
    unit = torch.eye(n, dtype=F64)
    C = rope_commutant(torch.complex(unit, torch.zeros_like(unit)), layout, d) - zero  # [r/2, d, d]
    S = rope_commutant(torch.complex(torch.zeros_like(unit), unit), layout, d) - zero  # [r/2, d, d]
    return zero, C, S


def still_optimal(Z: Tensor, perm: Tensor, cand: Tensor | None = None) -> bool:
    """Whether perm maximises sum_i Z[i, perm[i]] because every row already holds its row maximum.

    The sum of row maxima bounds every assignment, so such a perm is the Hungarian's answer (up to
    ties) at the cost of one pass over Z; early in an optimisation started from a permutation
    matrix it almost always holds. A GQA head permutation that holds it is also GQA-optimal. On a
    candidate graph (Z [n, k] at the columns cand [n, k], perm[i] among cand[i]) rows are compared
    over their candidates, and the bound is the same.
    """
    if cand is None:
        held = Z.gather(1, perm[:, None].to(Z.device))  # [n, 1]
    else:
        held = (Z * (cand == perm[:, None]).to(Z.device, Z.dtype)).sum(1, keepdim=True)  # [n, 1]
    return bool((held >= Z.max(1, keepdim=True).values).all())


# ---------------------------------------------------------------------------------------------
# Latents of one side's transform


class Transform(nn.Module):
    """Latents of one group element started at `g0`, in `dtype`: `maps()` for the loss, `solve()`
    to re-run the Hungarian, `element()` for the hard result."""

    def __init__(self, arch: Arch, spec: Spec, kinds: frozenset[str], g0: GroupElement, dtype: torch.dtype = F64,
                 mlp_candidates: list[Tensor] | None = None, keep_heads: bool = False):
        """mlp_candidates: cand [m, k] per layer (`candidates`), the partners each MLP neuron's latent
        scores, with g0's partner among them; None: every neuron (k = m, a dense latent in sparse form).
        keep_heads: g0's head permutation stays (its matrices are constants, not latents, and never re-solved)."""
        super().__init__()
        self.arch, self.spec, self.kinds, self.g0, self.dtype = arch, spec, kinds, g0, dtype
        L, d, hkv = arch.n_layers, arch.d_head, arch.n_kv_heads
        self.rep = arch.n_heads // hkv
        self.rope = spec.groups["blocks.0.qk"].structure in ("rope_commutant", "rope_qk_norm")
        self.qk_norm = spec.groups["blocks.0.qk"].structure == "rope_qk_norm"

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype))

        def latents(perms: list[Tensor]) -> nn.ParameterList:
            # one Parameter per layer: a gradient through a slice of one stacked [L, m, m] tensor
            # would allocate the whole stack per layer
            return nn.ParameterList(nn.Parameter(perm_matrix(p, dtype)) for p in perms)  # L x [n, n]

        # the hard permutations the forward pass uses; Hungarian of a permutation matrix is itself
        self.head_perms = [el.head_perm for el in g0.layers]
        self.mlp_perms = [el.mlp_perm for el in g0.layers]
        self.keep_heads = keep_heads
        if "heads" in kinds:
            self.Z_heads = [perm_matrix(p, dtype) for p in self.head_perms] if keep_heads else latents(self.head_perms)
        if "mlp" in kinds:
            if mlp_candidates is None:
                m = arch.d_mlp
                mlp_candidates = [torch.arange(m).expand(m, m).clone() for _ in range(L)]  # L x [m, m]
            for cand, perm in zip(mlp_candidates, self.mlp_perms):
                if not bool((cand == perm[:, None]).any(1).all()):
                    raise LMCError("MLP candidates must contain the starting partner of every neuron.")
            self.mlp_cand = [c.to(torch.long) for c in mlp_candidates]  # L x [m, k]
            self.Z_mlp = nn.ParameterList(nn.Parameter((c == p[:, None]).to(dtype))
                                          for c, p in zip(self.mlp_cand, self.mlp_perms))  # L x [m, k]
        if "mlp_scale" in kinds:
            self.e_scale = zeros(L, arch.d_mlp)
        if "qk" in kinds:
            if not self.rope or arch.rotary_dim < d:  # GL(d), or the GL(d - r) block of a partial RoPE
                self.E_qk = zeros(L, hkv, d, d)
            if self.rope:  # (log-modulus, phase) per pair; QK-norm: the log-modulus alone, shared by the KV groups
                self.e_rope = zeros(L, 1, arch.rotary_dim // 2, 1) if self.qk_norm else zeros(
                    L, hkv, arch.rotary_dim // 2, 2)
                self.basis = rope_basis(arch.rope_layout, arch.rotary_dim, d)
        if "vo" in kinds:
            self.E_vo = zeros(L, hkv, d, d)
        if "residual_perm" in kinds:
            self.Z_res = nn.Parameter(g0.residual.to(dtype).clone())  # [D, D], Omega's layout
            perm = residual_perm_of(g0.residual)
            self.res_perm = perm if perm is not None else assignment(self.Z_res.detach().T)  # new j = old res_perm[j]
        if "residual_orth" in kinds:
            self.E_res = zeros(arch.d_model, arch.d_model)

    def param_groups(self, lr_perm: float = LR["perm"], lr_map: float = LR["map"]) -> list[dict]:
        """Adam's groups: permutation latents and continuous latents, each with its peak step size."""
        perm = [p for n, p in self.named_parameters() if n.startswith("Z_")]
        cont = [p for n, p in self.named_parameters() if not n.startswith("Z_")]
        return [g for g in ({"params": perm, "lr": lr_perm, "peak": lr_perm},
                            {"params": cont, "lr": lr_map, "peak": lr_map}) if g["params"]]

    @torch.no_grad()
    def solve(self) -> dict[str, int]:
        """Re-solve the hard permutations from the latents: one Hungarian (a sparse matching on the MLP
        candidate graphs) per layer and class, unless `still_optimal` certifies the current one.
        Returns how many ran, how many were kept, and the flips: units whose partner changed, per class."""
        count = {"hungarian": 0, "kept": 0, "flips_heads": 0, "flips_mlp": 0, "flips_residual": 0}

        def solved(Z: Tensor, perm: Tensor, solver: Callable[[Tensor], Tensor], cls: str,
                   cand: Tensor | None = None) -> Tensor:
            if still_optimal(Z, perm, cand):
                count["kept"] += 1
                return perm
            count["hungarian"] += 1
            new = solver(Z)
            count[f"flips_{cls}"] += int((new != perm).sum())
            return new

        if "heads" in self.kinds and not self.keep_heads:
            gqa = lambda Z: gqa_assignment(Z, self.rep)
            self.head_perms = [solved(Z, p, gqa, "heads") for Z, p in zip(self.Z_heads, self.head_perms)]
        if "mlp" in self.kinds:
            self.mlp_perms = [solved(Z, p, lambda Z, c=c: sparse_assignment(Z, c), "mlp", c)
                              for Z, p, c in zip(self.Z_mlp, self.mlp_perms, self.mlp_cand)]
        if "residual_perm" in self.kinds:  # Omega = P^T maximises tr(Omega^T Z)
            self.res_perm = solved(self.Z_res.T, self.res_perm, assignment, "residual")
        return count

    # the continuous maps, one function per class, shared by maps() (self.dtype) and element() (float64)

    def _scale(self, layer: int, dtype: torch.dtype) -> Tensor:
        return self.g0.layers[layer].mlp_scale.to(dtype) * self.e_scale[layer].to(dtype).exp()

    def _qk(self, layer: int, dtype: torch.dtype) -> Tensor:
        """A [h_kv, d, d]: GL(d) as A_0 (I + E); RoPE: pair scalars z_0 exp(e_r + i e_phi), GL on the rest."""
        A0, d = self.g0.layers[layer].qk.to(dtype), self.arch.d_head
        if not self.rope:
            return A0 @ (torch.eye(d, dtype=dtype) + self.E_qk[layer].to(dtype))
        r = self.arch.rotary_dim
        e = self.e_rope[layer].to(dtype)  # [h_kv, r/2, 2], QK-norm [1, r/2, 1]
        phase = e[..., 1] if e.shape[-1] == 2 else torch.zeros_like(e[..., 0])
        z = rope_scalars(A0, self.arch.rope_layout, r) * torch.polar(e[..., 0].exp(), phase)  # [h_kv, r/2]
        zero, C, S = (t.to(dtype) for t in self.basis)
        A = zero + torch.einsum("kj,jde->kde", z.real, C) + torch.einsum("kj,jde->kde", z.imag, S)  # [h_kv, d, d]
        if r < d:  # partial RoPE: the unrotated block is GL(d - r)
            G = A0[:, r:, r:] @ (torch.eye(d - r, dtype=dtype) + self.E_qk[layer, :, r:, r:].to(dtype))  # [h_kv, d-r, d-r]
            A = torch.cat([A[:, :r], torch.cat([A[:, r:, :r], G], 2)], 1)  # [h_kv, d, d]
        return A

    def _vo(self, layer: int, dtype: torch.dtype) -> Tensor:
        d = self.arch.d_head
        return self.g0.layers[layer].vo.to(dtype) @ (torch.eye(d, dtype=dtype) + self.E_vo[layer].to(dtype))

    def maps(self) -> dict[str, dict]:
        """What `act_ste` needs per group: (hard index, latent of its matrix P, candidate graph or None)
        per permutation, and the continuous maps as differentiable tensors in the latents' dtype."""
        out: dict[str, dict] = {}
        g, rep, dt = self.arch.n_kv_heads, self.rep, self.dtype
        for layer in range(self.arch.n_layers):
            b = f"blocks.{layer}"
            if "heads" in self.kinds:
                Z, hp = self.Z_heads[layer], self.head_perms[layer]  # [h, h], [h]
                Z_kv = Z.reshape(g, rep, g, rep).sum((1, 3)) / rep  # [h_kv, h_kv] group-to-group scores
                out[f"{b}.heads"] = {"perm": (hp, Z, None), "perm_kv": (hp[::rep] // rep, Z_kv, None)}
            if "mlp" in self.kinds:
                out[f"{b}.mlp"] = {"perm": (self.mlp_perms[layer], self.Z_mlp[layer], self.mlp_cand[layer])}
            if "mlp_scale" in self.kinds:
                out[f"{b}.mlp_scale"] = {"scale": self._scale(layer, dt)}
            for kind, fn in (("qk", self._qk), ("vo", self._vo)):
                if kind in self.kinds:
                    M = fn(layer, dt)
                    out[f"{b}.{kind}"] = {"right": M, "right_inv_t": torch.linalg.inv(M).mT}
                    if kind == "qk" and self.qk_norm:  # W_Q, W_K by sign(M), the gains by |M|, |M^{-T}|
                        out[f"{b}.qk"] |= qk_norm_part(M, out[f"{b}.qk"]["right_inv_t"])
        if "residual_perm" in self.kinds:  # x Omega = P x along the axis with P = Omega^T
            out["residual"] = {"index": (self.res_perm, self.Z_res.mT, None)}
        elif "residual_orth" in self.kinds:
            O0, eye = self.g0.residual.to(dt), torch.eye(self.arch.d_model, dtype=dt)
            O = newton_schulz_polar(O0 @ (eye + self.E_res))
            out["residual"] = {"right": O, "right_inv_t": O}
        return out

    @torch.no_grad()
    def element(self) -> GroupElement:
        """The hard, exact group element (float64) of the current hard permutations and latents."""
        k = self.kinds
        layers = []
        for layer, el in enumerate(self.g0.layers):
            layers.append(LayerElement(
                self.head_perms[layer],
                self._qk(layer, F64) if "qk" in k else el.qk,
                self._vo(layer, F64) if "vo" in k else el.vo,
                self.mlp_perms[layer],
                self._scale(layer, F64) if "mlp_scale" in k else el.mlp_scale,
            ))
        O = self.g0.residual.to(F64)
        if "residual_perm" in k:
            O = residual_perm_matrix(self.res_perm)
        elif "residual_orth" in k:
            O = procrustes(O @ (torch.eye(self.arch.d_model, dtype=F64) + self.E_res.to(F64)))  # exact polar factor
        return GroupElement(tuple(layers), O)


# ---------------------------------------------------------------------------------------------
# Loss and memory


def blocks_checkpointed(params: int) -> bool:
    """Whether a training step forms each block again in its backward pass (activation checkpointing) rather
    than keeping every block's graph: from SMALL_MODEL parameters up. Below, the graphs of all blocks take
    a few hundred MB at most and keeping them saves about a fifth of a zoo pair's step time (bench/RESULTS.md,
    "Resumable runs, and steps without recomputation")."""
    return params >= SMALL_MODEL


def items_per_pass(arch: Arch, x: Tensor, dtype: torch.dtype) -> int:
    """Sequences / images per forward pass so that its logits stay under LOGIT_BYTES (at least one)."""
    per_item = (x.shape[1] if arch.task == "lm" else 1) * arch.n_out * dtype.itemsize
    return max(1, LOGIT_BYTES // per_item)


def scored(y: Tensor) -> int:
    """Targets the task loss scores: every one but a masked LM's IGNORE_INDEX positions (engine.data), so a
    micro-batch's mean loss weighs by its scored targets, not by the positions it holds."""
    return int((y != IGNORE_INDEX).sum())


def _loss_sum(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, per_pass: int) -> Tensor:
    """Sum over (x, y) of the task loss per scored target, `per_pass` items per forward pass, in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, len(x), per_pass):
        n = scored(y[i:i + per_pass])
        if n:  # a masked-LM micro-batch without a scored target adds nothing (its mean would be NaN)
            total += float(task_loss(forward(x[i:i + per_pass]), y[i:i + per_pass])) * n
    return total


@torch.no_grad()
def mean_loss(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, per_pass: int) -> float:
    """Mean task loss per scored target over (x, y), `per_pass` items per forward pass, summed in float64
    (under torchrun each process scores its share of the rows and the sums are added: engine.distributed)."""
    rows = distributed.shard(len(x))
    total = _loss_sum(forward, x[rows], y[rows], per_pass)
    distributed.all_sum(total)
    return float(total) / scored(y)


# ---------------------------------------------------------------------------------------------
# The path's forward pass a stage at a time


Stage = tuple[list[str], Callable[[Params, Tensor], Tensor]]  # (canonical keys it reads, (params, input) -> output)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype learned matching computes in for weights stored in `dtype`: float32 at least (bfloat16
    and float16 endpoints stay in their stored dtype and are widened a stage at a time)."""
    return torch.promote_types(dtype, torch.float32)


def compute(x: Tensor) -> Tensor:
    """x in compute_dtype(x.dtype): x itself when it already is."""
    return x.to(compute_dtype(x.dtype))


class _Call(nn.Module):
    """fn(module, *args) under torch.func.functional_call: the module's parameters, named m.<name>, replaced."""

    def __init__(self, module: nn.Module, fn: Callable):
        super().__init__()
        self.m, self.fn = module, fn

    def forward(self, *args):
        return self.fn(self.m, *args)


def stages(tw: Model, keys: list[str], dtype: torch.dtype) -> list[Stage]:
    """The twin's forward pass as a chain of stages, each with the canonical keys it reads: a reference-
    family twin runs its embedding, each block and its readout (the final norm and the head; a tied
    embedding is read again there); another twin (hf_bert's post-norm one) is one stage. The first stage
    takes the inputs (floating ones in `dtype`), the last returns logits."""
    from engine.models.reference import Transformer

    module = tw.module
    device = next(module.parameters()).device

    def inputs(x: Tensor) -> Tensor:
        return x.to(device, dtype) if x.is_floating_point() else x.to(device)

    if not isinstance(module, Transformer):
        return [(list(keys), lambda p, x: torch.func.functional_call(module, p, (inputs(x),), strict=False))]

    def stage(fn: Callable) -> Callable[[Params, Tensor], Tensor]:
        def run(p: Params, x: Tensor) -> Tensor:
            return torch.func.functional_call(_Call(module, fn), {f"m.{k}": v for k, v in p.items()}, (x,), strict=False)
        return run

    cfg = module.cfg
    tied = cfg.task == "lm" and cfg.tied_embeddings
    embed = [k for k in keys if k.startswith("embed.")]
    blocks = [[k for k in keys if k.startswith(f"blocks.{i}.")] for i in range(cfg.n_layers)]
    readout = [k for k in keys if k.startswith(("norm_f.", "head."))] + (["embed.tok"] if tied else [])
    left = set(keys) - set(embed) - set(readout) - {k for b in blocks for k in b}
    if left:
        raise LMCError(f"Parameter {min(left)} belongs to no stage of the reference forward pass.")
    out: list[Stage] = [(embed, stage(lambda m, x: m.embed_inputs(inputs(x))))]
    out += [(b, stage(lambda m, x, i=i: m.blocks[i](x, m.rope_tables(x)))) for i, b in enumerate(blocks)]
    return out + [(readout, stage(lambda m, x: m.readout(x)))]


class Midpoint:
    """The interpolated parameters (1 - lam) g_A theta_A + lam g_B theta_B of a training step, formed a
    stage's keys at a time in `dtype` and differentiable in the latents behind the maps.

    sides: ((maps of g_A or None, theta_A), (maps of g_B, theta_B)), maps as Transform.maps gives them,
    None for a side that does not move; the weights stay in their stored dtype until a stage reads them.
    """

    def __init__(self, spec: Spec, sides: tuple[tuple[dict | None, Params], tuple[dict | None, Params]],
                 lam: float, dtype: torch.dtype):
        self.spec, self.sides, self.lam, self.dtype = spec, sides, lam, dtype

    def keys(self) -> list[str]:
        """The parameters in the spec's order, which the action's graph, and so the order in which the
        backward pass sums the latents' gradients, follows."""
        return [k for k in self.spec.params if k in self.sides[0][1]]

    def __call__(self, keys: list[str], checkpointed: bool = False) -> Params:
        """The midpoint's parameters `keys`. checkpointed: each parameter's chain of actions under
        activation checkpointing (act_ste), for parameters formed outside a checkpointed stage."""
        moved = []
        for maps, params in self.sides:
            p = {k: params[k].to(self.dtype) for k in keys}
            if maps is not None:
                p = act_ste(self.spec, maps, p) if checkpointed else {
                    k: act(self.spec.params[k], maps, v, permute) for k, v in p.items()}
            moved.append(p)
        a, b = moved
        return {k: (1 - self.lam) * a[k] + self.lam * b[k] for k in keys}


def _formed(mid: Params | Midpoint, keys: list[str], checkpointed: bool = False) -> Params:
    return mid(keys, checkpointed) if isinstance(mid, Midpoint) else {k: mid[k] for k in keys}


def backward_loss(tw: Model, mid: Params | Midpoint, x: Tensor, y: Tensor, per_pass: int,
                  dtype: torch.dtype | None = None, checkpointed: bool = True) -> float:
    """The mean task loss of `mid` on (x, y), back-propagated into the latents behind `mid`.

    The forward runs a stage at a time (`stages`): every stage but the readout on all of x, its
    parameters formed inside it (a Midpoint forms a block's moved copies and their mix there), under
    activation checkpointing when `checkpointed`, so one block's parameters and each stage's input are
    what the forward keeps, and the backward pass forms each block again (`blocks_checkpointed` says
    when: not for small models, whose every block's graph fits where a quarter of a step's time would
    go to forming it again; the gradients are the same bit for bit). The readout (whose logits are the
    large part) runs `per_pass` items at a time on detached parameters and input whose gradients accumulate; the
    graph behind them is then walked once, not once per micro-batch. `dtype`: the dtype of floating
    inputs (default: the first parameter's, in compute_dtype).
    """
    keys = mid.keys() if isinstance(mid, Midpoint) else list(mid)
    dtype = dtype or (mid.dtype if isinstance(mid, Midpoint) else compute_dtype(next(iter(mid.values())).dtype))
    chain = stages(tw, keys, dtype)
    h = x
    for ks, fn in chain[:-1]:
        if checkpointed:
            h = checkpoint(lambda h, ks=ks, fn=fn: fn(_formed(mid, ks), h), h, use_reentrant=False)
        else:
            h = fn(_formed(mid, ks), h)
    ks, fn = chain[-1]
    tail = _formed(mid, ks, checkpointed=True)
    leaves = {k: v.detach().requires_grad_(v.requires_grad) for k, v in tail.items()}
    hl = h.detach().requires_grad_(h.requires_grad) if h.is_floating_point() else h
    total, n_all = 0.0, scored(y)
    for i in range(0, len(x), per_pass):
        yi = y[i:i + per_pass]
        n = scored(yi)
        if not n:  # nothing scored here (a masked LM): no loss and no gradient
            continue
        loss = task_loss(fn(leaves, hl[i:i + per_pass]), yi) * (n / n_all)
        loss.backward()
        total += float(loss.detach())
    outs = [(tail[k], leaves[k].grad) for k in ks if tail[k].requires_grad and leaves[k].grad is not None]
    if hl is not h and h.requires_grad and hl.grad is not None:
        outs.append((h, hl.grad))
    if outs:
        torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return total


Ends = Callable[[list[str]], tuple[Params, Params]]  # a stage's keys -> (theta_0, theta_1) for those keys


def _mix(ends: tuple[Params, Params], lam: float) -> Params:
    p, q = ends
    return {k: (1 - lam) * p[k] + lam * q[k] for k in p}


def _hidden(chain: list[Stage], ends: Ends, lambdas: tuple[float, ...], x: Tensor) -> list[Tensor]:
    """The readout's input at each of `lambdas` on the path between `ends`: each stage's two ends formed
    once for every lam, the stages in turn."""
    hs = [x] * len(lambdas)
    for ks, fn in chain[:-1]:
        e = ends(ks)
        hs = [fn(_mix(e, lam), h) for lam, h in zip(lambdas, hs)]
        del e
    return hs


@torch.no_grad()
def path_losses(tw: Model, keys: list[str], ends: Ends, lambdas: tuple[float, ...], x: Tensor, y: Tensor,
                per_pass: int, dtype: torch.dtype) -> list[float]:
    """The mean task loss per scored target at each of `lambdas` on the path (1 - lam) theta_0 + lam theta_1,
    whose ends a stage at a time `ends` gives (in `dtype`): no copy of a whole model, moved or mixed, is
    ever formed. The readout runs `per_pass` items at a time and the sums are float64, as mean_loss's
    (under torchrun each process scores its share of the rows: engine.distributed)."""
    chain = stages(tw, keys, dtype)
    rows = distributed.shard(len(x))
    xs, ys = x[rows], y[rows]
    hs = _hidden(chain, ends, lambdas, xs)
    ks, fn = chain[-1]
    e = ends(ks)
    totals = []
    for lam, h in zip(lambdas, hs):
        p = _mix(e, lam)
        totals.append(_loss_sum(lambda inp, p=p: fn(p, inp), h, ys, per_pass))
        del p
    total = torch.stack(totals)
    distributed.all_sum(total)
    return [float(t) / scored(y) for t in total]


@torch.no_grad()
def path_logits(tw: Model, keys: list[str], ends: Ends, lambdas: tuple[float, ...], x: Tensor,
                dtype: torch.dtype) -> list[Tensor]:
    """The logits of x (a few items, one pass) at each of `lambdas` on the path between `ends`."""
    chain = stages(tw, keys, dtype)
    hs = _hidden(chain, ends, lambdas, x)
    ks, fn = chain[-1]
    e = ends(ks)
    return [fn(_mix(e, lam), h) for lam, h in zip(lambdas, hs)]


def moved_ends(spec: Spec, p0: Params, p1: Params, g0: GroupElement | None, g1: GroupElement | None,
               dtype: torch.dtype) -> Ends:
    """Ends (g0 theta_0, g1 theta_1) a stage at a time, in `dtype` (None: the side as it is). Each moved
    parameter is computed as engine.align.run moves B: in float64 for a small model (exact, as
    symmetry.apply), in `dtype` at scale (weight.SMALL_MODEL), where a permutation is exact and a rotation
    costs a rounding of its products (a float64 product with the residual rotation, 2 P D operations a
    side, would double the time of a validation check at 1B)."""
    maps = [element_maps(g) if g is not None else None for g in (g0, g1)]
    small = sum(v.numel() for v in p0.values()) <= SMALL_MODEL

    def side(mats: dict | None, p: Params, keys: list[str]) -> Params:
        if mats is None:
            return {k: p[k].to(dtype) for k in keys}
        wide = {k: p[k].to(torch.promote_types(p[k].dtype, F64) if small else dtype) for k in keys}
        return {k: act(spec.params[k], mats, v).to(dtype) for k, v in wide.items()}

    return lambda keys: (side(maps[0], p0, keys), side(maps[1], p1, keys))


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, Tensor))


# ---------------------------------------------------------------------------------------------
# The optimisation, shared with dual.py


def relative(arch: Arch, g_a: GroupElement | None, g_b: GroupElement) -> GroupElement:
    """g_A^{-1} g_B: what the dual pair does to B seen from A's frame (docs/MATH.md section 4.5)."""
    return g_b if g_a is None else compose(arch, invert(arch, g_a), g_b)


def optimise(ctx: AlignContext, g0_b: GroupElement, dual: bool, steps: int,
             time_budget_s: float | None = None, progress: Progress | None = None,
             settings: Settings | None = None,
             on_check: Callable[[int, GroupElement | None, GroupElement], None] | None = None,
             phase: str | None = None, g0_a: GroupElement | None = None, start_file: dict | None = None) -> dict:
    """Adam on the latents of B's transform (and A's, if dual) on the interpolated task loss.

    Runs `steps` steps, or fewer when `time_budget_s` seconds of optimisation run out (checked
    before each step, as is ctx.cancel: engine.cancel) or when the validation midpoint loss has not
    improved for `settings.patience` checks. `settings` (default ctx.learned, else Settings()) sets
    the schedule, the lam sampling and the MLP candidates; `progress` (default ctx.progress) hears
    of every step; `on_check(step, g_a, g_b)` (optional) is called after every validation check with
    the best hard elements so far; `g0_a` (dual) starts A's latents there instead of at the identity, and
    `start_file` (the summary of the element file the starts came from) makes a state of another start's
    run not resumable. Returns the best hard elements seen on the validation batch
    (validation barrier of the path theta_A -> g_A^{-1} g_B theta_B, the same function as the dual
    path), the
    history, the curve, the steps done and the memory it took: latent and Adam-state bytes, and the
    process's peak resident memory (getrusage) before and after, or the CUDA allocator's peak on a GPU.

    With ctx.checkpoint set, the state is written at every validation check under `phase` (default "dual"
    or "learned") and an interrupted run of the same config resumes from it (engine.align.resume); a
    finished optimisation's result is returned from its state without running again.
    """
    pair, kinds = ctx.pair, ctx.classes
    arch, spec = pair.arch, pair.spec
    st = settings or ctx.learned or Settings()
    # the record names the lam sampling and MLP candidates it used
    st = replace(st, lambdas=st.lambdas or default_lambdas(arch.task, kinds),
                 candidates=st.candidates or DEFAULT_CANDIDATES[arch.task])
    progress = progress or ctx.progress
    name = "dual matching" if dual else "learned matching"
    ck, phase = ctx.checkpoint, phase or ("dual" if dual else "learned")
    # what makes it this optimisation beyond the run's config: a state of any other is not resumed
    # (keep_heads named only when set: a state saved before the option existed is this run's when it is off)
    settings_id = {k: v for k, v in asdict(st).items() if k != "keep_heads" or v}
    ident = {"dual": dual, "steps": steps, "time_budget_s": time_budget_s, "settings": settings_id, "seed": ctx.seed,
             "batch": st.batch or ctx.batch, "classes": sorted(kinds)} | (
                 {"start_sha256": start_file["sha256"]} if start_file else {})
    state = resume.load(ck, phase, ident) if ck is not None else None
    if state is not None and state.meta.get("finished"):
        return finished_result(state, arch.n_layers, dual)
    tw = twin(pair.model_a)
    xv, yv = val_batch(arch, VAL_ITEMS[arch.task])
    check_twin(pair.model_a, tw, xv[:2])
    ref = next(tw.module.parameters())  # the weights live where the twin runs; the latents on the CPU
    dtype, cuda = compute_dtype(ref.dtype), ref.device.type == "cuda"  # latents and products: float32 at least
    if cuda:
        torch.cuda.reset_peak_memory_stats(ref.device)
    rss_before = peak_rss_bytes()
    clock, earlier = tick(), 0.0  # earlier: the seconds earlier processes of a resumed run spent
    # the weights in their stored dtype: each stage widens what it reads (stages, Midpoint, moved_ends)
    pa = {k: v.detach().to(ref.device) for k, v in pair.params_a.items()}
    pb = {k: v.detach().to(ref.device) for k, v in pair.params_b.items()}
    keys = list(pa)
    has_mlp = "mlp" in kinds
    tags = "ab" if dual else "b"
    if state is not None:  # the starts and candidates it ran from, as saved
        g0 = {tag: resume.element_from(state.tensors, f"{tag}.g0.", arch.n_layers) for tag in tags}
        cand = {tag: [state.tensors[f"{tag}.cand.{i}"] for i in range(arch.n_layers)] for tag in tags} if has_mlp \
            else {}
    else:
        g0, cand = {"a": identity(arch) if g0_a is None else g0_a, "b": g0_b}, {}
        if has_mlp:
            cand["b"] = mlp_candidates(spec, pa, pb, g0_b, st.candidates)
            if dual:  # A's latent scores A's neurons against B moved by its start
                cand["a"] = mlp_candidates(spec, pb, pa, g0["a"], st.candidates, g_ref=g0_b)
    side_a, side_b = (Transform(arch, spec, kinds, g0[tag], dtype, cand.get(tag), st.keep_heads) if tag in tags
                      else None for tag in "ab")
    sides = [s for s in (side_a, side_b) if s is not None]
    latents = [p for s in sides for p in s.parameters()]
    groups = [g for s in sides for g in s.param_groups(st.lr_perm, st.lr_map)]
    opt = torch.optim.Adam(groups, foreach=False) if groups else None  # foreach would copy every latent
    batches = train_batches(arch, st.batch or ctx.batch, ctx.seed)
    rng = random.Random(ctx.seed)
    per_pass = items_per_pass(arch, xv, dtype)
    checkpointed = blocks_checkpointed(sum(v.numel() for v in pa.values()))

    def elements() -> tuple[GroupElement | None, GroupElement]:
        return (side_a.element() if side_a else None), side_b.element()

    def val_path(g_a: GroupElement | None, g_b: GroupElement) -> list[float]:
        """The validation loss at each of VAL_LAMBDAS on the path theta_A -> g_A^{-1} g_B theta_B, each
        block moved and mixed when the forward pass reaches it."""
        ends = moved_ends(spec, pa, pb, None, relative(arch, g_a, g_b), dtype)
        return path_losses(tw, keys, ends, VAL_LAMBDAS, xv, yv, per_pass, dtype)

    # the chord on the validation batch (g moves B within its function, so it never changes): a run is
    # judged on its validation barrier, the largest excess over the chord at VAL_LAMBDAS, which is what
    # the record's path measures, not on the midpoint alone (a run fitted to lam near 0.5 can leave
    # bumps nearer the endpoints: bench/RESULTS.md, "Validating on the path")
    end_a, end_b = path_losses(tw, keys, moved_ends(spec, pa, pb, None, None, dtype), (0.0, 1.0), xv, yv, per_pass,
                               dtype)
    chord = [(1 - lam) * end_a + lam * end_b for lam in VAL_LAMBDAS]

    def excess(losses: list[float]) -> tuple[float, float]:
        """(validation barrier, the lam where it lies)."""
        e = [v - c for v, c in zip(losses, chord)]
        i = max(range(len(e)), key=e.__getitem__)
        return e[i], VAL_LAMBDAS[i]

    if state is None:  # the start's check (a resumed run restores its histories below)
        best = elements()  # the start: its hard permutations are already Hungarian(Z)
        losses = val_path(*best)
        (best_val, worst_lam), best_step, solved_at = excess(losses), 0, 0
        best_mid = losses[MID]
        anchor = best_val  # the check that last counted as progress
        history = {"step": [0], "train_loss": [None], "val_midpoint_loss": [best_mid], "val_barrier": [best_val],
                   "val_worst_lambda": [worst_lam], "seconds": [clock()]}
        curve = {"step": [], "train_loss": [], "lr_factor": [], "lambda": []}  # every step
        solves = {"hungarian": 0, "kept": 0}
        resolves: dict[str, list] = {"step": [], "hungarian": [], "flips_heads": [], "flips_mlp": [],
                                     "flips_residual": []}
        if on_check:
            on_check(0, *best)

    def solve(step: int) -> None:
        nonlocal solved_at
        n = {k: 0 for k in resolves if k != "step"} | {"kept": 0}
        for s in sides:
            for k, v in s.solve().items():
                n[k] += v
        solves["hungarian"] += n["hungarian"]
        solves["kept"] += n["kept"]
        resolves["step"].append(step)
        for k, col in resolves.items():
            if k != "step":
                col.append(n[k])
        solved_at = step

    def validate(step: int, loss: float) -> bool:
        nonlocal best, best_val, best_mid, best_step, anchor, worst_lam
        solve(step)
        el = elements()
        losses = val_path(*el)
        v, worst_lam = excess(losses)
        for key, val in (("step", step), ("train_loss", loss), ("val_midpoint_loss", losses[MID]), ("val_barrier", v),
                         ("val_worst_lambda", worst_lam), ("seconds", clock())):
            history[key].append(val)
        if v < best_val:
            best_val, best_mid, best, best_step = v, losses[MID], el, step
        if on_check:
            on_check(step, *best)
        if anchor - v > st.min_improvement * max(anchor, 0.0):  # progress that counts for patience
            anchor = v
            return True
        return False

    every = st.eval_every or max(1, steps // EVALS)
    done, loss, stopped, waited = 0, float("nan"), "steps", 0
    next_check = 1 / EVALS  # under a time budget a check also comes at every EVALS-th of the budget
    resumed_at: list[int] = []
    t_opt = tick()
    named = {"a": side_a, "b": side_b}

    def save_state(finished: bool = False, result: dict | None = None) -> None:
        if ck is None or not distributed.is_main():
            return
        tensors: dict[str, Tensor] = {}
        for tag, s in named.items():
            if s is None:
                continue
            tensors |= {f"{tag}.latent.{k}": v for k, v in s.state_dict().items()}
            tensors |= resume.element_tensors(s.g0, f"{tag}.g0.")
            tensors |= {f"{tag}.head_perm.{i}": p for i, p in enumerate(s.head_perms)}
            tensors |= {f"{tag}.mlp_perm.{i}": p for i, p in enumerate(s.mlp_perms)}
            tensors |= {f"{tag}.cand.{i}": c for i, c in enumerate(getattr(s, "mlp_cand", []))}
            if hasattr(s, "res_perm"):
                tensors[f"{tag}.res_perm"] = s.res_perm
        for tag, g in zip("ab", best):
            if g is not None:
                tensors |= resume.element_tensors(g, f"best.{tag}.")
        osd = opt.state_dict() if opt else {"state": {}, "param_groups": []}
        for idx, st_ in osd["state"].items():
            tensors |= {f"opt.{idx}.{k}": v if isinstance(v, Tensor) else torch.tensor(v) for k, v in st_.items()}
        meta = {"step": done, "finished": finished, "loss": loss, "best_val": best_val, "best_mid": best_mid,
                "best_step": best_step, "solved_at": solved_at, "anchor": anchor, "worst_lam": worst_lam,
                "waited": waited, "next_check": next_check, "history": history, "curve": curve, "solves": solves,
                "resolves": resolves, "resumed_at": resumed_at, "rng": list(rng.getstate()), "seconds": clock(),
                "opt_seconds": t_opt(), "param_groups": osd["param_groups"]}
        if result is not None:
            meta["result"] = {k: v for k, v in result.items() if k not in ("g_a", "g_b")}
        resume.save(ck, phase, ident, meta, tensors)

    if state is not None:
        m, t = state.meta, state.tensors
        for tag, s in named.items():
            if s is None:
                continue
            s.load_state_dict(state.part(f"{tag}.latent."))
            s.head_perms = [t[f"{tag}.head_perm.{i}"] for i in range(arch.n_layers)]
            s.mlp_perms = [t[f"{tag}.mlp_perm.{i}"] for i in range(arch.n_layers)]
            if hasattr(s, "res_perm"):
                s.res_perm = t[f"{tag}.res_perm"]
        best = tuple(resume.element_from(t, f"best.{tag}.", arch.n_layers) if f"best.{tag}.residual" in t else None
                     for tag in "ab")
        if opt:
            opt_state: dict[int, dict] = {}
            for k, v in state.part("opt.").items():
                idx, key = k.split(".", 1)
                opt_state.setdefault(int(idx), {})[key] = v
            opt.load_state_dict({"state": opt_state, "param_groups": m["param_groups"]})
        done, loss, best_val, best_mid, best_step = m["step"], m["loss"], m["best_val"], m["best_mid"], m["best_step"]
        solved_at, anchor, worst_lam, waited, next_check = (m["solved_at"], m["anchor"], m["worst_lam"], m["waited"],
                                                             m["next_check"])
        history, curve, solves, resolves = m["history"], m["curve"], m["solves"], m["resolves"]
        resumed_at = m["resumed_at"] + [done]
        version, internal, gauss = m["rng"]
        rng.setstate((version, tuple(internal), gauss))
        for _ in range(done):  # the batch stream is a function of the seed: draw it up to the step reached
            next(batches)
        clock, t_opt, earlier = shifted(m["seconds"]), shifted(m["opt_seconds"]), m["seconds"]
    for step in range(done + 1, steps + 1 if opt else 1):
        check(ctx.cancel, f"{name}, step {step}/{steps}")
        now = distributed.agree(clock())  # process 0's clock decides for all (engine.distributed)
        if time_budget_s is not None and now >= time_budget_s:
            stopped = "time_budget"
            break
        if step - 1 - solved_at >= RESOLVE_EVERY:
            solve(step - 1)
        x, y = next(batches)
        rows = distributed.shard(len(x))  # this process's share of the batch (all of it in one process)
        share = scored(y[rows]) / scored(y)
        lam = sample_lambda(rng, st.lambdas, worst_lam)
        if time_budget_s is None:
            f = lr_factor(step, steps, st.warmup)
        else:  # the schedule follows whichever of the step and time budgets runs out first
            f = fraction_factor(budget_fraction(step - 1, steps, now, time_budget_s), st.warmup)
        for g in opt.param_groups:
            g["lr"] = g["peak"] * f
        mid = Midpoint(spec, ((side_a.maps() if side_a else None, pa), (side_b.maps(), pb)), lam, dtype)
        opt.zero_grad(set_to_none=True)
        loss = backward_loss(tw, mid, x[rows], y[rows], per_pass, checkpointed=checkpointed) * share
        del mid
        if distributed.size() > 1:  # the whole batch's gradient and loss: the shares' weighted sum
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in latents]
            total = torch.tensor([loss], dtype=torch.float64)
            for g in grads:
                g.mul_(share)
            distributed.all_sum(*grads, total)
            for p, g in zip(latents, grads):
                p.grad = g
            loss = float(total)
        opt.step()
        done = step
        for key, val in (("step", step), ("train_loss", loss), ("lr_factor", f), ("lambda", lam)):
            curve[key].append(val)
        p = budget_fraction(step, steps, distributed.agree(clock()), time_budget_s)
        if progress:
            of = f"{step}/{steps}" if steps < MAX_STEPS else f"{step}, {p:.0%} of {time_budget_s:.0f} s"
            progress(*((step, steps) if steps < MAX_STEPS else (round(1000 * p), 1000)),
                     f"step {of}: train loss {loss:.4f}, best validation barrier {best_val:.4f}")
        if step % every == 0 or step == steps or (time_budget_s is not None and p >= next_check):
            next_check = (math.floor(p * EVALS) + 1) / EVALS
            # at the peak step size the validation loss wanders and the gains come as the step size falls
            # (bench/RESULTS.md, "Learned and dual matching: barrier against budget"), so patience counts
            # only once the step size has decayed below half its peak
            decaying = f <= 0.5 and p > st.warmup
            waited = 0 if validate(step, loss) else waited + decaying
            if st.patience is not None and waited >= st.patience and step < steps:
                stopped = "patience"
                break
            save_state()
    if done and history["step"][-1] != done:  # stopped by the time budget between two checks
        validate(done, loss)
    opt_seconds = t_opt()
    memory = {
        "dtype": str(dtype).removeprefix("torch."),
        "weights_dtype": str(ref.dtype).removeprefix("torch."),
        "model_bytes": tensor_bytes(pair.params_a.values()),
        "latent_bytes": tensor_bytes(latents),
        "candidate_bytes": tensor_bytes(c for s in sides for c in getattr(s, "mlp_cand", [])),
        "adam_state_bytes": tensor_bytes(v for st_ in (opt.state.values() if opt else []) for v in st_.values()),
        "peak_rss_bytes_before": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if cuda:
        memory["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(ref.device)
    result = {"g_a": best[0], "g_b": best[1], "best_step": best_step, "best_val_midpoint_loss": best_mid,
              "best_val_barrier": best_val,
              "history": history, "curve": curve, "resolves": resolves, "settings": asdict(st),
              "steps": steps, "steps_done": done, "stopped": stopped,
              "time_budget_s": time_budget_s, "resolve_every": RESOLVE_EVERY, "permutation_solves": solves,
              "seconds_per_step": opt_seconds / done if done else None, "memory": memory, "resumed_at": resumed_at}
    save_state(finished=True, result=result)
    return result | {"earlier_seconds": earlier}


def shifted(base: float) -> Callable[[], float]:
    """A stopwatch that starts at `base` seconds (a resumed run's clock)."""
    t = tick()
    return lambda: base + t()


def finished_result(state: resume.State, n_layers: int, dual: bool) -> dict:
    """The result of an optimisation that finished before its run was interrupted, from its state (all of its
    seconds spent earlier)."""
    t = state.tensors
    g_a = resume.element_from(t, "best.a.", n_layers) if dual else None
    return state.meta["result"] | {"g_a": g_a, "g_b": resume.element_from(t, "best.b.", n_layers),
                                   "earlier_seconds": state.meta["seconds"]}


RECORD = ("steps", "steps_done", "stopped", "time_budget_s", "resolve_every", "permutation_solves", "best_step",
          "best_val_midpoint_loss", "best_val_barrier", "seconds_per_step", "memory", "resumed_at", "history", "curve",
          "resolves", "settings")


@dataclass(frozen=True)
class Start:
    """Where the latents start: B's element, A's (a dual run started from a dual run's file; None: the
    identity), and the element file's summary for the record (None: an aligner computed the start)."""

    g_b: GroupElement
    g_a: GroupElement | None = None
    file: dict | None = None

    def one_sided(self, arch: Arch) -> GroupElement:
        """The start of a one-sided run: the relative element g_A^{-1} g_B, the same path."""
        return relative(arch, self.g_a, self.g_b)


def starting_point(ctx: AlignContext) -> Start:
    """The element(s) the latents start from (`Settings.start`): weight matching, activation matching on one
    training batch, or an element file an earlier run saved (engine.align.start), checked against the pair's
    shape, classes and coordinates (the rewrite prepare_pair made)."""
    start = (ctx.learned or Settings()).start
    if is_file_start(start):
        # the coordinates prepare_pair put the pair in (a run's CLI checked them before loading: pair.rewrite_for)
        ef = read_element(start, ctx.pair.arch, ctx.classes, rewrite=ctx.pair.rewrite or "")
        return Start(ef.g_b, ef.g_a, ef.summary(start))
    progress = relabel(ctx.progress, f"{start} matching, starting point: ")
    if start == "activation":
        x, _ = next(train_batches(ctx.pair.arch, ACT_BATCH[ctx.pair.arch.task], ctx.seed))
        return Start(activation_match(ctx.pair, ctx.classes, x, ctx.qk_structure, progress, ctx.cancel)[0])
    return Start(weight_match(ctx.pair, ctx.classes, ctx.qk_structure, progress=progress, cancel=ctx.cancel)[0])


def align_learned(ctx: AlignContext) -> AlignOutput:
    """One-sided learned matching from its start (registry entry `learned`)."""
    t = tick()
    s = starting_point(ctx)
    t_init = t()
    res = optimise(ctx, s.one_sided(ctx.pair.arch), dual=False, steps=ctx.steps or TASK_STEPS[ctx.pair.arch.task],
                   time_budget_s=ctx.time_budget_s, start_file=s.file)
    info = {k: res[k] for k in RECORD}
    return AlignOutput(res["g_b"], info | {"seconds": t() + res["earlier_seconds"], "init_seconds": t_init}
                       | start_record(s))


def start_record(s: Start) -> dict:
    return {"start_element": s.file} if s.file is not None else {}


# ---------------------------------------------------------------------------------------------
# Memory, from the config alone (engine.resources)


def latent_count(arch: Arch) -> int:
    """Latents of one side, every class: Z = L (h^2 + m k + m + 2 h_kv d^2 + h_kv r) + 2 D^2, the MLP latent
    scoring k = min(m, DEFAULT_CANDIDATES of the task) partners per neuron."""
    m = arch.d_mlp
    per_layer = (arch.n_heads**2 + m * default_k(arch) + m + 2 * arch.n_kv_heads * arch.d_head**2
                 + arch.n_kv_heads * arch.rotary_dim)
    return arch.n_layers * per_layer + 2 * arch.d_model**2


def default_k(arch: Arch) -> int:
    """MLP candidates per neuron a run of this architecture takes when it names none."""
    return min(arch.d_mlp, DEFAULT_CANDIDATES[arch.task])


def scratch_bytes(arch: Arch, params: int, layer_params: int, itemsize: int, sides: int = 1,
                  batch: int | None = None) -> int:
    """Peak scratch beyond the two models (bytes), from the config alone (registry entry `learned`; `dual`
    with sides=2; the arithmetic is engine.resources'): the larger of weight matching's (the start, freed
    before the first step) and the optimisation's, whose parts are, in the compute dtype c (float32 at
    least) and per side, the latents with their gradient and two Adam moments (4 c Z), the MLP candidate
    graphs (8 L m k) and a residual rotation's Newton-Schulz graph (26 D^2 c); for the step, one block
    formed again in the backward pass (both sides' moved copies, the chains' saved inputs, the mix and its
    gradient: 8 P_layer c; every block's below SMALL_MODEL parameters, `blocks_checkpointed`), the embedding and readout matrices (5 V D c: the readout's mix and gradient, a
    gathered embedding's dense gradient and its moved copies), each block's input kept for the backward
    pass and one block's activations, or every block's (N_tr (L + 1) D c and N_tr (6 D + 3 m + h T) c each), and one micro-batch's
    logits with their softmax and gradient (3 LOGIT_BYTES); validation's five lam points hold one
    block's input each (5 N_val D c), less than the step's blocks. `batch`: sequences or images per step
    (None: AlignContext's)."""
    D, h, m, L, V = arch.d_model, arch.n_heads, arch.d_mlp, arch.n_layers, arch.n_out
    T, c = seq_len(arch), max(4, itemsize)
    items = batch or AlignContext.__dataclass_fields__["batch"].default
    n = items * T  # positions of one training batch
    per_side = 4 * c * latent_count(arch) + 8 * L * m * default_k(arch) + 26 * D * D * c
    kept = 1 if blocks_checkpointed(params) else L  # blocks whose graph the backward pass finds kept
    step = (8 * kept * layer_params * c + 5 * V * D * c + n * (L + 1) * D * c + kept * n * (6 * D + 3 * m + h * T) * c
            + 3 * LOGIT_BYTES)
    return max(weight_scratch(arch, params, layer_params, itemsize), sides * per_side + step)
