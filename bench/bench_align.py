"""Alignment cost per method on a zoo pair (the aligner only; interpolation is bench_interpolate's).

Run: .venv/bin/python bench/bench_align.py [A B]   (results go into bench/RESULTS.md by hand)
"""

from __future__ import annotations

import sys
import time

import torch

from engine.align import METHODS
from engine.align.run import align
from engine.api import load_named


def main(a_name: str = "lm-rope-s0", b_name: str = "lm-rope-s1") -> None:
    torch.set_num_threads(2)
    a, b = load_named(a_name), load_named(b_name)
    print(f"{a_name} / {b_name}, 2 threads")
    for name, m in METHODS.items():
        t0 = time.perf_counter()
        out = align(a, b, name, (), m.default_steps, 0)
        print(f"{name:<11} {time.perf_counter() - t0:7.1f} s  (aligner's own timer {out.seconds:.1f} s, "
              f"steps {m.default_steps})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
