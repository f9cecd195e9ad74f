"""`python -m engine ...`: train, zoo, interpolate, align, widen, multi, cache, runs, symmetry.

Every user error is one line `error: ...` on stderr and exit status 2, never a traceback: bad
arguments (argparse's own errors included), bad model directories and configs, and output locations
that cannot or must not be written. Everything is checked before the work starts, so a computation
is never lost to a bad output path at its end. Store problems that do not stop a command (a skipped
record) are one line `warning: ...` each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

from tqdm import tqdm

from engine.errors import LMCError

MAX_POINTS = 1001  # engine.results.MAX_POINTS, repeated so `--help` needs no torch import
MAX_STEPS = 100_000  # engine.results.MAX_STEPS
DTYPES = ("float32", "float64", "bfloat16")  # engine.results.DTYPE_NAMES


class UsageError(LMCError):
    """A command line argparse refused."""


class Parser(argparse.ArgumentParser):
    """argparse with the engine's one-line errors (argparse prints usage and exits by itself)."""

    def error(self, message: str):
        raise UsageError(message[0].upper() + message[1:] + ("" if message.endswith(".") else "."))


def _launched() -> bool:
    """Whether torchrun started this process as one of several (engine.distributed.launched, without
    importing torch: `--help` stays fast)."""
    return os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")


def _rank_zero() -> bool:
    """Whether this process speaks and writes: always, but under torchrun only process 0 (RANK 0)."""
    return not _launched() or os.environ.get("RANK", "0") == "0"


@contextmanager
def _quiet_unless_rank_zero():
    """Under torchrun the other processes' standard output goes nowhere: process 0 reports the run."""
    if _rank_zero():
        yield
        return
    with open(os.devnull, "w") as sink, redirect_stdout(sink):
        yield


class _PhaseBars:
    """A run_pair progress callback: one tqdm bar per phase (engine.progress), each closed when the next
    begins. A bar shows only once its phase has run BAR_DELAY_S, so quick phases (and errors found in
    them) leave stderr clean; `close()` ends the last one, also when the run fails."""

    BAR_DELAY_S = 0.5

    def __init__(self, desc: str):
        self.desc, self.bar, self.phase = desc, None, None

    def __call__(self, u) -> None:
        if u.phase != self.phase or self.bar is None or self.bar.total != (u.total or None):
            self.close()
            self.bar = tqdm(total=u.total or None, desc=f"{self.desc}: {u.phase}", leave=False, delay=self.BAR_DELAY_S,
                            disable=not _rank_zero())
            self.phase = u.phase
        self.bar.n = u.done
        self.bar.set_postfix_str(u.message, refresh=False)
        self.bar.update(0)  # redraws at most every mininterval, and not before the bar's delay

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _progress_bar(desc: str) -> _PhaseBars:
    return _PhaseBars(desc)


def _print_path_table(rec: dict) -> None:
    acc = rec.get("accuracy")
    folded = rec.get("loss_folded") if rec.get("folded_rewrite") else None  # naive: the aligned runs' coordinates
    print(f"{rec['method']}, {rec.get('path', 'weights')} path: {rec['model_a']} -> {rec['model_b']}  ({rec.get('eval_set', '')}, "
          f"{rec.get('provenance', {}).get('device', '?')})")
    train = rec.get("train_loss")  # a run without a train curve (run_pair(train_curve=False)) has none
    print(f"{'lambda':>7} {'loss':>9}" + (f" {'acc':>7}" if acc else "") + (f" {'train':>9}" if train else "")
          + (f" {'aligned coords':>15}" if folded else ""))
    for i, (t, l) in enumerate(zip(rec["lambdas"], rec["loss"])):
        print(f"{t:7.2f} {l:9.4f}" + (f" {acc[i]:7.2%}" if acc else "") + (f" {train[i]:9.4f}" if train else "")
              + (f" {folded[i]:15.4f}" if folded else ""))
    print(f"barrier {rec['barrier']:.4f}  midpoint barrier {rec['midpoint_barrier']:.4f}  "
          f"endpoints {rec['endpoint_loss_a']:.4f} / {rec['endpoint_loss_b']:.4f}")
    if train:
        mid = rec.get("train_midpoint_barrier")
        print(f"train barrier {rec['train_barrier']:.4f}" + (f"  midpoint barrier {mid:.4f}" if mid is not None else "")
              + f"  endpoints {train[0]:.4f} / {train[-1]:.4f}  ({rec['train_eval_set']})")
    if "barrier_folded" in rec:
        where = (f"after {rec['folded_rewrite']}, as the aligned runs interpolate" if rec["folded_rewrite"] else
                 "the same coordinates: the aligned runs rewrite nothing here")
        print(f"in the aligned runs' coordinates ({where}): barrier {rec['barrier_folded']:.4f}  "
              f"midpoint barrier {rec['midpoint_barrier_folded']:.4f}")


