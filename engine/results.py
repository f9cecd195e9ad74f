"""Run configs, result records and the cached_results/ store.

A run is described by one frozen `RunConfig`, validated when it is made; its hash keys the store. A
result record is plain JSON, written atomically, holding at least: method, model_a, model_b,
lambdas, loss, accuracy, barrier, midpoint_barrier, endpoint_loss_a, endpoint_loss_b, eval_tokens |
eval_images, timings, config, config_hash and provenance (engine version, git commit, torch and
transformers versions, device, dtype, threads; engine.api.run_pair's records also reference_gflops,
the machine's speed as the run started, engine.timing.reference_gflops). Records made since the train curve also hold
train_loss, train_accuracy, train_barrier, train_midpoint_barrier, train_eval_set and
train_eval_tokens | train_eval_images (TRAIN_FIELDS);
older ones lack them and stay valid.

Every record read is checked against the record schema (RECORD_SCHEMA, record_problem: each field's
type and bounds, and the fields' agreement) before any value is used. The store degrades gracefully:
a record that is not valid JSON, not an object, or breaks the schema is skipped with a StoreWarning
naming the file and the field (the CLI prints it on stderr), never taking the table, the manifest or
the app's other methods down with it; the manifest is always rebuilt from the records present.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import LMCError, OutputError
from engine.models.io import MAX_JSON_BYTES, read_json_object, write_json_atomic
from engine.options import Options

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "cached_results"
SCHEMA_VERSION = 2  # 2: learned/dual records validate on the path (history val_barrier, settings.lambdas)
MAX_POINTS = 1001  # grid points on a path: 2 (the endpoints) to 1001 (steps of 0.001)
MAX_STEPS = 100_000  # learned / dual optimisation steps
SPLITS = ("val", "test")
PATHS = ("weights", "circuits")  # what a path interpolates: the factored weights, or each head's circuits
DTYPE_NAMES = ("float32", "float64", "bfloat16")  # bfloat16: as released 1B checkpoints are stored


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
    options: Options = field(default_factory=Options)  # the method's run options (engine.options); none set by default

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
        need(isinstance(self.options, Options), f"options must be a method's options (engine.options), not "
                                                f"{self.options!r}")

    def to_dict(self) -> dict:
        """The config as a record holds it: the options as `extra`, their (name, text) pairs (Options.pairs)."""
        d = asdict(self)
        d.pop("options")
        return d | {"extra": self.options.pairs()}

    def hash(self) -> str:
        """Content hash of the config (device excluded: results agree up to float error; the default
        weight path excluded too, so records made before paths had a choice keep their hashes)."""
        d = {k: v for k, v in self.to_dict().items() if k != "device" and (k, v) != ("path", "weights")}
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


# The record schema: every field a record may hold, its type and its bounds (JSON Schema, checked
# with jsonschema), then what one field says of another (lengths, dependent fields). Every reader of
# a record (the store, the run history, an earlier --out file) goes through record_problem, so no
# value reaches the CLI, the app or torch unchecked. Fields the schema does not name are allowed.
#
# Numbers: a setting or a count (lambdas, config, arch, timings, sizes) is finite and bounded; a
# measurement (a loss, an accuracy, a barrier) may also be NaN or an infinity, which is what the
# engine writes for a run whose interpolated models overflow. No number lies beyond float range, so
# a 400-digit integer is refused by name before any arithmetic sees it.

MAX_COUNT = 10**12  # tokens, images, bytes, steps: any count a record holds
MAX_WIDTH = 2**20  # a model dimension (d_model, d_mlp, heads), so also a permutation's length
MAX_LAYERS = 10_000
MAX_TEXT = 10_000  # characters of a text field
MAX_LIST = MAX_STEPS + 1  # entries of an optimisation history (one per step at most)
MAX_RECORD_BYTES = 512 * 2**20  # a residual rotation of d_model 4,096 is about 150 MB of JSON


def _n(v) -> str:
    """A bound as the descriptions write it: 1,048,576, 0.5."""
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def _text(max_len: int = MAX_TEXT, null: bool = False) -> dict:
    return {"type": ["string", "null"] if null else "string", "maxLength": max_len,
            "description": f"text of at most {max_len:,} characters" + (" or null" if null else "")}


def _flag() -> dict:
    return {"type": "boolean", "description": "true or false"}


def _whole(lo: int = 0, hi: int = MAX_COUNT, null: bool = False) -> dict:
    return {"type": ["integer", "null"] if null else "integer", "minimum": lo, "maximum": hi,
            "description": f"a whole number{_bounds(lo, hi)}" + (" or null" if null else "")}


def _real(finite: bool = True, lo: float | None = None, hi: float | None = None, null: bool = False) -> dict:
    """A number: `finite`, or (a measurement) also NaN or an infinity; within [lo, hi] when given."""
    node = {"type": ["number", "null"] if null else "number", "finite": finite}
    node |= {} if lo is None else {"minimum": lo}
    node |= {} if hi is None else {"maximum": hi}
    what = ("a finite number" if finite else "a number") + _bounds(lo, hi)
    return node | {"description": what + (" or null" if null else "")}


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" from {_n(lo)} to {_n(hi)}"
    return f" of at least {_n(lo)}" if lo is not None else f" of at most {_n(hi)}" if hi is not None else ""


def _reals(max_items: int, min_items: int = 0, finite: bool = True, depth: int = 1, whole: bool = False,
           lo: float | None = None, hi: float | None = None, null: bool = False) -> dict:
    """A list of numbers (`depth` 2: a list of such lists), checked by the fast `numbers` keyword."""
    kind = ("whole numbers" if whole else "finite numbers" if finite else "numbers") + _bounds(lo, hi)
    what = (f"a list of {min_items:,} to {max_items:,} " if min_items else f"a list of at most {max_items:,} ") + (
        f"lists of {kind}" if depth == 2 else kind)
    return {"type": "array", "minItems": min_items, "maxItems": max_items,
            "numbers": {"depth": depth, "finite": finite, "whole": whole, "null": null, "minimum": lo, "maximum": hi},
            "description": what}


def _list(items: dict, max_items: int, min_items: int = 0, what: str = "items") -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items,
            "description": f"a list of {min_items:,} to {max_items:,} {what}" if min_items else
            f"a list of at most {max_items:,} {what}"}


def _obj(props: dict, required: tuple[str, ...] = (), what: str | None = None, null: bool = False) -> dict:
    """An object with these typed fields (others allowed), `required` among them."""
    node = {"type": ["object", "null"] if null else "object", "required": list(required), "properties": props}
    what = what or ("an object with " + ", ".join(required) if required else "an object")
    return node | {"description": what + (" or null" if null else "")}


def _map(values: dict, what: str, max_keys: int = 10_000) -> dict:
    """An object of any keys, each holding `values`."""
    return {"type": "object", "additionalProperties": values, "maxProperties": max_keys, "description": what}


_PERM = _reals(MAX_WIDTH, whole=True, lo=0, hi=MAX_WIDTH)
_MEASURE = _real(finite=False)
_MEASURES = _reals(MAX_POINTS, finite=False)  # a curve along the path: NaN where the models overflow
_HISTORY = _obj({k: _reals(MAX_LIST, finite=False, null=True) for k in
                 ("seconds", "train_loss", "val_barrier", "val_midpoint_loss", "val_worst_lambda")}
                | {"step": _reals(MAX_LIST, whole=True, lo=0, hi=MAX_COUNT)}, required=("step",))
_LAYER = _obj({
    "head_perm": _PERM, "kv_perm": _PERM, "mlp_perm": _PERM,
    "mlp_scale": _reals(MAX_WIDTH, finite=False),
    "qk_singular_values": _reals(MAX_WIDTH, finite=False, depth=2),
    "vo_singular_values": _reals(MAX_WIDTH, finite=False, depth=2),
    "head_cost": _reals(MAX_WIDTH, finite=False, depth=2),
    "rope_scalars": _obj({"abs": _reals(MAX_WIDTH, finite=False, depth=2),
                          "angle": _reals(MAX_WIDTH, finite=False, depth=2)}),
    "mlp_similarity": _obj({"matched": _reals(MAX_WIDTH, finite=False), "same_index": _reals(MAX_WIDTH, finite=False)}),
}, required=("head_perm", "kv_perm", "mlp_perm"))
_ELEMENT = _obj({
    "layers": _list(_LAYER, MAX_LAYERS, what="layers"),
    "residual": _obj({"kind": _text(64), "perm": _PERM, "matrix": _reals(MAX_WIDTH, finite=False, depth=2),
                      "distance_from_identity": _MEASURE}, required=("kind",)),
}, required=("layers", "residual"))
_DIAGNOSTICS = _obj({
    "seconds": _real(lo=0), "seconds_per_step": _real(lo=0, null=True), "init_seconds": _real(lo=0),
    "time_budget_s": _real(lo=0, null=True), "tokens": _whole(), "steps": _whole(), "steps_done": _whole(),
    "best_step": _whole(), "resolve_every": _whole(), "best_val_barrier": _MEASURE, "best_val_midpoint_loss": _MEASURE,
    "stopped": _text(), "stop": _text(), "stop_tol": _real(lo=0), "work_dtype": _text(64), "converged": _flag(),
    "residual_is_permutation": _flag(), "mlp_matched_correlation": _reals(MAX_LAYERS, finite=False),
    "history": _HISTORY,
    "curve": _obj({"step": _reals(MAX_LIST, whole=True, lo=0, hi=MAX_COUNT), "lambda": _reals(MAX_LIST, null=True),
                   "lr_factor": _reals(MAX_LIST, null=True), "train_loss": _reals(MAX_LIST, finite=False, null=True)}),
    "identity": _obj({"lambdas": _reals(MAX_POINTS), "loss_dual": _MEASURES, "loss_one_sided": _MEASURES,
                      "holds": _flag(), "dtype": _text(64), "tolerance": _real(lo=0),
                      "max_relative_error": _MEASURE, "max_logit_relative_error": _MEASURE},
                     required=("lambdas", "loss_dual", "loss_one_sided")),
    "one_sided_same_budget": _obj({"history": _HISTORY, "steps": _whole(), "best_val_barrier": _MEASURE,
                                   "best_val_midpoint_loss": _MEASURE, "dual_minus_one_sided": _MEASURE,
                                   "dual_minus_one_sided_barrier": _MEASURE, "from_learned_record": _flag()}),
    "one_sided_skipped": _text(),
    "sweeps": _list(_obj({"sweep": _whole(), "objective": _MEASURE, "permutation_changes": _whole(),
                          "residual_change": _MEASURE, "seconds": _real(lo=0)}, required=("sweep", "objective")),
                    MAX_LIST, what="sweeps"),
    "memory": _obj({k: _whole() for k in ("adam_state_bytes", "candidate_bytes", "latent_bytes", "model_bytes",
                                          "peak_rss_bytes", "peak_rss_bytes_before")} | {"dtype": _text(64)}),
    "resolves": _map(_reals(MAX_LIST, whole=True, lo=0, hi=MAX_COUNT), "an object of lists of whole numbers"),
    "permutation_solves": _map(_whole(), "an object of whole numbers"),
    "resumed_at": _reals(MAX_LIST, whole=True, lo=0, hi=MAX_COUNT),
    "start_element": _obj({"file": _text(4096), "sha256": _text(64), "method": _text(64, null=True),
                           "model_a": _text(null=True), "model_b": _text(null=True), "steps": _whole(null=True),
                           "barrier": _real(null=True)}, required=("file", "sha256")),
    "settings": _map({"type": ["string", "number", "boolean", "null"], "finite": True, "maxLength": MAX_TEXT},
                     "an object of settings, each text, a finite number, true, false or null"),
})
_COSTS = _map(_real(finite=False), "an object of numbers, one per block")
_ALIGNMENT = _obj({
    "method": _text(64), "display_name": _text(), "rewrite": _text(64, null=True), "seconds": _real(lo=0),
    "classes": _list(_text(64), 64, what="class names"), "classes_left_out": _map(_text(), "an object of sentences"),
    "groups": _map(_text(), "an object of group names"), "element": _ELEMENT, "element_a": _ELEMENT,
    "matching_cost": _obj({"before": _COSTS, "after": _COSTS}), "diagnostics": _DIAGNOSTICS,
}, required=("element",))
_ATTRIBUTION = _obj({
    "lambda": _real(lo=0, hi=1), "endpoint_loss_a": _MEASURE, "endpoint_loss_b": _MEASURE,
    "midpoint_barrier": _MEASURE, "sum_of_layers": _MEASURE, "eval_set": _text(), "seconds": _real(lo=0),
    "blocks": _list(_obj({"block": _text(256), "layer": _whole(hi=MAX_LAYERS, null=True),
                          "part": {"enum": ["all", "attention", "mlp"], "description": "all, attention or mlp"},
                          "excess": _MEASURE, "excess_a": _MEASURE, "excess_b": _MEASURE},
                         required=("block", "part", "excess", "excess_a", "excess_b")),
                    4 * MAX_LAYERS + 8, min_items=1, what="blocks"),
    "classes": _list(_obj({"class": _text(64), "midpoint_barrier": _MEASURE, "rise": _MEASURE},
                          required=("class", "midpoint_barrier", "rise")), 64, what="classes"),
}, required=("midpoint_barrier", "blocks", "classes"))
_DIMS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp")
_ARCH = _obj({
    **{k: _whole(hi=MAX_LAYERS if k == "n_layers" else MAX_WIDTH) for k in _DIMS},
    "n_out": _whole(hi=MAX_COUNT), "n_ctx": _whole(hi=MAX_COUNT), "rotary_dim": _whole(hi=MAX_WIDTH),
    "rope_base": _real(lo=0), "norm_eps": _real(lo=0), "family": _text(64), "task": _text(64), "pe": _text(64),
    "rope_layout": _text(64, null=True), "norm": _text(64), "mlp": _text(64), "rope_scaling": _text(1024),
    **{k: _flag() for k in ("norm_bias", "attn_bias", "out_bias", "mlp_bias", "head_bias", "tied_embeddings", "causal",
                            "parallel_residual", "qk_norm")},
}, required=_DIMS)
_WIDTHS = _obj({k: _whole(hi=MAX_WIDTH) for k in ("d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp", "rotary_dim")})
_CONFIG = _obj({
    "model_a": _text(4096), "model_b": _text(4096), "method": _text(64),
    "classes": _list(_text(64), 64, what="class names"), "steps": _whole(hi=MAX_STEPS),
    "points": _whole(2, MAX_POINTS), "eval_split": {"enum": list(SPLITS), "description": " or ".join(SPLITS)},
    "eval_items": _whole(1, MAX_COUNT, null=True), "seed": _whole(hi=2**32 - 1), "device": _text(64),
    "dtype": _text(64), "data_sha256": _text(64), "path": {"enum": list(PATHS), "description": " or ".join(PATHS)},
    "extra": _list(_list(_text(), 2, 2, what="texts"), 64, what="pairs of texts"),
})
RECORD_REQUIRED = ("schema", "method", "model_a", "model_b", "lambdas", "loss", "barrier", "midpoint_barrier",
                   "endpoint_loss_a", "endpoint_loss_b", "config_hash")
RECORD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "LMC Explorer result record",
    "type": "object",
    "required": list(RECORD_REQUIRED),
    "dependentRequired": {"train_loss": ["train_barrier", "train_eval_set"], "alignment": ["arch"]},
    "properties": {
        "schema": {"const": SCHEMA_VERSION, "description": f"{SCHEMA_VERSION}, the record schema this engine reads"},
        "method": _text(64), "model_a": _text(4096), "model_b": _text(4096),
        "path": {"enum": list(PATHS), "description": " or ".join(PATHS)}, "config_hash": _text(64),
        "created": _text(64), "eval_set": _text(), "train_eval_set": _text(), "folded_rewrite": _text(64, null=True),
        "lambdas": _reals(MAX_POINTS, 2, lo=0, hi=1),
        **{k: _MEASURES for k in ("loss", "train_loss", "loss_folded", "accuracy_folded")},
        **{k: _reals(MAX_POINTS, finite=False) | {"type": ["array", "null"], "description": _MEASURES["description"]
                                                  + " or null"} for k in ("accuracy", "train_accuracy")},
        **{k: _MEASURE for k in ("barrier", "midpoint_barrier", "endpoint_loss_a", "endpoint_loss_b", "train_barrier",
                                 "train_midpoint_barrier", "barrier_folded", "midpoint_barrier_folded",
                                 "accuracy_drop_folded")},
        "accuracy_drop": _real(finite=False, null=True),
        **{k: _whole(1, MAX_COUNT) for k in ("eval_tokens", "eval_images", "train_eval_tokens", "train_eval_images")},
        "classes": _list(_text(64), 64, what="class names"), "classes_left_out": _map(_text(), "an object of sentences"),
        "arch": _ARCH, "config": _CONFIG, "alignment": _ALIGNMENT, "attribution": _ATTRIBUTION,
        "attribution_skipped": _text(),
        "timings": _map(_real(lo=0), "an object of seconds, each a finite number of at least 0"),
        "provenance": _obj({"engine_version": _text(64, null=True), "git_commit": _text(64, null=True),
                            "engine_modified": {"type": ["boolean", "null"], "description": "true, false or null"},
                            "torch": _text(64, null=True), "transformers": _text(64, null=True),
                            "python": _text(64, null=True), "device": _text(64), "dtype": _text(64),
                            "threads": _whole(hi=MAX_WIDTH), "reference_gflops": _real(lo=0)}),
        "endpoint_check": _obj({"loss_b": _MEASURE, "loss_b_moved": _MEASURE, "abs_diff": _MEASURE,
                                "rel_diff": _MEASURE, "tolerance": _real(lo=0), "exact": _flag(),
                                "approximate_classes": _list(_text(64), 64, what="class names"),
                                "rewrite": _text(64, null=True)}),
        "lift": _obj({"widths_a": _WIDTHS, "widths_b": _WIDTHS, "stream_scale": _real(), "qk_scale": _real(),
                      "qk_norm_gain_scale": _real(null=True), "loss_a": _MEASURE, "loss_a_lifted": _MEASURE,
                      "accuracy_a": _MEASURE, "accuracy_a_lifted": _MEASURE, "abs_diff": _MEASURE,
                      "rel_diff": _MEASURE, "tolerance": _real(lo=0), "exact": _flag(), "rewrite": _text(64, null=True),
                      "maps": _obj({"heads": _PERM, "head_dims": _PERM, "mlp": _text(64), "residual": _text(64)}),
                      "padding": _map(_whole(hi=MAX_WIDTH), "an object of widths")}),
        "merged": _obj({"path": _text(4096), "alpha": _real(), "family": _text(64), "format": _text()}),
        "element_file": _obj({"path": _text(4096), "sha256": _text(64)}, required=("path",)),
    },
}


def _float_range(v) -> bool:
    """Whether a number converts to a float (a 400-digit integer does not)."""
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _leaf_problem(v, finite: bool, whole: bool, null: bool, lo, hi) -> str | None:
    """Why `v` is not an allowed entry of a `numbers` list, or None."""
    if v is None and null:
        return None
    if not _is_number(v) or (whole and not isinstance(v, int)):
        return "not a " + ("whole number" if whole else "number")
    if not _float_range(v) or (finite and not math.isfinite(v)):
        return "not finite"
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return "out of range"
    return None


def _finite_keyword(validator, finite, instance, schema):
    """`finite`: a number within float range and, when true, neither NaN nor an infinity."""
    if _is_number(instance) and (not _float_range(instance) or (finite and not math.isfinite(instance))):
        from jsonschema.exceptions import ValidationError

        yield ValidationError("not finite")


def _plainly_fine(row: list, finite: bool, whole: bool, lo, hi) -> bool:
    """A quick pass over a list of plain floats (or ints, for `whole`): True when every entry surely is
    allowed; False sends the list through the entry-by-entry check, which finds the culprit."""
    kind = int if whole else float
    if not set(map(type, row)) <= {kind}:
        return False
    if whole or finite:  # no NaN: min and max are exact
        if not whole:
            try:
                if not math.isfinite(math.fsum(row)):
                    return False
            except OverflowError:
                return False
        return not row or ((lo is None or min(row) >= lo) and (hi is None or max(row) <= hi))
    return lo is None and hi is None


def _numbers_keyword(validator, spec, instance, schema):
    """`numbers`: every entry of a list (of lists, at depth 2) a number as `spec` says. A residual rotation
    holds d_model**2 of them, so plain lists pass in one quick sweep."""
    from jsonschema.exceptions import ValidationError

    if not isinstance(instance, (list, tuple)):
        return
    args = spec["finite"], spec["whole"], spec["null"], spec["minimum"], spec["maximum"]
    rows = enumerate(instance) if spec["depth"] == 2 else [(None, instance)]
    for i, row in rows:
        if not isinstance(row, (list, tuple)) or len(row) > MAX_WIDTH:
            yield ValidationError("not a list", path=(i,), instance=row)
            return
        if _plainly_fine(row, spec["finite"], spec["whole"], spec["minimum"], spec["maximum"]):
            continue
        for j, v in enumerate(row):
            why = _leaf_problem(v, *args)
            if why:
                yield ValidationError(why, path=(j,) if i is None else (i, j), instance=v)
                return


@functools.cache
def _validator(required: bool = True):
    """The record schema's validator: jsonschema's draft 2020-12 with the `finite` and `numbers` keywords,
    where an integer is an int (never a bool or 2.0) and a tuple is an array; without `required`, the
    root's required and dependent fields are not asked for."""
    from jsonschema import Draft202012Validator, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine_many({
        "integer": lambda _, v: isinstance(v, int) and not isinstance(v, bool),
        "array": lambda _, v: isinstance(v, (list, tuple)),  # a record not yet written holds its config's tuples
    })
    cls = validators.extend(Draft202012Validator, {"finite": _finite_keyword, "numbers": _numbers_keyword},
                            type_checker=checker)
    schema = RECORD_SCHEMA if required else {k: v for k, v in RECORD_SCHEMA.items()
                                            if k not in ("required", "dependentRequired")}
    return cls(schema)


