"""Run configs, result records and the cached_results/ store.

A run is described by one frozen `RunConfig`, validated when it is made; its hash keys the store. A
result record is plain JSON, written atomically, holding at least: method, model_a, model_b,
lambdas, loss, accuracy, barrier, midpoint_barrier, endpoint_loss_a, endpoint_loss_b, eval_tokens |
eval_images, timings, config, config_hash and provenance (engine version, git commit, torch and
transformers versions, device, dtype, threads; engine.api.run_pair's records also reference_gflops,
the machine's speed as the run started, engine.progress.reference_gflops). Records made since the train curve also hold
train_loss, train_accuracy, train_barrier, train_midpoint_barrier, train_eval_set and
train_eval_tokens | train_eval_images (TRAIN_FIELDS);
older ones lack them and stay valid.

The store degrades gracefully: a record that is not valid JSON, not an object, or lacks a field is
skipped with a StoreWarning naming the file (the CLI prints it on stderr), never taking the table,
the manifest or the app's other methods down with it; the manifest is always rebuilt from the
records present.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import LMCError, OutputError
from engine.models.io import read_json_object, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "cached_results"
SCHEMA_VERSION = 1
MAX_POINTS = 1001  # grid points on a path: 2 (the endpoints) to 1001 (steps of 0.001)
MAX_STEPS = 100_000  # learned / dual optimisation steps
SPLITS = ("val", "test")
PATHS = ("weights", "circuits")  # what a path interpolates: the factored weights, or each head's circuits
DTYPE_NAMES = ("float32", "float64")


class StoreWarning(UserWarning):
    """A record in the result store that was skipped (unreadable or incomplete)."""


def cache_dir() -> Path:
    """The store in use: $LMC_CACHE_DIR if set, else CACHE.

    Read at call time, not import time, so tests and the app's test server can point the store at
    a fixture directory without touching the committed one.
    """
    return Path(os.environ.get("LMC_CACHE_DIR") or CACHE)


# ---------------------------------------------------------------------------------------------
# Run configs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RunConfig:
    model_a: str  # zoo name or model directory
    model_b: str
    method: str = "naive"
    classes: tuple[str, ...] = ()  # symmetry classes the aligner may use; () = all its method supports
    steps: int = 0  # learned / dual optimisation budget; 0 = the method's default
    points: int = 21
    eval_split: str = "test"
    eval_items: int | None = None  # scored tokens / images; None = the whole split
    seed: int = 0
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda or cuda:N
    dtype: str = "float32"
    data_sha256: str = ""
    path: str = "weights"  # PATHS (engine.circuits)
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise LMCError(f"Run config: {msg}.")

        need(isinstance(self.model_a, str) and self.model_a != "", "model_a must be a zoo name or a directory")
        need(isinstance(self.model_b, str) and self.model_b != "", "model_b must be a zoo name or a directory")
        need(isinstance(self.method, str), f"method must be a name, not {self.method!r}")
        need(_is_int(self.points) and 2 <= self.points <= MAX_POINTS,
             f"points must be an integer from 2 to {MAX_POINTS:,}, not {self.points!r}")
        need(_is_int(self.steps) and 0 <= self.steps <= MAX_STEPS,
             f"steps must be an integer from 0 (the method's default) to {MAX_STEPS:,}, not {self.steps!r}")
        need(self.eval_items is None or (_is_int(self.eval_items) and self.eval_items >= 1),
             f"eval_items must be a positive integer or None (the whole split), not {self.eval_items!r}")
        need(_is_int(self.seed) and 0 <= self.seed < 2**32, f"seed must be an integer from 0 to 2**32 - 1, not {self.seed!r}")
        need(self.eval_split in SPLITS, f"eval_split must be one of {', '.join(SPLITS)}, not {self.eval_split!r}")
        need(self.dtype in DTYPE_NAMES, f"dtype must be one of {', '.join(DTYPE_NAMES)}, not {self.dtype!r}")
        need(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                                or (self.device.startswith("cuda:") and self.device[5:].isdigit())),
             f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        need(isinstance(self.classes, (tuple, list)) and all(isinstance(c, str) for c in self.classes),
             "classes must be a tuple of class names")
        need(self.path in PATHS, f"path must be one of {', '.join(PATHS)}, not {self.path!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def hash(self) -> str:
        """Content hash of the config (device excluded: results agree up to float error; the default
        weight path excluded too, so records made before paths had a choice keep their hashes)."""
        d = {k: v for k, v in asdict(self).items() if k != "device" and (k, v) != ("path", "weights")}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def resolve_device(device: str) -> str:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` without a GPU is refused."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LMCError(f"Device {device} was asked for, but torch sees no CUDA GPU on this machine; "
                           "use --device cpu (or auto).")
        index = int(device[5:]) if device.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            raise LMCError(f"Device {device} was asked for, but torch sees only {torch.cuda.device_count()} "
                           f"CUDA GPU(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1}).")
    return device


# ---------------------------------------------------------------------------------------------
# Records


def _git(*args: str) -> str | None:
    """`git -C ROOT args...`'s output, or None (no git, not a checkout, an error)."""
    import subprocess

    if not (ROOT / ".git").exists():
        return None
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


