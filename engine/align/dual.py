"""Dual learned matching: both models learn a transform toward one shared path (MATH.md section 4).

    min over g_A, g_B   E_{lam ~ U(0.4, 0.6)}  L((1 - lam) g_A theta_A + lam g_B theta_B)

Every action is linear in the weights and an exact symmetry, so for every lam

    L((1 - lam) g_A theta_A + lam g_B theta_B) = L(g_A [(1 - lam) theta_A + lam g_A^{-1} g_B theta_B])
                                               = L((1 - lam) theta_A + lam g_A^{-1} g_B theta_B):

the dual optimum is the one-sided optimum over the relative transform g_A^{-1} g_B, and the path is
reported in A's frame with that relative transform. This file checks the identity numerically
(float64, on a validation batch) and, at the same step budget, data and lam sequence, runs the
one-sided optimiser too: any difference between the two is an optimisation effect, reported.
"""

from __future__ import annotations

import copy

import torch

from engine.align.common import F64, AlignContext, AlignOutput, Pair, functional_logits, tick, twin, val_batch
from engine.align.learned import CHUNK, DEFAULT_STEPS, mean_loss, optimise, relative
from engine.align.weight import weight_match
from engine.symmetry import GroupElement, apply

IDENTITY_LAMBDAS = (0.25, 0.5, 0.75)
IDENTITY_ITEMS = {"lm": 1024, "vit": 128}


def dual_identity(pair: Pair, g_a: GroupElement, g_b: GroupElement,
                  lambdas: tuple[float, ...] = IDENTITY_LAMBDAS) -> dict:
    """Both sides of the dual/one-sided identity at each lam, in float64, and their relative gap."""
    arch = pair.arch
    tw = copy.deepcopy(twin(pair.model_a))
    tw.module.to(F64)
    x, y = val_batch(arch, IDENTITY_ITEMS[arch.task])
    dev = next(tw.module.parameters()).device
    pa = {k: v.detach().to(dev, F64) for k, v in pair.params_a.items()}
    pb = {k: v.detach().to(dev, F64) for k, v in pair.params_b.items()}
    ta, tb = apply(arch, g_a, pa), apply(arch, g_b, pb)
    rel = apply(arch, relative(arch, g_a, g_b), pb)
    dual, one_sided, logit_err = [], [], []
    for lam in lambdas:
        mids = [{k: (1 - lam) * p[k] + lam * q[k] for k in p} for p, q in ((ta, tb), (pa, rel))]
        for out, mid in zip((dual, one_sided), mids):
            out.append(mean_loss(lambda inp, mid=mid: functional_logits(tw, mid, inp), x, y))
        with torch.no_grad():  # the mean loss washes out 1e-16 differences; the logits show them
            la, lb = (functional_logits(tw, mid, x[:CHUNK]) for mid in mids)
        logit_err.append(float((la - lb).abs().max() / lb.abs().max()))
    err = max(abs(u - v) / abs(v) for u, v in zip(dual, one_sided))
    return {"lambdas": list(lambdas), "loss_dual": dual, "loss_one_sided": one_sided, "max_relative_error": err,
            "max_logit_relative_error": max(logit_err)}

def align_dual(ctx: AlignContext) -> AlignOutput:
    """Dual learned matching (registry entry `dual`); returns g_A^{-1} g_B and A's own g_A."""
    t = tick()
    steps = ctx.steps or DEFAULT_STEPS
    g0, _ = weight_match(ctx.pair, ctx.classes, ctx.qk_structure)
    res = optimise(ctx, g0, dual=True, steps=steps)
    g_a, g_b = res["g_a"], res["g_b"]
    info = {k: res[k] for k in ("steps", "best_step", "best_val_midpoint_loss", "history")}
    info["identity"] = dual_identity(ctx.pair, g_a, g_b)
    info["seconds"] = t()
    if ctx.compare_one_sided:
        one = optimise(ctx, g0, dual=False, steps=steps)
        info["one_sided_same_budget"] = {
            "steps": steps, "best_val_midpoint_loss": one["best_val_midpoint_loss"], "history": one["history"],
            "dual_minus_one_sided": res["best_val_midpoint_loss"] - one["best_val_midpoint_loss"],
        }
    return AlignOutput(relative(ctx.pair.arch, g_a, g_b), info, g_a=g_a)
