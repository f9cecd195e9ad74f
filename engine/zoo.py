"""The built-in model zoo: reference LMs and ViTs, two seeds per positional encoding.

Folders under assets/zoo/ are named `lm-{pe}-s{seed}` and `vit-{pe}-s{seed}`, the wider
models `{task}-{pe}-w{width}-s{seed}` (the same recipe at d_model = width, d_mlp = 4 width), and the
medium tier `lm-{pe}-medium-s{seed}` (the same recipe at the shape of Theus et al.'s GPT-2-style LM:
6 layers, D 256, 4 heads of 64, MLP 1024; stored in bfloat16 to halve the clone), the recipe trained with
residual dropout `{task}-{pe}-dropout-s{seed}` and `{task}-{pe}-medium-dropout-s{seed}` (DROPOUT: the
same architecture), and further seeds of a
recipe for the N-model study (MORE_SEEDS: `vit-learned-s2`); each holds
config.json, model.safetensors and metrics.json (training curve, held-out metrics). The manifest
(assets/zoo/manifest.json) lists name, task, pe, seed, parameters, held-out metrics, steps and
the data hash. `python -m engine zoo build` retrains the lot from these definitions.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

import torch

from engine.data import ASSETS
from engine.errors import ModelError
from engine.models.io import read_json_object, write_json_atomic
from engine.models.reference import RefConfig
from engine.train import LM_TRAIN, VIT_TRAIN, TrainConfig, lm_config, vit_config

ZOO = ASSETS / "zoo"
LM_PES = ("none", "learned", "sinusoidal", "rope")
VIT_PES = ("learned", "sinusoidal", "rope")
SEEDS = (0, 1)
SLOW_PE_STEPS = {"none": 3000, "sinusoidal": 2500}
QUALITY = {"lm": ("test_loss", 1.45), "vit": ("test_accuracy", 0.95)}  # the bar each model must meet
WIDE = (("vit", "learned", 128),)  # (task, pe, width): wider pairs, to show how connectivity grows with width
MEDIUM = {"n_layers": 6, "d_model": 256, "d_mlp": 1024}  # the medium tier's shape (4 heads, context 128 as small)
MEDIUM_PES = ("learned", "rope")  # the reference's setting, and RoPE: the PE story at this size
# (task, pe, rate, tier): the recipe trained with residual dropout on every attention and MLP output (train
# --dropout); the literature's near-zero LM barriers come from models trained with dropout, the zoo's without
DROPOUT = (("lm", "learned", 0.1, "small"), ("lm", "learned", 0.1, "medium"))
MORE_SEEDS = (("vit", "learned", 2),)  # (task, pe, seed): further seeds of a recipe, for N-model studies
# (engine.multi); they join no pair, so every pair stays the recipe's seeds 0 and 1


def zoo_dir() -> Path:
    """The zoo in use: $LMC_ZOO_DIR if set, else ZOO; read at call time so tests can swap in tiny models."""
    return Path(os.environ.get("LMC_ZOO_DIR") or ZOO)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    task: str
    pe: str
    seed: int
    width: int | None = None  # None: the zoo's own width (LM 128, ViT 64)
    tier: str = "small"  # "small" | "medium" (MEDIUM's shape)
    dropout: float = 0.0  # residual dropout while training (DROPOUT); the architecture is the recipe's

    def config(self) -> RefConfig:
        cfg = lm_config(self.pe) if self.task == "lm" else vit_config(self.pe)
        if self.tier == "medium":
            return replace(cfg, **MEDIUM)
        return cfg if self.width is None else replace(cfg, d_model=self.width, d_mlp=4 * self.width)

    @property
    def store_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.tier == "medium" else torch.float32

    def train_config(self) -> TrainConfig:
        # NoPE must infer positions from the causal mask alone, and the fixed sinusoidal table learns
        # almost as slowly here: 1,000 steps leave them at 1.77 and 1.56 nats/byte (RoPE 1.33, learned
        # 1.41), so they get longer budgets to reach the quality bar.
        if self.task == "vit":
            tc = VIT_TRAIN
        else:
            tc = replace(LM_TRAIN, steps=SLOW_PE_STEPS[self.pe], eval_every=250) if self.pe in SLOW_PE_STEPS else LM_TRAIN
        return replace(tc, dropout=self.dropout)

    @property
    def path(self) -> Path:
        return zoo_dir() / self.name


ENTRIES: dict[str, ZooEntry] = {
    e.name: e
    for e in [ZooEntry(f"lm-{pe}-s{s}", "lm", pe, s) for pe in LM_PES for s in SEEDS]
    + [ZooEntry(f"vit-{pe}-s{s}", "vit", pe, s) for pe in VIT_PES for s in SEEDS]
    + [ZooEntry(f"{task}-{pe}-w{w}-s{s}", task, pe, s, w) for task, pe, w in WIDE for s in SEEDS]
    + [ZooEntry(f"lm-{pe}-medium-s{s}", "lm", pe, s, tier="medium") for pe in MEDIUM_PES for s in SEEDS]
    + [ZooEntry(f"{task}-{pe}{'-medium' if tier == 'medium' else ''}-dropout-s{s}", task, pe, s, tier=tier, dropout=rate)
       for task, pe, rate, tier in DROPOUT for s in SEEDS]
    + [ZooEntry(f"{task}-{pe}-s{s}", task, pe, s) for task, pe, s in MORE_SEEDS]
}


def resolve(name_or_path: str | Path) -> Path:
    """A zoo name or a model directory -> the directory."""
    s = str(name_or_path)
    if s in ENTRIES:
        p = ENTRIES[s].path
        if not (p / "model.safetensors").is_file():
            raise ModelError(f"Zoo model {s} is not built yet; run `python -m engine zoo build --only {s}`.")
        return p
    p = Path(s)
    if p.is_dir():
        return p
    raise ModelError(f"{s} is neither a zoo model ({', '.join(ENTRIES)}) nor a model directory.")


def display_name(name_or_path: str | Path) -> str:
    s = str(name_or_path)
    return s if s in ENTRIES else Path(s).name


def pairs() -> list[tuple[str, str]]:
    """Every same-recipe pair in the zoo: same task, positional encoding, width, tier and dropout, seeds 0 and 1
    (MORE_SEEDS join no pair)."""
    out = []
    for a, b in combinations(ENTRIES.values(), 2):
        if (a.task, a.pe, a.width, a.tier, a.dropout) == (b.task, b.pe, b.width, b.tier, b.dropout) and {a.seed, b.seed} <= set(SEEDS):
            out.append((a.name, b.name))
    return out


def manifest() -> list[dict]:
    """The zoo manifest's rows; an unreadable manifest or row is skipped with a warning naming it."""
    f = zoo_dir() / "manifest.json"
    if not f.is_file():
        return []
    try:
        rows = read_json_object(f, f"Zoo manifest {f}", allow_nan=True, kind="a zoo manifest").get("models")
    except ModelError as e:
        warnings.warn(f"{e} The zoo table is empty; `python -m engine zoo build` rewrites it.", stacklevel=2)
        return []
    if not isinstance(rows, list):
        warnings.warn(f"Zoo manifest {f} has no list of models; the zoo table is empty.", stacklevel=2)
        return []
    good = [r for r in rows if isinstance(r, dict) and isinstance(r.get("name"), str)]
    if len(good) < len(rows):
        warnings.warn(f"Zoo manifest {f}: skipped {len(rows) - len(good)} row(s) without a model name.", stacklevel=2)
    return good


