"""Two levers on learned / dual matching that the engine does not ship, measured against its defaults.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_levers.py lm-none --steps 1600 [--method dual]
        [--candidates 16 1 1 1] [--ensemble 1.0] [--lr-map 0.02] [--batch 64] [--val spread] [--val-items 4096]
        [--lambdas adaptive] [--band 0.3 0.7] [--val-lambdas 0.1 0.2 ... 0.9]

One optimisation from the weight-matching start (the engine's `optimise`, its defaults unless named), then
the record's evaluation of the kept element: the first 65,536 test tokens (or every test image), 21 points.
One JSON line: test barrier, best validation barrier and its step, optimisation seconds, MLP flips.

--candidates k_0 ... k_{L-1}: partners per MLP neuron in each layer's latent (1 keeps weight matching's
    partner; the engine uses one count for every layer).
--ensemble w: the training loss is (1 - w) x cross-entropy to the next token + w x cross-entropy to the
    lam-mixture of the two endpoints' predicted distributions, (1 - lam) p_A + lam p_B: a path whose every
    point predicted that mixture would lie at or below the chord (cross-entropy is convex in the predicted
    distribution), and a full distribution per token is a lower-variance target than one token. The
    endpoints' forward passes (without gradients) cost about half a step more.
--val spread: the validation batch that picks the kept element is --val-items tokens in windows spread evenly
    over the whole validation split, not the engine's windows from its start (one passage of one novel).
bench/RESULTS.md, "Two levers on the NoPE pair", has the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", help="zoo pair name: its -s0 and -s1 models")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--method", default="dual", choices=["learned", "dual"])
    ap.add_argument("--candidates", nargs="+", type=int, help="MLP partners per neuron, one count per layer")
    ap.add_argument("--ensemble", type=float, default=0.0, help="weight of the endpoints' mixture as the target")
    ap.add_argument("--lr-map", type=float, help="peak step size of the continuous latents")
    ap.add_argument("--batch", type=int, help="sequences / images per step (default: the engine's, 16)")
    ap.add_argument("--lambdas", help="lam sampling (the engine's Settings.lambdas; default: the task's)")
    ap.add_argument("--band", nargs=2, type=float, metavar=("LO", "HI"),
                    help="the interval `narrow` draws lam from (default: the engine's 0.4 0.6)")
    ap.add_argument("--val-lambdas", nargs="+", type=float, help="where a validation check measures the path "
                    "(default: the engine's 0.1, 0.3, ..., 0.9; must include 0.5)")
    ap.add_argument("--val", default="start", choices=["start", "spread"], help="where the validation windows lie")
    ap.add_argument("--val-items", type=int, help="validation tokens / images (default: the engine's)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from engine.align import learned
    from engine.align.context import AlignContext
    from engine.align.pair import model_for, prepare_pair
    from engine.align.weight import weight_match
    from engine.classes import resolve_classes
    from engine.evaluate import eval_set_for
    from engine.interpolate import interpolate
    from engine.models import canonical, load_model
    from engine.spec import build_spec
    from engine.symmetry import apply
    from engine.zoo import resolve

    a, b = load_model(resolve(f"{args.pair}-s0")), load_model(resolve(f"{args.pair}-s1"))
    kinds = resolve_classes(build_spec(a.arch, canonical(a, copy=False)), ())
    pair = prepare_pair(a, b, kinds)
    g0, _ = weight_match(pair, kinds)
    ks = args.candidates or [learned.default_k(a.arch)] * a.arch.n_layers
    if len(ks) != a.arch.n_layers:
        ap.error(f"--candidates needs one count per layer ({a.arch.n_layers})")

    every_layer = learned.mlp_candidates

    def per_layer(spec, ref, other, g_other, k, g_ref=None):
        by_k = {kk: every_layer(spec, ref, other, g_other, kk, g_ref) for kk in set(ks)}
        return [by_k[kk][i] for i, kk in enumerate(ks)]

    learned.mlp_candidates = per_layer
    if args.band:
        learned.LAMBDAS = learned.LAMBDAS | {"narrow": tuple(args.band)}
    if args.val_lambdas:
        learned.VAL_LAMBDAS, learned.MID = tuple(args.val_lambdas), args.val_lambdas.index(0.5)
    if args.val_items:
        learned.VAL_ITEMS = learned.VAL_ITEMS | {a.arch.task: args.val_items}
    if args.val == "spread":
        if a.arch.task != "lm":
            ap.error("--val spread is for causal LMs")
        from engine.data import default_splits

        def spread(arch, items):
            tokens, n_ctx = default_splits().val, min(arch.n_ctx, 128)
            starts = torch.linspace(0, len(tokens) - n_ctx - 1, max(1, items // n_ctx)).long()
            w = tokens[starts[:, None] + torch.arange(n_ctx + 1)]
            return w[:, :-1], w[:, 1:]

        learned.val_batch = spread
    if args.ensemble:
        w, target = args.ensemble, {}
        backward_loss, task_loss = learned.backward_loss, learned.task_loss
        ma, mb = pair.model_a.module.eval(), pair.model_b.module.eval()

        def with_target(tw, mid, x, y, per_pass, *rest, **kw):
            with torch.no_grad():
                target["p"] = (1 - mid.lam) * F.softmax(ma(x).float(), -1) + mid.lam * F.softmax(mb(x).float(), -1)
            try:
                return backward_loss(tw, mid, x, y, per_pass, *rest, **kw)
            finally:
                del target["p"]

        def mixed(logits, y):
            p = target.get("p")  # None outside a training step: validation scores the next token alone
            if p is None:
                return task_loss(logits, y)
            if p.shape != logits.shape:
                raise SystemExit("--ensemble needs the whole batch in one readout pass")
            return (1 - w) * task_loss(logits, y) - w * (p * F.log_softmax(logits, -1)).sum(-1).mean()

        learned.backward_loss, learned.task_loss = with_target, mixed
    named = {"lr_map": args.lr_map, "lambdas": args.lambdas, "batch": args.batch}
    st = learned.Settings(candidates=max(ks), **{k: v for k, v in named.items() if v is not None})
    t = time.perf_counter()
    r = learned.optimise(AlignContext(pair, kinds, steps=args.steps, learned=st), g0, args.method == "dual", args.steps)
    opt_s = time.perf_counter() - t
    moved = apply(pair.arch, learned.relative(pair.arch, r["g_a"], r["g_b"]), pair.params_b, strict=False)
    res = interpolate(pair.model_a, model_for(pair.model_b, pair.arch, moved), eval_set_for(a, "test", 65536), 21)
    print(json.dumps({"pair": args.pair, "method": args.method, "steps": args.steps, "candidates": ks,
                      "ensemble": args.ensemble, "batch": st.batch, "lr_map": st.lr_map, "lambdas": st.lambdas, "band": args.band, "val": args.val,
                      "val_lambdas": learned.VAL_LAMBDAS,
                      "val_items": learned.VAL_ITEMS[a.arch.task], "test_barrier": res["barrier"],
                      "best_val_barrier": r["best_val_barrier"], "best_step": r["best_step"],
                      "opt_seconds": round(opt_s, 1), "flips_mlp": sum(r["resolves"]["flips_mlp"]),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    main()
