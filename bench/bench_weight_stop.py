"""Weight matching's stopping rule and GL(d) step budgets, judged by the barrier they leave.

For each zoo pair, weight matching (default classes and settings) under each rule below, then the
aligned path's barrier on the test split. A rule sets the descent's stop (relative objective decrease of a
sweep that ends it: WeightSettings.stop_tol; the engine's own is REL_TOL of the work dtype, 1e-4 for these
float64-sized models) and engine.align.weight's INIT_REL_TOL (relative rise of the linearised objective
that ends the starting residual fit), and engine.align.solvers' GL_ITERS / GL_WARM_ITERS (L-BFGS steps
of a cold / warm-started GL(d) fit). The first rule is the engine's own.

Run: .venv/bin/python bench/bench_weight_stop.py [--pairs ...] [--lm-tokens N] [--points P]
(results go into bench/RESULTS.md by hand)
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.align import solvers, weight
from engine.align.run import align
from engine.align.weight import WeightSettings
from engine.api import load_named
from engine.evaluate import eval_set_for
from engine.interpolate import interpolate

PAIRS = ("lm-learned", "lm-none", "lm-rope", "vit-learned")
ENGINE = {"REL_TOL": None, "INIT_REL_TOL": weight.INIT_REL_TOL,
          "GL_ITERS": solvers.GL_ITERS, "GL_WARM_ITERS": solvers.GL_WARM_ITERS}
RULES = {  # label -> the constants changed from the engine's
    "engine": {},
    "stop 1e-3": {"REL_TOL": 1e-3},
    "stop 1e-5": {"REL_TOL": 1e-5},
    "starting fit 1e-7": {"INIT_REL_TOL": 1e-7},
    "cold GL 100": {"GL_ITERS": 100},
    "stop 1e-5, starting fit 1e-7, cold GL 100": {"REL_TOL": 1e-5, "INIT_REL_TOL": 1e-7, "GL_ITERS": 100},
}


def set_rule(change: dict) -> None:
    for k, v in (ENGINE | change).items():
        if k == "REL_TOL":
            continue  # a setting (WeightSettings.stop_tol), not a constant
        setattr(weight if k == "INIT_REL_TOL" else solvers, k, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lm-tokens", type=int, default=8192)
    ap.add_argument("--vit-images", type=int, default=1024)
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS))
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"engine: {ENGINE}; {args.lm_tokens} test tokens / {args.vit_images} test images, {args.points} points")
    print("| pair | rule | barrier / midpoint | final objective | sweeps | align seconds | stop |")
    print("|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        probe = load_named(f"{pair}-s0")
        es = eval_set_for(probe, "test", args.lm_tokens if probe.arch.task == "lm" else args.vit_images)
        for label in args.rules:
            set_rule(RULES[label])
            a, b = load_named(f"{pair}-s0"), load_named(f"{pair}-s1")
            t0 = time.perf_counter()
            st = WeightSettings(stop_tol=(ENGINE | RULES[label])["REL_TOL"])
            al = align(a, b, "weight", in_place=True, weight=st)
            dt = time.perf_counter() - t0
            r = interpolate(al.model_a, al.model_b, es, args.points)
            sw = al.out.info["sweeps"]
            print(f"| {pair} | {label} | {r['barrier']:.4f} / {r['midpoint_barrier']:.4f} | {sw[-1]['objective']:.6g} | "
                  f"{len(sw)} | {dt:.1f} | {al.out.info['stop']} |", flush=True)
    set_rule({})


if __name__ == "__main__":
    main()
