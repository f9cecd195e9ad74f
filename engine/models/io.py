"""Checkpoint files and output locations: read with clear errors, written without losing anything.

Reading. Every config.json goes through `read_config`: a regular file (a symlink is followed, but
never to a device, a directory or a huge file), valid JSON holding an object, no `auto_map` (which
asks to run Python shipped with the checkpoint: nothing in a model directory is ever executed), and
optionally type-checked field by field (`check_fields`), so a string where a size belongs or zero
heads is one sentence naming the field, never a traceback deep inside a model constructor. Weights
are safetensors only: pickled checkpoints (.bin, .pt, .pth) are refused, loading them runs code.
A model directory is a closed world (`check_closed_world`): no link in it leads outside it (a Hugging
Face cache snapshot's links into its repository's blobs/ excepted) and a shard index names files in
it by plain name; HF configs asking for quantization or a foreign attention kernel are refused by
name (`refuse_optional_features`).

Writing. Nothing the tool did not write is deleted or replaced:
- a model directory is written as a new sibling and put in place in one atomic rename, so a kill
  leaves the old model or the new one whole; the directories the tool writes carry a marker file
  listing their files, and `check_output_dir` refuses one holding anything else, a non-empty
  directory without the marker (unless the caller overwrites on purpose: then it is written into,
  file by file, each atomically) and any input model directory;
- an output file is written to a temporary file beside its target, flushed to the device, then
  moved over it; a symlink is written through (its target is replaced, not the link), and anything
  but a regular file as the target (a directory, a device, a fifo) is refused; the CLI's --out
  replaces an existing file only if it is a result record (engine.cli);
- a write the machine fails (a full disk at any step, a quota, an I/O error) is one OutputError
  naming the place, with the earlier file or model whole and no temporary file left; temporary files
  of writes that were killed are removed by the next write into the same directory (`remove_stale`).
Output locations are checked before a computation starts (`check_output_file`, `check_output_dir`),
so a result is never computed only to be lost at the end.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import ModelError, OutputError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_JSON_BYTES = 16 * 2**20  # a config or record larger than this is not one
MARKER = ".lmc-explorer-output"  # in every directory the tool creates: it may write there again
MARKER_TEXT = "Written by LMC Explorer (python -m engine); a later save here replaces this directory whole.\n"
FILES_LINE = "files: "  # the marker's second line: the files of the save (tab-separated)
# Files a save writes (the CLI refuses to put a result file under these names).
OWN_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json",
             "metrics.json")
OWN_SHARDS = "model-*-of-*.safetensors"


def _short(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Reading configs


def regular_file(f: Path, name: str, max_bytes: int | None, kind: str) -> os.stat_result:
    """The stat of `f`, refused in one sentence naming it (`name`) unless it is, or links to, a regular file of
    at most `max_bytes` (`kind`: what the file is meant to be, as the refusal says)."""
    if not os.path.lexists(f):
        raise ModelError(f"{name} does not exist.")
    try:
        st = f.stat()
    except FileNotFoundError:
        raise ModelError(f"{name} is a symbolic link to {os.readlink(f)}, which does not exist.") from None
    except OSError as e:
        raise ModelError(f"{name} cannot be read ({e.strerror or e}).") from None
    if not stat.S_ISREG(st.st_mode):
        found = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ModelError(f"{name} is {found}.")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ModelError(f"{name} is {st.st_size:,} bytes, too large for {kind} (at most {max_bytes:,}).")
    return st


def read_json_object(f: Path, what: str | None = None, max_bytes: int | None = MAX_JSON_BYTES,
                     allow_nan: bool = False, kind: str = "a JSON config") -> dict:
    """A JSON file holding an object, with one clear sentence for every way it can be unusable.

    A symlink is followed; its target must be a regular file of at most `max_bytes` (a link to
    /dev/zero or to a directory would otherwise hang or crash the reader), the refusal naming what
    the file is meant to be (`kind`: a JSON config, a result record, a shard index). NaN and
    Infinity, which JSON does not have, are refused unless `allow_nan` (files the engine wrote
    itself: Python's json writes them for non-finite floats).
    """
    f = Path(f)
    name = what or str(f)
    regular_file(f, name, max_bytes, kind)
    try:
        text = f.read_bytes().decode("utf-8")
        obj = json.loads(text) if allow_nan else json.loads(text, parse_constant=_no_constant)
    except OSError as e:
        raise ModelError(f"{name} cannot be read ({e.strerror}).") from None
    except UnicodeDecodeError as e:
        raise ModelError(f"{name} is not UTF-8 text (bad byte at offset {e.start}).") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{name} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None
    except ValueError as e:  # NaN / Infinity, which JSON does not have
        raise ModelError(f"{name} is not valid JSON ({e}).") from None
    except RecursionError:
        raise ModelError(f"{name} is not a usable JSON file: it nests too deeply.") from None
    if not isinstance(obj, dict):
        raise ModelError(f"{name} holds a JSON {type(obj).__name__}, not an object.")
    return obj


def _no_constant(c: str):
    raise ValueError(f"{c} is not a JSON value")


def refuse_code(cfg: dict, name: str) -> None:
    """Refuse a config that asks to run Python shipped with the checkpoint (transformers' `auto_map`)."""
    if "auto_map" in cfg:
        raise ModelError(
            f"{name} has an auto_map entry, which asks to run Python code from the model directory; "
            "the engine never runs code from a checkpoint."
        )


def read_config(path: Path, rules: Mapping | None = None) -> dict:
    """config.json of a model directory: a JSON object without auto_map, fields checked by `rules`."""
    path = Path(path)
    f = path / "config.json"
    if not os.path.lexists(f):
        raise ModelError(f"Model directory {path} has no config.json.")
    cfg = read_json_object(f)
    refuse_code(cfg, str(f))
    if rules:
        check_fields(cfg, rules, str(f))
    return cfg


# Field kinds for check_fields: each is (test, what the value must be).
def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "size": (lambda v: _int(v) and v > 0, "a positive integer"),
    "opt_size": (lambda v: v is None or (_int(v) and v > 0), "a positive integer or null"),
    "count": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "size_or_pair": (lambda v: (_int(v) and v > 0) or (isinstance(v, list) and len(v) == 2
                                                       and all(_int(x) and x > 0 for x in v)),
                     "a positive integer or a pair of them"),
    "positive": (lambda v: _num(v) and v > 0, "a positive finite number"),
    "nonneg": (lambda v: _num(v) and v >= 0, "a non-negative finite number"),
    "finite": (_num, "a finite number"),
    "fraction": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "opt_fraction": (lambda v: v is None or (_num(v) and 0 <= v <= 1), "a number in [0, 1] or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "opt_bool": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "opt_str": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "opt_dict": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


def check_fields(cfg: Mapping, rules: Mapping, source: str) -> None:
    """Refuse the first field of `cfg` whose value is not of its kind in `rules` (absent fields pass).

    `rules` maps a key to a kind of KINDS, or to a nested rules dict for an object-valued field
    (which may also be null).
    """
    for key, kind in rules.items():
        if key not in cfg:
            continue
        v = cfg[key]
        if isinstance(kind, Mapping):
            if v is None:
                continue
            if not isinstance(v, Mapping):
                raise ModelError(f"{source}: {key} must be an object, not {_short(v)}.")
            check_fields(v, kind, f"{source}: {key}")
            continue
        ok, what = KINDS[kind]
        if not ok(v):
            raise ModelError(f"{source}: {key} must be {what}, not {_short(v)}.")


def check_dataclass_fields(obj, source: str, positive: Iterable[str] = (), nonneg: Iterable[str] = ()) -> None:
    """Type-check a config dataclass against its annotations (int, float, bool, str), with ranges.

    A dataclass built from JSON otherwise takes "4" or 4.5 for an int field and fails later, deep in
    a constructor; this names the field instead. int fields are non-negative integers (`positive`:
    at least 1); float fields are finite numbers, integers included (`positive` / `nonneg` ranges).
    """
    positive, nonneg = set(positive), set(nonneg)
    kinds = {"int": ("size", "count", "count"), "float": ("positive", "nonneg", "finite"),
             "bool": ("bool",) * 3, "str": ("str",) * 3}
    rules = {}
    for f in fields(obj):
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if t in kinds:
            rules[f.name] = kinds[t][0 if f.name in positive else 1 if f.name in nonneg else 2]
    check_fields({f.name: getattr(obj, f.name) for f in fields(obj)}, rules, source)


# Fields of Hugging Face configs (GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, ...) that the adapters read: checked before
# transformers builds anything, because its constructors take "4" or 0 heads and fail much later.
HF_RULES: dict = {
    "model_type": "str",
    "n_embd": "size", "n_head": "size", "n_layer": "size", "n_positions": "size", "n_ctx": "size",
    "n_inner": "opt_size", "vocab_size": "size",
    "hidden_size": "size", "num_attention_heads": "size", "num_hidden_layers": "size",
    "intermediate_size": "size", "max_position_embeddings": "size", "num_key_value_heads": "opt_size",
    "head_dim": "opt_size",
    "layer_norm_epsilon": "nonneg", "layer_norm_eps": "nonneg", "rms_norm_eps": "nonneg",
    "rope_theta": "positive", "rotary_emb_base": "positive", "rotary_pct": "fraction",
    "partial_rotary_factor": "fraction",
    "attn_pdrop": "opt_fraction", "resid_pdrop": "opt_fraction", "embd_pdrop": "opt_fraction",
    "attention_dropout": "opt_fraction", "hidden_dropout": "opt_fraction",
    "tie_word_embeddings": "bool", "attention_bias": "bool", "mlp_bias": "bool", "scale_attn_weights": "bool",
    "scale_attn_by_inverse_layer_idx": "bool", "add_cross_attention": "bool", "reorder_and_upcast_attn": "bool",
    "use_parallel_residual": "bool", "use_cache": "bool",
    "sliding_window": "opt_size", "use_sliding_window": "bool", "max_window_layers": "count",
    "activation_function": "str", "hidden_act": "str",
    "rope_parameters": {"rope_type": "str", "rope_theta": "positive", "partial_rotary_factor": "fraction",
                        "factor": "positive", "low_freq_factor": "positive", "high_freq_factor": "positive",
                        "original_max_position_embeddings": "size"},
    "rope_scaling": "opt_dict",
}


# ---------------------------------------------------------------------------------------------
# A model directory is a closed world

INDEX = "model.safetensors.index.json"


def _inside(target: str, roots: Iterable[str]) -> bool:
    return any(target == r or target.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def check_closed_world(path: Path) -> None:
    """Refuse a model directory that reaches outside itself: a symbolic link in it whose target lies
    elsewhere, or a shard index naming a file that is not a plain name inside it.

    One exception keeps the Hugging Face cache usable: in a snapshot directory
    (`models--org--name/snapshots/<revision>`) every file is a link into that repository's own
    `blobs/`, which is allowed (and nothing else outside the snapshot).
    """
    path = Path(path)
    root = os.path.realpath(path)
    roots = [root]
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        roots.append(os.path.realpath(path.parent.parent / "blobs"))
    for p in sorted(path.iterdir()):
        if p.is_symlink():
            target = os.path.realpath(p)
            if not _inside(target, roots):
                raise ModelError(f"Model directory {path}: {p.name} is a symbolic link to {target}, outside the "
                                 "model directory; a model directory must hold its own files.")
    if os.path.lexists(path / INDEX):
        index = read_json_object(path / INDEX, kind="a shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{path / INDEX} has no weight_map object of tensor names to shard file names.")
        for shard in sorted(set(weight_map.values())):
            if shard in ("", ".", "..") or "/" in shard or "\\" in shard or os.path.isabs(shard):
                raise ModelError(f"{path / INDEX} names shard {_short(shard)}, which is not a file name inside "
                                 "the model directory.")


# Optional features of HF configs that need packages or kernels the engine does not ship.
ATTENTION_KERNELS = (None, "eager", "sdpa")


def refuse_optional_features(cfg: Mapping, source: str) -> None:
    """Refuse, by name, an HF config that asks for a quantized checkpoint or an attention kernel from a
    package the engine does not ship, before transformers tries to import it."""
    q = cfg.get("quantization_config")
    if q is not None:
        method = q.get("quant_method") if isinstance(q, Mapping) else None
        name = f"quantization method {method!r}" if isinstance(method, str) else "a quantization method"
        raise ModelError(f"{source} asks for {name}; the engine aligns full-precision weights only "
                         "(float32, float16 or bfloat16 safetensors), so dequantize the checkpoint first.")
    for key in ("attn_implementation", "_attn_implementation"):
        kernel = cfg.get(key)
        if kernel not in ATTENTION_KERNELS:
            raise ModelError(f"{source}: {key} {_short(kernel)} names an attention kernel the engine does not "
                             "ship; remove it (the engine runs its own attention).")


# ---------------------------------------------------------------------------------------------
# Reading weights


def refuse_pickles(path: Path) -> None:
    pickles = [p.name for p in Path(path).iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not list(Path(path).glob("*.safetensors")):
        raise ModelError(
            f"Model directory {path} holds only pickled weights ({', '.join(sorted(pickles))}); "
            "convert them to safetensors first, pickles can run arbitrary code."
        )


def read_safetensors(file: Path, expected: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Load a safetensors file; check keys, shapes and dtypes against `expected`, refuse NaN/inf."""
    file = Path(file)
    if not file.is_file():
        refuse_pickles(file.parent)
        raise ModelError(f"Model directory {file.parent} has no {file.name}.")
    try:
        state = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelError(f"{file} is not a readable safetensors file ({e}).") from None
    if expected is not None:
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise ModelError(f"{file} does not match its config: missing {missing[:3]}, unexpected {extra[:3]}.")
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ModelError(f"{file}: tensor {k} has shape {tuple(state[k].shape)}, config says {tuple(v.shape)}.")
            if v.is_floating_point() and not state[k].is_floating_point():
                raise ModelError(f"{file}: tensor {k} holds {str(state[k].dtype).removeprefix('torch.')} values; "
                                 "model weights must be floating point.")
    check_finite(state, str(file))
    return state


def weight_files(path: Path) -> list[Path]:
    """The directory's safetensors files, refused when there are none (pickles only, or nothing) or one is not a
    regular file (a link to a device or a directory is never handed to a reader)."""
    path = Path(path)
    refuse_pickles(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"Model directory {path} has no model.safetensors.")
    for f in files:
        if not f.is_file():
            raise ModelError(f"{f} is not a regular file.")
    return files


def check_weight_files(path: Path, parameters: Mapping[str, tuple[int, ...]]) -> None:
    """Before any weight is read: the directory's weights are safetensors (weight_files) and store every model
    parameter as floating point in the shape its config gives (their headers alone are read: check_weight_headers)."""
    weight_files(path)
    check_weight_headers(path, parameters)


def check_weight_headers(path: Path, parameters: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse safetensors in `path` that store a model parameter as integers or booleans, or in another shape than
    the module's (`parameters`: its names and shapes), from the files' headers.

    A loader would cast integers to float without a word; weights that were never floating point are a broken or
    foreign checkpoint, and weights of another shape a config that is not theirs. Tensors that are no parameter
    (masks, counters) pass. A file key matches the parameter of the same name, or those it ends or is ended by
    (a prefix such as `model.` or `transformer.` on one side): the dtype is checked against any of them, the shape
    against the one when it is unique.
    """
    from safetensors import safe_open

    names = list(parameters)
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                    match = [k] if k in parameters else [n for n in names if n.endswith("." + k) or k.endswith("." + n)]
                    if not match:
                        continue
                    sl = sf.get_slice(k)
                    dt = sl.get_dtype()
                    if not dt.startswith(("F", "BF")):  # F16, F32, F64, BF16, F8_*
                        raise ModelError(f"{f}: tensor {k} holds {dt} values; model weights must be floating point.")
                    shape, want = tuple(sl.get_shape()), tuple(parameters[match[0]])
                    if len(match) == 1 and shape != want:
                        raise ModelError(f"{f}: tensor {k} has shape {shape}, config says {want}.")
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f} is not a readable safetensors file ({e}).") from None


def check_finite(state: dict[str, torch.Tensor], name: str) -> None:
    for k, v in state.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ModelError(f"{name}: tensor {k} contains NaN or infinite values.")


# ---------------------------------------------------------------------------------------------
# Checking output locations (before any work)


def _nearest_existing(path: Path) -> Path:
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _check_parent(target: Path, name: str) -> None:
    """The directory that will hold `target` exists and is writable, or can be created."""
    anc = _nearest_existing(target.parent)
    if not anc.is_dir():
        raise OutputError(f"{name}: {anc} is not a directory, so nothing can be written under it.")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputError(f"{name}: directory {anc} is not writable.")


def check_output_file(file: str | Path, name: str = "Output file") -> Path:
    """The path a result file will really be written to (a symlink resolved), checked before any work.

    Refuses a target that exists but is not a regular file, a parent that is a file or is not
    writable, and an existing file that is not writable.
    """
    file = Path(file)
    label = f"{name} {file}"
    if str(file) == "" or file.name in ("", ".", ".."):
        raise OutputError(f"{label} names a directory, not a file.")
    target = Path(os.path.realpath(file))  # a symlink (final or in a parent) is written through
    if os.path.lexists(target):
        try:
            st = target.stat()
        except OSError as e:
            raise OutputError(f"{label} cannot be checked ({e.strerror}).") from None
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{label} is a directory; give a file name.")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{label} exists and is not a regular file (a device, fifo or socket); "
                              "the tool only replaces regular files.")
        if not os.access(target, os.W_OK):
            raise OutputError(f"{label} is not writable.")
    _check_parent(target, label)
    return target


def refuse_foreign(target: Path, label: str, own: Callable[[Path], bool], what: str) -> None:
    """The one rule for files the tool replaces: an existing, non-empty `target` must be `what`, a file of this
    tool (`own` says so), or nothing is written. `what` names the kind: "result record", "element file"."""
    if target.exists() and target.stat().st_size and not own(target):
        article = "an" if what[0] in "aeiou" else "a"
        raise OutputError(f"{label} already holds a file that is not {article} {what} of this tool; choose another "
                          f"file name (only an earlier {what} is replaced).")


def _resolved(p: str | Path) -> Path:
    return Path(os.path.realpath(Path(p)))


def check_output_dir(path: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = (),
                     name: str = "Output directory") -> Path:
    """The directory a checkpoint will be written into (resolved), checked before any work.

    Refused: a path that is not a directory; a non-empty directory without the tool's marker (unless
    `overwrite`: files of the tool's own names are then replaced, nothing else is touched); a
    directory with the marker that holds files its last save did not write (it is replaced whole);
    any of the input model directories `inputs`, even with `overwrite`; an unwritable location.
    """
    label = f"{name} {path}"
    target = check_dir_target(path, inputs, label)
    if target.exists():
        entries = sorted(p.name for p in target.iterdir())
        if entries and MARKER not in entries and not overwrite:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise OutputError(
                f"{label} already holds files the tool did not write ({shown}); choose a new or empty "
                "directory, or pass --overwrite to replace only the files of a checkpoint there."
            )
        if MARKER in entries:  # the tool's own directory: replaced whole, so nothing else may be in it
            foreign = foreign_files(target)
            if foreign:
                shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
                raise OutputError(f"{label} was written by the tool but now also holds {shown}, which it did "
                                  "not write; move them away or choose another directory.")
        for n in OWN_FILES:
            p = target / n
            if os.path.lexists(p) and not p.is_file():
                raise OutputError(f"{label}: {n} there is not a regular file; the tool will not replace it.")
    return target


def check_dir_target(path: str | Path, inputs: Iterable[str | Path | None], label: str) -> Path:
    """A directory the tool will write into (resolved): none of the `inputs` directories, and either an
    existing writable directory or a path whose nearest existing parent is one. `label` starts each sentence."""
    target = _resolved(Path(path))
    for inp in inputs:
        if inp is not None and _resolved(inp) == target:
            raise OutputError(f"{label} is an input model directory; write the output somewhere else.")
    if os.path.lexists(target):
        if not target.is_dir():
            raise OutputError(f"{label} exists and is not a directory.")
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutputError(f"{label} is not writable.")
        return target
    _check_parent(target, label)
    return target


# ---------------------------------------------------------------------------------------------
# Writing


def _new_file_mode(full: int = 0o666) -> int:
    """The mode a new file (0o666) or directory (0o777) gets under the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return full & ~mask


# Temporary names the tool writes beside a target NAME: `.NAME.lmc-XXXXXXXX.tmp` (a file) and
# `.NAME.lmc-new-XXXXXXXX` / `.NAME.lmc-old-XXXXXXXX` (a model directory's sibling), XXXXXXXX being
# tempfile's eight random characters. The writer holds an flock on each for as long as it writes; the
# kernel drops the lock when the writer dies, so a name of this pattern whose lock is free is the
# leftover of a killed write, and the next write into that directory removes it (the next run kept in
# the history has a new name, so cleaning by directory, not by target, is what reaches its leftovers).
# Where there is no flock (Windows) nothing is removed.
_RANDOM = "[a-z0-9_]{8}"
STALE = re.compile(rf"\..+\.lmc-(?:{_RANDOM}\.tmp|(?:new|old)-{_RANDOM})")


def _lock(fd: int, wait: bool = True) -> bool:
    """flock `fd` exclusively; False when another process holds it (only without `wait`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _locked_temp(make: Callable[[], str]) -> tuple[str, int | None]:
    """A new temporary file or directory (`make` creates it and returns its path) and an open descriptor
    holding its lock (None without flock). A cleaner (another writer into the same directory) could
    take the lock between creation and locking and remove the path: then a new one is made."""
    while True:
        tmp = make()
        if fcntl is None:
            return tmp, None
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except FileNotFoundError:  # removed before it was even opened
            continue
        _lock(fd)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale(parent: Path) -> list[str]:
    """Remove the temporary files and directories that killed writes into `parent` left (the names
    above, their lock free); returns the names removed. Anything else, a user's `.NAME.tmp` or
    `.NAME.lmc-notes` included, a symbolic link, and a write still running, is left alone."""
    removed = []
    if fcntl is None:
        return removed
    try:
        entries = [e for e in os.scandir(parent) if STALE.fullmatch(e.name)]
    except OSError:
        return removed
    for e in sorted(entries, key=lambda e: e.name):
        p = os.path.join(parent, e.name)
        try:
            st = os.lstat(p)
            is_dir = stat.S_ISDIR(st.st_mode)
            if not (is_dir or stat.S_ISREG(st.st_mode)):
                continue  # a link or anything else: not what the tool writes
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if _lock(fd, wait=False) and os.fstat(fd).st_ino == st.st_ino:
                if is_dir:
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
                removed.append(e.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _why(e: BaseException) -> str | None:
    """Why a write failed, when the machine is the reason: an OSError's message, or the OS error that
    safetensors' writer reports inside its own error ("... I/O error: No space left on device (os error
    28)"); None for any other exception (a bug, not the machine)."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, SafetensorError):
        m = re.search(r"os error (\d+)", str(e))
        return os.strerror(int(m.group(1))) if m else None
    return None


def _fsync(path: str | Path) -> None:
    """Flush a written file's data to its device: a full disk that the file system reports only now (a
    network or delayed-allocation file system) fails here, before the file replaces anything."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _claim(tmp: str, target: Path) -> bool:
    """Give the written `tmp` the name `target` unless that name exists (False); atomic, so of two
    writers claiming one name exactly one succeeds. A hard link does it; on a file system without
    them (FAT, some network shares) the name is first created exclusively, then replaced."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return False
        os.replace(tmp, target)
        return True
    os.unlink(tmp)
    return True


def write_file_atomic(file: Path, write: Callable[[Path], None], replace: bool = True) -> Path:
    """`write(tmp)` into a temporary file beside the real target of `file`, then move it over the target.

    A symlink is written through; a target that is not a regular file is refused; the permissions of
    a replaced file are kept. The data is flushed to the device (fsync) before it takes the target's
    name, so a failed write (a full disk at any step), a kill or a crash leaves the old file whole and
    the new one never torn. A failure of the machine is an OutputError naming `file` and the temporary
    file is removed; temporary files of earlier killed writes into the same directory are removed
    first (remove_stale). With `replace` False an existing target is never replaced: the write claims the
    name atomically and raises FileExistsError (nothing written) when it is taken.
    """
    target = check_output_file(file)
    tmp = fd = None
    taken = False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent)
        mode = target.stat().st_mode & 0o7777 if target.exists() else _new_file_mode()

        def make() -> str:
            f, t = tempfile.mkstemp(prefix=f".{target.name}.lmc-", suffix=".tmp", dir=target.parent)
            os.close(f)
            return t

        tmp, fd = _locked_temp(make)
        write(Path(tmp))
        _fsync(tmp)
        os.chmod(tmp, mode)
        if replace:
            os.replace(tmp, target)
        else:
            taken = not _claim(tmp, target)
        if not taken:
            tmp = None
    except Exception as e:
        why = _why(e)
        if why is None:
            raise
        raise OutputError(f"Could not write {file} ({why}).") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)
    if taken:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    return target


def write_json_atomic(file: Path, obj, allow_nan: bool = True, replace: bool = True) -> Path:
    """`obj` as indented JSON, atomically (write_file_atomic, which `replace` is passed to); `allow_nan`
    False refuses NaN and Infinity (ValueError), which JSON does not have."""
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=allow_nan)
            f.write("\n")

    return write_file_atomic(Path(file), write, replace)


def foreign_files(path: Path) -> list[str]:
    """Entries of a directory carrying the marker that its last save did not write (sorted). A marker
    that lists no files (written before markers listed them) owns the checkpoint files of the tool's
    own names."""
    lines = (path / MARKER).read_text(errors="replace").splitlines()
    listed = next((ln[len(FILES_LINE):].split("\t") for ln in lines if ln.startswith(FILES_LINE)), None)
    own = set(listed) if listed is not None else set(OWN_FILES)
    return sorted(p.name for p in path.iterdir()
                  if p.name != MARKER and p.name not in own and not (listed is None and p.match(OWN_SHARDS)))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 with RENAME_EXCHANGE); False where the
    platform, kernel or file system cannot."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_into_dir(path: Path, fill: Callable[[Path], None]) -> Path:
    """Run `fill` on a new sibling directory of `path`, then put it in the place of `path` in one step.

    Transactional: a new or empty `path` becomes the sibling by one rename; the tool's own directory
    (with the marker; `check_output_dir` refuses it when it holds anything its last save did not
    write) is exchanged with the sibling in one atomic rename (renameat2; where the file system
    cannot, two renames) and the old one removed, so a kill at any point leaves the old model or the
    new one whole. Every file is flushed to the device before the swap, so a full disk fails the save
    (an OutputError naming `path`) with the old model in place and the sibling removed. The new marker
    lists the files written. Siblings and temporary files left by earlier killed writes into the
    same directory (`.NAME.lmc-new-*`, their lock free: remove_stale) are removed first.

    A directory the tool did not write (allowed by --overwrite) is replaced whole too, without
    touching or claiming anything else in it: everything else in it is mirrored into the sibling by
    hard links (subdirectories recreated, symbolic links copied as links), and the two are exchanged,
    so the old files and the new ones never mix; the old directory then holds only links and the
    replaced files. Where that cannot be done (a special file there, a file system without hard links
    or the exchange), the files are put in one by one, each atomically.
    """
    path = _resolved(path)
    if os.path.lexists(path) and not path.is_dir():
        raise OutputError(f"Output directory {path} exists and is not a directory.")
    new = fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent)
        occupied = path.exists() and any(path.iterdir())
        foreign_dir = occupied and not (path / MARKER).is_file()
        new, fd = _locked_temp(lambda: tempfile.mkdtemp(prefix=f".{path.name}.lmc-new-", dir=path.parent))
        new = Path(new)
        fill(new)
        written = sorted(p.name for p in new.iterdir() if p.is_file())
        mode = _new_file_mode()  # writers of temporary files (safetensors) may leave them private
        for n in written:
            _fsync(new / n)
            os.chmod(new / n, mode)
        if foreign_dir:
            for n in written:
                dst = path / n
                if os.path.lexists(dst) and not dst.is_file():
                    raise OutputError(f"Output directory {path}: {n} there is not a regular file; it was left alone.")
            if _swap_foreign(path, new, set(written)):
                return path
            for n in written:
                os.replace(new / n, path / n)
            return path
        (new / MARKER).write_text(MARKER_TEXT + FILES_LINE + "\t".join(written) + "\n")
        _fsync(new / MARKER)
        os.chmod(new, _new_file_mode(0o777))  # mkdtemp makes it private
        if not occupied:
            if path.exists():
                path.rmdir()
            os.rename(new, path)
        elif not _exchange(new, path):  # after an exchange `new` holds the old model
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.lmc-old-", dir=path.parent))
            os.rmdir(old)
            os.rename(path, old)
            os.rename(new, path)
            new = old
    except Exception as e:
        why = _why(e)
        if why is None:
            raise
        raise OutputError(f"Could not write into {path} ({why}).") from None
    finally:
        if new is not None:
            shutil.rmtree(new, ignore_errors=True)
        if fd is not None:
            os.close(fd)
    return path


def _mirror(src: Path, dst: Path, skip: set[str] = frozenset()) -> bool:
    """Hard-link every entry of `src` but the names in `skip` into the directory `dst`: directories
    recreated with their modes, symbolic links copied as links; False where an entry cannot be (a
    special file, a link the file system refuses)."""
    try:
        for e in os.scandir(src):
            if e.name in skip:
                continue
            d = dst / e.name
            if e.is_symlink():
                os.symlink(os.readlink(e.path), d)
            elif e.is_dir(follow_symlinks=False):
                os.mkdir(d)
                if not _mirror(Path(e.path), d):
                    return False
                shutil.copystat(e.path, d, follow_symlinks=False)
            elif e.is_file(follow_symlinks=False):
                os.link(e.path, d, follow_symlinks=False)
            else:
                return False
        return True
    except OSError:
        return False


def _swap_foreign(path: Path, new: Path, written: set[str]) -> bool:
    """Put the filled sibling `new` in the place of a directory the tool did not write, in one step:
    mirror the rest of `path` into `new`, exchange them, then move back anything that appeared in the
    old directory meanwhile. False (with `path` untouched) where mirroring or the exchange cannot be
    done; `new` is then removed by the caller, which removes links only."""
    if not _mirror(path, new, written):
        return False
    try:
        shutil.copystat(path, new)
        if not _exchange(new, path):
            return False
    except OSError:
        return False
    for e in os.scandir(new):  # `new` is the old directory now: a late arrival is moved, not removed
        if not os.path.lexists(path / e.name):
            os.rename(e.path, path / e.name)
    return True


def write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor], extra: dict[str, str] | None = None) -> None:
    """Write config.json + model.safetensors (+ extra text files) into directory `path`, file by file."""

    def fill(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    write_into_dir(path, fill)
