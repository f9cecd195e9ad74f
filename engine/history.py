"""Run history: the live runs a user made, kept across sessions and server restarts.

The history is a directory of the user's own, never the shipped cached_results/ store:
$LMC_EXPLORER_HOME/runs when that variable is set, else lmc-explorer/runs in the platform's user data
directory ($XDG_DATA_HOME, by default ~/.local/share, on Linux; ~/Library/Application Support on
macOS; %LOCALAPPDATA% on Windows).

One file per run, `run-<id>.json`, written atomically: a result record (engine.results: the same
fields, the same validation) with one more object, "run": {"id", "status", "saved"}. The id is the
UTC time of saving and a random suffix (20261201T032634Z-a3f29c); "saved" is that time to the
microsecond, which orders the runs.
Status is done, stopped or failed; only a run that produced a record can be kept.

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
from engine.results import CACHE, StoreWarning, cache_dir, load_record, record_problem, write_record

STATUSES = ("done", "stopped", "failed")
RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
RUN_FILE = re.compile(rf"run-({RUN_ID.pattern})\.json")
ID_EXAMPLE = "20261201T032634Z-a3f29c"


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


def run_problem(entry, name: str) -> str | None:
    """Why `entry` is not a run of the history, as a sentence naming `name`, or None."""
    problem = record_problem(entry, name)
    if problem:
        return problem
    run = entry.get("run")
    if not isinstance(run, dict):
        return f"{name} is a result record but not a kept run (it has no \"run\" object)."
    if not isinstance(run.get("id"), str) or not RUN_ID.fullmatch(run["id"]):
        return f"{name}: run.id must be a run id like {ID_EXAMPLE}, not {run.get('id')!r}."
    if run.get("status") not in STATUSES:
        return f"{name}: run.status must be one of {', '.join(STATUSES)}, not {run.get('status')!r}."
    return None


def save_run(record: dict, status: str = "done", root: Path | str | None = None) -> dict:
    """Keep `record` (a result record) as a new run of the history; returns what was written."""
    if status not in STATUSES:
        raise LMCError(f"Run status must be one of {', '.join(STATUSES)}, not {status!r}.")
    problem = record_problem(record)
    if problem:
        raise LMCError(f"Cannot keep a broken record in the run history: {problem}")
    root = _root(root)
    now = time.time()
    run_id = new_run_id(now)
    while (root / f"run-{run_id}.json").exists():  # two saves in one second may draw the same suffix
        run_id = new_run_id(now)
    saved = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    entry = {**record, "run": {"id": run_id, "status": status, "saved": saved}}
    try:
        write_record(entry, root / f"run-{run_id}.json")
    except OSError as e:
        raise OutputError(f"Could not keep the run in the run history {root} ({e.strerror or e}).") from None
    return entry


def _read(f: Path) -> tuple[dict | None, str | None]:
    """(run, None) or (None, why it is skipped) for one entry of the history directory."""
    m = RUN_FILE.fullmatch(f.name)
    if m is None:
        return None, f"{f} is not a run file of this tool (its name is not run-<id>.json)."
    try:
        entry = load_record(f)
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
        if f.name.startswith("."):
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
    f = run_file(run_id, root)
    if f.is_symlink():
        raise OutputError(f"Run file {f} is a symbolic link, not a file the tool wrote; it was left alone.")
    if not os.path.lexists(f):
        raise LMCError(f"There is no run {run_id} in the run history {f.parent}.")
    entry, why = _read(f)
    if entry is None:
        raise OutputError(f"{why} The tool deletes only runs it wrote, so the file was left alone.")
    return f


def delete_run(run_id: str, root: Path | str | None = None) -> Path:
    """Delete one run the tool wrote; returns its file."""
    f = own_file(run_id, root)
    try:
        f.unlink()
    except OSError as e:
        raise OutputError(f"Could not delete {f} ({e.strerror or e}).") from None
    return f


# ---------------------------------------------------------------------------------------------
# Reading runs side by side


def loss_unit(entry: dict) -> str:
    """What a run's loss is averaged over: "image" (ViT), "byte" (byte-level LM) or "token" (LM)."""
    if "eval_images" in entry:
        return "image"
    return "byte" if "(bytes)" in str(entry.get("eval_set", "")) else "token"


def summary(entry: dict) -> dict:
    """One row of the history's table."""
    arch, run = entry.get("arch") or {}, entry["run"]
    return {
        "id": run["id"], "created": entry.get("created") or run.get("saved"), "status": run["status"],
        "model_a": entry["model_a"], "model_b": entry["model_b"], "method": entry["method"],
        "task": arch.get("task"), "pe": arch.get("pe"), "barrier": entry["barrier"],
        "midpoint_barrier": entry["midpoint_barrier"],
        "eval_items": entry.get("eval_images" if "eval_images" in entry else "eval_tokens"),
    }


def compare(entries: list[dict]) -> list[dict]:
    """Rows comparing runs whose losses share a unit: barrier, midpoint barrier and endpoint losses,
    each barrier also against the first run's."""
    if not entries:
        raise LMCError("Pick at least one run to compare.")
    first = entries[0]
    for e in entries[1:]:
        if loss_unit(e) != loss_unit(first):
            raise LMCError(f"Runs {first['run']['id']} and {e['run']['id']} cannot share a chart: one measures loss "
                           f"per {loss_unit(first)}, the other per {loss_unit(e)}.")
    return [{**summary(e), "barrier_vs_first": e["barrier"] - first["barrier"],
             "endpoint_loss_a": e["endpoint_loss_a"], "endpoint_loss_b": e["endpoint_loss_b"]} for e in entries]
