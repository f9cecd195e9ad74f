"""The circuit path against the weight path on zoo pairs, before and after alignment.

Run: .venv/bin/python bench/bench_circuits.py [--pairs lm-learned lm-none] [--method weight] [--points 11]
     [--eval-items 16384]   (results go into bench/RESULTS.md by hand)

Each pair is aligned once (B moved onto A with the method's default classes); the naive and the
aligned pair are then interpolated on both paths with the same evaluation set. The naive rows use the
models' own coordinates, the aligned rows the aligner's (norm-folded where the residual is rotated).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.align.run import align
from engine.api import load_named
from engine.evaluate import eval_set_for
from engine.interpolate import interpolate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", nargs="+", default=["lm-learned", "lm-none"], help="zoo pair stems (seeds 0 and 1)")
    ap.add_argument("--method", default="weight")
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--eval-items", type=int, default=16_384)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| pair | alignment | path | barrier | midpoint barrier | accuracy drop | seconds |")
    print("|---|---|---|---|---|---|---|")
    for stem in args.pairs:
        a, b = load_named(f"{stem}-s0"), load_named(f"{stem}-s1")
        es = eval_set_for(a, "test", args.eval_items)
        al = align(a, b, args.method)
        for tag, (ma, mb) in (("naive", (a, b)), (args.method, (al.model_a, al.model_b))):
            for path in ("weights", "circuits"):
                t0 = time.perf_counter()
                r = interpolate(ma, mb, es, args.points, path=path)
                drop = "-" if r["accuracy_drop"] is None else f"{100 * r['accuracy_drop']:.1f} pt"
                print(f"| {stem} | {tag} | {path} | {r['barrier']:.4f} | {r['midpoint_barrier']:.4f} | {drop} | "
                      f"{time.perf_counter() - t0:.0f} |", flush=True)
        print(f"<!-- {stem}: {es.description}, {args.points} points, classes {', '.join(sorted(al.classes))} -->")


if __name__ == "__main__":
    main()
