"""Writes that the machine fails, writes that were killed, and two writers claiming one run id.

Every write path of the engine (a record --out, a cache build's record and manifest, a run kept in
the history, a note, a store file, a train state, a merged model) ends, on a full disk, in one
OutputError naming the place (exit 2 in the CLI), with the earlier file or model whole and no
temporary file left. Two ways to fill the disk: fault injection (os.fsync, the file object's write,
safetensors' writer, creating or moving the temporary file raise ENOSPC), which always runs, and a
real tmpfs of a few pages, mounted where the test may mount one.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from path_records import lm_record
from ref_models import tiny
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine import history
from engine.cli import main
from engine.errors import OutputError
from engine.models import hf_gpt2, io, load_model, model_logits, reference, save_model
from engine.results import RunConfig, list_cached, load_record, make_record, store, write_record

ROOT = Path(__file__).resolve().parents[2]
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
GPT2 = {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 256, "bos_token_id": 0,
        "eos_token_id": 0}


def record(barrier: float) -> dict:
    """A valid result record of barrier `barrier` (its loss rises by that much at the midpoint)."""
    r = lm_record(loss=(2.0, 2.0 + barrier / 2, 2.0 + barrier, 2.0 + barrier / 2, 2.0))
    body = {k: v for k, v in r.items() if k not in ("method", "model_a", "model_b")}
    return make_record(RunConfig(r["model_a"], r["model_b"]), body, {"align": 0.0})


def snapshot(d: Path) -> dict[str, bytes | str]:
    """Every path under `d`: a file's bytes, "dir" for a directory, a link's target."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


# ---------------------------------------------------------------------------------------------
# The write paths: each writes an earlier version into `d`, then returns the write of a newer one
# and the place its error must name.


def _out_record(d: Path):
    write_record(record(0.1), d / "r.json")
    return lambda: write_record(record(0.2), d / "r.json"), d / "r.json"


def _store_record(d: Path):
    store(record(0.1), d)
    return lambda: store(record(0.2), d), d / "lm-rope-s0__lm-rope-s1__naive.json"


def _history_run(d: Path):
    history.save_run(record(0.1), root=d)
    return lambda: history.save_run(record(0.2), root=d), d / "run-"


def _history_stopped(d: Path):
    history.save_run(record(0.1), root=d)
    cfg = RunConfig("lm-rope-s0", "lm-rope-s1").to_dict()
    return lambda: history.save_unfinished(cfg, "stopped", "align", "Stopped.", {}, 1.0, root=d), d / "run-"


def _note(d: Path):
    run_id = history.save_run(record(0.1), root=d)["run"]["id"]
    history.set_note(run_id, "first", root=d)
    return lambda: history.set_note(run_id, "second", root=d), d / f"run-{run_id}.json"


def _store_file(d: Path):  # a symmetry, ablation, plane or multi-model store file (write_json_atomic, no NaN)
    io.write_json_atomic(d / "lm-rope-s0.json", {"view": [1.0, 2.0]}, allow_nan=False)
    return lambda: io.write_json_atomic(d / "lm-rope-s0.json", {"view": [3.0] * 100}, allow_nan=False), \
        d / "lm-rope-s0.json"


def _tensor_file(d: Path):  # a training run's resumable state (engine.train_state)
    def write(x: float) -> None:
        io.write_file_atomic(d / "state.safetensors", lambda tmp: io.save_file({"w": torch.full((64,), x)}, str(tmp)))

    write(1.0)
    return lambda: write(2.0), d / "state.safetensors"


def _merged_reference(d: Path):
    save_model(reference.build(tiny(), seed=0), d / "merged")
    return lambda: save_model(reference.build(tiny(), seed=1), d / "merged"), d / "merged"


def _merged_hf(d: Path):
    save_model(hf_gpt2.build(GPT2, seed=0), d / "merged")
    return lambda: save_model(hf_gpt2.build(GPT2, seed=1), d / "merged"), d / "merged"


WRITERS: dict[str, Callable] = {
    "--out record": _out_record, "store record": _store_record, "kept run": _history_run,
    "stopped run": _history_stopped, "note": _note, "store file": _store_file, "train state": _tensor_file,
    "merged model": _merged_reference, "merged HF model": _merged_hf,
}


