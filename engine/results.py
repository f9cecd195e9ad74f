"""Run configs, result records and the cached_results/ store.

A run is described by one frozen `RunConfig`; its hash keys the store. A result record is plain
JSON, written atomically, holding at least: method, model_a, model_b, lambdas, loss, accuracy,
barrier, midpoint_barrier, endpoint_loss_a, endpoint_loss_b, eval_tokens | eval_images, timings,
config_hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import LMCError
from engine.models.io import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "cached_results"
SCHEMA_VERSION = 1


def cache_dir() -> Path:
    """The store in use: $LMC_CACHE_DIR if set, else CACHE.

    Read at call time, not import time, so tests and the app's test server can point the store at
    a fixture directory without touching the committed one.
    """
    return Path(os.environ.get("LMC_CACHE_DIR") or CACHE)


@dataclass(frozen=True)
class RunConfig:
    model_a: str  # zoo name or model directory
    model_b: str
    method: str = "naive"
    classes: tuple[str, ...] = ()  # symmetry classes the aligner may use; () = all its method supports
    steps: int = 0  # learned / dual optimisation budget
    points: int = 21
    eval_split: str = "test"
    eval_items: int | None = None  # scored tokens / images; None = the whole split
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    data_sha256: str = ""
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return asdict(self)

    def hash(self) -> str:
        """Content hash of the config (device excluded: results agree up to float error)."""
        d = {k: v for k, v in asdict(self).items() if k != "device"}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


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
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_record(record: dict, file: Path) -> Path:
    write_json_atomic(Path(file), record)
    return Path(file)


def load_record(file: Path) -> dict:
    try:
        rec = json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise LMCError(f"Result file {file} does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LMCError(f"Result file {file} is not valid JSON ({e}).") from None
    missing = [k for k in ("method", "model_a", "model_b", "lambdas", "loss", "barrier") if k not in rec]
    if missing:
        raise LMCError(f"Result file {file} is not a result record (missing {', '.join(missing)}).")
    return rec


# ---------------------------------------------------------------------------------------------
# The cached_results/ store: one file per (pair, method), a manifest listing them.


def cache_file(model_a: str, model_b: str, method: str, root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / f"{model_a}__{model_b}__{method}.json"


def store(record: dict, root: Path | None = None) -> Path:
    """Write a record into the store and refresh the manifest."""
    root = Path(root or cache_dir())
    f = write_record(record, cache_file(record["model_a"], record["model_b"], record["method"], root))
    write_manifest(root)
    return f


def write_manifest(root: Path | None = None) -> None:
    root = Path(root or cache_dir())
    rows = []
    for f in sorted(Path(root).glob("*__*__*.json")):
        r = load_record(f)
        rows.append({
            "file": f.name, "model_a": r["model_a"], "model_b": r["model_b"], "method": r["method"],
            "barrier": r["barrier"], "midpoint_barrier": r["midpoint_barrier"],
            "config_hash": r["config_hash"], "created": r.get("created"),
        })
    write_json_atomic(Path(root) / "manifest.json", {"schema": SCHEMA_VERSION, "records": rows})


def list_cached(root: Path | None = None) -> list[dict]:
    """Manifest rows of every cached record (empty if the store has none)."""
    m = Path(root or cache_dir()) / "manifest.json"
    if not m.is_file():
        return []
    return json.loads(m.read_text())["records"]


def cached_record(model_a: str, model_b: str, method: str, root: Path | None = None) -> dict | None:
    f = cache_file(model_a, model_b, method, root)
    return load_record(f) if f.is_file() else None