@functools.cache
def _git_commit() -> str | None:
    """The commit of the working tree the engine runs from, or None (no git, not a checkout)."""
    out = (_git("rev-parse", "HEAD") or "").strip()
    return out if len(out) == 40 else None


@functools.cache
def _engine_modified() -> bool | None:
    """Whether engine/ differs from that commit (uncommitted changes): then the commit alone does not say
    which code produced a record. None without git."""
    if _git_commit() is None:
        return None
    out = _git("status", "--porcelain", "--", "engine")
    return None if out is None else bool(out.strip())


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def provenance(device: str, dtype: str) -> dict:
    """What produced a record: engine version and commit (and whether engine/ had uncommitted changes),
    library versions, device, dtype, threads."""
    import platform

    import torch

    return {
        "engine_version": _version("lmc-explorer"), "git_commit": _git_commit(), "engine_modified": _engine_modified(),
        "torch": torch.__version__, "transformers": _version("transformers"), "python": platform.python_version(),
        "device": device, "dtype": dtype, "threads": torch.get_num_threads(),
    }


def make_record(cfg: RunConfig, path_result: dict, timings: dict[str, float], **extra) -> dict:
    timings = {**timings, "interpolate": path_result.get("interpolate_seconds", 0.0)}
    body = {k: v for k, v in path_result.items() if k != "interpolate_seconds"}
    return {
        "schema": SCHEMA_VERSION,
        "method": cfg.method,
        "model_a": cfg.model_a,
        "model_b": cfg.model_b,
        **body,
        **extra,
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "provenance": provenance(cfg.device, cfg.dtype),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# The train curve (optional): the path's points on a bounded sample of the train split (engine.interpolate).
TRAIN_FIELDS = ("train_loss", "train_accuracy", "train_barrier", "train_midpoint_barrier", "train_eval_set",
                "train_eval_tokens", "train_eval_images")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def record_problem(rec, name: str = "record") -> str | None:
    """Why `rec` is not a usable result record, as a sentence naming the field, or None."""
    if not isinstance(rec, dict):
        return f"{name} holds a JSON {type(rec).__name__}, not a result record."
    missing = [k for k in ("method", "model_a", "model_b", "lambdas", "loss", "barrier", "midpoint_barrier",
                           "endpoint_loss_a", "endpoint_loss_b", "config_hash") if k not in rec]
    if missing:
        return f"{name} is not a result record (missing {', '.join(missing)})."
    for k in ("method", "model_a", "model_b", "config_hash"):
        if not isinstance(rec[k], str):
            return f"{name}: {k} must be a string, not {type(rec[k]).__name__}."
    for k in ("barrier", "midpoint_barrier"):
        if not _number(rec[k]):
            return f"{name}: {k} must be a number, not {type(rec[k]).__name__}."
    for k in ("endpoint_loss_a", "endpoint_loss_b", "accuracy_drop"):
        if rec.get(k) is not None and not _number(rec[k]):
            return f"{name}: {k} must be a number, not {type(rec[k]).__name__}."
    lam, loss = rec["lambdas"], rec["loss"]
    for k, v in (("lambdas", lam), ("loss", loss)):
        if not isinstance(v, list) or len(v) < 2 or not all(_number(x) for x in v):
            return f"{name}: {k} must be a list of at least two numbers."
    if len(loss) != len(lam):
        return f"{name}: loss has {len(loss)} values for {len(lam)} lambdas."
    acc = rec.get("accuracy")
    if acc is not None and (not isinstance(acc, list) or len(acc) != len(lam) or not all(_number(x) for x in acc)):
        return f"{name}: accuracy must be null or one number per lambda."
    if acc is not None and not _number(rec.get("accuracy_drop")):
        return f"{name}: a record with accuracy needs a numeric accuracy_drop."
    if not all(math.isfinite(x) for x in lam):
        return f"{name}: lambdas must be finite."
    return _train_problem(rec, name, len(lam)) or _attribution_problem(rec, name)


def _attribution_problem(rec: dict, name: str) -> str | None:
    """Why a record's barrier attribution (optional: engine.attribution) is unusable, or None."""
    if "attribution" not in rec:
        return None
    at = rec["attribution"]
    if not isinstance(at, dict) or not _number(at.get("midpoint_barrier")):
        return f"{name}: attribution must be an object with a numeric midpoint_barrier."
    blocks, classes = at.get("blocks"), at.get("classes")
    if not isinstance(blocks, list) or not blocks or not all(
            isinstance(b, dict) and isinstance(b.get("block"), str) and b.get("part") in ("all", "attention", "mlp")
            and all(_number(b.get(k)) for k in ("excess", "excess_a", "excess_b")) for b in blocks):
        return f"{name}: attribution.blocks must be a list of blocks, each with a name, a part and numeric excesses."
    if not isinstance(classes, list) or not all(
            isinstance(c, dict) and isinstance(c.get("class"), str) and _number(c.get("midpoint_barrier"))
            and _number(c.get("rise")) for c in classes):
        return f"{name}: attribution.classes must be a list of classes, each with a numeric midpoint_barrier and rise."
    return None


def _train_problem(rec: dict, name: str, n: int) -> str | None:
    """Why a record's train curve (optional: records from before it have none) is unusable, or None."""
    if "train_loss" not in rec:
        stray = [k for k in TRAIN_FIELDS if k in rec]
        return f"{name}: {stray[0]} is given without train_loss." if stray else None
    tl = rec["train_loss"]
    if not isinstance(tl, list) or len(tl) != n:
        got = f"{len(tl)} values" if isinstance(tl, list) else f"a {type(tl).__name__}"
        return f"{name}: train_loss must be one number per lambda ({n}), not {got}."
    if not all(_number(x) for x in tl):
        return f"{name}: train_loss must hold numbers only."
    for k in ("train_barrier", "train_midpoint_barrier"):
        if k in rec and not _number(rec[k]):
            return f"{name}: {k} must be a number, not {type(rec[k]).__name__}."
    if not _number(rec.get("train_barrier")):
        return f"{name}: a record with train_loss needs a numeric train_barrier."
    ta = rec.get("train_accuracy")
    if ta is not None and (not isinstance(ta, list) or len(ta) != n or not all(_number(x) for x in ta)):
        return f"{name}: train_accuracy must be null or one number per lambda."
    if not isinstance(rec.get("train_eval_set"), str):
        return f"{name}: a record with train_loss needs train_eval_set, the description of its train sample."
    for k in ("train_eval_tokens", "train_eval_images"):
        if k in rec and not (_number(rec[k]) and rec[k] == int(rec[k]) and rec[k] > 0):
            return f"{name}: {k} must be a positive whole number, not {rec[k]!r}."
    return None


def write_record(record: dict, file: Path) -> Path:
    """Write a record atomically (through a symlink; never over a directory, device or fifo)."""
    write_json_atomic(Path(file), record)
    return Path(file)


def load_record(file: Path) -> dict:
    """A result record from a JSON file; any problem is an LMCError naming the file."""
    file = Path(file)
    if not file.exists() and not file.is_symlink():
        raise LMCError(f"Result file {file} does not exist.")
    rec = read_json_object(file, f"Result file {file}", max_bytes=None, allow_nan=True)
    problem = record_problem(rec, f"Result file {file}")
    if problem:
        raise LMCError(problem)
    return rec


# ---------------------------------------------------------------------------------------------
# The cached_results/ store: one file per (pair, method), a manifest listing them.


def _store_root(root: Path | str | None) -> Path:
    root = Path(root or cache_dir())
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise OutputError(f"Result store {root} is not a directory (set LMC_CACHE_DIR to a directory).")
    return root


def cache_file(model_a: str, model_b: str, method: str, root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / f"{model_a}__{model_b}__{method}.json"


def _read_stored(f: Path) -> tuple[dict | None, str | None]:
    """(record, None) or (None, why it was skipped) for one store file; the record must match its name."""
    try:
        rec = load_record(f)
    except LMCError as e:
        return None, str(e)
    parts = f.name[: -len(".json")].split("__")
    if len(parts) == 3 and parts != [rec["model_a"], rec["model_b"], rec["method"]]:
        return None, (f"Result file {f} holds {rec['model_a']} / {rec['model_b']} / {rec['method']}, "
                      "not what its name says.")
    return rec, None


def _skip(problem: str) -> None:
    warnings.warn(f"skipped a cached record: {problem}", StoreWarning, stacklevel=3)


def scan_store(root: Path | None = None) -> tuple[dict[str, dict], list[str]]:
    """Every usable record of the store by file name, and a sentence for each file skipped."""
    root = _store_root(root)
    good, problems = {}, []
    if not root.is_dir():
        return good, problems
    for f in sorted(root.glob("*__*__*.json")):
        rec, why = _read_stored(f)
        if rec is None:
            problems.append(why)
        else:
            good[f.name] = rec
    return good, problems


def _row(name: str, r: dict) -> dict:
    return {"file": name, "model_a": r["model_a"], "model_b": r["model_b"], "method": r["method"],
            "barrier": r["barrier"], "midpoint_barrier": r["midpoint_barrier"],
            "config_hash": r["config_hash"], "created": r.get("created")}


def store(record: dict, root: Path | None = None) -> Path:
    """Write a record into the store and rebuild the manifest."""
    root = _store_root(root)
    problem = record_problem(record)
    if problem:
        raise LMCError(f"Cannot store a broken record: {problem}")
    f = write_record(record, cache_file(record["model_a"], record["model_b"], record["method"], root))
    write_manifest(root)
    return f


def write_manifest(root: Path | None = None) -> list[str]:
    """Rebuild manifest.json from the records present; skipped files are warned about and returned."""
    root = _store_root(root)
    good, problems = scan_store(root)
    for p in problems:
        _skip(p)
    write_json_atomic(root / "manifest.json",
                      {"schema": SCHEMA_VERSION, "records": [_row(n, r) for n, r in good.items()]})
    return problems


def list_cached(root: Path | None = None) -> list[dict]:
    """Manifest rows of every cached record (empty if the store has none).

    A missing store is empty; an unreadable manifest is rebuilt in memory from the records present.
    """
    root = _store_root(root)
    m = root / "manifest.json"
    if not m.is_file():
        return []
    try:
        rows = read_json_object(m, max_bytes=None, allow_nan=True)["records"]
        keys = ("file", "model_a", "model_b", "method")
        if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
            raise LMCError("its records are not a list of rows")
        return rows
    except (LMCError, KeyError) as e:
        warnings.warn(f"the manifest {m} is unreadable ({e}); listing the records present instead", StoreWarning,
                      stacklevel=2)
        good, problems = scan_store(root)
        for p in problems:
            _skip(p)
        return [_row(n, r) for n, r in good.items()]


def cached_record(model_a: str, model_b: str, method: str, root: Path | None = None) -> dict | None:
    """The stored record of a pair and method; None when there is none or it is unusable (warned)."""
    f = cache_file(model_a, model_b, method, _store_root(root))
    if not f.exists():
        return None
    rec, why = _read_stored(f)
    if rec is None:
        _skip(why)
    return rec
