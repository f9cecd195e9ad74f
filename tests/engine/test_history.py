"""The run history (engine.history) and `python -m engine runs`: live runs kept in a user store.

Records come from real engine runs on tiny reference models (one LM pair, one ViT pair); every test
points the history at its own directory through LMC_EXPLORER_HOME.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from ref_models import tiny

from engine import history
from engine.api import run_pair
from engine.cli import main
from engine.errors import LMCError, OutputError
from engine.models import reference, save_model
from engine.results import CACHE, RunConfig, StoreWarning, load_record, record_problem


@pytest.fixture(scope="module")
def recs(tmp_path_factory) -> SimpleNamespace:
    """A naive LM record, a weight-matching LM record of the same pair, and a naive ViT record."""
    root = tmp_path_factory.mktemp("models")
    for name, cfg in (("lm", tiny(vocab_size=256)), ("vit", tiny("vit", n_ctx=32))):
        for s in (0, 1):
            save_model(reference.build(cfg, seed=s), root / f"{name}{s}")

    def run(task: str, method: str) -> dict:
        return run_pair(RunConfig(str(root / f"{task}0"), str(root / f"{task}1"), method, eval_items=64, points=5))

    return SimpleNamespace(lm=run("lm", "naive"), lm_weight=run("lm", "weight"), vit=run("vit", "naive"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LMC_CACHE_DIR", raising=False)
    return tmp_path / "home" / "runs"


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ---------------------------------------------------------------------------------------------
# Where the history lives


def test_the_store_is_the_users_own(monkeypatch, tmp_path):
    monkeypatch.delenv("LMC_EXPLORER_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(history.sys, "platform", "linux")
    assert history.runs_dir() == tmp_path / "data" / "lmc-explorer" / "runs"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # the XDG spec says: ignore a relative path
    assert history.runs_dir() == Path.home() / ".local" / "share" / "lmc-explorer" / "runs"
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path / "elsewhere"))
    assert history.runs_dir() == tmp_path / "elsewhere" / "runs"


def test_the_shipped_store_and_files_are_refused(recs, home, monkeypatch, tmp_path):
    with pytest.raises(OutputError, match="lies in the result store .*shipped records"):
        history.save_run(recs.lm, root=CACHE / "runs")
    store = tmp_path / "my_store"
    monkeypatch.setenv("LMC_CACHE_DIR", str(store))
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(store.parent / "my_store"))  # runs/ would sit in the store in use
    with pytest.raises(OutputError, match="lies in the result store"):
        history.list_runs()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OutputError, match=f"Run history {a_file} is not a directory"):
        history.list_runs(a_file)
    assert not (CACHE / "runs").exists()


# ---------------------------------------------------------------------------------------------
# Save, list, load, delete


def test_a_saved_run_reads_back_as_the_same_record(recs, home):
    entry = history.save_run(recs.lm)
    run_id = entry["run"]["id"]
    assert history.RUN_ID.fullmatch(run_id) and entry["run"]["status"] == "done"
    assert files(home) == [f"run-{run_id}.json"]
    on_disk = load_record(home / f"run-{run_id}.json")  # the same record format as cached_results/
    assert record_problem(on_disk) is None
    assert {k: v for k, v in on_disk.items() if k != "run"} == json.loads(json.dumps(recs.lm))
    assert history.load_run(run_id) == on_disk
    assert history.list_runs() == [on_disk]
    row = history.summary(on_disk)
    assert (row["id"], row["method"], row["task"], row["pe"], row["barrier"], row["eval_items"]) == \
        (run_id, "naive", "lm", recs.lm["arch"]["pe"], recs.lm["barrier"], recs.lm["eval_tokens"])
    assert row["created"] == recs.lm["created"]


def test_runs_list_newest_first_with_their_status(recs, home):
    ids = [history.save_run(r, status=s)["run"]["id"]
           for r, s in ((recs.lm, "done"), (recs.vit, "stopped"), (recs.lm_weight, "done"))]
    assert len(set(ids)) == 3
    listed = history.list_runs()
    assert [e["run"]["id"] for e in listed] == ids[::-1]  # newest first, also within one second
    assert {e["run"]["id"]: e["run"]["status"] for e in listed} == dict(zip(ids, ("done", "stopped", "done")))


def test_bad_saves_are_refused_and_write_nothing(recs, home):
    with pytest.raises(LMCError, match="status must be one of done, stopped, failed, not 'finished'"):
        history.save_run(recs.lm, status="finished")
    broken = {k: v for k, v in recs.lm.items() if k != "loss"}
    with pytest.raises(LMCError, match=r"Cannot keep a broken record in the run history: .*missing loss"):
        history.save_run(broken)
    assert files(home) == []


def test_delete_removes_only_the_run_it_names(recs, home):
    keep, gone = (history.save_run(r)["run"]["id"] for r in (recs.lm, recs.vit))
    assert history.delete_run(gone) == home / f"run-{gone}.json"
    assert files(home) == [f"run-{keep}.json"]
    with pytest.raises(LMCError, match=f"There is no run {gone} in the run history"):
        history.delete_run(gone)
    with pytest.raises(LMCError, match="'../x' is not a run id"):
        history.delete_run("../x")


def test_files_the_tool_did_not_write_are_skipped_and_never_deleted(recs, home):
    good = history.save_run(recs.lm)["run"]["id"]
    other = history.new_run_id()
    (home / f"run-{other}.json").write_text("{not json")  # corrupt, under a run's name
    (home / "notes.json").write_text(json.dumps(recs.lm))  # foreign name
    renamed = history.new_run_id()
    while renamed == other:
        renamed = history.new_run_id()
    entry = history.load_run(good)
    (home / f"run-{renamed}.json").write_text(json.dumps(entry))  # a copy under another run's name
    plain = history.new_run_id()
    while plain in (other, renamed):
        plain = history.new_run_id()
    (home / f"run-{plain}.json").write_text(json.dumps(recs.lm))  # a record, but not a kept run
    (home / ".run-x.json.tmp").write_text("")  # a write in progress: not looked at
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = history.list_runs()
    assert [e["run"]["id"] for e in runs] == [good]
    said = sorted(str(w.message) for w in caught if w.category is StoreWarning)
    assert len(said) == 4
    assert any(str(home / "notes.json") in s and "is not a run file of this tool" in s for s in said)
    assert any(f"run-{other}.json" in s and "is not valid JSON" in s for s in said)
    assert any(f"run-{renamed}.json holds run {good}, not the run its name says" in s for s in said)
    assert any(f"run-{plain}.json" in s and 'no "run" object' in s for s in said)
    before = files(home)
    for run_id in (other, renamed, plain):
        with pytest.raises(OutputError, match="deletes only runs it wrote, so the file was left alone"):
            history.delete_run(run_id)
    link = history.new_run_id()
    os.symlink(home / f"run-{good}.json", home / f"run-{link}.json")
    with pytest.raises(OutputError, match="is a symbolic link, not a file the tool wrote"):
        history.delete_run(link)
    assert files(home) == sorted([*before, f"run-{link}.json"])


def test_an_oversized_run_file_or_manifest_is_refused_by_its_size_before_it_is_read(recs, home, tmp_path):
    from engine.builders import plane_record
    from engine.results import MAX_RECORD_BYTES, list_cached

    good = history.save_run(recs.lm)["run"]["id"]
    big = history.new_run_id()
    while big == good:
        big = history.new_run_id()
    with open(home / f"run-{big}.json", "wb") as fh:  # sparse: past the limit, no disk used, never read
        fh.truncate(MAX_RECORD_BYTES + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [e["run"]["id"] for e in history.list_runs()] == [good]
    (said,) = [str(w.message) for w in caught if w.category is StoreWarning]
    assert f"run-{big}.json is {MAX_RECORD_BYTES + 1:,} bytes, too large for a kept run" in said
    store = tmp_path / "store"
    (store / "plane").mkdir(parents=True)
    with open(store / "manifest.json", "wb") as fh:
        fh.truncate(2**30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list_cached(store) == []  # rebuilt from the records present: none
    assert any("too large for a store manifest" in str(w.message) for w in caught)
    with open(store / "plane" / "a__b__weight.json", "wb") as fh:
        fh.truncate(MAX_RECORD_BYTES + 1)
    with pytest.raises(LMCError, match="too large for a loss plane"):
        plane_record("a", "b", root=store)


# ---------------------------------------------------------------------------------------------
# Comparing


def test_compare_reads_barriers_against_the_first(recs, home):
    a, b = history.save_run(recs.lm), history.save_run(recs.lm_weight)
    rows = history.compare([a, b])
    assert [r["id"] for r in rows] == [a["run"]["id"], b["run"]["id"]]
    assert rows[0]["barrier_vs_first"] == 0
    assert rows[1]["barrier_vs_first"] == pytest.approx(recs.lm_weight["barrier"] - recs.lm["barrier"], rel=1e-12)
    assert (rows[1]["endpoint_loss_a"], rows[1]["endpoint_loss_b"]) == \
        (recs.lm_weight["endpoint_loss_a"], recs.lm_weight["endpoint_loss_b"])
    v = history.save_run(recs.vit)
    with pytest.raises(LMCError, match=f"Runs {a['run']['id']} and {v['run']['id']} cannot share a chart: one "
                                       "measures loss per byte, the other per image"):
        history.compare([a, v])
    with pytest.raises(LMCError, match="Pick at least one run"):
        history.compare([])


# ---------------------------------------------------------------------------------------------
# The CLI


def test_cli_lists_shows_and_deletes(recs, home, capsys):
    assert main(["runs", "list"]) == 0
    assert capsys.readouterr().out.startswith(f"no runs kept in {home}")
    a, b = (history.save_run(r)["run"]["id"] for r in (recs.lm, recs.lm_weight))
    assert main(["runs", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(b) and out[2].startswith(a)  # newest first
    assert f"{recs.lm['barrier']:8.4f}" in out[2] and "naive" in out[2]
    assert out[-1] == f"2 run(s) in {home}"
    assert main(["runs", "show", a]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {a}: done, created {recs.lm['created']}")
    assert f"barrier {recs.lm['barrier']:.4f}" in out
    assert main(["runs", "show", a, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == history.load_run(a)
    nan = history.save_run(recs.lm | {"loss": [recs.lm["loss"][0], float("nan"), *recs.lm["loss"][2:]]})["run"]["id"]
    assert main(["runs", "show", nan, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert shown["loss"][1] is None and shown["loss"][0] == recs.lm["loss"][0]
    assert main(["runs", "delete", nan]) == 0
    capsys.readouterr()
    assert main(["runs", "delete", b, b]) == 0
    assert capsys.readouterr().out == f"deleted run {b} ({home / f'run-{b}.json'})\n"
    assert files(home) == [f"run-{a}.json"]


@pytest.mark.parametrize("argv, says", [
    (["runs", "show"], "`runs show` takes one run id, not 0."),
    (["runs", "list", "x"], "`runs list` lists every run; `runs show ID` shows one."),
    (["runs", "delete"], "`runs delete` needs the ids of the runs to delete"),
    (["runs", "list", "--json"], "--json applies to `runs show`."),
    (["runs", "show", "20990101T000000Z-abcdef"], "There is no run 20990101T000000Z-abcdef in the run history"),
    (["runs", "show", "latest"], "'latest' is not a run id"),
])
def test_cli_refusals_are_one_line(argv, says, home, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1


def test_cli_list_warns_of_each_file_it_skips(recs, home, capsys):
    good = history.save_run(recs.lm)["run"]["id"]
    (home / "notes.json").write_text("{}")
    assert main(["runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert err == f"warning: skipped a file of the run history: {home / 'notes.json'} is not a run file of this " \
                  "tool (its name is not run-<id>.json).\n"
    assert out.splitlines()[1].startswith(good)


def test_cli_delete_checks_every_run_before_deleting_any(recs, home, capsys):
    good = history.save_run(recs.lm)["run"]["id"]
    bad = history.new_run_id()
    (home / f"run-{bad}.json").write_text("[]")
    assert main(["runs", "delete", good, bad]) == 2
    assert "left alone" in capsys.readouterr().err
    assert files(home) == sorted([f"run-{good}.json", f"run-{bad}.json"])


# ---------------------------------------------------------------------------------------------
# Stopped and failed runs, durations, notes


def stopped_run(recs, partial=None, phase="interpolate", status="stopped", message="The run was stopped on request "
                "during interpolation, point 3/5."):
    cfg = RunConfig(recs.lm["model_a"], recs.lm["model_b"], "weight", eval_items=64, points=5).to_dict()
    return history.save_unfinished(cfg, status, phase, message, {"load": 0.25, "measure B": 1.5, "align": 2.0},
                                   9.87654, partial, arch=recs.lm["arch"])


def test_a_stopped_run_is_kept_with_what_it_reached(recs, home, capsys):
    entry = stopped_run(recs, {"lambdas": [0.0, 0.25], "loss": [5.5, float("nan")]})
    run_id = entry["run"]["id"]
    on_disk = json.loads((home / f"run-{run_id}.json").read_text())
    assert on_disk["run"] | {"saved": None} == {"id": run_id, "status": "stopped", "saved": None, "seconds": 9.877,
                                                "phase": "interpolate",
                                                "message": "The run was stopped on request during interpolation, "
                                                           "point 3/5."}
    assert (on_disk["method"], on_disk["model_a"], on_disk["config"]["points"]) == ("weight", recs.lm["model_a"], 5)
    assert on_disk["timings"] == {"load": 0.25, "measure B": 1.5, "align": 2.0} and on_disk["arch"] == recs.lm["arch"]
    assert on_disk["partial"]["lambdas"] == [0.0, 0.25] and on_disk["partial"]["loss"][0] == 5.5
    (listed,) = history.list_runs()
    assert listed["run"]["id"] == run_id and not history.finished(listed)
    row = history.summary(listed)
    assert (row["status"], row["barrier"], row["midpoint_barrier"], row["seconds"], row["phase"], row["eval_items"],
            row["task"]) == ("stopped", None, None, 9.877, "interpolate", 64, recs.lm["arch"]["task"])
    failed = stopped_run(recs, phase=None, status="failed", message="The evaluation set is empty.")
    assert "partial" not in failed and failed["run"]["phase"] is None
    assert history.load_run(failed["run"]["id"])["run"]["message"] == "The evaluation set is empty."
    with pytest.raises(LMCError, match=f"Run {run_id} stopped before its path was measured, so it has no barrier"):
        history.compare([history.save_run(recs.lm), listed])
    capsys.readouterr()
    assert main(["runs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(run_id) and " stopped " in line and " -        - " in line for line in lines)


def test_a_done_run_keeps_its_wall_time(recs, home):
    entry = history.save_run(recs.lm, seconds=42.123456)
    assert entry["run"]["seconds"] == 42.123 and history.summary(history.load_run(entry["run"]["id"]))["seconds"] == 42.123
    assert "seconds" not in history.save_run(recs.lm)["run"]  # unknown: not written


def test_unfinished_runs_are_checked_before_they_are_written(recs, home):
    with pytest.raises(LMCError, match="Only a stopped or failed run is kept without a record, not a 'done' one"):
        stopped_run(recs, status="done")
    with pytest.raises(LMCError, match="partial must hold lambdas and loss, one number each per point measured"):
        stopped_run(recs, {"lambdas": [0.0, 0.5], "loss": [1.0]})
    with pytest.raises(LMCError, match="run.phase must be one of load, measure B, align, interpolate, attribution"):
        stopped_run(recs, phase="walking")
    assert files(home) == []
    good = stopped_run(recs)
    f = home / f"run-{good['run']['id']}.json"
    for broken in ({**good, "config": "x"}, {**good, "run": {**good["run"], "seconds": -1}},
                   {**good, "run": {**good["run"], "note": 5}}, {**good, "arch": "x"},
                   {**good, "timings": {"align": 10**400}}, {**good, "config": {**good["config"], "points": 10**400}}):
        f.write_text(json.dumps(broken))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert history.list_runs() == []
        assert len(caught) == 1 and str(f) in str(caught[0].message)


def test_a_note_is_written_into_the_run_and_only_into_a_run_the_tool_wrote(recs, home):
    done, stopped = history.save_run(recs.lm), stopped_run(recs)
    for entry in (done, stopped):
        run_id = entry["run"]["id"]
        before = history.load_run(run_id)
        noted = history.set_note(run_id, "  baseline for the talk \n")
        assert noted["run"]["note"] == "baseline for the talk"
        after = history.load_run(run_id)
        assert after == noted and {k: v for k, v in after.items() if k != "run"} == \
            {k: v for k, v in before.items() if k != "run"}
        assert history.summary(after)["note"] == "baseline for the talk"
        assert "note" not in history.set_note(run_id, "")["run"]  # an empty note removes it
    assert sorted(p.name for p in home.iterdir()) == sorted(f"run-{e['run']['id']}.json" for e in (done, stopped))
    with pytest.raises(LMCError, match="A run's note is text of at most 2,000 characters"):
        history.set_note(done["run"]["id"], "x" * 2001)
    foreign = history.new_run_id()
    (home / f"run-{foreign}.json").write_text(json.dumps(recs.lm))  # a record, not a kept run
    with pytest.raises(OutputError, match="deletes only runs it wrote, so the file was left alone"):
        history.set_note(foreign, "mine")
    assert json.loads((home / f"run-{foreign}.json").read_text()) == json.loads(json.dumps(recs.lm))


def test_cli_shows_where_a_stopped_run_ended(recs, home, capsys):
    run_id = stopped_run(recs)["run"]["id"]
    assert main(["runs", "show", run_id]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run {run_id}: stopped, created -, kept ")
    assert out[1] == (f"weight: {recs.lm['model_a']} / {recs.lm['model_b']}; stopped during interpolate: The run was "
                      "stopped on request during interpolation, point 3/5.")


def test_a_run_keeps_its_element_under_an_id_drawn_before_it(recs, home, capsys, tmp_path):
    cfg = RunConfig(recs.lm["model_a"], recs.lm["model_b"], "learned", steps=2, eval_items=64, points=3)
    run_id = history.new_run_id()
    element = history.element_path(run_id)
    rec = run_pair(cfg, save_element=element, attribution=False, train_curve=False)
    kept = history.save_run(rec, run_id=run_id)
    assert kept["run"]["id"] == run_id and history.run_element(kept) == element
    runs, skipped = history.scan_runs()
    assert [r["run"]["id"] for r in runs] == [run_id] and skipped == []  # the element is its run's, not foreign
    with pytest.raises(OutputError, match=f"its id {run_id} is taken already"):
        history.save_run(rec, run_id=run_id)
    assert main(["runs", "show", run_id]) == 0
    assert f"element kept: {element} (`align " in capsys.readouterr().out
    other = history.save_run(recs.lm)  # a run without an element: none is named, none deleted
    assert history.run_element(other) is None
    assert main(["runs", "delete", run_id]) == 0
    assert not element.exists() and [r["run"]["id"] for r in history.list_runs()] == [other["run"]["id"]]
