"""Weight-matching variants by barrier: head cost, MLP score and residual weighting (WeightSettings).

For each zoo pair: weight matching with the default classes and the default settings, then with each
variant alone (unsquared or normalised head costs, normalised MLP rows, per-block scaling of the
residual fit, embedding rows of the tokens seen in the training split only: language models), and
finally the two compatible variants with the lowest mean barrier together. Barrier and midpoint
barrier of the aligned path on the test split, and the seconds of the alignment.

Run: OMP_NUM_THREADS=2 .venv/bin/python bench/bench_weight_variants.py [--pairs lm-learned DIR_A,DIR_B ...]
     [--lm-tokens N] [--points P]
(results go into bench/RESULTS.md by hand)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from engine.align.run import align
from engine.align.weight import WeightSettings
from engine.api import load_named
from engine.data import default_splits
from engine.evaluate import eval_set_for
from engine.interpolate import interpolate

PAIRS = ("lm-learned", "lm-none", "lm-rope", "lm-sinusoidal", "vit-learned")
VARIANTS = {  # label -> the settings changed from the default (seen tokens filled in per pair)
    "head unsquared": {"head_cost": "unsquared"},
    "head normalised": {"head_cost": "normalised"},
    "MLP normalised rows": {"mlp_score": "normalised"},
    "per-block scaling": {"block_scale": True},
    "seen-token rows": {"seen_tokens": "train"},
}


def settings_for(change: dict, task: str, seen: frozenset[int]) -> WeightSettings | None:
    """The settings of a variant on a pair, or None where it does not apply (seen tokens on a ViT)."""
    if "seen_tokens" in change and task != "lm":
        return None
    return replace(WeightSettings(), **(change | ({"seen_tokens": seen} if "seen_tokens" in change else {})))


def endpoints(pair: str) -> tuple[str, str]:
    """A zoo pair's two seeds, or two model directories given as 'A,B'."""
    return tuple(pair.split(",")) if "," in pair else (f"{pair}-s0", f"{pair}-s1")


def run(pair: str, st: WeightSettings, es, points: int) -> tuple[float, float, float, int]:
    a, b = (load_named(x) for x in endpoints(pair))
    t0 = time.perf_counter()
    al = align(a, b, "weight", in_place=True, weight=st)
    dt = time.perf_counter() - t0
    r = interpolate(al.model_a, al.model_b, es, points)
    return r["barrier"], r["midpoint_barrier"], dt, len(al.out.info["sweeps"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lm-tokens", type=int, default=8192)
    ap.add_argument("--vit-images", type=int, default=1024)
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS),
                    help="zoo pairs (lm-learned: seeds 0 and 1) or two model directories 'A,B'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seen = frozenset(torch.unique(default_splits().split("train")).tolist())
    print(f"{args.lm_tokens} test tokens / {args.vit_images} test images, {args.points} points, {args.threads} "
          f"threads; {len(seen)} token ids occur in the training split")
    print("| pair | weight matching | barrier / midpoint | change of barrier | align time, sweeps |")
    print("|---|---|---|---|---|")
    barriers: dict[str, dict[str, float]] = {}
    sets: dict[str, object] = {}

    def row(pair: str, label: str, st: WeightSettings) -> None:
        bar, mid, dt, sweeps = run(pair, st, sets[pair], args.points)
        barriers.setdefault(label, {})[pair] = bar
        base = barriers["default"].get(pair)
        change = "-" if label == "default" else f"{bar - base:+.4f}"
        print(f"| {pair} | {label} | {bar:.4f} / {mid:.4f} | {change} | {dt:.1f} s, {sweeps} |", flush=True)

    for pair in args.pairs:
        probe = load_named(endpoints(pair)[0])
        sets[pair] = eval_set_for(probe, "test", args.lm_tokens if probe.arch.task == "lm" else args.vit_images)
        row(pair, "default", WeightSettings())
        for label, change in VARIANTS.items():
            st = settings_for(change, probe.arch.task, seen)
            if st is not None:
                row(pair, label, st)
    # the two compatible variants (different settings fields) with the lowest mean change over their pairs
    mean = {k: sum(v[p] - barriers["default"][p] for p in v) / len(v) for k, v in barriers.items() if k != "default"}
    ranked = sorted(mean, key=mean.get)
    first = ranked[0]
    second = next(k for k in ranked[1:] if not set(VARIANTS[k]) & set(VARIANTS[first]))
    label = f"{first} + {second}"
    print(f"mean change of barrier per variant: {', '.join(f'{k} {v:+.4f}' for k, v in mean.items())}")
    for pair in args.pairs:
        task = load_named(endpoints(pair)[0]).arch.task
        one, two = settings_for(VARIANTS[first], task, seen), settings_for(VARIANTS[second], task, seen)
        if one is None or two is None:
            continue
        row(pair, label, replace(one, **{k: getattr(two, k) for k in VARIANTS[second]}))


if __name__ == "__main__":
    main()
