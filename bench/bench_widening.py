"""bfloat16 weights on this CPU: evaluated natively in bfloat16, widened to float32 per block
(engine.models.widening), and held in float32, against a float32 matmul measured alongside.

Run: .venv/bin/python bench/bench_widening.py [MODEL ...]   (zoo names or model directories; default: the
medium zoo LM lm-learned-medium-s0, stored in bfloat16). Everything runs in one process, the three ways
interleaved (best of --repeats), so the ratios are meaningful on a shared machine. Results go into
bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    from bench_scale import matmul_seconds  # the same 2048^3 float32 reference

    from engine.api import load_named
    from engine.evaluate import evaluate, lm_eval_set
    from engine.models import widening

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["lm-learned-medium-s0"])
    ap.add_argument("--tokens", type=int, default=4096, help="scored tokens per evaluation")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, bfloat16 products native: "
          f"{widening.fast_half(torch.bfloat16, torch.device('cpu'))}")
    for name in args.models:
        m16, m32 = load_named(name, "bfloat16"), load_named(name, "float32")
        es = lm_eval_set("test", args.tokens, n_ctx=min(128, m32.arch.n_ctx))
        row: dict = {"model": name, "tokens": es.size}
        ways = {"float32": (m32, None), "bfloat16 native": (m16, False), "bfloat16 widened": (m16, True)}
        best = {k: float("inf") for k in ways}
        unit = matmul_seconds()
        for _ in range(args.repeats):
            for k, (m, force) in ways.items():
                widening.FORCE = force
                t = time.perf_counter()
                row[f"loss {k}"] = evaluate(m, es)["loss"]
                best[k] = min(best[k], time.perf_counter() - t)
        widening.FORCE = None
        unit = (unit + matmul_seconds()) / 2
        row |= {f"seconds {k}": v for k, v in best.items()} | {f"units {k}": v / unit for k, v in best.items()}
        row["matmul_ms"] = unit * 1e3
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
