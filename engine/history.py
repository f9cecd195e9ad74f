"""Run history: the live runs a user made, kept across sessions and server restarts.

The history is a directory of the user's own, never the shipped cached_results/ store:
$LMC_EXPLORER_HOME/runs when that variable is set, else lmc-explorer/runs in the platform's user data
directory ($XDG_DATA_HOME, by default ~/.local/share, on Linux; ~/Library/Application Support on
macOS; %LOCALAPPDATA% on Windows).

One file per run, `run-<id>.json`, written atomically (a learned or dual run of the app also keeps the element
it found beside it, `run-<id>.element.safetensors`, that a later run may start from: engine.align.start), with a "run" object: {"id", "status",
"saved", and optionally "seconds" (the run's wall time) and "note" (the user's words about it)}. The
id is the UTC time of saving (of starting, for a run that keeps an element) and a random suffix
(20261201T032634Z-a3f29c); "saved" is that time to
the microsecond, which orders the runs. Status is done, stopped or failed. A done run is a result
record (engine.results: the same fields, the same validation) plus the run object. A stopped or
failed run keeps what it reached: method, model_a, model_b, its config, the timings of the phases it
finished, its architecture when known, the points of the path it had measured ("partial": lambdas and
loss), and in its run object the phase it was in and the sentence it ended with ("phase", "message").

The tool deletes only files it wrote: a regular file named after a run id whose "run" object holds
the same id. Anything else in the directory (a corrupt, renamed or foreign file) is left alone and
skipped with a StoreWarning naming it.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
import warnings
from pathlib import Path

from engine.errors import LMCError, OutputError
from engine.models.io import read_json_object, write_json_atomic
from engine.progress import PHASES
from engine.results import (
    CACHE,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    StoreWarning,
    cache_dir,
    fields_problem,
    record_problem,
    write_record,
)

STATUSES = ("done", "stopped", "failed")
MAX_NOTE = 2000  # characters of a run's note
RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
RUN_FILE = re.compile(rf"run-({RUN_ID.pattern})\.json")
ELEMENT_FILE = re.compile(rf"run-({RUN_ID.pattern})\.element\.safetensors")  # read through its run
ID_EXAMPLE = "20261201T032634Z-a3f29c"
ID_DRAWS = 100  # ids drawn for one save before the history is deemed unwritable


def user_data_dir() -> Path:
    """Where the platform keeps a user's application data."""
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    xdg = os.environ.get("XDG_DATA_HOME", "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"  # relative: ignored (XDG spec)


def runs_dir() -> Path:
    """The run history in use, read at call time (tests and servers point it elsewhere)."""
    home = os.environ.get("LMC_EXPLORER_HOME")
    if home:
        return Path(home).expanduser() / "runs"
    return user_data_dir() / "lmc-explorer" / "runs"


def _root(root: Path | str | None) -> Path:
    """The history directory: refused if it is a file or lies in the shipped result store."""
    root = Path(root or runs_dir())
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise OutputError(f"Run history {root} is not a directory (set LMC_EXPLORER_HOME to a directory).")
    real = Path(os.path.realpath(root))
    for shipped in {Path(os.path.realpath(CACHE)), Path(os.path.realpath(cache_dir()))}:
        if real == shipped or shipped in real.parents:
            raise OutputError(f"Run history {root} lies in the result store {shipped}, which holds the shipped "
                              "records; set LMC_EXPLORER_HOME to a directory of your own.")
    return root


def new_run_id(now: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def run_file(run_id: str, root: Path | str | None = None) -> Path:
    """The file of `run_id` (which must look like a run id) in the history."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise LMCError(f"{run_id!r} is not a run id (ids look like {ID_EXAMPLE}; `python -m engine runs list` "
                       "shows them).")
    return _root(root) / f"run-{run_id}.json"


def element_path(run_id: str, root: Path | str | None = None) -> Path:
    """Where run `run_id` keeps the element it found (a learned or dual run of the app), beside its run file."""
    return run_file(run_id, root).with_name(f"run-{run_id}.element.safetensors")


def run_element(entry: dict, root: Path | str | None = None) -> Path | None:
    """The element file a finished run kept, or None: its record names the file beside it, which is still
    there."""
    f = element_path(entry["run"]["id"], root)
    named = (entry.get("element_file") or {}).get("path")
    return f if named is not None and Path(named) == f and f.is_file() and not f.is_symlink() else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def unfinished_problem(entry: dict, name: str) -> str | None:
    """Why a stopped or failed run's entry (no result record) is unusable, as a sentence, or None: the
    record schema on the fields it has (engine.results.fields_problem), then what such a run needs."""
    problem = fields_problem(entry, name)
    if problem:
        return problem
    for k in ("method", "model_a", "model_b"):
        if not isinstance(entry.get(k), str):
            return f"{name}: a stopped or failed run needs {k} as a string."
    if not isinstance(entry.get("config"), dict):
        return f"{name}: a stopped or failed run needs its config as an object."
    t = entry.get("timings", {})
    if not isinstance(t, dict) or not all(_number(v) for v in t.values()):
        return f"{name}: timings must map phases to seconds."
    if entry["run"].get("phase") not in (None, *PHASES):
        return f"{name}: run.phase must be one of {', '.join(PHASES)} or null, not {entry['run']['phase']!r}."
    if not isinstance(entry["run"].get("message", ""), str):
        return f"{name}: run.message must be a sentence."
    part = entry.get("partial")
    if part is not None and not (isinstance(part, dict) and isinstance(part.get("lambdas"), list)
                                 and isinstance(part.get("loss"), list) and len(part["lambdas"]) == len(part["loss"])
                                 and all(_number(x) for x in part["lambdas"] + part["loss"])):
        return f"{name}: partial must hold lambdas and loss, one number each per point measured."
    return None


def run_problem(entry, name: str) -> str | None:
    """Why `entry` is not a run of the history, as a sentence naming `name`, or None."""
    if not isinstance(entry, dict):
        return record_problem(entry, name)
    run = entry.get("run")
    if not isinstance(run, dict):
        return record_problem(entry, name) or f"{name} is a result record but not a kept run (it has no \"run\" object)."
    if not isinstance(run.get("id"), str) or not RUN_ID.fullmatch(run["id"]):
        return f"{name}: run.id must be a run id like {ID_EXAMPLE}, not {run.get('id')!r}."
    if run.get("status") not in STATUSES:
        return f"{name}: run.status must be one of {', '.join(STATUSES)}, not {run.get('status')!r}."
    if run.get("seconds") is not None and not (_number(run["seconds"]) and run["seconds"] >= 0):
        return f"{name}: run.seconds must be a number of seconds, not {run['seconds']!r}."
    if not isinstance(run.get("note", ""), str):
        return f"{name}: run.note must be text, not {type(run['note']).__name__}."
    problem = record_problem(entry, name)
    if problem and run["status"] != "done":  # a stopped or failed run keeps what it reached
        return unfinished_problem(entry, name)
    return problem


def _write_new(entry: dict, status: str, root: Path | str | None, seconds: float | None, run_id: str | None = None,
               **run_fields) -> dict:
    """`entry` under a new run id with `status` (its run object: id, status, saved, seconds and
    `run_fields`), written atomically into the history; returns it.

    The id's file name is claimed atomically with the write (write_json_atomic without replace), so two
    saves that draw one id (two tabs in one second, a suffix drawn twice) never overwrite each other:
    the later one draws a new id. A `run_id` drawn before the run (its element file is named after it) is
    used as it is, and refused if taken."""
    if status not in STATUSES:
        raise LMCError(f"Run status must be one of {', '.join(STATUSES)}, not {status!r}.")
    root = _root(root)
    given = run_id
    if given is not None:
        run_file(given, root)  # the form of an id
    for _ in range(1 if given is not None else ID_DRAWS):
        now = time.time()
        run_id = given or new_run_id(now)
        saved = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        run = {"id": run_id, "status": status, "saved": saved} | ({} if seconds is None else {"seconds": round(seconds, 3)})
        new = {**entry, "run": run | run_fields}
        problem = run_problem(new, "The run")
        if problem:
            raise LMCError(f"Cannot keep a broken run in the run history: {problem}")
        try:
            write_json_atomic(root / f"run-{run_id}.json", new, replace=False)
        except FileExistsError:
            continue
        return new
    if given is not None:
        raise OutputError(f"Could not keep the run in the run history {root}: its id {given} is taken already.")
    raise OutputError(f"Could not keep the run in the run history {root}: {ID_DRAWS} run ids drawn in a row were "
                      "taken already.")


def save_run(record: dict, status: str = "done", root: Path | str | None = None,
             seconds: float | None = None, run_id: str | None = None) -> dict:
    """Keep `record` (a result record) as a new run of the history, its wall time `seconds` if known, under
    `run_id` when the run drew one before it started (new_run_id: its element file, element_path, is named
    after it); returns what was written."""
    problem = record_problem(record)
    if problem:
        raise LMCError(f"Cannot keep a broken record in the run history: {problem}")
    return _write_new(record, status, root, seconds, run_id)


def save_unfinished(config: dict, status: str, phase: str | None, message: str, timings: dict[str, float],
                    seconds: float, partial: dict | None = None, arch: dict | None = None,
                    root: Path | str | None = None) -> dict:
    """Keep a run that stopped or failed before its record, with what it reached: its `config` (a
    RunConfig's dict), the `phase` it was in (None before the first), the sentence it ended with, the
    seconds of the phases it finished, its wall time, the path points it had measured (`partial`:
    {"lambdas", "loss"}) and its architecture when known; returns what was written."""
    if status not in ("stopped", "failed"):
        raise LMCError(f"Only a stopped or failed run is kept without a record, not a {status!r} one.")
    entry = {"schema": SCHEMA_VERSION, "method": config.get("method"), "model_a": config.get("model_a"),
             "model_b": config.get("model_b"), "config": config, "timings": {k: round(v, 3) for k, v in timings.items()}}
    if arch is not None:
        entry["arch"] = arch
    if partial and partial.get("lambdas"):
        entry["partial"] = partial
    return _write_new(entry, status, root, seconds, phase=phase, message=message)


def _read(f: Path) -> tuple[dict | None, str | None]:
    """(run, None) or (None, why it is skipped) for one entry of the history directory."""
    m = RUN_FILE.fullmatch(f.name)
    if m is None:
        return None, f"{f} is not a run file of this tool (its name is not run-<id>.json)."
    try:
        entry = read_json_object(f, f"Run file {f}", max_bytes=MAX_RECORD_BYTES, allow_nan=True, kind="a kept run")
    except LMCError as e:
        return None, str(e)
    problem = run_problem(entry, f"Run file {f}")
    if problem:
        return None, problem
    if entry["run"]["id"] != m.group(1):
        return None, f"Run file {f} holds run {entry['run']['id']}, not the run its name says."
    return entry, None


def scan_runs(root: Path | str | None = None) -> tuple[list[dict], list[str]]:
    """Every usable run, newest first, and a sentence for each file skipped; hidden files (the
    temporary files of a write in progress) are not looked at."""
    root = _root(root)
    if not root.is_dir():
        return [], []
    runs, problems = [], []
    for f in sorted(root.iterdir()):
        if f.name.startswith(".") or ELEMENT_FILE.fullmatch(f.name):
            continue
        entry, why = _read(f)
        if entry is None:
            problems.append(why)
        else:
            runs.append(entry)
    runs.sort(key=lambda e: (str(e["run"].get("saved", "")), e["run"]["id"]), reverse=True)
    return runs, problems


def list_runs(root: Path | str | None = None) -> list[dict]:
    """Every usable run, newest first; each file skipped is one StoreWarning naming it."""
    runs, problems = scan_runs(root)
    for p in problems:
        warnings.warn(f"skipped a file of the run history: {p}", StoreWarning, stacklevel=2)
    return runs


def load_run(run_id: str, root: Path | str | None = None) -> dict:
    """One run by id; a missing or unusable file is an LMCError naming it."""
    f = run_file(run_id, root)
    if not os.path.lexists(f):
        raise LMCError(f"There is no run {run_id} in the run history {f.parent}.")
    entry, why = _read(f)
    if entry is None:
        raise LMCError(why)
    return entry


def own_file(run_id: str, root: Path | str | None = None) -> Path:
    """The file of `run_id`, checked to be one the tool wrote (so it may delete it)."""
    return _own(run_id, root)[0]


def _own(run_id: str, root: Path | str | None) -> tuple[Path, dict]:
    """own_file, and the run it holds (read once)."""
    f = run_file(run_id, root)
    if f.is_symlink():
        raise OutputError(f"Run file {f} is a symbolic link, not a file the tool wrote; it was left alone.")
    if not os.path.lexists(f):
        raise LMCError(f"There is no run {run_id} in the run history {f.parent}.")
    entry, why = _read(f)
    if entry is None:
        raise OutputError(f"{why} The tool deletes only runs it wrote, so the file was left alone.")
    return f, entry


def set_note(run_id: str, note: str, root: Path | str | None = None) -> dict:
    """Write the user's `note` into a run the tool wrote (its run object's "note"; empty removes it),
    atomically; returns the run as written."""
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        raise LMCError(f"A run's note is text of at most {MAX_NOTE:,} characters.")
    f, entry = _own(run_id, root)
    run = {k: v for k, v in entry["run"].items() if k != "note"} | ({"note": note.strip()} if note.strip() else {})
    entry = {**entry, "run": run}
    write_record(entry, f)
    return entry


def delete_run(run_id: str, root: Path | str | None = None) -> Path:
    """Delete one run the tool wrote, and the element file it kept; returns its run file."""
    from engine.align.start import is_element_file

    f, entry = _own(run_id, root)
    element = run_element(entry, root)
    for g in (f, element) if element is not None and is_element_file(element) else (f,):
        try:
            g.unlink()
        except OSError as e:
            raise OutputError(f"Could not delete {g} ({e.strerror or e}).") from None
    return f


# ---------------------------------------------------------------------------------------------
# Reading runs side by side


def loss_unit(entry: dict) -> str:
    """What a run's loss is averaged over: "image" (ViT), "byte" (byte-level LM) or "token" (LM)."""
    if "eval_images" in entry:
        return "image"
    return "byte" if "(bytes)" in str(entry.get("eval_set", "")) else "token"


def finished(entry: dict) -> bool:
    """Whether a run holds a whole result record (a path, its barrier), not only what it reached."""
    return "barrier" in entry


def summary(entry: dict) -> dict:
    """One row of the history's table; a stopped or failed run without a record has no barrier (None),
    and the items of its config."""
    arch, run = entry.get("arch") or {}, entry["run"]
    items = entry.get("eval_images" if "eval_images" in entry else "eval_tokens") if finished(entry) else \
        entry["config"].get("eval_items")
    return {
        "id": run["id"], "created": entry.get("created") or run.get("saved"), "status": run["status"],
        "model_a": entry["model_a"], "model_b": entry["model_b"], "method": entry["method"],
        "task": arch.get("task"), "pe": arch.get("pe"), "barrier": entry.get("barrier"),
        "midpoint_barrier": entry.get("midpoint_barrier"), "eval_items": items, "seconds": run.get("seconds"),
        "phase": run.get("phase"), "note": run.get("note", ""),
    }


def compare(entries: list[dict]) -> list[dict]:
    """Rows comparing runs whose losses share a unit: barrier, midpoint barrier and endpoint losses,
    each barrier also against the first run's."""
    if not entries:
        raise LMCError("Pick at least one run to compare.")
    for e in entries:
        if not finished(e):
            raise LMCError(f"Run {e['run']['id']} {e['run']['status']} before its path was measured, so it has no "
                           "barrier curve to compare.")
    first = entries[0]
    for e in entries[1:]:
        if loss_unit(e) != loss_unit(first):
            raise LMCError(f"Runs {first['run']['id']} and {e['run']['id']} cannot share a chart: one measures loss "
                           f"per {loss_unit(first)}, the other per {loss_unit(e)}.")
    return [{**summary(e), "barrier_vs_first": e["barrier"] - first["barrier"],
             "endpoint_loss_a": e["endpoint_loss_a"], "endpoint_loss_b": e["endpoint_loss_b"]} for e in entries]
