"""More than two models: N >= 3 models of one architecture in one shared basis, the barrier between every
pair of them before and after, and the loss over the triangle of three (docs/MATH.md section 10).

Two ways to a shared basis, both built from weight matching (engine.align.weight) and the group action
(engine.symmetry.apply), so every aligned model computes its original function exactly:

    reference    model 0 stays as it is; every other model is weight-matched onto it
    barycentre   start from the reference alignment; then repeat: form the mean of the aligned models
                 and weight-match every model (model 0 too) onto the mean, until a round changes no
                 permutation (heads, MLP neurons, a residual permutation) or MAX_ROUNDS is reached

All models are first put into the coordinates the aligners work in (norms folded, or LayerNorm rewritten
as RMSNorm, when the residual stream is rotated: docs/MATH.md section 4.1), and every path, before and
after, runs in those coordinates, so the two barrier matrices compare like for like.

The barrier matrix walks the straight line between every pair on a small grid of lambdas (each model's
own loss evaluated once, as every path's endpoint); the triangle evaluates the loss at every point of a
barycentric grid of the simplex spanned by three aligned models, and at its centroid, in one work model.
Every loop reports (stage, done, total, message) ticks and checks a CancelToken before each unit of work
(a model matched, a grid point), as engine.plane does.

A run is one JSON record (`kind: "multi"`), written atomically and checked on reading (`check_record`);
the store's records live under cached_results/multi/.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.align.pair import Pair, model_for, prepare_pair
from engine.align.run import TOLERANCE  # the endpoint check's
from engine.align.solvers import residual_perm_of
from engine.align.weight import weight_match
from engine.cancel import CancelToken, check
from engine.classes import choose_classes
from engine.errors import ArchitectureMismatch, ExactnessError, LMCError
from engine.evaluate import EvalSet, evaluate
from engine.interpolate import LinearPath, _empty_copy, accuracy_drop, barrier_metrics, grid
from engine.models import Model, canonical
from engine.models.base import Arch, Params, check_same_architecture
from engine.results import MAX_RECORD_BYTES
from engine.spec import Spec, build_spec
from engine.symmetry import GroupElement, apply, identity

F64 = torch.float64
TOS = ("reference", "barycentre")  # the shared basis: model 0's, or the models' barycentre
MIN_MODELS = 3
MAX_ROUNDS = 20  # barycentre rounds: a safety cap, reaching it is recorded as not converged
POINTS = 5  # lambdas on each pairwise path, endpoints included (0, 0.25, 0.5, 0.75, 1)
MAX_POINTS = 101
PER_EDGE = 6  # points per edge of the triangle's barycentric grid: 6 * 7 / 2 = 21 points
MAX_PER_EDGE = 21
SCHEMA = 1

Stage = Callable[[str, int, int, str], None]  # (stage, done, total, message)


# ---------------------------------------------------------------------------------------------
# The models in the aligners' coordinates


@dataclass
class Prepared:
    """N models of one architecture in the coordinates the chosen classes act on (engine.align.pair)."""

    arch: Arch
    spec: Spec
    models: list[Model]  # each computes its original model's function
    params: list[Params]  # canonical views of `models`
    classes: frozenset[str]
    left_out: dict[str, str]
    rewrite: str  # "", "fold_norms" or "layernorm_to_rmsnorm"


def check_models(models: list[Model]) -> None:
    """At least MIN_MODELS models, all of model 0's architecture (one sentence otherwise)."""
    if len(models) < MIN_MODELS:
        raise LMCError(f"Aligning models into one basis takes at least {MIN_MODELS} models, not {len(models)}; "
                       "for two, align the pair.")
    for m in models[1:]:
        check_same_architecture(models[0], m)


def _untied(m: Model) -> Model:
    """A tied model with its own head E^T (the same function), as a reference-family twin."""
    p = dict(canonical(m))
    p["head.W"] = p["embed.tok"].T.clone()  # [D, V]
    return model_for(m, replace(m.arch, tied_embeddings=False, family="reference"), p)


