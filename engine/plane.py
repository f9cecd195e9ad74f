"""The loss over the plane through A, B and aligned B (docs/MATH.md section 5, the loss plane;
Garipov et al., 2018).

With d1 = theta_B' - theta_A (B' = g.theta_B, aligned) and d2 = theta_B - theta_A, the plane's
orthonormal axes are u = d1 / |d1| and v = the part of d2 orthogonal to u, normalised. A point
(x, y) of the plane is theta_A + x u + y v = (1 - alpha - beta) theta_A + alpha theta_B' + beta theta_B
with beta = y / w and alpha = (x - beta c) / |d1|, where c = <d2, u> and w = |d2 - c u|: every
point is an affine combination of the three models, so only three dot products of whole weight
vectors are needed (float64, each tensor once; tied weights once) and the grid is evaluated in one
work model. A sits at (0, 0), B' at (|d1|, 0), B at (c, w): the naive segment A-B and the aligned
segment A-B' are both drawn on it, and B and B' are one function in two places of weight space.

The three models must be in the same coordinates: `plane_of` aligns with `in_place=False`, so the
pair's B is the unmoved B after the same norm rewrite as B'.
"""

from __future__ import annotations

import math
import time

import torch

from engine.align.run import align
from engine.cancel import CancelToken, check
from engine.errors import LMCError
from engine.evaluate import EvalSet, evaluate
from engine.interpolate import _empty_copy
from engine.models import Model
from engine.models.base import check_same_architecture
from engine.progress import Progress

GRID = 11  # points per axis (GRID x GRID evaluations)
MARGIN = 0.25  # the grid extends this fraction of the points' span beyond them on every side
MAX_GRID = 41


def _params(m: Model) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in m.module.named_parameters()}  # tied weights once


@torch.no_grad()
def axes(a: Model, b: Model, b_aligned: Model) -> dict[str, float]:
    """|d1|, c = <d2, u> and w = |d2 - c u| (see the module docstring), in float64."""
    pa, pb, pc = _params(a), _params(b), _params(b_aligned)
    d11 = d12 = d22 = 0.0
    for k, ta in pa.items():
        x = ta.to(torch.float64)
        d1 = pc[k].to(torch.float64) - x
        d2 = pb[k].to(torch.float64) - x
        d11 += float((d1 * d1).sum())
        d12 += float((d1 * d2).sum())
        d22 += float((d2 * d2).sum())
    n1 = math.sqrt(d11)
    if n1 == 0.0:
        raise LMCError("Aligned B coincides with A, so they span no plane.")
    c = d12 / n1
    w = math.sqrt(max(d22 - c * c, 0.0))
    if w <= 1e-12 * max(n1, 1.0):
        raise LMCError("B lies on the line through A and aligned B (the alignment moved nothing), so the three "
                       "span no plane; pick an aligning method.")
    return {"norm_d1": n1, "c": c, "w": w}


def weights(ax: dict[str, float], x: float, y: float) -> tuple[float, float]:
    """(alpha, beta) of the point (x, y): theta = (1 - alpha - beta) theta_A + alpha theta_B' + beta theta_B."""
    beta = y / ax["w"]
    return (x - beta * ax["c"]) / ax["norm_d1"], beta


def grid(ax: dict[str, float], n: int = GRID, margin: float = MARGIN) -> tuple[list[float], list[float]]:
    """The x and y coordinates of an n x n grid around A (0, 0), B' (|d1|, 0) and B (c, w)."""
    xs = [0.0, ax["norm_d1"], ax["c"]]
    ys = [0.0, 0.0, ax["w"]]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    mx, my = margin * (x1 - x0), margin * (y1 - y0)
    lin = lambda lo, hi: [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    return lin(x0 - mx, x1 + mx), lin(y0 - my, y1 + my)


@torch.no_grad()
def loss_plane(a: Model, b: Model, b_aligned: Model, es: EvalSet, n: int = GRID, margin: float = MARGIN,
               progress: Progress | None = None, cancel: CancelToken | None = None) -> dict:
    """The loss (and accuracy, for classifiers) on an n x n grid of the plane through A, B and B'."""
    if not (isinstance(n, int) and 3 <= n <= MAX_GRID):
        raise LMCError(f"The plane's grid takes 3 to {MAX_GRID} points per axis, not {n!r}.")
    check_same_architecture(a, b)
    check_same_architecture(a, b_aligned)
    t0 = time.perf_counter()
    ax = axes(a, b, b_aligned)
    xs, ys = grid(ax, n, margin)
    work = _empty_copy(a, next(a.module.parameters()).device)
    sa, sb, sc = (m.module.state_dict() for m in (a, b, b_aligned))
    sw = work.module.state_dict()
    loss = [[0.0] * n for _ in range(n)]
    acc = [[0.0] * n for _ in range(n)] if es.task == "vit" else None
    for j, y in enumerate(ys):
        for i, x in enumerate(xs):
            check(cancel, f"loss plane, point {j * n + i + 1}/{n * n}")
            alpha, beta = weights(ax, x, y)
            for k, t in sw.items():
                if t.is_floating_point():
                    t.copy_(sa[k]).mul_(1.0 - alpha - beta).add_(sc[k], alpha=alpha).add_(sb[k], alpha=beta)
            r = evaluate(work, es, cancel=cancel)
            loss[j][i] = r["loss"]
            if acc is not None:
                acc[j][i] = r["accuracy"]
            if progress:
                progress(j * n + i + 1, n * n, f"point {j * n + i + 1}/{n * n}: loss {r['loss']:.4f}")
    return {"x": xs, "y": ys, "loss": loss, "accuracy": acc, "points": {"A": [0.0, 0.0], "B": [ax["c"], ax["w"]],
            "B_aligned": [ax["norm_d1"], 0.0]}, "axes": ax, "seconds": time.perf_counter() - t0}


def check_method(method: str) -> None:
    """Naive alignment leaves B where it is: A, B and 'aligned' B then span no plane."""
    if method == "naive":
        raise LMCError("The loss plane needs an aligning method: naive leaves B where it is, so A, B and "
                       "aligned B span no plane.")


def plane_of(a: Model, b: Model, method: str, es: EvalSet, n: int = GRID, steps: int = 0, seed: int = 0,
             progress: Progress | None = None, cancel: CancelToken | None = None) -> dict:
    """Align B onto A with `method`, then the loss plane through A, B and aligned B (same coordinates)."""
    check_method(method)
    al = align(a, b, method, steps=steps, seed=seed, cancel=cancel)
    check(cancel, "loss plane")
    out = loss_plane(al.model_a, al.pair.model_b, al.model_b, es, n, progress=progress, cancel=cancel)
    return out | {"method": method, "classes": sorted(al.classes), "align_seconds": al.seconds}