def _refused(write: Callable, place: Path) -> str:
    """The one sentence a write ends in on a full disk: an OutputError naming `place`."""
    with pytest.raises(OutputError) as e:
        write()
    msg = str(e.value)
    assert "\n" not in msg
    assert re.fullmatch(rf"Could not write (into )?{re.escape(str(place))}\S* \({NO_SPACE}\)\.", msg), msg
    return msg


# ---------------------------------------------------------------------------------------------
# Fault injection: ENOSPC at each step of a write


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, NO_SPACE)


class _TornFile:
    """A file object whose write stores half of what it is given, then fails as a full disk does."""

    def __init__(self, f):
        self._f = f

    def write(self, s):
        self._f.write(s[: len(s) // 2])
        self._f.flush()
        _enospc()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _torn_safetensors(_tensors, filename, *_a, **_k):
    Path(filename).write_bytes(b"\x08\x00\x00\x00")  # a header length, then nothing: torn
    raise SafetensorError(f"Error while serializing: I/O error: {NO_SPACE} (os error {errno.ENOSPC})")


def _inject(monkeypatch, step: str) -> None:
    """Make `step` of every write fail with ENOSPC: creating the temporary file or directory, writing
    its content (JSON, safetensors, Hugging Face's save), flushing it to the device, moving it in place."""
    if step == "create":
        monkeypatch.setattr(io.tempfile, "mkstemp", _enospc)
        monkeypatch.setattr(io.tempfile, "mkdtemp", _enospc)
    elif step == "write":
        monkeypatch.setattr(io, "open", lambda *a, **k: _TornFile(open(*a, **k)), raising=False)  # noqa: SIM115
        monkeypatch.setattr(io, "save_file", _torn_safetensors)
        import transformers.modeling_utils

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _torn_safetensors)
    elif step == "fsync":
        monkeypatch.setattr(os, "fsync", _enospc)
    elif step == "move":
        for name in ("replace", "rename", "link"):
            monkeypatch.setattr(os, name, _enospc)
        monkeypatch.setattr(io, "_exchange", _enospc)


@pytest.mark.parametrize("step", ["create", "write", "fsync", "move"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_failing_at_any_step_is_one_sentence_and_changes_nothing(writer, step, tmp_path, monkeypatch):
    d = tmp_path / "place"
    d.mkdir()
    write, place = WRITERS[writer](d)
    before = snapshot(d)
    _inject(monkeypatch, step)
    _refused(write, place)
    monkeypatch.undo()
    assert snapshot(d) == before  # the earlier version whole, no temporary file left
    write()  # the same write on a disk with room succeeds
    assert snapshot(d) != before


def test_a_manifest_failing_after_its_record_keeps_the_earlier_manifest(tmp_path, monkeypatch):
    """A cache build writes the record, then the manifest; the disk fills in between."""
    store(record(0.1), tmp_path)
    manifest = (tmp_path / "manifest.json").read_bytes()
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the record's flush passes, the manifest's fails
            _enospc()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _refused(lambda: store(record(0.2), tmp_path), tmp_path / "manifest.json")
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm-rope-s0__lm-rope-s1__naive.json", "manifest.json"]
    assert load_record(tmp_path / "lm-rope-s0__lm-rope-s1__naive.json")["barrier"] == pytest.approx(0.2)


def test_out_and_save_merged_on_a_full_disk_exit_2_and_keep_the_earlier_files(tmp_path, monkeypatch, capsys):
    for s in (0, 1):
        save_model(reference.build(tiny(vocab_size=256), seed=s), tmp_path / f"m{s}")
    out = tmp_path / "out"
    out.mkdir()
    write_record(record(0.1), out / "r.json")
    save_model(reference.build(tiny(vocab_size=256), seed=2), out / "merged")
    before = snapshot(out)
    run = ["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--method", "naive", "--points", "2",
           "--eval-items", "64"]
    monkeypatch.setattr(io, "save_file", _torn_safetensors)
    capsys.readouterr()
    assert main([*run, "--save-merged", str(out / "merged")]) == 2
    assert capsys.readouterr().err == f"error: Could not write into {out / 'merged'} ({NO_SPACE}).\n"
    monkeypatch.setattr(os, "fsync", _enospc)
    assert main([*run, "--out", str(out / "r.json")]) == 2
    assert capsys.readouterr().err == f"error: Could not write {out / 'r.json'} ({NO_SPACE}).\n"
    assert snapshot(out) == before


# ---------------------------------------------------------------------------------------------
# A real full disk: a tmpfs of a few pages


@dataclass
class Disk:
    root: Path

    def fill(self) -> int:
        """Fill what is left of the file system with one file; its size in bytes."""
        fd = os.open(self.root / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        return (self.root / "filler").stat().st_size


@pytest.fixture
def disk(tmp_path) -> Disk:
    """A 1 MiB tmpfs mounted for the test (root, or a user allowed to mount); skipped where mounting is
    not permitted, the fault-injection tests above still checking every write path."""
    root = tmp_path / "disk"
    root.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here, so no small tmpfs to fill; the fault-injection tests check full "
                    "disks instead")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({r.stderr.strip() or r.returncode}); the "
                    "fault-injection tests check full disks instead")
    try:
        yield Disk(root)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_to_a_really_full_disk_is_one_sentence_and_changes_nothing(writer, disk):
    d = disk.root / "place"
    d.mkdir()
    write, place = WRITERS[writer](d)
    assert disk.fill() > 0
    before = snapshot(disk.root)
    _refused(write, place)
    assert snapshot(disk.root) == before
    (disk.root / "filler").unlink()
    write()  # room again: the same write succeeds
    assert snapshot(d) != before


# ---------------------------------------------------------------------------------------------
# Temporary files of killed writes


_KILLED_WRITE = """
import os, sys, time
from pathlib import Path
from engine.models import io
def write(tmp):
    tmp.write_text('{"partial": ')
    if sys.argv[2] == "hang":
        print("writing", flush=True)
        time.sleep(600)
    os._exit(9)
io.write_file_atomic(Path(sys.argv[1]), write)
"""


def _killed_write(target: Path) -> None:
    """Leave a temporary file beside `target` as a writer killed mid-write does."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(target), "die"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]


NEEDS_FLOCK = pytest.mark.skipif(importlib.util.find_spec("fcntl") is None,
                                 reason="without flock a temporary file cannot be told from a live write's")


def _temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if io.STALE.fullmatch(p.name))


@NEEDS_FLOCK
def test_the_next_write_removes_a_killed_writes_temporary_file_and_nothing_else(tmp_path):
    target = tmp_path / "r.json"
    write_record(record(0.1), target)
    _killed_write(target)
    assert len(_temps(tmp_path)) == 1
    user = {".r.json.tmp": "mine", ".r.json.lmc-notes": "mine", ".r.json.lmc-abcdefgh.txt": "mine",
            "r.json.lmc-abcdefgh.tmp": "mine"}
    for name, text in user.items():
        (tmp_path / name).write_text(text)
    (tmp_path / ".r.json.lmc-zzzzzzzz.tmp").symlink_to(tmp_path / ".r.json.tmp")  # a link: never the tool's
    assert load_record(target)["barrier"] == pytest.approx(0.1)  # the killed writes left it whole
    write_record(record(0.2), target)
    assert _temps(tmp_path) == [".r.json.lmc-zzzzzzzz.tmp"]
    assert {n: (tmp_path / n).read_text() for n in user} == user
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*user, ".r.json.lmc-zzzzzzzz.tmp", "r.json"])
    assert load_record(target)["barrier"] == pytest.approx(0.2)


@NEEDS_FLOCK
def test_a_write_in_progress_keeps_its_temporary_file(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITE, str(tmp_path / "r.json"), "hang"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
        live = _temps(tmp_path)
        assert len(live) == 1
        write_record(record(0.1), tmp_path / "r.json")  # the other writer still runs: its file stays
        assert _temps(tmp_path) == live
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    write_record(record(0.2), tmp_path / "r.json")  # now it is dead: its file goes
    assert _temps(tmp_path) == []


@NEEDS_FLOCK
@pytest.mark.parametrize("kind", ["file", "model directory"])
def test_a_cleaner_removing_a_new_temporary_before_it_is_locked_costs_a_retry(kind, tmp_path, monkeypatch):
    """Another writer into the directory cleans it between the creation of this write's temporary file
    and its lock (the worst moment): the write makes a new one and succeeds."""
    cleaned = []

    def racing(real):
        def make(*a, **k):
            made = real(*a, **k)
            if not cleaned:
                cleaned.extend(io.remove_stale(tmp_path))
            return made
        return make

    monkeypatch.setattr(io.tempfile, "mkstemp", racing(io.tempfile.mkstemp))
    monkeypatch.setattr(io.tempfile, "mkdtemp", racing(io.tempfile.mkdtemp))
    if kind == "file":
        write_record(record(0.1), tmp_path / "r.json")
        assert load_record(tmp_path / "r.json")["barrier"] == pytest.approx(0.1)
    else:
        save_model(reference.build(tiny(), seed=0), tmp_path / "merged")
        load_model(tmp_path / "merged")
    assert len(cleaned) == 1 and io.STALE.fullmatch(cleaned[0])
    assert _temps(tmp_path) == []


@NEEDS_FLOCK
def test_a_killed_save_to_the_history_is_cleaned_by_the_next_save(tmp_path):
    """Every kept run has a new file name, so the history's leftovers go with the next save into it."""
    _killed_write(tmp_path / "run-20260101T000000Z-aaaaaa.json")
    assert len(_temps(tmp_path)) == 1
    history.save_run(record(0.1), root=tmp_path)
    assert _temps(tmp_path) == []
    assert [e["barrier"] for e in history.list_runs(tmp_path)] == [pytest.approx(0.1)]


# ---------------------------------------------------------------------------------------------
# Two savers that draw one run id


def _ids(*ids: str) -> Callable:
    """new_run_id drawing `ids` in turn, then failing (a loop that keeps drawing is a bug)."""
    it = iter(ids)
    lock = threading.Lock()

    def draw(now=None):
        with lock:
            return next(it)

    return draw


X, Y = "20260101T000000Z-aaaaaa", "20260101T000000Z-bbbbbb"


@pytest.mark.parametrize("links", [True, False], ids=["hard link", "no hard links"])
def test_two_savers_drawing_one_id_never_overwrite_each_other(links, tmp_path, monkeypatch):
    """Both check that the id is free before either writes (a barrier holds them there): the claim of the
    name is atomic, so one keeps the id and the other draws a new one."""
    if not links:  # a file system without hard links (FAT, some network shares)
        monkeypatch.setattr(os, "link", lambda *a, **k: _raise(errno.EPERM))
    monkeypatch.setattr(history, "new_run_id", _ids(X, X, Y))
    barrier, real, waited = threading.Barrier(2), history.run_problem, set()

    def checked_together(entry, name):
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait(timeout=120)
        return real(entry, name)

    monkeypatch.setattr(history, "run_problem", checked_together)
    kept, errors, records = {}, [], {b: record(b) for b in (0.1, 0.2)}

    def save(b: float) -> None:
        try:
            kept[b] = history.save_run(records[b], root=tmp_path)["run"]["id"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=save, args=(b,)) for b in records]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert errors == []
    assert sorted(kept.values()) == [X, Y]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"run-{X}.json", f"run-{Y}.json"]
    for b, run_id in kept.items():
        entry = json.loads((tmp_path / f"run-{run_id}.json").read_text())
        assert entry["run"]["id"] == run_id and entry["barrier"] == pytest.approx(b)