def _json_safe(x):
    """`x` with every non-finite float replaced by None, so that json.dumps(allow_nan=False) accepts it."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _print_attribution(rec: dict) -> None:
    """Where the midpoint barrier lives: each block alone, and what each class buys."""
    at = rec.get("attribution")
    if not at:
        if rec.get("attribution_skipped"):
            print(f"{rec['attribution_skipped']} --attribution runs it.")
        return
    parts: dict[str, dict[str, float]] = {}
    for r in at["blocks"]:
        parts.setdefault(r["block"], {})[r["part"]] = r["excess"]
    top = max(parts, key=lambda b: parts[b]["all"])
    print(f"barrier attribution (midpoint barrier {at['midpoint_barrier']:.4f}; each block interpolated alone, "
          f"the rest at an endpoint; sum {at['sum_of_layers']:.4f}):")
    for block, v in parts.items():
        split = f"  (attention {v['attention']:.4f}, MLP {v['mlp']:.4f})" if "mlp" in v and "attention" in v else ""
        print(f"  {block:<12} {v['all']:8.4f}{split}{'  <- most' if block == top else ''}")
    if at["classes"]:
        print("  without a class, the midpoint barrier rises by: " + ", ".join(
            f"{c['class']} {c['rise']:+.4f}" for c in at["classes"]))


def _print_classes(rec: dict) -> None:
    """Which symmetry classes the run used and why the others were left out."""
    if "classes" not in rec:
        return
    print(f"classes: {', '.join(rec['classes']) or 'none'}")
    for kind, why in rec.get("classes_left_out", {}).items():
        print(f"  left out {kind}: {why}")


# ---------------------------------------------------------------------------------------------
# Checks made before any model is loaded


def _is_record(f: Path) -> bool:
    """Whether `f` holds a result record (load_record accepts it); a file not starting with '{' is read
    no further, so a large foreign file costs one byte."""
    from engine.models.io import read_json_object
    from engine.results import MAX_RECORD_BYTES, load_record

    try:
        with open(f, "rb") as fh:
            if fh.read(1) != b"{":
                return False
        kind = read_json_object(f, max_bytes=MAX_RECORD_BYTES, kind="a result record").get("kind")
        if kind in ("loss_plane", "multi", "representation"):  # plane, multi, an encoder's align (engine.represent)
            return True
        load_record(f)
    except (OSError, LMCError):
        return False
    return True


def _check_out(out: str | None, inputs: list[Path], merged_dir: str | None = None) -> Path | None:
    """--out: a regular file (or new), not a file of an input model, not a file of the merged checkpoint,
    and, if it exists and is not empty, a result record (a file this tool wrote): nothing else is replaced."""
    from engine.models.io import MARKER, OWN_FILES, check_output_file, refuse_foreign

    if out is None:
        return None
    target = check_output_file(out, "--out")
    for d in inputs:
        if target.parent == Path(os.path.realpath(d)) and target.exists():
            raise LMCError(f"--out {out} would replace {target.name} in the input model directory {d}.")
    if merged_dir is not None and target == Path(os.path.realpath(merged_dir)):
        raise LMCError(f"--out {out} is the --save-merged directory; give the record its own file name.")
    if merged_dir is not None and target.parent == Path(os.path.realpath(merged_dir)) and (
            target.name in (*OWN_FILES, MARKER) or target.suffix == ".safetensors"):
        raise LMCError(f"--out {out} would replace {target.name} of the model saved with --save-merged.")
    refuse_foreign(target, f"--out {out}", _is_record, "result record")
    return target


def _finite_result(rec: dict) -> None:
    """Refuse a result whose path is not finite (an interpolated model that overflows): its numbers
    would leave the tool as NaN, which JSON does not have, and a barrier of NaN says nothing."""
    bad = [f"{t:.2f}" for t, v in zip(rec["lambdas"], rec["loss"]) if not math.isfinite(v)]
    if bad or not math.isfinite(rec["barrier"]):
        where = f" at lambda {', '.join(bad[:5])}" if bad else ""
        raise LMCError(f"The loss along the path is not finite{where} (the interpolated models overflow); "
                       "no record was written.")


def _not_a_zoo_name(path: Path, flag: str) -> None:
    """A model written under a zoo model's bare name would be shadowed by it: every command reads that
    name as the zoo model."""
    from engine.zoo import ENTRIES

    if str(path) in ENTRIES:
        raise LMCError(f"{flag} {path} is the name of a zoo model, which every command would read instead of "
                       "the directory; choose another name.")


def _check_pair_args(args) -> tuple[list[Path], str]:
    """The two model directories and the resolved device; --out, --save-merged, --alpha checked."""
    from engine.results import resolve_device
    from engine.zoo import resolve

    device = resolve_device(args.device)
    inputs = [resolve(args.model_a), resolve(args.model_b)]
    merged = getattr(args, "save_merged", None)
    if merged is not None:
        from engine.api import check_alpha
        from engine.models.io import check_output_dir

        check_alpha(0.5 if args.alpha is None else args.alpha, args.extrapolate)
        _not_a_zoo_name(merged, "--save-merged")
        check_output_dir(merged, args.overwrite, inputs=inputs, name="--save-merged directory")
    elif getattr(args, "alpha", None) is not None:
        raise LMCError("--alpha sets the position of the model saved with --save-merged; add --save-merged DIR.")
    elif getattr(args, "extrapolate", False) or getattr(args, "overwrite", False):
        raise LMCError("--extrapolate and --overwrite apply to --save-merged; add --save-merged DIR.")
    _check_out(args.out, inputs, merged)
    if _launched():  # under torchrun: join the other processes (engine.distributed)
        from engine.distributed import start

        start(device)
    return inputs, device


def cmd_train(args) -> None:
    from dataclasses import replace

    from engine.models.io import check_output_dir
    from engine.train import LM_TRAIN, VIT_TRAIN, lm_config, train, vit_config
    from engine.zoo import MEDIUM

    if args.tier == "medium" and args.task != "lm":
        raise LMCError("--tier medium is an LM shape (6 layers, D 256, MLP 1024); a ViT trains at the zoo's own shape.")
    _not_a_zoo_name(args.out, "--out")
    check_output_dir(args.out, args.overwrite, name="--out directory")
    cfg = lm_config(args.pe) if args.task == "lm" else vit_config(args.pe)
    if args.tier == "medium":
        cfg = replace(cfg, **MEDIUM)
    tc = LM_TRAIN if args.task == "lm" else VIT_TRAIN
    if args.steps is not None:
        tc = replace(tc, steps=args.steps, eval_every=max(1, min(tc.eval_every, args.steps)))
    if args.train_bytes is not None:
        if args.task != "lm":
            raise LMCError("--train-bytes restricts an LM's training text; a ViT trains on the digits' train split.")
        tc = replace(tc, train_bytes=args.train_bytes)
    if args.dropout:
        tc = replace(tc, dropout=args.dropout)
    _, met = train(cfg, args.seed, tc, out=Path(args.out), overwrite=args.overwrite)
    acc = f", test accuracy {met['test_accuracy']:.2%}" if met["test_accuracy"] is not None else ""
    print(f"saved {args.out}: test loss {met['test_loss']:.4f}{acc} after {met['steps']} steps ({met['train_seconds']:.0f} s)")


def cmd_zoo(args) -> None:
    from engine import zoo

    if args.action == "build":
        _check_zoo_names(args.only)
        zoo.build(args.only or None)
    elif args.only is not None:
        raise LMCError("--only selects the models `zoo build` retrains; `zoo list` lists them all.")
    rows = zoo.manifest()
    if not rows:
        print("the zoo is empty; run `python -m engine zoo build`")
        return
    print(f"{'name':<22} {'D':>4} {'params':>9} {'test loss':>10} {'test acc':>9} {'steps':>6}  bar")

    def num(v, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    for r in rows:
        print(f"{r['name']:<22} {num(r.get('d_model'), 'd'):>4} {num(r.get('parameters'), ','):>9} {num(r.get('test_loss'), '.4f'):>10} "
              f"{num(r.get('test_accuracy'), '.2%'):>9} {num(r.get('steps'), 'd'):>6}  "
              f"{'ok' if r.get('meets_bar') else 'MISSED'}")


def _check_zoo_names(names: list[str] | None) -> None:
    from engine.zoo import ENTRIES

    for n in names or ():
        if n not in ENTRIES:
            raise LMCError(f"--only {n}: not a zoo model (zoo models: {', '.join(ENTRIES)}).")


def _run_config(args, method: str, device: str):
    from engine.align import method_options
    from engine.results import RunConfig

    given = {k.removeprefix(OPTION_DEST): v for k, v in vars(args).items() if k.startswith(OPTION_DEST)}
    return RunConfig(
        model_a=args.model_a, model_b=args.model_b, method=method,
        classes=tuple(getattr(args, "classes", None) or ()), steps=getattr(args, "steps", 0) or 0,
        points=args.points, eval_split=args.split, eval_items=args.eval_items,
        seed=getattr(args, "seed", 0), device=device, options=method_options(method, given), path=args.path,
        dtype=args.dtype,
    )


def _encoders(args, method: str, device: str) -> bool:
    """A pair of encoders without a head has no loss: compare its hidden states along the path instead
    (engine.represent), print them and write the record; False for any other pair."""
    import torch

    from engine.models.io import write_json_atomic
    from engine.represent import encoder_pair, format_record, represent_pair

    if not encoder_pair(args.model_a, args.model_b):
        return False
    if getattr(args, "save_merged", None) is not None or getattr(args, "save_element", None) is not None or \
            args.path != "weights" or args.offload:
        raise LMCError("--save-merged, --save-element, --path circuits and --offload apply to loss paths; an encoder "
                       "without a head gets the representation comparison alone.")
    rec = represent_pair(args.model_a, args.model_b, method, tuple(getattr(args, "classes", None) or ()),
                         args.points, args.split, args.eval_items, getattr(args, "seed", 0),
                         getattr(torch, args.dtype), device=device)
    print(format_record(rec))
    if args.out and _rank_zero():
        write_json_atomic(Path(args.out), rec, allow_nan=False)
        print(f"wrote {args.out}")
    return True


def cmd_interpolate(args) -> None:
    from engine.api import run_pair

    _, device = _check_pair_args(args)
    if _encoders(args, "naive", device):
        return
    cfg = _run_config(args, "naive", device)
    bars = _progress_bar("interpolate")
    try:
        rec = run_pair(cfg, progress=bars, offload=args.offload, attribution=args.attribution, announce=_announce)
    finally:
        bars.close()
    _report(rec, args.out)


def _announce(need) -> None:
    """The run's memory, printed once every input is checked and before anything loads (run_pair's `announce`)."""
    from engine.resources import describe

    print(describe(need))


def _report(rec: dict, out: str | None, details: Callable[[], None] | None = None) -> None:
    """A finished run: its path table, classes and attribution (then `details`), refused if its path is
    not finite, written to `out` by process 0."""
    from engine.results import write_record

    _print_path_table(rec)
    _print_classes(rec)
    _print_attribution(rec)
    if details is not None:
        details()
    _finite_result(rec)
    if out and _rank_zero():
        write_record(rec, Path(out))
        print(f"wrote {out}")


def _check_steps(args) -> None:
    from engine.align import METHODS

    if args.steps and not METHODS[args.method].default_steps:
        raise LMCError(f"--steps sets the optimisation budget of learned and dual matching; method "
                       f"{args.method} has no steps.")


def cmd_align(args) -> None:
    from engine.api import run_pair

    _check_steps(args)
    inputs, device = _check_pair_args(args)
    state = _check_resume(args, inputs)
    if args.save_element is not None and args.out is not None and \
            os.path.realpath(args.save_element) == os.path.realpath(args.out):
        raise LMCError(f"--save-element {args.save_element} is also the --out file; give each its own file name.")
    if _encoders(args, args.method, device):
        return
    alpha = 0.5 if args.alpha is None else args.alpha
    cfg = _run_config(args, args.method, device)
    bars = _progress_bar(args.method)
    try:
        rec = run_pair(cfg, progress=bars, save_merged=args.save_merged, alpha=alpha, overwrite=args.overwrite,
                       extrapolate=args.extrapolate, offload=args.offload, attribution=args.attribution,
                       checkpoint=state, save_element=args.save_element, announce=_announce)
    finally:
        bars.close()
    _report(rec, args.out, lambda: _print_alignment(rec, args, alpha))
    if state is not None and _rank_zero():  # the record is out: the state has served
        from engine.align.resume import clear

        clear(state)


def _check_resume(args, inputs: list[Path]) -> Path | None:
    """--resume: learned or dual matching only, a directory that is new or holds only an alignment state."""
    if args.resume is None:
        return None
    if args.method not in ("learned", "dual"):
        raise LMCError(f"--resume keeps the state of learned and dual matching; {args.method} has no optimisation "
                       "to resume.")
    from engine.align.resume import check_dir

    return check_dir(args.resume, tuple(inputs))


def _print_alignment(rec: dict, args, alpha: float) -> None:
    al, chk = rec["alignment"], rec["endpoint_check"]
    print(f"classes {', '.join(al['classes']) or '-'}  align {al['seconds']:.1f} s  "
          f"endpoint check: loss {chk['loss_b']:.6f} -> {chk['loss_b_moved']:.6f} (relative {chk['rel_diff']:.1e})"
          + (f", approximate: {', '.join(chk['approximate_classes'])}" if chk["approximate_classes"] else ""))
    if "identity" in al["diagnostics"]:
        print(f"dual/one-sided identity: max relative error {al['diagnostics']['identity']['max_relative_error']:.1e}")
    if "one_sided_skipped" in al["diagnostics"]:
        print(f"one-sided comparison skipped: {al['diagnostics']['one_sided_skipped']}")
    if "sweeps" in al["diagnostics"]:  # weight matching says how its descent ended, converged or not
        d = al["diagnostics"]
        print(f"weight matching: {len(d['sweeps'])} sweep(s), {'converged' if d['converged'] else 'NOT converged'}: "
              f"{d['stop']}")
    if args.save_merged:
        print(f"saved merged model (alpha {alpha}) to {args.save_merged}")
        print(f"merged model format: {rec['merged']['format']}")
    start = al["diagnostics"].get("start_element")
    if start:
        barrier = start.get("barrier")
        print(f"started from {start['file']} ({start.get('method') or 'an alignment'}, {start.get('steps') or 0:,} "
              "steps" + (f", barrier {barrier:.4f})" if isinstance(barrier, (int, float)) else ")"))
    if args.save_element:
        print(f"saved the element to {args.save_element}; `--start {args.save_element}` goes on from it")


def cmd_widen(args) -> None:
    """Lift A into B's wider shape, align B onto lifted A, interpolate in B's width (docs/MATH.md section 8)."""
    from engine.api import check_widen, widen_pair
    from engine.results import RunConfig, resolve_device
    from engine.zoo import resolve

    _check_steps(args)
    device = resolve_device(args.device)
    check_widen(args.model_a, args.model_b)  # from the configs: refused before anything loads
    _check_out(args.out, [resolve(args.model_a), resolve(args.model_b)])
    cfg = RunConfig(model_a=args.model_a, model_b=args.model_b, method=args.method,
                    classes=tuple(args.classes or ()), steps=args.steps, points=args.points, eval_split=args.split,
                    eval_items=args.eval_items, seed=args.seed, device=device, dtype=args.dtype)
    bars = _progress_bar(f"widen, {args.method}")
    try:
        rec = widen_pair(cfg, progress=bars, attribution=args.attribution)
    finally:
        bars.close()
    _report(rec, args.out, lambda: _print_lift(rec, args.method))


def _print_lift(rec: dict, method: str) -> None:
    lift, chk = rec["lift"], rec["endpoint_check"]
    wa, wb = lift["widths_a"], lift["widths_b"]
    print(f"lift: D {wa['d_model']} -> {wb['d_model']}, {wa['n_heads']} -> {wb['n_heads']} heads of {wa['d_head']} -> "
          f"{wb['d_head']}, MLP {wa['d_mlp']} -> {wb['d_mlp']}; writers x {lift['stream_scale']:.4f}, "
          f"W_Q and W_K x {lift['qk_scale']:.4f}")
    print(f"lift check: loss of A {lift['loss_a']:.6f}, lifted {lift['loss_a_lifted']:.6f} "
          f"(relative {lift['rel_diff']:.1e}, tolerance {lift['tolerance']:.0e})")
    if method != "naive":
        print(f"endpoint check: loss of B {chk['loss_b']:.6f} -> {chk['loss_b_moved']:.6f} (relative {chk['rel_diff']:.1e})")


def cmd_multi(args) -> None:
    """N models in one basis: the pairwise barriers before and after, the triangle (docs/MATH.md section 10)."""
    from engine.api import multi_models
    from engine.multi import write_record
    from engine.zoo import resolve

    if len(args.models) < 3:
        raise LMCError(f"Aligning models into one basis takes at least 3 models, not {len(args.models)}; for two, "
                       "use `align`.")
    _check_out(args.out, [resolve(m) for m in args.models])
    bars = _progress_bar(f"multi, to the {args.to}")
    try:
        rec = multi_models(args.models, args.to, args.eval_items, args.split, args.points, args.per_edge, args.dtype,
                           args.device, stage=lambda stage, done, total, msg: bars(_Tick(stage, done, total, msg)))
    finally:
        bars.close()
    _print_multi(rec)
    if args.out:
        write_record(rec, Path(args.out))
        print(f"wrote {args.out}")


def _print_multi(rec: dict) -> None:
    names = rec["models"]
    n, w = len(names), max(len(s) for s in names)
    print(f"{n} models to the {rec['to']} ({rec['eval_set']}; classes {', '.join(rec['classes']) or '-'}; "
          f"{len(rec['lambdas'])} points per path)")
    for side in ("before", "after"):
        print(f"barrier {side} alignment" + (" (as trained, in the aligners' coordinates)" if side == "before" else ""))
        for i, row in enumerate(rec[side]["barrier"]):
            print(f"  {names[i]:<{w}} " + " ".join(f"{v:8.4f}" for v in row))
    al = rec["alignment"]
    if rec["to"] == "barycentre":
        changes = [r["permutation_changes"] for r in al["rounds"][1:]]
        print(f"barycentre: {len(changes)} round(s), permutation changes {changes}; {al['stop']}")
    ex = rec["exactness"]
    print(f"exactness: every aligned model's loss within {max(m['rel_diff'] for m in ex['models']):.1e} relative of "
          f"its own (tolerance {ex['tolerance']:.0e})")
    tri, c = rec["triangle"], rec["triangle"]["centroid"]
    print(f"triangle of {', '.join(names[i] for i in tri['models'])} ({len(tri['weights'])} points): centroid loss "
          f"{c['loss']:.4f}, {c['excess']:+.4f} over the vertices' mean; largest excess {tri['barrier']:.4f}")


def cmd_cache(args) -> None:
    from engine.api import build_cache
    from engine.results import cache_dir
    from engine.zoo import pairs

    if args.action == "table":
        if args.only is not None or args.methods is not None or args.force:
            raise LMCError("--only, --methods and --force apply to `cache build`; `cache table` shows the whole store.")
        print(cache_table())
        return
    _check_zoo_names(args.only)
    only = [(a, b) for a, b in pairs() if args.only is None or a in args.only or b in args.only]
    if args.ablation:
        from engine.api import ablation_dir, build_ablation

        if args.methods is not None:
            raise LMCError("--methods does not apply to `cache build --ablation`: the ablation runs weight matching.")
        out = build_ablation(only=only, force=args.force, log=lambda s: print(s, file=sys.stderr))
        print(f"{sum(len(a['runs']) for a in out)} ablation run(s) for {len(out)} pair(s) in {ablation_dir()}")
        return
    if args.widen:
        from engine.api import WIDEN_METHODS, build_widen, widen_dir

        if args.only is not None:
            raise LMCError("--only does not apply to `cache build --widen`: it builds the zoo's width-heterogeneous "
                           "pairs.")
        out = build_widen(tuple(args.methods or WIDEN_METHODS), eval_items=args.eval_items, force=args.force,
                          log=lambda s: print(s, file=sys.stderr))
        print(f"{len(out)} width-heterogeneous record(s) in {widen_dir()}")
        return
    if args.multi:
        from engine.api import build_multi
        from engine.multi import store_dir

        if args.only is not None or args.methods is not None:
            raise LMCError("--only and --methods do not apply to `cache build --multi`: it builds the zoo's seed sets "
                           "with weight matching.")
        out = build_multi(force=args.force, log=lambda s: print(s, file=sys.stderr))
        print(f"{len(out)} multi-model record(s) in {store_dir()}")
        return
    if args.planes:
        from engine.api import build_planes, plane_dir

        if args.methods is not None:
            raise LMCError("--methods does not apply to `cache build --planes`: the planes use weight matching.")
        out = build_planes(only=only, force=args.force, log=lambda s: print(s, file=sys.stderr))
        print(f"{len(out)} loss plane(s) in {plane_dir()}")
        return
    from engine.api import build_symmetry, symmetry_dir

    names = sorted({n for p in only for n in p})
    if not args.symmetry:
        recs = build_cache(methods=args.methods, eval_items=args.eval_items, only=only, force=args.force,
                           log=lambda s: print(s, file=sys.stderr))
        print(f"{len(recs)} record(s) in {cache_dir()}")
    done = build_symmetry(names, force=args.force, log=lambda s: print(s, file=sys.stderr))
    print(f"{len(done)} symmetry report(s) in {symmetry_dir()}")


def cache_table() -> str:
    """The cached barriers as a markdown table: one row per zoo pair, barrier / midpoint per method, and
    the naive barrier also in the aligned runs' coordinates (a "-" where a record lacks it).

    A broken record is a "-" cell (and a warning naming its file), never the end of the table.
    """
    from engine.align import METHODS
    from engine.builders import is_current
    from engine.results import cached_record
    from engine.zoo import pairs

    earlier = []  # records of another config than `cache build` now computes (an earlier budget or default setting)

    def cell(r: dict | None, suffix: str = "") -> str:
        if r is None or not isinstance(r.get("barrier" + suffix), (int, float)):
            return "-"
        out = f"{r['barrier' + suffix]:.3f} / {r['midpoint_barrier' + suffix]:.3f}"
        if isinstance(r.get("accuracy_drop" + suffix), (int, float)):
            out += f" ({100 * r['accuracy_drop' + suffix]:.1f} pt)"
        if not suffix and not is_current(r):
            earlier.append(r)
            out += " *"
        return out

    at = list(METHODS).index("naive") + 1  # the naive path after the aligned runs' norm folding / rewrite
    names = [m.display_name for m in METHODS.values()]
    names.insert(at, "Naive, aligned runs' coordinates")
    rows = ["| pair | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a, b in pairs():
        recs = {m: cached_record(a, b, m) for m in METHODS}
        cells = [cell(r) for r in recs.values()]
        cells.insert(at, cell(recs["naive"], "_folded"))
        rows.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    if earlier:
        rows.append(f"\n\\* {len(earlier)} record(s) of another config than `cache build` now computes (an earlier "
                    "budget, evaluation size or default setting); `cache build` recomputes them.")
    return "\n".join(rows)


def cmd_runs(args) -> None:
    """The run history (engine.history): list it, show one run, delete runs the tool wrote."""
    from engine import history

    ids = list(dict.fromkeys(args.ids))  # a run named twice is deleted once
    if args.json and args.action != "show":
        raise LMCError("--json applies to `runs show`.")
    if args.action == "list":
        if ids:
            raise LMCError("`runs list` lists every run; `runs show ID` shows one.")
        runs = history.list_runs()
        if not runs:
            print(f"no runs kept in {history.runs_dir()}; runs finished in the app are kept there")
            return
        print(f"{'id':<23} {'created':<20} {'status':<7} {'method':<10} {'barrier':>8} {'midpoint':>8} "
              f"{'items':>7}  pair")
        for r in map(history.summary, runs):
            items = f"{r['eval_items']:,}" if isinstance(r["eval_items"], int) else "all"
            barriers = "       -        -" if r["barrier"] is None else f"{r['barrier']:8.4f} {r['midpoint_barrier']:8.4f}"
            print(f"{r['id']:<23} {r['created'] or '-':<20} {r['status']:<7} {r['method']:<10} "
                  f"{barriers} {items:>7}  {r['model_a']} / {r['model_b']}")
        print(f"{len(runs)} run(s) in {history.runs_dir()}")
    elif args.action == "show":
        if len(ids) != 1:
            raise LMCError(f"`runs show` takes one run id, not {len(ids)}.")
        entry = history.load_run(ids[0])
        if args.json:  # strict JSON: a NaN or infinity (a diverged run's loss) is written as null
            print(json.dumps(_json_safe(entry), indent=1, allow_nan=False))
            return
        run = entry["run"]
        print(f"run {run['id']}: {run['status']}, created {entry.get('created', '-')}, kept {run.get('saved', '-')}")
        if history.finished(entry):
            _print_path_table(entry)
            element = history.run_element(entry)
            if element is not None:
                print(f"element kept: {element} (`align {entry['model_a']} {entry['model_b']} --method "
                      f"{entry['method']} --start {element}` goes on from it)")
        else:  # stopped or failed before its record: where it was and why it ended
            print(f"{entry['method']}: {entry['model_a']} / {entry['model_b']}; {run['status']} during "
                  f"{run.get('phase') or 'its start'}: {run.get('message') or '-'}")
    else:
        if not ids:
            raise LMCError("`runs delete` needs the ids of the runs to delete (`runs list` shows them).")
        for i in ids:  # every run is checked before any is deleted
            history.own_file(i)
        for i in ids:
            print(f"deleted run {i} ({history.delete_run(i)})")


def cmd_plane(args) -> None:
    from engine.api import plane_pair
    from engine.models.io import write_json_atomic
    from engine.zoo import resolve

    inputs = [resolve(args.model_a), resolve(args.model_b)]
    _check_out(args.out, inputs, None)
    bars = _progress_bar("plane")
    try:
        rec = plane_pair(args.model_a, args.model_b, args.method, args.grid, args.eval_items, args.split, args.steps,
                         args.seed, progress=lambda done, total, msg: bars(_Tick("loss plane", done, total, msg)))
    finally:
        bars.close()
    p, ax = rec["points"], rec["axes"]
    print(f"loss plane through {rec['model_a']}, {rec['model_b']} and B aligned by {rec['method']} "
          f"({len(rec['x'])} x {len(rec['y'])} points, {rec['eval_set']})")
    print(f"A at (0, 0), aligned B at ({p['B_aligned'][0]:.3f}, 0), B at ({p['B'][0]:.3f}, {p['B'][1]:.3f}); "
          f"|A - aligned B| {ax['norm_d1']:.3f} against |A - B| {math.hypot(ax['c'], ax['w']):.3f}")
    flat = [v for row in rec["loss"] for v in row]
    print(f"loss from {min(flat):.4f} to {max(flat):.4f}  ({rec['seconds']:.1f} s)")
    if args.out:
        write_json_atomic(Path(args.out), rec, allow_nan=False)
        print(f"wrote {args.out}")


class _Tick:
    """A progress update for _PhaseBars from a (done, total, message) callback."""

    def __init__(self, phase: str, done: int, total: int, message: str):
        self.phase, self.done, self.total, self.message = phase, done, total, message


def cmd_symmetry(args) -> None:
    from engine.report import format_report, symmetry_report

    target = args.model
    if not args.dims_only:
        from engine.zoo import resolve

        target = resolve(target)
    rep = symmetry_report(target, dims_only=args.dims_only)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))


# ---------------------------------------------------------------------------------------------
# Argument types: each refusal is one sentence naming the value and what is expected


def _ascii_int(s: str) -> int | None:
    """An integer written with ASCII digits (thousands may be grouped by ',' or '_'), or None: int()
    alone also reads other scripts' digits ('٣' is 3) and surrounding spaces."""
    t = s.replace(",", "").replace("_", "")
    body = t[1:] if t[:1] in "+-" else t
    return int(t) if body.isascii() and body.isdigit() else None


