"""Entry points shared by the CLI and the app: one call from a run config to a result record."""

from __future__ import annotations

import time

import torch

from engine.errors import LMCError
from engine.evaluate import eval_set_for
from engine.interpolate import Progress, check_same_architecture, interpolate
from engine.models import Model, load_model
from engine.results import RunConfig, make_record, store
from engine.zoo import display_name, pairs, resolve

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_named(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> Model:
    m = load_model(resolve(name_or_path), dtype=DTYPES[dtype])
    m.name = display_name(name_or_path)
    m.module.to(device)
    return m


def run_pair(cfg: RunConfig, progress: Progress | None = None) -> dict:
    """Load both models, align B onto A with cfg.method, interpolate, return the result record."""
    t0 = time.perf_counter()
    a = load_named(cfg.model_a, cfg.dtype, cfg.device)
    b = load_named(cfg.model_b, cfg.dtype, cfg.device)
    check_same_architecture(a, b)
    t_load = time.perf_counter() - t0
    if cfg.method != "naive":
        raise LMCError(f"Method {cfg.method!r} is not available; choose one of: naive.")
    es = eval_set_for(a, cfg.eval_split, cfg.eval_items)
    path = interpolate(a, b, es, cfg.points, progress=progress)
    return make_record(cfg, path, {"load": t_load}, arch=a.arch.to_dict())


def build_cache(methods: list[str] | None = None, eval_items: int | None = None,
                only: list[tuple[str, str]] | None = None) -> list[dict]:
    """Precompute a record for every same-architecture zoo pair x method into cached_results/."""
    from tqdm import tqdm

    methods = methods or ["naive"]
    todo = [(a, b, m) for a, b in (only or pairs()) for m in methods]
    out = []
    for a, b, m in tqdm(todo, desc="cache"):
        rec = run_pair(RunConfig(a, b, m, eval_items=eval_items))
        store(rec)
        out.append(rec)
    return out
