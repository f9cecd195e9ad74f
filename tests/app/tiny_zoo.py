"""A stand-in zoo and result store from tiny reference models, for tests that must not depend on the
real (slow to train) zoo: the same names as engine.zoo.ENTRIES, 2 layers of width 32, random weights.

Pointed at with LMC_ZOO_DIR / LMC_CACHE_DIR, the app and the engine treat them like the real ones.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from engine import zoo
from engine.api import run_pair
from engine.models import save_model
from engine.models.reference import RefConfig, build
from engine.results import RunConfig, store

TINY = RefConfig(n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=32)
# The pair the app opens on (sidebar.OPENING_PAIR) and a ViT pair are cached; lm-rope is built but
# left uncached, for the "nothing cached, press Run" path.
CACHED_PAIRS = (("lm-learned-s0", "lm-learned-s1"), ("vit-learned-s0", "vit-learned-s1"))
UNCACHED_PAIR = ("lm-rope-s0", "lm-rope-s1")
EVAL_ITEMS = {"lm": 1024, "vit": 64}


@contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_zoo(root: Path) -> Path:
    """Tiny checkpoints under the zoo's names, and a zoo manifest for the app's table."""
    rows = []
    for a, b in (*CACHED_PAIRS, UNCACHED_PAIR):
        for name in (a, b):
            e = zoo.ENTRIES[name]
            m = build(replace(TINY, task=e.task, pe=e.pe), seed=e.seed)
            save_model(m, root / name)
            rows.append({
                "name": name, "task": e.task, "pe": e.pe, "seed": e.seed,
                "parameters": sum(p.numel() for p in m.module.parameters()),
                "test_loss": None, "test_accuracy": None, "meets_bar": False, "steps": 0,
            })
    (root / "manifest.json").write_text(json.dumps({"models": rows}))
    return root


def build_store(zoo_root: Path, root: Path) -> list[dict]:
    """Real engine runs on the tiny zoo, stored like `python -m engine cache` does; the LM pair also
    with weight matching, so overlaying several cached methods is exercised."""
    root.mkdir(parents=True, exist_ok=True)
    runs = [(*CACHED_PAIRS[0], "naive"), (*CACHED_PAIRS[0], "weight"), (*CACHED_PAIRS[1], "naive")]
    recs = []
    with env(LMC_ZOO_DIR=str(zoo_root)):
        for a, b, method in runs:
            rec = run_pair(RunConfig(a, b, method, eval_items=EVAL_ITEMS[zoo.ENTRIES[a].task], points=11))
            store(rec, root)
            recs.append(rec)
    return recs
