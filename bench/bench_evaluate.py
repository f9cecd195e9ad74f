"""Evaluation throughput: the token-budget, float32-chunked evaluate() against the sequence-batched
float64-logit one it replaced, and a GPT-2-small-sized model against a matmul reference.

Run: .venv/bin/python bench/bench_evaluate.py   (results go into bench/RESULTS.md by hand)
Everything runs in one process, the old and new evaluations interleaved, so ratios are meaningful
on a shared machine; FLOP rates are fractions of a 2048 x 2048 float32 matmul measured alongside.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.api import load_named
from engine.evaluate import EvalSet, evaluate, items_per_batch, lm_eval_set
from engine.models import model_logits


@torch.no_grad()
def evaluate_before(model, es: EvalSet, batch_size: int = 64) -> float:
    """The evaluation this change replaced: 64 sequences per forward, the loss over float64 logits."""
    model.module.eval()
    total = 0.0
    for i in range(0, len(es.inputs), batch_size):
        logits = model_logits(model, es.inputs[i : i + batch_size]).double()  # [B, T, V]
        total += F.cross_entropy(logits.flatten(0, -2), es.targets[i : i + batch_size].flatten(), reduction="sum").item()
    return total / es.size


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def matmul_flops(n: int = 2048, repeats: int = 10) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up
    t, _ = best_of(lambda: a @ b, repeats)
    return 2 * n**3 / t


def main(repeats: int = 3) -> None:
    torch.set_num_threads(2)
    peak = matmul_flops()
    print(f"matmul 2048 x 2048 float32: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")

    m = load_named("lm-rope-s0")
    es = lm_eval_set("test", 16384)
    n_params = sum(p.numel() for p in m.module.parameters())
    t_old = t_new = float("inf")
    for _ in range(repeats):  # interleaved
        t, old = best_of(lambda: evaluate_before(m, es), 1)
        t_old = min(t_old, t)
        t, new = best_of(lambda: evaluate(m, es)["loss"], 1)
        t_new = min(t_new, t)
    print(f"lm-rope-s0 on {es.size:,} tokens: before {es.size / t_old:,.0f} tokens/s (64 windows per forward), "
          f"after {es.size / t_new:,.0f} tokens/s ({items_per_batch(m.arch)} windows per forward); "
          f"loss {old:.8f} vs {new:.8f} (relative {abs(new - old) / old:.1e}); "
          f"{2 * n_params * es.size / t_new / peak:.1%} of the matmul rate")

    from transformers import GPT2Config

    from engine.models import hf_gpt2

    g2 = hf_gpt2.build(GPT2Config(), seed=0)  # random init, float32
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, g2.arch.n_out, (32, 129), generator=g)  # 32 windows of 128 scored tokens
    es2 = EvalSet("lm", ids[:, :-1], ids[:, 1:], "random ids, 4,096 tokens")
    evaluate(g2, EvalSet("lm", ids[:1, :-1], ids[:1, 1:], "warm-up"))
    n2 = sum(p.numel() for p in g2.module.parameters())
    t, r = best_of(lambda: evaluate(g2, es2)["loss"], 1)
    print(f"GPT-2-small (random init, {n2 / 1e6:.1f}M parameters) on {es2.size:,} tokens: {es2.size / t:,.0f} tokens/s "
          f"({items_per_batch(g2.arch)} windows per forward), {2 * n2 * es2.size / t / 1e9:.1f} GFLOP/s = "
          f"{2 * n2 * es2.size / t / peak:.1%} of the matmul rate; loss {r:.3f} (ln V = {torch.log(torch.tensor(50257.0)):.3f})")


if __name__ == "__main__":
    main()
