"""Zoo weight matching in units of a same-process matmul (the aligner only, 2 threads).

Run: .venv/bin/python bench/bench_zoo_weight.py [pair ...]   (default: lm-rope lm-learned vit-learned)
Each pair loads seed 0 and seed 1 and runs `align(a, b, "weight")` once; the unit is the best of five
2048 x 2048 float32 matmuls, measured before and after and averaged, so rows taken at different
machine loads stay comparable.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from bench_scale import matmul_seconds  # this script's directory is on sys.path when it runs

from engine.align.run import align
from engine.api import load_named


def main(pairs: list[str]) -> None:
    torch.set_num_threads(2)
    print("| pair | seconds | matmul units | sweeps | stop | load |\n|---|---|---|---|---|---|")
    for pair in pairs:
        a, b = load_named(f"{pair}-s0"), load_named(f"{pair}-s1")
        u0 = matmul_seconds()
        t = time.perf_counter()
        al = align(a, b, "weight")
        s = time.perf_counter() - t
        unit = (u0 + matmul_seconds()) / 2
        info = al.out.info
        print(f"| {pair} | {s:.2f} | {s / unit:.0f} (unit {unit * 1e3:.0f} ms) | {len(info['sweeps'])} | "
              f"{info['stop']} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["lm-rope", "lm-learned", "vit-learned"])