def prepare(models: list[Model], classes: tuple[str, ...] = ()) -> Prepared:
    """Every model in the coordinates of weight matching's classes (`classes`, () for the default):
    prepare_pair of model 0 with each other model, on copies (the models passed in are not changed).

    Folding a tied model's final gain unties it unless the gain is 1, and a pair unties both of its models
    when only one of them unties; where that leaves the pairs in two forms, every model is untied."""
    check_models(models)
    choice = choose_classes(models[0].arch, "weight", classes)
    pairs = [prepare_pair(models[0], m, choice.classes) for m in models[1:]]
    out = [pairs[0].model_a] + [p.model_b for p in pairs]
    if len({p.arch for p in pairs}) > 1:
        out = [_untied(m) if m.arch.tied_embeddings else m for m in out]
    arch = out[0].arch
    params = [canonical(m, copy=False) for m in out]
    return Prepared(arch, build_spec(arch, params[0]), out, params, choice.classes, choice.left_out, pairs[0].rewrite)


# ---------------------------------------------------------------------------------------------
# One basis: to a reference, or to the barycentre (docs/MATH.md section 10)


def match(prep: Prepared, target: Params, i: int, cancel: CancelToken | None = None) -> tuple[GroupElement, dict]:
    """Weight matching (engine.align.weight.weight_match) of prepared model i onto `target`: g with
    g . theta_i close to target. The pair's model A stands in for the target, which no aligner reads."""
    pair = Pair(prep.arch, prep.spec, target, prep.params[i], prep.models[0], prep.models[i], prep.rewrite)
    return weight_match(pair, prep.classes, cancel=cancel)


def moved(prep: Prepared, g: GroupElement, i: int) -> Params:
    """g . theta_i (engine.symmetry.apply; membership is judged by the exactness check on the losses)."""
    return apply(prep.arch, g, prep.params[i], strict=False)


def mean(params: list[Params]) -> Params:
    """The mean of N parameter dicts, in float64."""
    return {k: sum(p[k].to(F64) for p in params) / len(params) for k in params[0]}


def spread(params: list[Params]) -> float:
    """(1/N) sum_i ||theta_i - mean||^2: how far the aligned models lie from their barycentre."""
    c = mean(params)
    return sum(float(((p[k].to(F64) - c[k]) ** 2).sum()) for p in params for k in c) / len(params)


def _units(prep: Prepared, g: GroupElement) -> torch.Tensor:
    """Every discrete choice of g as one vector: head and MLP permutations per layer, the residual permutation."""
    parts = [torch.cat([el.head_perm, el.mlp_perm]) for el in g.layers]
    if "residual_perm" in prep.classes:
        parts.append(residual_perm_of(g.residual))
    return torch.cat(parts)


def permutation_changes(prep: Prepared, old: list[GroupElement], new: list[GroupElement]) -> int:
    """How many units (heads, neurons, residual coordinates) changed partner between two sets of elements."""
    return sum(int((_units(prep, a) != _units(prep, b)).sum()) for a, b in zip(old, new))


def _diag(info: dict) -> dict:
    """What a record keeps of one weight matching: its sweeps and how it stopped."""
    return {"sweeps": len(info["sweeps"]), "converged": info["converged"], "stop": info["stop"]}


@dataclass
class Shared:
    """N models in one basis: g_i moves prepared model i there, `models[i]` computes g_i . theta_i."""

    prep: Prepared
    to: str
    elements: list[GroupElement]
    params: list[Params]
    models: list[Model]
    diagnostics: dict
    seconds: float


def to_reference(prep: Prepared, stage: Stage | None = None,
                 cancel: CancelToken | None = None) -> tuple[list[GroupElement], list[dict]]:
    """g_0 = the identity, g_i = weight matching of model i onto model 0."""
    n = len(prep.models)
    elements, infos = [identity(prep.arch)], [{"sweeps": 0, "converged": True, "stop": "the reference"}]
    for i in range(1, n):
        check(cancel, f"aligning to the reference, model {i + 1}/{n}")
        g, info = match(prep, prep.params[0], i, cancel)
        elements.append(g)
        infos.append(_diag(info))
        if stage:
            stage("align", i, n - 1, f"model {i + 1} onto model 1: {infos[-1]['sweeps']} sweep(s)")
    return elements, infos


