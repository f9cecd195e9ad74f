"""Entry points shared by the CLI and the app: one call from a run config to a result record."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.data import default_splits, digits_sha256
from engine.errors import LMCError
from engine.evaluate import eval_set_for
from engine.interpolate import LinearPath, Progress, check_same_architecture, interpolate
from engine.models import Model, load_model, save_model
from engine.results import RunConfig, make_record, store
from engine.zoo import display_name, pairs, resolve

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_named(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> Model:
    m = load_model(resolve(name_or_path), dtype=DTYPES[dtype])
    m.name = display_name(name_or_path)
    m.module.to(device)
    return m


def run_pair(cfg: RunConfig, progress: Progress | None = None, save_merged: str | Path | None = None,
             alpha: float = 0.5) -> dict:
    """Load both models, align B onto A with cfg.method, interpolate, return the result record.

    Every method goes through the aligner registry (engine/align); the record then carries the
    alignment diagnostics and the endpoint exactness check. `save_merged` writes the model at
    (1 - alpha) theta_A + alpha g.theta_B in its family's own format.
    """
    from engine.align import METHODS
    from engine.align.run import align, alignment_record, endpoint_check

    from engine.resources import check_run  # memory from the configs alone: refuse before loading
    check_run(cfg)
    t0 = time.perf_counter()
    a = load_named(cfg.model_a, cfg.dtype, cfg.device)
    b = load_named(cfg.model_b, cfg.dtype, cfg.device)
    check_same_architecture(a, b)
    t_load = time.perf_counter() - t0
    if cfg.method not in METHODS:
        raise LMCError(f"Method {cfg.method!r} is not available; choose one of: {', '.join(METHODS)}.")
    # The record and its hash carry the budget and data actually used, not the "default" markers.
    data = digits_sha256() if a.arch.task == "vit" else default_splits().sha256
    cfg = replace(cfg, steps=cfg.steps or METHODS[cfg.method].default_steps, data_sha256=data)
    al = align(a, b, cfg.method, cfg.classes, cfg.steps, cfg.seed)
    es = eval_set_for(a, cfg.eval_split, cfg.eval_items)
    path = interpolate(al.model_a, al.model_b, es, cfg.points, progress=progress)
    t1 = time.perf_counter()
    check = endpoint_check(b, al, es, path["endpoint_loss_b"])
    timings = {"load": t_load, "align": al.seconds, "endpoint_check": time.perf_counter() - t1}
    extra = {}
    if save_merged is not None:
        merged = LinearPath(al.model_a, al.model_b).at(alpha)
        save_model(merged, save_merged)
        extra["merged"] = {"path": str(save_merged), "alpha": alpha, "family": merged.family}
    return make_record(cfg, path, timings, arch=a.arch.to_dict(), alignment=alignment_record(al),
                       endpoint_check=check, **extra)


# The default evaluation size of the CLI and of cached records: the first 65,536 tokens (512 windows
# of 128) of the 196,608-token LM test split, or all 360 digits test images. The barrier's standard
# error at this size is far below the differences between methods, and the whole LM split would
# triple the cost of every path (bench/RESULTS.md); `--eval-items all` scores the whole split.
DEFAULT_EVAL_ITEMS = 65_536


def build_cache(methods: list[str] | None = None, eval_items: int | None = DEFAULT_EVAL_ITEMS,
                only: list[tuple[str, str]] | None = None) -> list[dict]:
    """Precompute a record for every same-architecture zoo pair x method into cached_results/."""
    from tqdm import tqdm

    from engine.align import METHODS

    methods = methods or list(METHODS)  # learned / dual use their registry's fixed budget (engine/align)
    todo = [(a, b, m) for a, b in (only or pairs()) for m in methods]
    out = []
    for a, b, m in tqdm(todo, desc="cache"):
        rec = run_pair(RunConfig(a, b, m, eval_items=eval_items))
        store(rec)
        out.append(rec)
    return out
