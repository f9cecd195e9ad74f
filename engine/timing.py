"""How long a run will take, said before it starts: the machine's measured speed, earlier records of
the same architecture scaled by it, and the run's own arithmetic where no record tells.

The machine's speed is measured, not assumed: `reference_gflops` times a fixed float32 product in this
process (a tenth of a second, memoised, measured again at the start of every run, whose record keeps
it as provenance.reference_gflops). A phase (engine.progress.PHASES) comes from earlier result records
of the same architecture (their `timings`, `estimate_seconds`) scaled by the evaluation size, the grid
and the step budget, and by the ratio of the machine's speed then and now when the record knows it; a
phase no record tells comes from the run's own arithmetic (`arithmetic_seconds`: the FLOPs of its
forward passes, optimisation steps and matching products, at the measured speed times an efficiency
calibrated on the shipped records, bench/RESULTS.md "Time estimates"). During the run
engine.progress.remaining_seconds refines it from the run's pace. A simple rate model, good to a
factor of two, not a promise.

Above the aligners (the arithmetic reads their batch sizes and validation grids), below the facade.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from engine.models.base import GATED_MLPS
from engine.progress import PHASES

# ---------------------------------------------------------------------------------------------
# The machine's speed

REFERENCE_N = 512  # the reference product: [N, N] @ [N, N] in float32, 0.27 GFLOP
REFERENCE_S = 0.1  # seconds of products one measurement takes (after one untimed warm-up product)
_rates: dict[tuple[str, int], float] = {}  # (device, torch threads) -> GFLOP/s, this process's last measurement


def _measure_gflops(device: str) -> float:
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(REFERENCE_N, REFERENCE_N, generator=g).to(dev) for _ in range(2))
    out = torch.mm(a, b)  # warm-up: allocation, kernel choice, thread pool start
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=out)
        sync()
        reps += 1
        t = time.perf_counter() - t0
        if t >= REFERENCE_S and reps >= 3:
            return 2 * REFERENCE_N**3 * reps / t / 1e9


def reference_gflops(device: str = "cpu", refresh: bool = False) -> float:
    """The machine's speed now: GFLOP/s of a float32 [512, 512] product on `device`, with the torch
    threads in use, repeated for REFERENCE_S in this process, so that other work on the machine slows it
    as it slows a run. Memoised per device and thread count; `refresh` measures again (every run does
    at its start: engine.api.run_pair)."""
    import torch

    key = (str(device), torch.get_num_threads())
    if refresh or key not in _rates:
        _rates[key] = _measure_gflops(str(device))
    return _rates[key]


def record_gflops(rec: dict) -> float | None:
    """The machine's speed when a record was made (provenance.reference_gflops), or None for a record
    made before records kept it."""
    v = (rec.get("provenance") or {}).get("reference_gflops")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


# ---------------------------------------------------------------------------------------------
# Before the run: from earlier records


def record_items(rec: dict) -> int | None:
    """Scored tokens (LM) or images (ViT) of a record's evaluation set."""
    n = rec.get("eval_tokens", rec.get("eval_images"))
    return n if isinstance(n, int) and n > 0 else None


def record_train_items(rec: dict) -> int:
    """Scored tokens or images of a record's train curve, evaluated at every point beside the test
    set (0 for a record without one)."""
    n = rec.get("train_eval_tokens", rec.get("train_eval_images"))
    return n if isinstance(n, int) and n > 0 else 0


def same_arch(a: dict | None, b: dict) -> bool:
    """Whether a record's architecture is `b`, on the fields both know (records written before a field
    was added to Arch lack it)."""
    if not isinstance(a, dict):
        return False
    common = a.keys() & b.keys()
    return bool(common) and all(a[k] == b[k] for k in common)


def naive_paths(arch) -> int:
    """Paths a naive run walks: its own, and again in the aligned runs' coordinates when those differ
    (engine.pipeline.naive_in_aligned_coordinates). `arch`: an Arch or its dict; 1 for a dict it cannot read."""
    from engine.classes import choose_classes
    from engine.models.base import Arch

    if isinstance(arch, dict):
        try:
            arch = Arch(**arch)
        except TypeError:
            return 1
    return 2 if "residual_orth" in choose_classes(arch, "weight").classes else 1


