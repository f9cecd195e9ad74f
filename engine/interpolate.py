"""Linear paths between two models and their loss barriers (docs/MATH.md section 5).

theta(lam) = (1 - lam) theta_A + lam theta_B, built into ONE preallocated work model: every grid
point lerps the endpoint state dicts into the work model's existing tensors, so no module is
re-created along the path and the work model is the only copy the path makes (P parameters; the
endpoints are read, never copied). The conversion to canonical coordinates is linear, so
interpolating native state dicts is the same path as interpolating canonical parameters.

Offload: the endpoints may stay on the CPU (page-locked when the work model is on CUDA, so copies
overlap) while the work model lives on the compute device; each tensor is then copied to the
device and lerped there one at a time, so the device holds the work model plus one tensor, and a
pair too large for the device together still interpolates.
"""

from __future__ import annotations

import copy
import time

import torch

from engine.cancel import CancelToken, check
from engine.circuits import PATHS, CircuitPath
from engine.errors import LMCError
from engine.evaluate import EvalSet, evaluate
from engine.models import Model
from engine.models.base import check_same_architecture
from engine.progress import Progress


def grid(points: int) -> list[float]:
    if points < 2:
        raise ValueError(f"An interpolation grid needs at least 2 points, got {points}.")
    return [i / (points - 1) for i in range(points)]


def _empty_copy(model: Model, device: torch.device) -> Model:
    """A copy of `model` whose parameters are uninitialised tensors on `device` (buffers copied).

    deepcopy with every parameter pre-entered in its memo: the module tree, config and tied
    parameters are copied as usual, but no parameter's data is duplicated on the way.
    """
    memo: dict[int, object] = {}
    for p in model.module.parameters():  # tied parameters appear once: they stay tied
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    for b in model.module.buffers():  # non-floating and non-persistent buffers are not lerped
        memo[id(b)] = b.detach().to(device, copy=True)
    return copy.deepcopy(model, memo)


def _same_device(u: torch.device, v: torch.device) -> bool:
    """'cuda' and 'cuda:0' name the same device when one of them leaves the index open."""
    return u.type == v.type and (u.index is None or v.index is None or u.index == v.index)


def _pin(model: Model) -> None:
    """Move the model's CPU parameters into page-locked memory, one tensor at a time (same values)."""
    with torch.no_grad():
        for p in model.module.parameters():
            if p.device.type == "cpu" and not p.is_pinned():
                p.data = p.data.pin_memory()


class LinearPath:
    """The straight line between two models, evaluated in one preallocated work model.

    `device` is where the work model lives (default: model A's device). With `offload` the endpoint
    models stay on the CPU and only the work model occupies `device`; on CUDA their parameters are
    first moved into page-locked memory (the same values, relocated in place, not a kept copy).
    """

    def __init__(self, a: Model, b: Model, offload: bool = False, device: str | torch.device | None = None):
        check_same_architecture(a, b)
        da, db = next(a.module.parameters()).device, next(b.module.parameters()).device
        self.device = torch.device(device) if device is not None else da
        self.offload = offload
        if offload:
            for m, d in ((a, da), (b, db)):
                if any(t.device.type != "cpu" for t in m.module.state_dict().values()):
                    raise LMCError(f"Offloaded interpolation keeps the endpoints on the CPU, but "
                                   f"{m.name or 'a model'} lives on {d}; load it on the CPU.")
            if self.device.type == "cuda":
                _pin(a)
                _pin(b)
        elif not (_same_device(da, self.device) and _same_device(db, self.device)):
            raise LMCError(f"Models {a.name or 'A'} ({da}) and {b.name or 'B'} ({db}) must both live on the "
                           f"path's device {self.device}; use offload to keep them on the CPU.")
        self.a, self.b = a, b
        self.work = _empty_copy(a, self.device)
        self.work.name = f"path({a.name}, {b.name})"
        self._sa = {k: v.detach() for k, v in a.module.state_dict().items()}  # views, not copies
        self._sb = {k: v.detach() for k, v in b.module.state_dict().items()}
        self._sw = self.work.module.state_dict()
        self.at(0.0)  # the work model starts as A

    @torch.no_grad()
    def at(self, lam: float) -> Model:
        """The work model set to theta(lam); exact endpoints at lam 0 and 1 (torch.lerp)."""
        for k, w in self._sw.items():
            if not w.is_floating_point():
                continue
            if self.offload:  # one tensor at a time: w <- A's values, then lerp toward B's on the device
                w.copy_(self._sa[k], non_blocking=True)
                w.lerp_(self._sb[k].to(w.device, non_blocking=True), lam)
            else:
                torch.lerp(self._sa[k], self._sb[k], lam, out=w)
        return self.work