def to_barycentre(prep: Prepared, max_rounds: int = MAX_ROUNDS, stage: Stage | None = None,
                  cancel: CancelToken | None = None) -> tuple[list[GroupElement], list[dict], dict]:
    """Alternating matching (docs/MATH.md section 10): from the reference alignment, each round matches every
    model onto the mean of the models as the last round aligned them; it stops after a round that changed no
    permutation, or after `max_rounds` (then `converged` is False)."""
    n = len(prep.models)
    elements, infos = to_reference(prep, stage, cancel)
    aligned = [moved(prep, g, i) for i, g in enumerate(elements)]
    rounds = [{"round": 0, "permutation_changes": None, "spread": spread(aligned)}]
    stop, converged = f"round cap ({max_rounds}) reached while permutations still changed", False
    for r in range(1, max_rounds + 1):
        target = mean(aligned)
        new, new_infos = [], []
        for i in range(n):
            check(cancel, f"barycentre round {r}, model {i + 1}/{n}")
            g, info = match(prep, target, i, cancel)
            new.append(g)
            new_infos.append(_diag(info))
            if stage:
                stage("align", i + 1, n, f"barycentre round {r}: model {i + 1}/{n}")
        changes = permutation_changes(prep, elements, new)
        elements, infos = new, new_infos
        aligned = [moved(prep, g, i) for i, g in enumerate(elements)]
        rounds.append({"round": r, "permutation_changes": changes, "spread": spread(aligned)})
        if changes == 0:
            stop, converged = "a round changed no permutation", True
            break
    return elements, infos, {"rounds": rounds, "stop": stop, "converged": converged, "max_rounds": max_rounds}