def _int_in(lo: int, hi: int, what: str):
    def parse(s: str) -> int:
        n = _ascii_int(s)
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo:,} to {hi:,} ({what}), got {s!r}")
        return n

    return parse


def _items(s: str) -> int | None:
    if s == "all":
        return None
    n = _ascii_int(s)
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {s!r}")
    return n


def _finite(s: str) -> float:
    try:
        x = float(s)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return x


def _fraction(what: str):
    def parse(s: str) -> float:
        x = _finite(s)
        if not 0 <= x < 1:
            raise argparse.ArgumentTypeError(f"expected a fraction from 0 up to (not including) 1 ({what}), got {s!r}")
        return x

    return parse


def _path(s: str) -> str:
    if not s.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    if "\0" in s:
        raise argparse.ArgumentTypeError(f"expected a path, got {s!r} (it holds a NUL byte)")
    return s


_seed = _int_in(0, 2**32 - 1, "a random seed")


def _positive_seconds(s: str) -> float:
    v = _finite(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r} is not a positive number of seconds")
    return v


OPTION_DEST = "option_"  # the argparse destination of a run option's flag: OPTION_DEST + its name


def _add_option_args(p: argparse.ArgumentParser) -> None:
    """One flag per run option of the methods (engine.options), from its declaration: each says which
    methods take it; a flag the chosen method does not take is refused when the config is built."""
    from engine.align import METHODS

    takers: dict[str, tuple] = {}
    for method, entry in METHODS.items():
        for name, spec in entry.options.specs().items():
            takers.setdefault(name, (spec, []))[1].append(method)
    for name, (spec, methods) in takers.items():
        kw: dict = {"dest": OPTION_DEST + name, "default": None,
                    "help": f"{' / '.join(methods)}: {spec.help[:1].lower()}{spec.help[1:].rstrip('.')}"}
        if spec.kind == "choice":
            kw["choices"] = list(spec.choices)
        elif spec.kind == "choice_or_file":  # the options type checks the form, the method the file
            kw["metavar"] = "{" + ",".join(spec.choices) + f",FILE{spec.suffix}}}"
        elif spec.kind == "flag":
            kw |= {"action": "store_const", "const": True}
        elif spec.kind == "count":
            kw |= {"type": _int_in(1, spec.most, spec.label), "metavar": "N"}
        elif spec.kind == "seconds":
            kw |= {"type": _positive_seconds, "metavar": "SECONDS"}
        else:  # rate, fraction: their bounds are the options type's to check
            kw |= {"type": _finite, "metavar": "X"}
        p.add_argument(spec.flag, **kw)