def _found(v) -> str:
    """What a refused value is, in a few words."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int):
        digits = len(str(abs(v))) if abs(v) < 10**4000 else "over 4,000"
        return f"an integer of {digits} digits" if abs(v) >= 10**15 else str(v)
    if isinstance(v, float):
        return json.dumps(v) if math.isfinite(v) else {"inf": "Infinity", "-inf": "-Infinity"}.get(str(v), "NaN")
    if isinstance(v, str):
        return f"the text {v[:40]!r}" + ("..." if len(v) > 40 else "")
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v):,} items"
    return "an object"


def _field(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _schema_sentence(error, name: str) -> str:
    """One sentence for a schema violation: the described field it lies in, what that field must be, and
    what was found where."""
    path = list(error.absolute_path)
    if error.validator == "required" and not path:
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"{name} is not a result record (missing {', '.join(missing)})."
    if error.validator == "dependentRequired":
        key, needs = next((k, [d for d in deps if d not in error.instance]) for k, deps in error.validator_value.items()
                          if k in error.instance and any(d not in error.instance for d in deps))
        return f"{name}: a record with {key} needs {' and '.join(needs)}."
    node, at, desc = RECORD_SCHEMA, 0, None
    for i, p in enumerate(path):  # the deepest node on the path with a description
        node = (node.get("properties", {}).get(p) or node.get("additionalProperties")) if isinstance(p, str) \
            else node.get("items")
        if not isinstance(node, dict):
            break
        if "description" in node:
            at, desc = i + 1, node["description"]
    rest = path[at:]
    where = f"item {rest[0]}" if len(rest) == 1 and isinstance(rest[0], int) else _field(rest)
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        found = f"{where + ' ' if rest else ''}lacks {', '.join(missing)}"
    else:
        found = (f"{where} is " if rest else "found ") + _found(error.instance)
    return f"{name}: field '{_field(path[:at])}' must be {desc} ({found})."


def _problem(rec, name: str, required: bool) -> str | None:
    if not isinstance(rec, dict):
        return f"{name} holds a JSON {type(rec).__name__}, not a result record."
    v = rec.get("schema")
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < SCHEMA_VERSION:
        return (f"{name} was written with record schema {v}; this engine reads schema {SCHEMA_VERSION} "
                "(run it again, or rebuild the store with `python -m engine cache build --force`).")
    error = next(_validator(required).iter_errors(rec), None)
    return None if error is None else _schema_sentence(error, name)


def fields_problem(rec, name: str = "record") -> str | None:
    """Why a field present in `rec` breaks the record schema (its type or bounds), as one sentence naming
    the field, or None; no field is required (a run kept before its record: engine.history)."""
    return _problem(rec, name, required=False)


def record_problem(rec, name: str = "record") -> str | None:
    """Why `rec` is not a usable result record, as one sentence naming the field, or None: the schema,
    then what fields say of each other (one value per lambda on every curve, the fields a curve needs)."""
    problem = _problem(rec, name, required=True)
    if problem:
        return problem
    n = len(rec["lambdas"])
    for k in ("loss", "train_loss", "loss_folded", "accuracy_folded", "accuracy", "train_accuracy"):
        if rec.get(k) is not None and len(rec[k]) != n:
            m = len(rec[k])
            return (f"{name}: {k} must be {'null or ' if 'accuracy' in k else ''}one number per lambda ({n}), not "
                    f"{m} value{'s' if m != 1 else ''}.")
    if rec.get("accuracy") is not None and rec.get("accuracy_drop") is None:
        return f"{name}: a record with accuracy needs a numeric accuracy_drop."
    stray = [k for k in TRAIN_FIELDS if k in rec] if "train_loss" not in rec else []
    if stray:
        return f"{name}: {stray[0]} is given without train_loss."
    return None


def write_record(record: dict, file: Path) -> Path:
    """Write a record atomically (through a symlink; never over a directory, device or fifo)."""
    write_json_atomic(Path(file), record)
    return Path(file)


def load_record(file: Path) -> dict:
    """A result record from a JSON file, checked against the record schema (record_problem); any problem
    is an LMCError naming the file and the field."""
    file = Path(file)
    if not file.exists() and not file.is_symlink():
        raise LMCError(f"Result file {file} does not exist.")
    rec = read_json_object(file, f"Result file {file}", max_bytes=MAX_RECORD_BYTES, allow_nan=True,
                           kind="a result record")
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


@contextmanager
def _locked(root: Path):
    """The store directory locked (flock) while its manifest is rebuilt. Two writers at once (two cache
    builds) would otherwise interleave scan and write, and the later write of the earlier scan would drop
    the other's newest record from the manifest. Where there is no fcntl (Windows) nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
    except OSError as e:
        raise OutputError(f"Could not write into the result store {root} ({e.strerror or e}).") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_manifest(root: Path | None = None) -> list[str]:
    """Rebuild manifest.json from the records present; skipped files are warned about and returned."""
    root = _store_root(root)
    with _locked(root):
        good, problems = scan_store(root)
        write_json_atomic(root / "manifest.json",
                          {"schema": SCHEMA_VERSION, "records": [_row(n, r) for n, r in good.items()]})
    for p in problems:
        _skip(p)
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
        rows = read_json_object(m, max_bytes=MAX_JSON_BYTES, allow_nan=True, kind="a store manifest")["records"]
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