def align_models(models: list[Model], to: str = "reference", classes: tuple[str, ...] = (),
                 max_rounds: int = MAX_ROUNDS, stage: Stage | None = None, cancel: CancelToken | None = None,
                 prep: Prepared | None = None) -> Shared:
    """The models in one basis, `to` the reference (model 0) or the barycentre (see the module docstring)."""
    if to not in TOS:
        raise LMCError(f"A shared basis is {' or '.join(TOS)}, not {to!r}.")
    if not (isinstance(max_rounds, int) and max_rounds >= 1):
        raise LMCError(f"The barycentre takes at least one round, not {max_rounds!r}.")
    t0 = time.perf_counter()
    prep = prep or prepare(models, classes)
    if to == "reference":
        elements, infos = to_reference(prep, stage, cancel)
        diag: dict = {}
    else:
        elements, infos, diag = to_barycentre(prep, max_rounds, stage, cancel)
    params = [moved(prep, g, i) for i, g in enumerate(elements)]
    out = [model_for(prep.models[i], prep.arch, p) for i, p in enumerate(params)]
    diag = {"to": to, "matches": infos, **diag}
    if to == "reference":
        diag["spread"] = spread(params)
    return Shared(prep, to, elements, params, out, diag, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Pairwise barriers and the triangle


def check_points(points: int) -> None:
    if not (isinstance(points, int) and not isinstance(points, bool) and 3 <= points <= MAX_POINTS):
        raise LMCError(f"A pairwise path takes 3 to {MAX_POINTS} points (endpoints included), not {points!r}.")


def _tick(stage: Stage | None, name: str, done: int, total: int, message: str) -> None:
    if stage:
        stage(name, done, total, message)


@torch.no_grad()
def barrier_matrix(models: list[Model], es: EvalSet, points: int = POINTS, stage: Stage | None = None,
                   cancel: CancelToken | None = None, name: str = "barriers") -> dict:
    """The path between every pair on `points` lambdas: loss and accuracy per path, and the N x N barrier,
    midpoint barrier (and accuracy drop, classifiers) matrices, symmetric with a zero diagonal. Each
    model is evaluated once (the endpoint of its N - 1 paths)."""
    check_points(points)
    n, lambdas = len(models), grid(points)
    total = n + n * (n - 1) // 2 * (points - 2)
    ends = []
    for i, m in enumerate(models):
        check(cancel, f"{name}, model {i + 1}/{n}")
        ends.append(evaluate(m, es, cancel=cancel))
        _tick(stage, name, i + 1, total, f"model {i + 1}: loss {ends[-1]['loss']:.4f}")
    vit = es.task == "vit"
    zero = [[0.0] * n for _ in range(n)]
    barrier, mid, drop = [r[:] for r in zero], [r[:] for r in zero], [r[:] for r in zero] if vit else None
    paths, done = [], n
    for i in range(n):
        for j in range(i + 1, n):
            line = LinearPath(models[i], models[j])
            loss, acc = [ends[i]["loss"]], [ends[i]["accuracy"]]
            for lam in lambdas[1:-1]:
                check(cancel, f"{name}, path {i + 1}-{j + 1}, lambda {lam:.2f}")
                r = evaluate(line.at(lam), es, cancel=cancel)
                loss.append(r["loss"])
                acc.append(r["accuracy"])
                done += 1
                _tick(stage, name, done, total, f"path {i + 1}-{j + 1}, lambda {lam:.2f}: loss {r['loss']:.4f}")
            loss.append(ends[j]["loss"])
            acc.append(ends[j]["accuracy"])
            bm = barrier_metrics(lambdas, loss)
            barrier[i][j] = barrier[j][i] = bm["barrier"]
            mid[i][j] = mid[j][i] = bm["midpoint_barrier"]
            if vit:
                drop[i][j] = drop[j][i] = accuracy_drop(lambdas, acc)
            paths.append({"i": i, "j": j, "loss": loss, "accuracy": acc if vit else None})
    return {"lambdas": lambdas, "loss": [e["loss"] for e in ends],
            "accuracy": [e["accuracy"] for e in ends] if vit else None,
            "barrier": barrier, "midpoint_barrier": mid, "accuracy_drop": drop, "paths": paths}


def simplex_grid(per_edge: int = PER_EDGE) -> list[list[float]]:
    """The barycentric weights (w_0, w_1, w_2) = (i, j, k) / (per_edge - 1) with i + j + k = per_edge - 1,
    from vertex 0 to vertex 2: per_edge (per_edge + 1) / 2 points, the vertices exact."""
    if not (isinstance(per_edge, int) and not isinstance(per_edge, bool) and 2 <= per_edge <= MAX_PER_EDGE):
        raise LMCError(f"The triangle's grid takes 2 to {MAX_PER_EDGE} points per edge, not {per_edge!r}.")
    n = per_edge - 1
    return [[i / n, j / n, (n - i - j) / n] for i in range(n, -1, -1) for j in range(n - i, -1, -1)]


@torch.no_grad()
def triangle(models: list[Model], es: EvalSet, per_edge: int = PER_EDGE, stage: Stage | None = None,
             cancel: CancelToken | None = None) -> dict:
    """The loss (and accuracy) at every point w of the barycentric grid of the triangle of three models,
    theta(w) = w_0 theta_0 + w_1 theta_1 + w_2 theta_2, and at its centroid; the excess of each point over
    the plane through the vertices' losses, sum_i w_i L_i, and its largest value (the triangle's barrier)."""
    if len(models) != 3:
        raise LMCError(f"A triangle has three models, not {len(models)}.")
    for m in models[1:]:
        check_same_architecture(models[0], m)
    ws = simplex_grid(per_edge)
    points = ws + [[1 / 3, 1 / 3, 1 / 3]]
    work = _empty_copy(models[0], next(models[0].module.parameters()).device)
    s0, s1, s2 = (m.module.state_dict() for m in models)
    sw = work.module.state_dict()
    loss, acc = [], []
    for k, w in enumerate(points):
        check(cancel, f"triangle, point {k + 1}/{len(points)}")
        for key, t in sw.items():
            if t.is_floating_point():
                t.copy_(s0[key]).mul_(w[0]).add_(s1[key], alpha=w[1]).add_(s2[key], alpha=w[2])
        r = evaluate(work, es, cancel=cancel)
        loss.append(r["loss"])
        acc.append(r["accuracy"])
        _tick(stage, "triangle", k + 1, len(points), f"point {k + 1}/{len(points)}: loss {r['loss']:.4f}")
    vertex = [loss[ws.index(v)] for v in ([1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0])]
    excess = [l - sum(wi * li for wi, li in zip(w, vertex)) for w, l in zip(points, loss)]
    vit = es.task == "vit"
    return {"per_edge": per_edge, "weights": ws, "loss": loss[:-1], "accuracy": acc[:-1] if vit else None,
            "excess": excess[:-1], "barrier": max(excess[:-1]), "vertex_loss": vertex,
            "centroid": {"loss": loss[-1], "accuracy": acc[-1] if vit else None, "excess": excess[-1]}}


# ---------------------------------------------------------------------------------------------
# A run and its record


def _finite(x) -> bool:
    """Whether every number in a nested structure of lists and dicts is finite (None and text pass)."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return True
    if isinstance(x, (int, float)):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return True


def run(models: list[Model], to: str, es: EvalSet, points: int = POINTS, per_edge: int = PER_EDGE,
        classes: tuple[str, ...] = (), max_rounds: int = MAX_ROUNDS, stage: Stage | None = None,
        cancel: CancelToken | None = None) -> dict:
    """Align `models` into one basis `to` (TOS), the barrier matrices of the models before (as trained, in
    the aligners' coordinates) and after, and the triangle of the first three aligned models: a record's
    body. Refused in one sentence: fewer than three models, two architectures, a loss that is not finite
    (an overflowing model or path), an aligned model whose loss differs from its original's (ExactnessError)."""
    check_models(models)
    if to not in TOS:
        raise LMCError(f"A shared basis is {' or '.join(TOS)}, not {to!r}.")
    simplex_grid(per_edge)  # the grids are checked before any work
    check_points(points)
    t0 = time.perf_counter()
    own = []
    for i, m in enumerate(models):
        check(cancel, f"measuring model {i + 1}/{len(models)}")
        own.append(evaluate(m, es, cancel=cancel)["loss"])
        if not math.isfinite(own[-1]):
            raise LMCError(f"Model {m.name or i + 1} has a loss that is not finite ({own[-1]}) on {es.description}; "
                           "its weights overflow, so no barrier can be measured.")
        _tick(stage, "measure", i + 1, len(models), f"model {i + 1}: loss {own[-1]:.4f}")
    t_measure = time.perf_counter() - t0
    prep = prepare(models, classes)
    t1 = time.perf_counter()
    before = barrier_matrix(prep.models, es, points, stage, cancel, name="barriers before")
    t_before = time.perf_counter() - t1
    shared = align_models(models, to, classes, max_rounds, stage, cancel, prep=prep)
    t1 = time.perf_counter()
    after = barrier_matrix(shared.models, es, points, stage, cancel, name="barriers after")
    t_after = time.perf_counter() - t1
    dtype = next(models[0].module.parameters()).dtype
    tol = TOLERANCE.get(dtype, 1e-4)
    exact = []
    for i, (m, l0, l1) in enumerate(zip(models, own, after["loss"])):
        rel = abs(l1 - l0) / max(abs(l0), 1e-30)
        exact.append({"loss": l0, "loss_aligned": l1, "rel_diff": rel})
        if rel > tol:
            raise ExactnessError(f"Aligning model {m.name or i + 1} into the shared basis changed its loss from "
                                 f"{l0:.6g} to {l1:.6g} (relative {rel:.1e} > {tol:.0e}): the transform is not a "
                                 "symmetry of the model.")
    t1 = time.perf_counter()
    tri = triangle(shared.models[:3], es, per_edge, stage, cancel)
    t_tri = time.perf_counter() - t1
    body = {
        "kind": "multi", "schema": SCHEMA, "models": [m.name or f"model {i + 1}" for i, m in enumerate(models)],
        "to": to, "task": models[0].arch.task, "arch": models[0].arch.to_dict(), "classes": sorted(prep.classes),
        "classes_left_out": prep.left_out, "rewrite": prep.rewrite, "eval_set": es.description,
        ("eval_images" if es.task == "vit" else "eval_tokens"): es.size, "lambdas": before["lambdas"],
        "before": {k: v for k, v in before.items() if k != "lambdas"},
        "after": {k: v for k, v in after.items() if k != "lambdas"},
        "triangle": {"models": [0, 1, 2]} | tri,
        "exactness": {"tolerance": tol, "models": exact},
        "alignment": shared.diagnostics,
        "timings": {"measure": round(t_measure, 3), "barriers_before": round(t_before, 3),
                    "align": round(shared.seconds, 3), "barriers_after": round(t_after, 3),
                    "triangle": round(t_tri, 3)},
    }
    if not _finite(body):
        raise LMCError("A loss over the models' paths or triangle is not finite (an interpolated model "
                       "overflows); no record was made.")
    return body


def make_record(body: dict, device: str, dtype: str) -> dict:
    """The record of a run: its body, provenance and time of creation."""
    from engine.results import provenance

    return body | {"provenance": provenance(device, dtype),
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _matrix_problem(x, n: int, what: str) -> str | None:
    if not (isinstance(x, list) and len(x) == n and all(isinstance(r, list) and len(r) == n for r in x)):
        return f"its {what} is not a {n} x {n} matrix"
    if not _numbers(x):
        return f"its {what} holds a value that is not a finite number"
    if any(x[i][i] != 0 for i in range(n)) or any(x[i][j] != x[j][i] for i in range(n) for j in range(n)):
        return f"its {what} is not symmetric with a zero diagonal"
    return None


def _numbers(x) -> bool:
    """A non-empty nest of lists of finite numbers."""
    if isinstance(x, list):
        return bool(x) and all(_numbers(v) for v in x)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record_problem(rec: dict) -> str | None:
    """Why `rec` is not a usable multi-model record (a phrase), or None."""
    if rec.get("kind") != "multi":
        return "it is not a multi-model record (kind is not 'multi')"
    if rec.get("schema") != SCHEMA:
        return f"its schema is {rec.get('schema')!r}, not {SCHEMA}"
    names = rec.get("models")
    if not (isinstance(names, list) and len(names) >= MIN_MODELS and all(isinstance(s, str) and s for s in names)):
        return f"it does not name at least {MIN_MODELS} models"
    n = len(names)
    if rec.get("to") not in TOS:
        return f"its basis is {rec.get('to')!r}, not one of {', '.join(TOS)}"
    if rec.get("task") not in ("lm", "vit"):
        return f"its task is {rec.get('task')!r}"
    lam = rec.get("lambdas")
    if not (_numbers(lam) and len(lam) >= 3 and lam[0] == 0 and lam[-1] == 1):
        return "its lambdas are not a grid from 0 to 1"
    vit = rec["task"] == "vit"
    for side in ("before", "after"):
        s = rec.get(side)
        if not isinstance(s, dict):
            return f"it has no '{side}' matrices"
        for key in ("barrier", "midpoint_barrier") + (("accuracy_drop",) if vit else ()):
            why = _matrix_problem(s.get(key), n, f"{side} {key.replace('_', ' ')}")
            if why:
                return why
        if not (_numbers(s.get("loss")) and len(s["loss"]) == n):
            return f"its {side} losses are not {n} finite numbers"
    tri = rec.get("triangle")
    if not isinstance(tri, dict):
        return "it has no triangle"
    k, ws = tri.get("per_edge"), tri.get("weights")
    if not (isinstance(k, int) and 2 <= k <= MAX_PER_EDGE and ws == simplex_grid(k)):
        return "its triangle's weights are not the barycentric grid of its points per edge"
    for key in ("loss", "excess") + (("accuracy",) if vit else ()):
        if not (_numbers(tri.get(key)) and len(tri[key]) == len(ws)):
            return f"its triangle's {key} is not one finite number per grid point"
    c = tri.get("centroid")
    if not (isinstance(c, dict) and _numbers([c.get("loss"), c.get("excess")])):
        return "its triangle has no finite centroid loss"
    t = tri.get("models")
    if not (isinstance(t, list) and len(t) == 3 and all(isinstance(i, int) and 0 <= i < n for i in t)):
        return "its triangle does not name three of its models"
    if not (isinstance(rec.get("classes"), list) and all(isinstance(c, str) for c in rec["classes"])
            and isinstance(rec.get("eval_set"), str)):
        return "it does not say which classes and evaluation set it used"
    ex = (rec.get("exactness") or {}).get("models")
    if not (isinstance(ex, list) and len(ex) == n and all(isinstance(e, dict) and _numbers([e.get("rel_diff")])
                                                          for e in ex)):
        return f"its exactness check does not hold {n} finite relative differences"
    al = rec.get("alignment")
    if not (isinstance(al, dict) and al.get("to") == rec["to"]):
        return "its alignment does not say which basis it reached"
    if rec["to"] == "barycentre" and not (isinstance(al.get("rounds"), list) and len(al["rounds"]) >= 2
                                          and isinstance(al.get("stop"), str)):
        return "its barycentre alignment has no rounds"
    return None


def check_record(rec: dict, name: str = "Multi-model record") -> dict:
    """`rec` if it is a usable multi-model record, else an LMCError naming `name` and the problem."""
    why = record_problem(rec)
    if why:
        raise LMCError(f"{name} is unusable: {why}.")
    return rec


def read_record(f: Path) -> dict:
    """A multi-model record from a JSON file, checked (LMCError naming the file otherwise)."""
    from engine.models.io import read_json_object

    name = f"Multi-model record {f}"
    return check_record(read_json_object(Path(f), name, max_bytes=MAX_RECORD_BYTES, kind="a multi-model record"), name)


def write_record(rec: dict, f: Path) -> Path:
    """Check `rec` and write it atomically as JSON (no NaN: check_record refused it)."""
    from engine.models.io import write_json_atomic

    check_record(rec)
    return write_json_atomic(Path(f), rec, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# The store: cached_results/multi/, one record per set of zoo models and basis


SETS = (("vit-learned-s0", "vit-learned-s1", "vit-learned-s2"),)  # the zoo's: three seeds of one recipe


def store_dir(root: Path | None = None) -> Path:
    from engine.results import cache_dir

    return Path(root or cache_dir()) / "multi"


def store_file(names: list[str] | tuple[str, ...], to: str, root: Path | None = None) -> Path:
    return store_dir(root) / f"{'__'.join(names)}__{to}.json"


def stored(root: Path | None = None) -> tuple[list[dict], list[str]]:
    """Every usable stored record (sorted by models, reference before barycentre) and a sentence per file
    skipped as unusable or not holding what its name says."""
    d = store_dir(root)
    recs, skipped = [], []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            rec = read_record(f)
        except LMCError as e:
            skipped.append(str(e))
            continue
        if f.name != store_file(rec["models"], rec["to"], root).name:
            skipped.append(f"Multi-model record {f} holds {', '.join(rec['models'])} to the {rec['to']}, not what "
                           "its name says.")
            continue
        recs.append(rec)
    recs.sort(key=lambda r: (r["models"], TOS.index(r["to"])))
    return recs, skipped


def store_stamp(root: Path | None = None) -> int:
    """Changes when a stored record is written: a cache key for `stored`."""
    d = store_dir(root)
    return hash(tuple((f.name, f.stat().st_mtime_ns) for f in sorted(d.glob("*.json")))) if d.is_dir() else 0


def mismatch(archs: list[Arch], labels: list[str], names: list[str]) -> None:
    """Refuse, from the configs, N models of more than one kind or shape (ArchitectureMismatch naming the first)."""
    for i in range(1, len(archs)):
        if labels[i] != labels[0]:
            raise ArchitectureMismatch(f"Model {names[i]} is a {labels[i]} and model {names[0]} a {labels[0]}: only "
                                       "models of one kind can share a basis.")
        diff = archs[0].mismatch(archs[i])
        if diff is not None:
            raise ArchitectureMismatch(f"Models {names[0]} and {names[i]} are of different shapes ({diff}), so they "
                                       "cannot share a basis.")