def slowdown(rec: dict, rate: float | None) -> float:
    """How much longer the record's work takes on the machine now than it took then: its speed over
    today's `rate` (GFLOP/s), or 1 when either is unknown."""
    then = record_gflops(rec)
    return then / rate if then is not None and rate else 1.0


def estimate_seconds(method: str, arch: dict, eval_size: int, points: int, steps: int,
                     refs: Iterable[dict], train_size: int = 0, attribution_size: int = 0,
                     rate: float | None = None, batch: int | None = None) -> dict[str, float | None]:
    """About how long each phase of a run will take, from earlier records `refs` (best first).

    The first record of the same architecture (`same_arch`) gives the evaluation rate (its path's seconds per
    point per scored item) and the loading time; the first of the same architecture and method gives
    the alignment time, scaled by the step budget and the batch for learned and dual matching. `steps`
    is the run's budget (0 for methods without one), `batch` its sequences or images per step (None:
    the default, AlignContext.batch); `train_size` the items of its train curve
    (engine.evaluate.train_items; 0 without one), scored at every point of the path like a record's
    own train items; `attribution_size` the items the barrier attribution scores at each of its
    evaluations (engine.attribution.items; 0 without one). `rate` is the machine's speed now
    (reference_gflops): a record that kept its own is scaled by their ratio (`slowdown`; the loading
    time, mostly the disk's, is not). A phase no record can tell is None.
    """
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    same = [r for r in refs if same_arch(r.get("arch"), arch) and isinstance(r.get("timings"), dict)]
    for r in same:
        t, n, k = r["timings"], record_items(r), len(r.get("lambdas") or ())
        if n and k and isinstance(t.get("interpolate"), (int, float)):
            per_item_point = t["interpolate"] * slowdown(r, rate) / ((n + record_train_items(r)) * k)
            paths = naive_paths(arch) if method == "naive" else 1  # naive's second path: test split only
            out["interpolate"] = per_item_point * points * (eval_size * paths + train_size)
            out["measure B"] = 0.0 if method == "naive" else per_item_point * eval_size
            out["load"] = float(t.get("load", 0.0))
            out["attribution"] = per_item_point * attribution_size * attribution_evaluations(method, arch)
            break
    if method == "naive":
        out["align"] = 0.0
    else:
        for r in same:
            t = r["timings"]
            if r.get("method") != method or not isinstance(t.get("align"), (int, float)):
                continue
            ref_steps = (r.get("config") or {}).get("steps") or 0
            scale = steps / ref_steps if steps and ref_steps else 1.0
            if method in ("learned", "dual"):  # a step's work grows with its batch
                scale *= (batch or default_batch()) / (record_batch(r) or default_batch())
            out["align"] = t["align"] * scale * slowdown(r, rate)
            break
    return out


# ---------------------------------------------------------------------------------------------
# Before the run: from the run's own arithmetic

# The speed each kind of work reaches, as a share of the reference product's (reference_gflops), fitted by
# bench/bench_estimates.py (bench/RESULTS.md, "Time estimates"): evaluation and matching from runs that
# measured the reference as they ran, optimisation from the shipped records (their paths say how fast the
# machine then was); medians, each kind's timings scattering by a factor of 2-4 either side. Small
# models reach a fraction of a [512, 512] product's speed: their products are small, and norms,
# softmax, gathers, float64 solves, assignments and Python lie between them. Fitted on 2 busy cores
# (load 7): on a quiet machine these shares are higher, and the estimates on the long side.
EFFICIENCY = {"evaluate": 0.18, "optimise": 0.17, "match": 0.055}
LOAD_BYTES_PER_S = 8.2e7  # reading both models and making the evaluation sets (float32 bytes), same fit
WEIGHT_SWEEPS = 11  # sweeps weight matching takes: the median of the shipped weight-matching records


class Sizes(NamedTuple):
    L: int
    d: int
    h: int
    hkv: int
    dh: int
    m: int
    n_out: int
    n_ctx: int