def _add_path_args(p: argparse.ArgumentParser) -> None:
    from engine.api import DEFAULT_EVAL_ITEMS

    p.add_argument("model_a", type=_path, help="zoo name (see `zoo list`) or model directory")
    p.add_argument("model_b", type=_path, help="zoo name or model directory")
    p.add_argument("--points", type=_int_in(2, MAX_POINTS, "grid points on the path, endpoints included"),
                   default=21, help=f"grid points on the path, endpoints included (2 to {MAX_POINTS:,})")
    p.add_argument("--split", default="test", choices=["val", "test"], help="held-out split to evaluate on")
    p.add_argument("--eval-items", type=_items, default=DEFAULT_EVAL_ITEMS,
                   help="scored tokens (LM) or images (ViT) per point, or 'all' for the whole split "
                        "(default 65,536: a third of the LM test split, every test image)")
    p.add_argument("--path", default="weights", choices=["weights", "circuits"],
                   help="weights (default): lerp the factored weights; circuits: lerp each head's QK and OV "
                        "circuits (a model with heads twice as wide), like for like with the literature")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the dtype both models are loaded and run in (float64: exact to 1e-12, slower; bfloat16: "
                        "half float32's memory, as 1B checkpoints are stored, the aligners' products in float32 "
                        "per block)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--offload", action="store_true",
                   help="keep both endpoints on the CPU and only the path model on --device (a pair that "
                        "does not fit the GPU three times)")
    p.add_argument("--out", type=_path, default=None,
                   help="write the result record (JSON) here; checked before the run starts; an existing "
                        "file is replaced only if it is an earlier result record")
    p.add_argument("--attribution", action=argparse.BooleanOptionalAction, default=None,
                   help="attribute the midpoint barrier to layers and classes (1 evaluation per class, 2 per "
                        "layer part: 0.4 of a zoo pair's path); by default unless it would cost more than twice the "
                        "path's own evaluations and more than about a minute, and the record says when it was skipped")


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("train", help="train one reference model")
    p.add_argument("--task", choices=["lm", "vit"], required=True)
    p.add_argument("--pe", choices=["none", "learned", "sinusoidal", "rope"], required=True)
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--steps", type=_int_in(1, MAX_STEPS, "training steps"), default=None,
                   help="override the default step budget")
    p.add_argument("--train-bytes", type=_int_in(1024, 10**9, "training bytes"), default=None,
                   help="LM: train on the first N bytes of the train split only, repeating them (epochs over a small "
                        "corpus, as Tiny Shakespeare studies train); default: the whole split")
    p.add_argument("--dropout", type=_fraction("dropout rate"), default=0.0,
                   help="residual dropout on every attention and MLP output while training (default 0, the zoo's recipe)")
    p.add_argument("--tier", choices=["small", "medium"], default="small",
                   help="LM shape: the small tier's (4 layers, D 128) or the medium tier's (6 layers, D 256, MLP 1024)")
    p.add_argument("--out", type=_path, required=True, help="directory for the checkpoint (new, empty, or written by this tool)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty directory the tool did not create (only the checkpoint's files are replaced)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("zoo", help="list or rebuild the built-in model zoo")
    p.add_argument("action", choices=["list", "build"])
    p.add_argument("--only", nargs="+", help="zoo names to (re)build")
    p.set_defaults(fn=cmd_zoo)

    p = sub.add_parser("interpolate", help="loss barrier of the naive linear path between two models")
    _add_path_args(p)
    p.set_defaults(fn=cmd_interpolate)

    from engine.align import METHODS
    from engine.classes import CLASSES

    p = sub.add_parser("align", help="align model B onto model A, then measure the loss barrier")
    _add_path_args(p)
    p.add_argument("--method", default="weight", choices=list(METHODS))
    p.add_argument("--classes", nargs="+", choices=list(CLASSES), default=None,
                   help="symmetry classes to use (default: every exact class of the model)")
    p.add_argument("--steps", type=_int_in(0, MAX_STEPS, "optimisation steps; 0 for the method's default"), default=0,
                   help="learned / dual optimisation steps (0: the method's default)")
    p.add_argument("--seed", type=_seed, default=0, help="data order and lambda samples of data-driven methods")
    _add_option_args(p)
    p.add_argument("--save-merged", type=_path, default=None, metavar="DIR",
                   help="save the interpolated model into this directory (new, empty, or written by this tool)")
    p.add_argument("--alpha", type=_finite, default=None,
                   help="position of the saved model on the path, 0 = A to 1 = B (default 0.5)")
    p.add_argument("--extrapolate", action="store_true", help="allow --alpha outside [0, 1]")
    p.add_argument("--overwrite", action="store_true",
                   help="let --save-merged write into a non-empty directory the tool did not create")
    p.add_argument("--resume", type=_path, default=None, metavar="DIR",
                   help="learned, dual: keep the optimisation's state in DIR at every validation check; the same "
                        "command run again after an interruption resumes there, to the same result; the state is "
                        "deleted when the run finishes")
    p.add_argument("--save-element", type=_path, default=None, metavar="FILE.safetensors",
                   help="write the element the run found, in full precision, to this file (new, or one this tool "
                        "wrote); a later learned or dual run starts there with --start FILE")
    p.set_defaults(fn=cmd_align)

    p = sub.add_parser("plane", help="the loss over the plane through A, B and B aligned (a contour map's data)")
    p.add_argument("model_a", type=_path, help="zoo name (see `zoo list`) or model directory")
    p.add_argument("model_b", type=_path, help="zoo name or model directory")
    p.add_argument("--method", default="weight", choices=[m for m in METHODS if m != "naive"])
    p.add_argument("--grid", type=_int_in(3, 41, "grid points per axis"), default=11,
                   help="points per axis (the plane costs grid^2 evaluations)")
    p.add_argument("--eval-items", type=_items, default=8192,
                   help="scored tokens (LM) or images (ViT) per grid point, or 'all' (default 8,192)")
    p.add_argument("--split", default="test", choices=["val", "test"], help="held-out split to evaluate on")
    p.add_argument("--steps", type=_int_in(0, MAX_STEPS, "optimisation steps; 0 for the method's default"), default=0,
                   help="learned / dual optimisation steps (0: the method's default)")
    p.add_argument("--seed", type=_seed, default=0, help="data order and lambda samples of data-driven methods")
    p.add_argument("--out", type=_path, default=None, help="write the plane (JSON) here")
    p.set_defaults(fn=cmd_plane)

    from engine.api import DEFAULT_EVAL_ITEMS

    p = sub.add_parser("cache", help="precompute cached_results/ for every zoo pair")
    p.add_argument("action", choices=["build", "table"])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    p.add_argument("--eval-items", type=_items, default=DEFAULT_EVAL_ITEMS,
                   help="scored tokens / images per point, or 'all' (default 65,536: every test image)")
    p.add_argument("--only", nargs="+", help="zoo names: build only the pairs containing them")
    p.add_argument("--force", action="store_true", help="recompute records that are already up to date")
    p.add_argument("--ablation", action="store_true",
                   help="build the class ablation instead (weight matching with each symmetry class alone and all "
                        "together, 8,192 items at 11 points) into cached_results/ablation/")
    p.add_argument("--planes", action="store_true",
                   help="build the loss planes instead (A, B and B weight-matched; 11 x 11 points of 8,192 items) "
                        "into cached_results/plane/")
    p.add_argument("--widen", action="store_true",
                   help="build the width-heterogeneous records instead (each narrow zoo ViT lifted into its wider "
                        "twin's shape; naive and weight matching) into cached_results/widen/")
    p.add_argument("--multi", action="store_true",
                   help="build the multi-model records instead (three seeds of the learned-PE ViT in one basis, to the "
                        "reference and to the barycentre) into cached_results/multi/")
    p.add_argument("--symmetry", action="store_true",
                   help="build only the zoo's symmetry reports (cached_results/symmetry/; a plain build writes them "
                        "too)")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("widen", help="lift a narrower model A into the wider B's shape, align B onto it, measure "
                                     "the loss barrier in B's width")
    p.add_argument("model_a", type=_path, help="the narrower model: zoo name or model directory")
    p.add_argument("model_b", type=_path, help="the wider model: zoo name or model directory")
    p.add_argument("--method", default="weight", choices=list(METHODS))
    p.add_argument("--classes", nargs="+", choices=list(CLASSES), default=None,
                   help="symmetry classes to use (default: every exact class of the model)")
    p.add_argument("--steps", type=_int_in(0, MAX_STEPS, "optimisation steps; 0 for the method's default"), default=0,
                   help="learned / dual optimisation steps (0: the method's default)")
    p.add_argument("--seed", type=_seed, default=0, help="data order and lambda samples of data-driven methods")
    p.add_argument("--points", type=_int_in(2, MAX_POINTS, "grid points on the path, endpoints included"),
                   default=21, help=f"grid points on the path, endpoints included (2 to {MAX_POINTS:,})")
    p.add_argument("--split", default="test", choices=["val", "test"], help="held-out split to evaluate on")
    p.add_argument("--eval-items", type=_items, default=DEFAULT_EVAL_ITEMS,
                   help="scored tokens (LM) or images (ViT) per point, or 'all' (default 65,536: every test image)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the dtype both models are loaded and run in (float64: the lift exact to 1e-12, slower)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--out", type=_path, default=None, help="write the result record (JSON) here")
    p.add_argument("--attribution", action=argparse.BooleanOptionalAction, default=None,
                   help="attribute the midpoint barrier to layers and classes (1 evaluation per class, 2 per "
                        "layer part: 0.4 of a zoo pair's path); by default unless it would cost more than twice the "
                        "path's own evaluations and more than about a minute, and the record says when it was skipped")
    p.set_defaults(fn=cmd_widen)

    p = sub.add_parser("multi", help="align N >= 3 models of one architecture into one basis; the barrier between every "
                                     "pair before and after, and the loss over the triangle of the first three")
    p.add_argument("models", nargs="+", type=_path, metavar="MODEL", help="zoo names or model directories (3 or more)")
    p.add_argument("--to", default="reference", choices=["reference", "barycentre"],
                   help="the shared basis: the first model's (each other model weight-matched onto it), or the "
                        "models' barycentre by alternating matching")
    p.add_argument("--points", type=_int_in(3, 101, "points on each pairwise path, endpoints included"), default=5,
                   help="lambdas on each pairwise path, endpoints included (default 5)")
    p.add_argument("--per-edge", type=_int_in(2, 21, "points per edge of the triangle"), default=6,
                   help="points per edge of the triangle's barycentric grid (default 6: 21 points)")
    p.add_argument("--eval-items", type=_items, default=8192,
                   help="scored tokens (LM) or images (ViT) per point, or 'all' (default 8,192, or every test image)")
    p.add_argument("--split", default="test", choices=["val", "test"], help="held-out split to evaluate on")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the dtype the models are loaded and run in")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--out", type=_path, default=None, help="write the record (JSON) here")
    p.set_defaults(fn=cmd_multi)

    p = sub.add_parser("runs", help="list, show or delete the live runs kept in the run history")
    p.add_argument("action", choices=["list", "show", "delete"])
    p.add_argument("ids", nargs="*", metavar="ID", type=_path, help="run ids, as `runs list` shows them")
    p.add_argument("--json", action="store_true", help="`runs show`: the whole run file as JSON")
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("symmetry", help="symmetry-group diagnostics of a model")
    p.add_argument("model", type=_path,
                   help="zoo name, model directory, or (with --dims-only) a directory with config.json")
    p.add_argument("--dims-only", action="store_true", help="group dimensions from the config alone")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_symmetry)
    return ap


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {_one_line(message)}", file=sys.stderr)


