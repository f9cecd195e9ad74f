"""Barrier against optimisation budget for learned and dual matching on zoo pairs.

    .venv/bin/python bench/bench_learned_budget.py [--pairs lm-learned lm-none vit-learned]
        [--methods learned dual] [--checkpoints 25 50 100 200] [--items 8192] [--points 11] [--out FILE]
    .venv/bin/python bench/bench_learned_budget.py --time-budgets 60 120 240 [--pairs lm-learned-medium ...]

For each pair and method: ONE run of max(checkpoints) steps from the weight-matching start (the
schedule, warm-up + cosine, spans the whole run), and at every checkpoint the full-path barrier of
the best element kept so far (the element the run would return if it stopped there), on a reduced
evaluation: `--items` test tokens / images (the ViT test split is smaller: all of it) and `--points`
points. Step 0 is the weight-matching start. The naive barrier is measured in the same (norm-folded)
coordinates. One JSON line per checkpoint on stdout, all of them in --out.

With --time-budgets: for each budget T a SEPARATE run given only T seconds (no step cap: the schedule
follows the clock, as `align --time-budget T` does), its final element's barrier, the steps it took,
its process CPU seconds and the seconds of a matmul measured in the same process (so
budgets compare across machines as ratios; bench_scale's unit, a 2048^3 float32 matmul). Run it alone: the clock is the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ("lm-learned", "lm-none", "lm-rope", "lm-sinusoidal", "vit-learned", "vit-sinusoidal", "vit-rope",
         "vit-learned-w128", "lm-learned-medium", "lm-rope-medium")


CONTEXT_KEYS = ("batch",)  # variant keys of the run's AlignContext (sequences / images per step), not of Settings


def split_variant(settings: dict, variant: dict):
    """(Settings, AlignContext keyword arguments) of one variant over the shared settings."""
    from engine.align.learned import Settings

    merged = settings | variant
    return (Settings(**{k: v for k, v in merged.items() if k not in CONTEXT_KEYS}),
            {k: merged[k] for k in CONTEXT_KEYS if k in merged})


def run_pair(name: str, methods: list[str], checkpoints: list[int], items: int, points: int, settings: dict,
             emit, eval_every: int | None, variants: list[dict], time_budgets: list[float] | None = None,
             splits: tuple[str, ...] = ("test",)) -> None:
    import torch

    from engine.align.context import AlignContext
    from engine.align.learned import optimise, relative
    from engine.align.pair import model_for, prepare_pair
    from engine.align.weight import weight_match
    from engine.classes import resolve_classes
    from engine.evaluate import eval_set_for
    from engine.interpolate import interpolate
    from engine.models import canonical, load_model
    from engine.spec import build_spec
    from engine.symmetry import apply
    from engine.zoo import resolve

    a, b = load_model(resolve(f"{name}-s0")), load_model(resolve(f"{name}-s1"))
    kinds = resolve_classes(build_spec(a.arch, canonical(a, copy=False)), ())
    pair = prepare_pair(a, b, kinds)
    sets = {s: eval_set_for(a, s, items) for s in splits}  # the first is the one reported as "barrier"
    es = sets[splits[0]]
    base = {"pair": name, "classes": sorted(kinds), "rewrite": pair.rewrite, "items": es.size, "points": points,
            "threads": torch.get_num_threads()}

    def path(g) -> dict:
        moved = pair.params_b if g is None else apply(pair.arch, g, pair.params_b, strict=False)
        r = interpolate(pair.model_a, model_for(pair.model_b, pair.arch, moved), es, points)
        out = {"barrier": r["barrier"], "endpoints": [r["loss"][0], r["loss"][-1]], "max_loss": max(r["loss"])}
        if r["accuracy"] is not None:  # ViT: the worst accuracy along the path against the worse endpoint
            acc = r["accuracy"]
            out |= {"endpoint_accuracy": [acc[0], acc[-1]], "min_accuracy": min(acc),
                    "accuracy_drop_points": 100 * (min(acc[0], acc[-1]) - min(acc))}
        for s, other in list(sets.items())[1:]:
            r = interpolate(pair.model_a, model_for(pair.model_b, pair.arch, moved), other, points)
            out |= {f"{s}_barrier": r["barrier"], f"{s}_endpoints": [r["loss"][0], r["loss"][-1]]}
        return out

    emit(base | {"method": "naive", "step": 0} | path(None))
    t = time.perf_counter()
    g0, _ = weight_match(pair, kinds, None)
    init_s = time.perf_counter() - t
    emit(base | {"method": "weight", "step": 0, "seconds": init_s} | path(g0))
    if time_budgets:
        from bench_scale import matmul_seconds  # this script's directory is on sys.path when it runs

        from engine.results import MAX_STEPS

        for method, variant, budget in ((m, v, T) for m in methods for v in variants for T in time_budgets):
            st, ctx_kw = split_variant(settings, variant)
            ref = matmul_seconds()
            cpu, t = time.process_time(), time.perf_counter()
            res = optimise(AlignContext(pair, kinds, steps=MAX_STEPS, **ctx_kw), g0, dual=method == "dual", steps=MAX_STEPS,
                           time_budget_s=budget, settings=st)
            row = base | {"method": method, "variant": variant, "time_budget_s": budget, "matmul_s": ref,
                          "opt_seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu,
                          "steps_done": res["steps_done"], "stopped": res["stopped"], "best_step": res["best_step"],
                          "best_val_midpoint_loss": res["best_val_midpoint_loss"]}
            emit(row | path(relative(pair.arch, res["g_a"], res["g_b"])))
        return
    steps = max(checkpoints)
    for method, variant in ((m, v) for m in methods for v in variants):
        st, ctx_kw = split_variant(settings | {"eval_every": eval_every}, variant)
        t = time.perf_counter()
        eval_s = [0.0]

        def on_check(step, g_a, g_b, method=method, variant=variant, t=t, eval_s=eval_s) -> None:
            if step not in checkpoints:
                return
            t1 = time.perf_counter()
            row = base | {"method": method, "variant": variant, "step": step, "opt_seconds": t1 - t - eval_s[0]}
            emit(row | path(relative(pair.arch, g_a, g_b)))
            eval_s[0] += time.perf_counter() - t1

        res = optimise(AlignContext(pair, kinds, steps=steps, **ctx_kw), g0, dual=method == "dual", steps=steps, settings=st,
                       on_check=on_check)
        emit(base | {"method": method, "variant": variant, "summary": True, "steps_done": res["steps_done"], "stopped": res["stopped"],
                     "best_step": res["best_step"], "settings": res["settings"], "history": res["history"],
                     "resolves": res["resolves"], "seconds_per_step": res["seconds_per_step"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS),
                    help="zoo pair names, or a path prefix P whose P-s0 and P-s1 are model directories")
    ap.add_argument("--methods", nargs="+", default=["learned", "dual"], choices=["learned", "dual"])
    ap.add_argument("--checkpoints", nargs="+", type=int, default=[25, 50, 100, 200])
    ap.add_argument("--items", type=int, default=8192)
    ap.add_argument("--splits", nargs="+", default=["test"], choices=["test", "val", "train"],
                    help="where each barrier is measured: the first as barrier, the others as <split>_barrier "
                         "(train: the first --items of the train split, the text a --train-bytes model repeats)")
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--eval-every", type=int, default=5, help="steps between validation checks (divides every checkpoint)")
    ap.add_argument("--lr-perm", type=float, default=None, help="peak step size of the permutation latents")
    ap.add_argument("--lr-map", type=float, default=None, help="peak step size of the continuous latents")
    ap.add_argument("--lambdas", default=None, help="lam sampling mode (narrow, uniform, fixed)")
    ap.add_argument("--variants", nargs="+", type=json.loads, default=[{}],
                    help="Settings overrides (and \"batch\", sequences or images per step) as JSON objects, one optimisation run each from the same start")
    ap.add_argument("--time-budgets", nargs="+", type=float, default=None,
                    help="seconds: one separate run per budget, no step cap (the schedule follows the clock)")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = ap.parse_args()
    if not args.time_budgets and any(c % args.eval_every for c in args.checkpoints):
        ap.error("--eval-every must divide every checkpoint")
    settings = {k: v for k, v in (("lr_perm", args.lr_perm), ("lr_map", args.lr_map),
                                            ("lambdas", args.lambdas)) if v is not None}
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (closed below)

    def emit(row: dict) -> None:
        row = row | {"load_avg": os.getloadavg()[0]}
        line = json.dumps(row)
        print(line if not row.get("summary") else json.dumps({k: row[k] for k in row if k not in (
            "history", "resolves")}), flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    try:
        for name in args.pairs:
            run_pair(name, args.methods, sorted(set(args.checkpoints)), args.items, args.points, settings, emit,
                     args.eval_every, args.variants, args.time_budgets, tuple(args.splits))
    finally:
        if out:
            out.close()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
