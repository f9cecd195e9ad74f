"""Linear paths between two models and their loss barriers (MATH.md section 5).

theta(lam) = (1 - lam) theta_A + lam theta_B, built into ONE preallocated work model: every grid
point lerps the endpoint state dicts into the work model's existing tensors, so no module is
re-created along the path. The conversion to canonical coordinates is linear, so interpolating
native state dicts is the same path as interpolating canonical parameters.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from engine.errors import ArchitectureMismatch
from engine.evaluate import EvalSet, evaluate
from engine.models import Model

Progress = Callable[[int, int, str], None]  # (done, total, message)


def check_same_architecture(a: Model, b: Model) -> None:
    """Raise with the first difference if `a` and `b` cannot be interpolated."""
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


def grid(points: int) -> list[float]:
    if points < 2:
        raise ValueError(f"An interpolation grid needs at least 2 points, got {points}.")
    return [i / (points - 1) for i in range(points)]


class LinearPath:
    """The straight line between two models, evaluated in one preallocated work model."""

    def __init__(self, a: Model, b: Model):
        check_same_architecture(a, b)
        self.a, self.b = a, b
        self.work = copy.deepcopy(a)
        self.work.name = f"path({a.name}, {b.name})"
        self._sa = {k: v.detach() for k, v in a.module.state_dict().items()}
        self._sb = {k: v.detach() for k, v in b.module.state_dict().items()}
        self._sw = self.work.module.state_dict()

    @torch.no_grad()
    def at(self, lam: float) -> Model:
        """The work model set to theta(lam); exact endpoints at lam 0 and 1 (torch.lerp)."""
        for k, w in self._sw.items():
            if w.is_floating_point():
                torch.lerp(self._sa[k], self._sb[k], lam, out=w)
        return self.work


def barrier_metrics(lambdas: list[float], loss: list[float]) -> dict[str, float]:
    """Barrier = max over the grid of L(theta(lam)) minus the chord; midpoint = its value at 0.5."""
    la, lb = loss[0], loss[-1]
    excess = [l - ((1 - t) * la + t * lb) for t, l in zip(lambdas, loss)]
    mid = min(range(len(lambdas)), key=lambda i: abs(lambdas[i] - 0.5))
    return {"barrier": max(excess), "midpoint_barrier": excess[mid], "excess": excess}


def accuracy_drop(lambdas: list[float], acc: list[float]) -> float:
    """Largest fall of accuracy below the chord between the endpoints (classifiers)."""
    return max((1 - t) * acc[0] + t * acc[-1] - a for t, a in zip(lambdas, acc))


def interpolate(a: Model, b: Model, es: EvalSet, points: int = 21, batch_size: int = 64,
                progress: Progress | None = None) -> dict:
    """Loss (and accuracy) along the path on `es`; the barrier fields of a result record."""
    t0 = time.perf_counter()
    path = LinearPath(a, b)
    lambdas = grid(points)
    loss, acc = [], []
    for i, lam in enumerate(lambdas):
        r = evaluate(path.at(lam), es, batch_size)
        loss.append(r["loss"])
        acc.append(r["accuracy"])
        if progress:
            progress(i + 1, points, f"lambda = {lam:.2f}: loss {r['loss']:.4f}")
    m = barrier_metrics(lambdas, loss)
    out = {
        "lambdas": lambdas,
        "loss": loss,
        "accuracy": acc if es.task == "vit" else None,
        "barrier": m["barrier"],
        "midpoint_barrier": m["midpoint_barrier"],
        "endpoint_loss_a": loss[0],
        "endpoint_loss_b": loss[-1],
        "accuracy_drop": accuracy_drop(lambdas, acc) if es.task == "vit" else None,
        "eval_set": es.description,
        ("eval_images" if es.task == "vit" else "eval_tokens"): es.size,
        "interpolate_seconds": time.perf_counter() - t0,
    }
    return out
