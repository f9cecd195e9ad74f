"""Default classes on the zoo LM pairs: naive in both coordinates, weight matching per residual choice.

For each LM pair: the naive barrier on the native path and in the aligned runs' coordinates (norm
gains folded), then weight matching with the residual stream permuted (what the engine did for
LayerNorm models before residual rotations became the default), rotated (the default wherever it is
exact) and, under sinusoidal PE where no residual map is exact, left alone (the default there) next
to the two approximate choices with the endpoint change they cause.

Run: .venv/bin/python bench/bench_defaults.py [--eval-items N] [--points P] [--pairs pe ...]
(results go into bench/RESULTS.md by hand)
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.api import run_pair
from engine.results import RunConfig

WITHIN = ("heads", "mlp", "qk", "vo")
VARIANTS = {  # label -> classes (() = the default)
    "residual permuted": (*WITHIN, "residual_perm"),
    "residual rotated": (*WITHIN, "residual_orth"),
    "no residual map": WITHIN,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-items", type=int, default=16_384)
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--pairs", nargs="+", default=["learned", "none", "rope", "sinusoidal"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.eval_items} test tokens, {args.points} points, {args.threads} threads")
    print("| pair | run | classes | barrier / midpoint | endpoint change of B | time |")
    print("|---|---|---|---|---|---|")
    for pe in args.pairs:
        a, b = f"lm-{pe}-s0", f"lm-{pe}-s1"
        common = {"points": args.points, "eval_items": args.eval_items, "device": "cpu"}
        t0 = time.perf_counter()
        rec = run_pair(RunConfig(a, b, "naive", **common))
        dt = time.perf_counter() - t0
        print(f"| lm-{pe} | naive, native | - | {rec['barrier']:.4f} / {rec['midpoint_barrier']:.4f} | - | {dt:.0f} s |")
        print(f"| lm-{pe} | naive, aligned coordinates ({rec['folded_rewrite'] or 'same'}) | - | "
              f"{rec['barrier_folded']:.4f} / {rec['midpoint_barrier_folded']:.4f} | - | |", flush=True)
        default: list[str] = []
        for label, classes in [("weight, default", ())] + [(f"weight, {k}", v) for k, v in VARIANTS.items()]:
            if classes and sorted(classes) == default:
                continue  # the default run above
            t0 = time.perf_counter()
            rec = run_pair(RunConfig(a, b, "weight", classes=classes, **common))
            dt = time.perf_counter() - t0
            default = default or rec["classes"]
            chk = rec["endpoint_check"]
            change = f"{chk['rel_diff']:.1e}" + (" (approximate)" if chk["approximate_classes"] else "")
            sweeps = len(rec["alignment"]["diagnostics"].get("sweeps", []))
            print(f"| lm-{pe} | {label} | {' '.join(c.replace('residual_', 'r_') for c in rec['classes'])} | "
                  f"{rec['barrier']:.4f} / {rec['midpoint_barrier']:.4f} | {change} | {dt:.0f} s, {sweeps} sweeps |",
                  flush=True)


if __name__ == "__main__":
    main()