def make_path(a: Model, b: Model, path: str = "weights", offload: bool = False,
              device: str | torch.device | None = None) -> LinearPath | CircuitPath:
    """The path between `a` and `b` of kind `path` (PATHS): LinearPath or engine.circuits.CircuitPath."""
    if path not in PATHS:
        raise LMCError(f"Path {path!r} is not a kind of path; choose one of: {', '.join(PATHS)}.")
    if path == "circuits":
        if offload:
            for m in (a, b):
                if any(t.device.type != "cpu" for t in m.module.state_dict().values()):
                    raise LMCError(f"Offloaded interpolation keeps the endpoints on the CPU, but "
                                   f"{m.name or 'a model'} does not live there; load it on the CPU.")
        return CircuitPath(a, b, device=device)
    return LinearPath(a, b, offload=offload, device=device)


def barrier_metrics(lambdas: list[float], loss: list[float]) -> dict[str, float]:
    """Barrier = max over the grid of L(theta(lam)) minus the chord; midpoint = its value at 0.5."""
    la, lb = loss[0], loss[-1]
    excess = [l - ((1 - t) * la + t * lb) for t, l in zip(lambdas, loss)]
    mid = min(range(len(lambdas)), key=lambda i: abs(lambdas[i] - 0.5))
    return {"barrier": max(excess), "midpoint_barrier": excess[mid], "excess": excess}


def accuracy_drop(lambdas: list[float], acc: list[float]) -> float:
    """Largest fall of accuracy below the chord between the endpoints (classifiers)."""
    return max((1 - t) * acc[0] + t * acc[-1] - a for t, a in zip(lambdas, acc))


def interpolate(a: Model, b: Model, es: EvalSet, points: int = 21, max_tokens: int | None = None,
                progress: Progress | None = None, offload: bool = False, device: str | torch.device | None = None,
                autocast: bool = False, cancel: CancelToken | None = None, path: str = "weights",
                train_es: EvalSet | None = None) -> dict:
    """Loss (and accuracy) along the path on `es`; the barrier fields of a result record.

    `max_tokens` and `autocast` go to every evaluation (engine.evaluate.evaluate); `offload` and
    `device` place the path (LinearPath). `path` is "weights" (the factored weights lerp: LinearPath)
    or "circuits" (each head's QK and OV circuits lerp: engine.circuits.CircuitPath, a model with
    heads twice as wide). `train_es`, when given, is evaluated at every point right after `es`, on the
    same model (one walk of the path): the train curve, fields train_loss, train_accuracy,
    train_barrier, train_midpoint_barrier, train_eval_set and train_eval_tokens | train_eval_images. `progress` hears of every grid point once
    both its evaluations are done; `cancel` is checked before each point, each evaluation and each
    evaluation batch (engine.cancel).
    """
    t0 = time.perf_counter()
    line = make_path(a, b, path, offload=offload, device=device)
    lambdas = grid(points)
    loss, acc, train_loss, train_acc = [], [], [], []
    for i, lam in enumerate(lambdas):
        check(cancel, f"interpolation, point {i + 1}/{points}")
        model = line.at(lam)
        r = evaluate(model, es, max_tokens, autocast, cancel=cancel)
        loss.append(r["loss"])
        acc.append(r["accuracy"])
        message = f"lambda = {lam:.2f}: loss {r['loss']:.4f}"
        if train_es is not None:
            check(cancel, f"interpolation, point {i + 1}/{points}, train split")
            rt = evaluate(model, train_es, max_tokens, autocast, cancel=cancel)
            train_loss.append(rt["loss"])
            train_acc.append(rt["accuracy"])
            message += f", train {rt['loss']:.4f}"
        if progress:
            progress(i + 1, points, message)
    m = barrier_metrics(lambdas, loss)
    out = {
        "path": path,
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
    }
    if train_es is not None:
        mt = barrier_metrics(lambdas, train_loss)
        out |= {
            "train_loss": train_loss,
            "train_accuracy": train_acc if train_es.task == "vit" else None,
            "train_barrier": mt["barrier"],
            "train_midpoint_barrier": mt["midpoint_barrier"],
            "train_eval_set": train_es.description,
            ("train_eval_images" if train_es.task == "vit" else "train_eval_tokens"): train_es.size,
        }
    out["interpolate_seconds"] = time.perf_counter() - t0
    return out