@contextmanager
def _quiet_transformers():
    """No transformers progress bars or advisories on stderr around the CLI's own lines.

    Before transformers is imported its environment switches do it (and then hold for the process);
    once imported, its logging module, whose previous state is restored afterwards (the CLI also runs
    in-process, in tests).
    """
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    old_env = {k: os.environ.get(k) for k in env}
    imported = "transformers" in sys.modules
    if imported:
        from transformers.utils import logging as hf_logging

        old = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    os.environ.update(env)
    if imported:
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if imported:
            if old[0]:
                hf_logging.enable_progress_bar()
            else:
                hf_logging.disable_progress_bar()
            hf_logging.set_verbosity(old[1])


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 2 for every user error (one line on stderr), 130 on Ctrl-C.

    An unexpected exception is a bug in the engine: one line and status 1 (LMC_DEBUG=1 re-raises it
    with its traceback).
    """
    with warnings.catch_warnings(), _quiet_transformers():
        warnings.showwarning = _warning_line
        try:
            args = parser().parse_args(argv)
            if _launched() and args.fn not in (cmd_align, cmd_interpolate):
                raise LMCError(f"Only `align` and `interpolate` run across processes; run `{args.command}` "
                               "without torchrun.")
            with _quiet_unless_rank_zero():
                args.fn(args)
        except LMCError as e:
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
        except OSError as e:  # the user's files or machine: permissions, a full disk, a vanished path
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{_one_line(e.strerror or e)}", file=sys.stderr)
            return 2
        except MemoryError:
            print("error: out of memory; use fewer --eval-items or smaller models.", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("error: interrupted.", file=sys.stderr)
            return 130
        except Exception as e:  # the last line of defence against a traceback
            if os.environ.get("LMC_DEBUG"):
                raise
            if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
                print("error: the GPU ran out of memory; use --device cpu or fewer --eval-items.", file=sys.stderr)
                return 2
            print(f"error: internal error ({type(e).__name__}: {_one_line(e)[:300]}); this is a bug in the engine, "
                  "rerun with LMC_DEBUG=1 for the traceback.", file=sys.stderr)
            return 1
        finally:
            if _launched() and "torch.distributed" in sys.modules:
                from engine.distributed import stop

                stop()
    return 0