def sizes(arch: dict) -> Sizes | None:
    """The sizes the arithmetic needs from an arch dict (engine.models.base.Arch), or None."""
    try:
        return Sizes(*(int(arch[k]) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp",
                                               "n_out", "n_ctx")))
    except (KeyError, TypeError, ValueError):
        return None


def seq_positions(arch: dict) -> int:
    """Positions of one evaluation or training item: an LM window (at most 128), or a ViT's patches and
    class token (engine.evaluate.seq_len)."""
    return min(int(arch["n_ctx"]), 128) if arch.get("task") == "lm" else int(arch["n_ctx"])


def layer_params(arch: dict) -> int:
    """Weights of one block's products (Q, K, V, O, the MLP's two or three matrices)."""
    z = sizes(arch)
    mats = 3 if arch.get("mlp") in GATED_MLPS else 2
    return z.d * z.h * z.dh + 2 * z.d * z.hkv * z.dh + z.h * z.dh * z.d + mats * z.d * z.m


def param_count(arch: dict) -> int:
    """About the parameters of a model: its blocks and the embedding, head and positions."""
    z = sizes(arch)
    embed = (z.n_out if arch.get("task") == "lm" else 0) * z.d
    head = 0 if arch.get("tied_embeddings") else z.n_out * z.d
    return z.L * layer_params(arch) + embed + head + (z.n_ctx * z.d if arch.get("pe") == "learned" else 0)


def forward_flops(arch: dict) -> float | None:
    """FLOPs of one forward pass per scored item (an LM token; a ViT image, all its positions): 2 x the
    block weights per position, the attention's two products over the positions a query sees (half
    the window when causal), and the head; None for an arch dict that lacks the sizes."""
    z = sizes(arch)
    if z is None:
        return None
    n = seq_positions(arch)
    span = n / 2 if arch.get("causal", arch.get("task") == "lm") else n
    per_position = z.L * (2 * layer_params(arch) + 2 * 2 * z.h * z.dh * span)
    if arch.get("task") == "vit":
        return n * per_position + 2 * z.d * z.n_out  # the class token alone meets the head
    return per_position + 2 * z.d * z.n_out


def weight_sweep_flops(arch: dict) -> float:
    """FLOPs of one weight-matching sweep (engine.align.weight): per layer both models' head circuits
    (W_Q W_K^T and W_V W_O, d x d per head) and their h x h cost, the MLP's two [m, d] @ [d, m]
    scores and its assignment (about m^3), and the residual fit's products over the block's weights."""
    z = sizes(arch)
    return z.L * (8 * z.h * z.dh * z.d**2 + 4 * z.h**2 * z.d**2 + 4 * z.m**2 * z.d + z.m**3
                  + 4 * z.d * layer_params(arch))


def default_batch() -> int:
    from engine.align.context import AlignContext

    return AlignContext.batch


def record_batch(r: dict) -> int | None:
    """The batch a learned or dual record's steps ran on (its diagnostics' settings; None: the default)."""
    settings = ((r.get("alignment") or {}).get("diagnostics") or {}).get("settings") or {}
    b = settings.get("batch")
    return b if isinstance(b, int) and not isinstance(b, bool) and b > 0 else None


def align_flops(method: str, arch: dict, steps: int, batch: int | None = None) -> float:
    """FLOPs of the aligner: weight matching's WEIGHT_SWEEPS sweeps; activation matching's forward
    passes of both models over its batch and its per-layer correlations; learned matching's weight-
    matching start, its `steps` of a forward and backward (about 3 forwards) on a training batch, and its
    validation checks (five points on the path each); dual matching's start and twice the steps (the
    dual run and the one-sided comparison at the same budget)."""
    from engine.align.activation import ACT_BATCH
    from engine.align.context import AlignContext
    from engine.align.learned import EVALS, VAL_ITEMS, VAL_LAMBDAS

    if method == "naive":
        return 0.0
    task, f, z = arch.get("task", "lm"), forward_flops(arch), sizes(arch)
    per = seq_positions(arch) if task == "lm" else 1  # scored items per sequence / image
    if method == "activation":
        n = ACT_BATCH.get(task, 16) * seq_positions(arch)  # positions whose activations are correlated
        return 2 * ACT_BATCH.get(task, 16) * per * f + z.L * (2 * n * (z.m**2 + z.d**2) + z.m**3)
    start = WEIGHT_SWEEPS * weight_sweep_flops(arch)
    if method == "weight":
        return start
    val = (EVALS + 1) * len(VAL_LAMBDAS) * VAL_ITEMS.get(task, 4096) * f
    one = steps * 3 * (batch or AlignContext.batch) * per * f + val
    return start + (2 * one if method == "dual" else one)