def write_manifest() -> list[dict]:
    rows = []
    for e in ENTRIES.values():
        m = e.path / "metrics.json"
        if not m.is_file():
            continue
        key, bar = QUALITY[e.task]
        try:
            met = read_json_object(m, allow_nan=True, kind="a model's metrics")
        except ModelError as err:
            warnings.warn(f"{err} {e.name} is left out of the zoo manifest.", stacklevel=2)
            continue
        missing = [k for k in ("parameters", "test_loss", "test_accuracy", "steps") if k not in met]
        if missing or isinstance(met[key], bool) or not isinstance(met[key], (int, float)):
            warnings.warn(f"{m} is not a usable metrics file (missing or non-numeric: {', '.join(missing) or key}); "
                          f"{e.name} is left out of the zoo manifest.", stacklevel=2)
            continue
        rows.append({
            "name": e.name, "task": e.task, "pe": e.pe, "seed": e.seed, "d_model": e.config().d_model,
            "n_layers": e.config().n_layers, "tier": e.tier, "dropout": e.dropout,
            "stored_dtype": met.get("stored_dtype", "float32"),
            "parameters": met["parameters"], "test_loss": met["test_loss"],
            "test_accuracy": met["test_accuracy"], "meets_bar": (met[key] <= bar) if e.task == "lm" else (met[key] >= bar),
            "steps": met["steps"], "train_seconds": met.get("train_seconds"), "data_sha256": met.get("data_sha256"),
        })
    write_json_atomic(zoo_dir() / "manifest.json", {"models": rows})
    return rows


def build(names: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Train (or retrain) zoo models into assets/zoo and rewrite the manifest."""
    from engine.train import train

    unknown = [n for n in names or () if n not in ENTRIES]
    if unknown:  # every name checked before any training starts
        raise ModelError(f"{unknown[0]} is not a zoo model ({', '.join(ENTRIES)}).")
    for n in names or list(ENTRIES):
        e = ENTRIES[n]
        # the zoo's own directories; an interrupted build of the same model resumes (engine.train_state)
        train(e.config(), e.seed, e.train_config(), out=e.path, progress=progress, overwrite=True, store_dtype=e.store_dtype)
        write_manifest()
    return write_manifest()
