"""`python -m engine ...`: train, zoo, interpolate, align, cache, symmetry.

Every user error is an LMCError: printed as one line `error: ...`, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from engine.errors import LMCError


def _progress_bar(desc: str):
    bar = None

    def update(done: int, total: int, message: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, leave=False)
        bar.n = done
        bar.set_postfix_str(message)
        bar.refresh()
        if done == total:
            bar.close()

    return update


def _print_path_table(rec: dict) -> None:
    acc = rec.get("accuracy")
    print(f"{rec['method']}: {rec['model_a']} -> {rec['model_b']}  ({rec.get('eval_set', '')})")
    print(f"{'lambda':>7} {'loss':>9}" + (f" {'acc':>7}" if acc else ""))
    for i, (t, l) in enumerate(zip(rec["lambdas"], rec["loss"])):
        print(f"{t:7.2f} {l:9.4f}" + (f" {acc[i]:7.2%}" if acc else ""))
    print(f"barrier {rec['barrier']:.4f}  midpoint barrier {rec['midpoint_barrier']:.4f}  "
          f"endpoints {rec['endpoint_loss_a']:.4f} / {rec['endpoint_loss_b']:.4f}")


def cmd_train(args) -> None:
    from dataclasses import replace

    from engine.train import LM_TRAIN, VIT_TRAIN, lm_config, train, vit_config

    cfg = lm_config(args.pe) if args.task == "lm" else vit_config(args.pe)
    tc = LM_TRAIN if args.task == "lm" else VIT_TRAIN
    if args.steps:
        tc = replace(tc, steps=args.steps, eval_every=max(1, min(tc.eval_every, args.steps)))
    _, met = train(cfg, args.seed, tc, out=Path(args.out))
    acc = f", test accuracy {met['test_accuracy']:.2%}" if met["test_accuracy"] is not None else ""
    print(f"saved {args.out}: test loss {met['test_loss']:.4f}{acc} after {met['steps']} steps ({met['train_seconds']:.0f} s)")


def cmd_zoo(args) -> None:
    from engine import zoo

    if args.action == "build":
        zoo.build(args.only or None)
    rows = zoo.manifest()
    if not rows:
        print("the zoo is empty; run `python -m engine zoo build`")
        return
    print(f"{'name':<20} {'params':>8} {'test loss':>10} {'test acc':>9} {'steps':>6}  bar")
    for r in rows:
        acc = f"{r['test_accuracy']:.2%}" if r["test_accuracy"] is not None else "-"
        print(f"{r['name']:<20} {r['parameters']:>8,} {r['test_loss']:>10.4f} {acc:>9} {r['steps']:>6}  "
              f"{'ok' if r['meets_bar'] else 'MISSED'}")


def _run_config(args, method: str):
    from engine.results import RunConfig

    return RunConfig(
        model_a=args.model_a, model_b=args.model_b, method=method,
        classes=tuple(getattr(args, "classes", None) or ()), steps=getattr(args, "steps", 0) or 0,
        points=args.points, eval_split=args.split, eval_items=args.eval_items,
        seed=getattr(args, "seed", 0), device=args.device,
    )


def cmd_interpolate(args) -> None:
    from engine.api import run_pair
    from engine.results import write_record

    rec = run_pair(_run_config(args, "naive"), progress=_progress_bar("interpolate"))
    _print_path_table(rec)
    if args.out:
        write_record(rec, Path(args.out))
        print(f"wrote {args.out}")


def cmd_align(args) -> None:
    from engine.api import run_pair
    from engine.results import write_record

    rec = run_pair(_run_config(args, args.method), progress=_progress_bar(args.method),
                   save_merged=args.save_merged, alpha=args.alpha)
    _print_path_table(rec)
    al, chk = rec["alignment"], rec["endpoint_check"]
    print(f"classes {', '.join(al['classes']) or '-'}  align {al['seconds']:.1f} s  "
          f"endpoint check: loss {chk['loss_b']:.6f} -> {chk['loss_b_moved']:.6f} (relative {chk['rel_diff']:.1e})"
          + (f", approximate: {', '.join(chk['approximate_classes'])}" if chk["approximate_classes"] else ""))
    if "identity" in al["diagnostics"]:
        print(f"dual/one-sided identity: max relative error {al['diagnostics']['identity']['max_relative_error']:.1e}")
    if args.save_merged:
        print(f"saved merged model (alpha {args.alpha}) to {args.save_merged}")
    if args.out:
        write_record(rec, Path(args.out))
        print(f"wrote {args.out}")


def cmd_cache(args) -> None:
    from engine.api import build_cache
    from engine.zoo import pairs

    if args.action == "table":
        print(cache_table())
        return
    only = [(a, b) for a, b in pairs() if not args.only or a in args.only or b in args.only]
    build_cache(methods=args.methods, eval_items=args.eval_items, only=only)


def cache_table() -> str:
    """The cached barriers as a markdown table: one row per zoo pair, barrier / midpoint per method."""
    from engine.align import METHODS
    from engine.results import cached_record
    from engine.zoo import pairs

    head = "| pair | " + " | ".join(m.display_name for m in METHODS.values()) + " |"
    rows = [head, "|---" * (len(METHODS) + 1) + "|"]
    for a, b in pairs():
        cells = []
        for m in METHODS:
            r = cached_record(a, b, m)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['barrier']:.3f} / {r['midpoint_barrier']:.3f}"
            if r.get("accuracy_drop") is not None:
                cell += f" ({100 * r['accuracy_drop']:.1f} pt)"
            cells.append(cell)
        rows.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cmd_symmetry(args) -> None:
    from engine.diagnostics import format_report, symmetry_report

    target = args.model
    if not args.dims_only:
        from engine.zoo import resolve

        target = resolve(target)
    rep = symmetry_report(target, dims_only=args.dims_only)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))


def _items(s: str) -> int | None:
    if s == "all":
        return None
    try:
        n = int(s.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {s!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {s!r}")
    return n


def _add_path_args(p: argparse.ArgumentParser) -> None:
    from engine.api import DEFAULT_EVAL_ITEMS

    p.add_argument("model_a", help="zoo name (see `zoo list`) or model directory")
    p.add_argument("model_b", help="zoo name or model directory")
    p.add_argument("--points", type=int, default=21, help="grid points on the path, endpoints included")
    p.add_argument("--split", default="test", choices=["val", "test"], help="held-out split to evaluate on")
    p.add_argument("--eval-items", type=_items, default=DEFAULT_EVAL_ITEMS,
                   help="scored tokens (LM) or images (ViT) per point, or 'all' for the whole split "
                        "(default 65,536: a third of the LM test split, every test image)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="write the result record (JSON) here")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one reference model")
    p.add_argument("--task", choices=["lm", "vit"], required=True)
    p.add_argument("--pe", choices=["none", "learned", "sinusoidal", "rope"], required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="override the default step budget")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("zoo", help="list or rebuild the built-in model zoo")
    p.add_argument("action", choices=["list", "build"])
    p.add_argument("--only", nargs="*", help="zoo names to (re)build")
    p.set_defaults(fn=cmd_zoo)

    p = sub.add_parser("interpolate", help="loss barrier of the naive linear path between two models")
    _add_path_args(p)
    p.set_defaults(fn=cmd_interpolate)

    from engine.align import METHODS
    from engine.align.common import CLASSES

    p = sub.add_parser("align", help="align model B onto model A, then measure the loss barrier")
    _add_path_args(p)
    p.add_argument("--method", default="weight", choices=list(METHODS))
    p.add_argument("--classes", nargs="+", choices=list(CLASSES), default=None,
                   help="symmetry classes to use (default: every exact class of the model)")
    p.add_argument("--steps", type=int, default=0, help="learned / dual optimisation steps (0: the method's default)")
    p.add_argument("--seed", type=int, default=0, help="data order and lambda samples of data-driven methods")
    p.add_argument("--save-merged", default=None, metavar="DIR", help="save the interpolated model here")
    p.add_argument("--alpha", type=float, default=0.5, help="position of the saved model on the path (0 = A, 1 = B)")
    p.set_defaults(fn=cmd_align)

    from engine.api import DEFAULT_EVAL_ITEMS

    p = sub.add_parser("cache", help="precompute cached_results/ for every zoo pair")
    p.add_argument("action", choices=["build", "table"])
    p.add_argument("--methods", nargs="*", default=None)
    p.add_argument("--eval-items", type=_items, default=DEFAULT_EVAL_ITEMS,
                   help="scored tokens / images per point, or 'all' (default 65,536: every test image)")
    p.add_argument("--only", nargs="*", help="zoo names: build only the pairs containing them")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("symmetry", help="symmetry-group diagnostics of a model")
    p.add_argument("model", help="zoo name, model directory, or (with --dims-only) a directory with config.json")
    p.add_argument("--dims-only", action="store_true", help="group dimensions from the config alone")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_symmetry)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except LMCError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
