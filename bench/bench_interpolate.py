"""Interpolation cost: the preallocated path model vs re-creating a model per grid point.

Run: .venv/bin/python bench/bench_interpolate.py   (results go into bench/RESULTS.md by hand)
Both variants run in the same process, interleaved, so their ratio is meaningful on a shared machine.
"""

from __future__ import annotations

import copy
import time

import torch

from engine.evaluate import evaluate, lm_eval_set
from engine.interpolate import LinearPath
from engine.models.reference import build
from engine.train import lm_config


def recreate_at(a, b, lam):
    m = copy.deepcopy(a)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    m.module.load_state_dict({k: torch.lerp(sa[k], sb[k], lam) for k in sa})
    return m


def main(points: int = 21, repeats: int = 3) -> None:
    torch.set_num_threads(2)
    a, b = build(lm_config("rope"), seed=0), build(lm_config("rope"), seed=1)
    es = lm_eval_set("test", 8192)
    lambdas = [i / (points - 1) for i in range(points)]
    t_pre = t_new = t_eval = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = LinearPath(a, b)
        for lam in lambdas:
            path.at(lam)
        t_pre += time.perf_counter() - t0
        t0 = time.perf_counter()
        for lam in lambdas:
            recreate_at(a, b, lam)
        t_new += time.perf_counter() - t0
        t0 = time.perf_counter()
        evaluate(path.at(0.5), es)
        t_eval += time.perf_counter() - t0
    n = repeats * points
    print(f"weights per grid point: preallocated {1e3 * t_pre / n:.2f} ms, re-created {1e3 * t_new / n:.2f} ms "
          f"(ratio {t_new / t_pre:.1f}x)")
    print(f"evaluation: {repeats * es.size / t_eval:,.0f} tokens/s on {es.size:,} tokens (2 threads)")


if __name__ == "__main__":
    main()