def arithmetic_seconds(method: str, arch: dict, eval_size: int, points: int, steps: int, rate: float,
                       train_size: int = 0, attribution_size: int = 0,
                       batch: int | None = None) -> dict[str, float | None]:
    """About how long each phase of a run takes from its own arithmetic: FLOPs (forward_flops,
    align_flops) at `rate` GFLOP/s (reference_gflops) times the EFFICIENCY of the kind of work; the
    arguments as for estimate_seconds. Every phase None for an arch dict without sizes."""
    f = forward_flops(arch)
    if f is None or not rate:
        return dict.fromkeys(PHASES)
    speed = rate * 1e9

    def evaluating(items: float) -> float:
        return items * f / (speed * EFFICIENCY["evaluate"])

    paths = naive_paths(arch) if method == "naive" else 1
    kind = "optimise" if method in ("learned", "dual") else "match"
    return {
        "load": 2 * 4 * param_count(arch) / LOAD_BYTES_PER_S,
        "measure B": 0.0 if method == "naive" else evaluating(eval_size),
        "align": align_flops(method, arch, steps, batch) / (speed * EFFICIENCY[kind]),
        "interpolate": evaluating(points * (eval_size * paths + train_size)),
        "attribution": evaluating(attribution_size * attribution_evaluations(method, arch)),
    }


def estimate_run(method: str, arch: dict, eval_size: int, points: int, steps: int, refs: Iterable[dict],
                 rate: float | None, train_size: int = 0, attribution_size: int = 0,
                 batch: int | None = None, time_budget_s: float | None = None,
                 ) -> tuple[dict[str, float | None], dict[str, str]]:
    """(seconds per phase, where each came from): a phase an earlier record of the architecture tells
    (estimate_seconds, scaled to today's `rate`) is "records", the others "arithmetic"
    (arithmetic_seconds); a phase neither tells is None and has no source.

    `steps` is the run's step cap as it runs (engine.align.learned.step_budget: MAX_STEPS under a time budget
    alone). Learned and dual matching under `time_budget_s` align for at most weight matching's start and the
    budget (their clock counts the optimisation), whichever of that and the steps' estimate is shorter."""
    refs = list(refs)
    kw = {"train_size": train_size, "attribution_size": attribution_size, "batch": batch}
    est = estimate_seconds(method, arch, eval_size, points, steps, refs, rate=rate, **kw)
    calc = arithmetic_seconds(method, arch, eval_size, points, steps, rate, **kw) if rate else dict.fromkeys(PHASES)
    source = {}
    for p in PHASES:
        if est[p] is not None:
            source[p] = "records"
        elif calc[p] is not None:
            est[p], source[p] = calc[p], "arithmetic"
    if time_budget_s is not None and method in ("learned", "dual") and est["align"] is not None:
        start = estimate_run("weight", arch, eval_size, points, 0, refs, rate)[0]["align"]
        if start is not None:
            est["align"] = min(est["align"], start + time_budget_s)
    return est, source


def attribution_evaluations(method: str, arch: dict) -> int:
    """Evaluations the attribution makes at most: both endpoints and the midpoint, two per block
    (embedding, head, and each layer whole, its attention and its MLP), one per dropped class (six)."""
    layers = arch.get("n_layers") if isinstance(arch.get("n_layers"), int) else 0
    return 3 + 2 * (2 + 3 * layers) + (0 if method == "naive" else 6)
