"""Dual learned matching: both models learn a transform toward one shared path (docs/MATH.md section 4.5).

    min over g_A, g_B   E_lam  L((1 - lam) g_A theta_A + lam g_B theta_B)   (lam as learned.sample_lambda draws it)

Every action is linear in the weights and an exact symmetry, so for every lam

    L((1 - lam) g_A theta_A + lam g_B theta_B) = L(g_A [(1 - lam) theta_A + lam g_A^{-1} g_B theta_B])
                                               = L((1 - lam) theta_A + lam g_A^{-1} g_B theta_B):

the dual optimum is the one-sided optimum over the relative transform g_A^{-1} g_B, and the path is
reported in A's frame with that relative transform. This file checks the identity numerically on a
validation batch: in float64 for models up to IDENTITY_F64_MAX_PARAMS parameters, in the model's
compute dtype above (float32 at least; a float64 copy of a large model is what the memory budget
forbids), each block moved and mixed when the forward pass reaches it (learned.path_losses), with a
tolerance for that dtype; the record says which. Unless the context turns it off
(`compare_one_sided`, it doubles the cost) or the run has a time budget (the dual optimisation spends
it; the record says the comparison was skipped), it also runs the one-sided optimiser for the same
number of steps, on the same data and lam sequence: any difference between the two is an
optimisation effect, reported. `cache build` hands it the pair's stored one-sided learned record where
that ran this very optimisation (AlignContext.one_sided), which halves a dual record's cost.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from engine.align.batches import val_batch
from engine.align.context import F64, AlignContext, AlignOutput, tick
from engine.align.forward import twin
from engine.align.learned import (
    RECORD,
    TASK_STEPS,
    compute_dtype,
    items_per_pass,
    moved_ends,
    optimise,
    path_logits,
    path_losses,
    relative,
    start_record,
    starting_point,
)
from engine.align.learned import scratch_bytes as learned_scratch
from engine.align.pair import Pair
from engine.models.base import Arch
from engine.progress import relabel
from engine.results import MAX_STEPS
from engine.symmetry import GroupElement

IDENTITY_LAMBDAS = (0.25, 0.5, 0.75)
IDENTITY_ITEMS = {"lm": 1024, "vit": 128}
IDENTITY_LOGIT_ITEMS = 2  # sequences / images whose logits are compared (kept for every lam and both sides)
IDENTITY_F64_MAX_PARAMS = 20_000_000  # above this the check runs in the model's dtype
IDENTITY_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}  # relative, as the exactness guard's


def dual_identity(pair: Pair, g_a: GroupElement, g_b: GroupElement,
                  lambdas: tuple[float, ...] = IDENTITY_LAMBDAS) -> dict:
    """Both sides of the dual/one-sided identity at each lam, their relative gap, and whether it is
    within the tolerance of the dtype the check ran in (float64 for small models)."""
    arch = pair.arch
    tw = twin(pair.model_a)
    ref = next(tw.module.parameters())
    n_params = sum(v.numel() for v in pair.params_a.values())
    dtype = F64 if n_params <= IDENTITY_F64_MAX_PARAMS else compute_dtype(ref.dtype)
    if dtype == F64 and ref.dtype != F64:  # a small model: a float64 twin (a large one's stages widen its weights)
        tw = copy.deepcopy(tw)
        tw.module.to(dtype)
    x, y = val_batch(arch, IDENTITY_ITEMS[arch.task])
    per_pass = items_per_pass(arch, x, dtype)
    pa = {k: v.detach().to(ref.device) for k, v in pair.params_a.items()}
    pb = {k: v.detach().to(ref.device) for k, v in pair.params_b.items()}
    keys = list(pa)
    losses: dict[str, list[float]] = {}
    logits: dict[str, list[Tensor]] = {}
    # each block moved and mixed when the forward pass reaches it: no whole moved or mixed copy
    for side, (g0, g1) in (("dual", (g_a, g_b)), ("one_sided", (None, relative(arch, g_a, g_b)))):
        ends = moved_ends(pair.spec, pa, pb, g0, g1, dtype)
        losses[side] = path_losses(tw, keys, ends, lambdas, x, y, per_pass, dtype)
        # the mean loss washes out 1e-16 differences; the logits show them
        logits[side] = path_logits(tw, keys, ends, lambdas, x[:IDENTITY_LOGIT_ITEMS], dtype)
    dual, one_sided = losses["dual"], losses["one_sided"]
    logit_err = [float((la - lb).abs().max() / lb.abs().max()) for la, lb in zip(logits["dual"], logits["one_sided"])]
    err = max(abs(u - v) / abs(v) for u, v in zip(dual, one_sided))
    tol = IDENTITY_TOLERANCE.get(dtype, IDENTITY_TOLERANCE[torch.float32])
    return {"lambdas": list(lambdas), "loss_dual": dual, "loss_one_sided": one_sided, "max_relative_error": err,
            "max_logit_relative_error": max(logit_err), "dtype": str(dtype).removeprefix("torch."),
            "tolerance": tol, "holds": max(err, max(logit_err)) <= tol}


def align_dual(ctx: AlignContext) -> AlignOutput:
    """Dual learned matching (registry entry `dual`); returns g_A^{-1} g_B and A's own g_A."""
    t = tick()
    steps = ctx.steps or TASK_STEPS[ctx.pair.arch.task]
    s = starting_point(ctx)
    t_init = t()
    # a time budget is the whole run's: the dual optimisation spends it, and a comparison as long again would
    # double the wall time the user asked for, so it runs only under a step budget (as every stored record has)
    compare = ctx.compare_one_sided and ctx.time_budget_s is None
    # one stretch of progress for both optimisations: the dual steps, then the one-sided comparison's
    unit = steps if steps < MAX_STEPS else 1000  # without a step cap, progress is per mille of the time budget
    total = 2 * unit if compare else unit
    res = optimise(ctx, s.g_b, dual=True, steps=steps, time_budget_s=ctx.time_budget_s,
                   progress=relabel(ctx.progress, "dual: ", total=total), g0_a=s.g_a, start_file=s.file)
    g_a, g_b = res["g_a"], res["g_b"]
    info = {k: res[k] for k in RECORD}
    info["identity"] = dual_identity(ctx.pair, g_a, g_b)
    info["seconds"], info["init_seconds"] = t() + res["earlier_seconds"], t_init  # a resumed run counts its earlier part
    info |= start_record(s)
    if not compare:
        why = (f"the {ctx.time_budget_s:g} s time budget went to the dual optimisation" if ctx.compare_one_sided
               else "the run skipped it (--skip-comparison)")
        if res["steps_done"]:
            info["one_sided_skipped"] = (f"{why}; `--method learned --steps {res['steps_done']}` runs the one-sided "
                                         "one for as many steps")
        else:
            info["one_sided_skipped"] = f"{why}, which ended before the first step: there is no step to compare"
    if compare:  # the steps the dual run did, without a clock: the same budget
        done = res["steps_done"]
        taken = ctx.one_sided is not None and ctx.one_sided["steps"] == done
        # the same optimisation, data and lam sequence as a learned run of `done` steps: an equal one is taken
        one = ctx.one_sided if taken else optimise(
            ctx, s.one_sided(ctx.pair.arch), dual=False, steps=done, phase="one_sided",
            progress=relabel(ctx.progress, "one-sided comparison: ", offset=done, total=2 * done), start_file=s.file)
        info["one_sided_same_budget"] = {"from_learned_record": taken,
            "steps": res["steps_done"], "best_val_midpoint_loss": one["best_val_midpoint_loss"],
            "best_val_barrier": one["best_val_barrier"], "history": one["history"],
            "dual_minus_one_sided": res["best_val_midpoint_loss"] - one["best_val_midpoint_loss"],
            "dual_minus_one_sided_barrier": res["best_val_barrier"] - one["best_val_barrier"],
        }
    return AlignOutput(relative(ctx.pair.arch, g_a, g_b), info, g_a=g_a)


def scratch_bytes(arch: Arch, params: int, layer_params: int, itemsize: int, batch: int | None = None) -> int:
    """Peak scratch beyond the two models (bytes), from the config alone (registry entry `dual`): learned
    matching's with both sides' latents and parameters."""
    return learned_scratch(arch, params, layer_params, itemsize, sides=2, batch=batch)