def _raise(code: int):
    raise OSError(code, os.strerror(code))


def test_a_history_whose_ids_are_all_taken_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "new_run_id", _ids(X))
    history.save_run(record(0.1), root=tmp_path)
    first = (tmp_path / f"run-{X}.json").read_bytes()
    monkeypatch.setattr(history, "new_run_id", _ids(*[X] * (history.ID_DRAWS + 5)))
    with pytest.raises(OutputError, match=rf"^Could not keep the run in the run history {re.escape(str(tmp_path))}: "
                                          rf"{history.ID_DRAWS} run ids drawn in a row were taken already\.$"):
        history.save_run(record(0.2), root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"run-{X}.json"]
    assert (tmp_path / f"run-{X}.json").read_bytes() == first


# ---------------------------------------------------------------------------------------------
# The saved model is whole after a failed save and a good one


def test_a_merged_save_after_a_full_disk_gives_the_new_model(tmp_path, monkeypatch):
    out = tmp_path / "merged"
    a, b = reference.build(tiny(), seed=0), reference.build(tiny(), seed=1)
    save_model(a, out)
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OutputError):
        save_model(b, out)
    x = torch.randint(0, 40, (1, 8))
    assert torch.equal(model_logits(load_model(out), x), model_logits(a, x))
    monkeypatch.undo()
    save_model(b, out)
    assert torch.equal(model_logits(load_model(out), x), model_logits(b, x))
    assert load_file(str(out / "model.safetensors")).keys() == b.module.state_dict().keys()
    assert not list(tmp_path.glob(".merged.lmc-*"))
    assert list_cached(tmp_path / "store") == []
