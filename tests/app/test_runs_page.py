"""The Runs page under AppTest: the run history (engine.history) listed, filtered, compared, reopened,
noted and deleted; a live run of Connectivity is kept there, finished, stopped or failed. Records are real engine runs on the
tiny stand-in zoo (tiny_zoo.py); each test has its own history (LMC_EXPLORER_HOME)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from plotly_json import chart, curves
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS, UNCACHED_PAIR

from app import live_run
from app.sidebar import methods, pair_label
from engine import history
from engine.errors import DataError, OutputError
from engine.progress import Update
from engine.results import RunConfig, cached_record

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
RUNS = "app_pages/runs.py"
TIMEOUT = 60


@pytest.fixture
def home(tiny_env, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "runs"


@pytest.fixture
def kept(home, tiny_env) -> dict[str, dict]:
    """Three kept runs, saved in this order: LM naive, LM weight matching, ViT naive."""
    _, store = tiny_env
    recs = {"lm_naive": cached_record(*CACHED_PAIRS[0], "naive", store),
            "lm_weight": cached_record(*CACHED_PAIRS[0], "weight", store),
            "vit_naive": cached_record(*CACHED_PAIRS[1], "naive", store)}
    return {k: history.save_run(r) for k, r in recs.items()}


def runs_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page(RUNS).run()
    assert not at.exception
    assert at.title[0].value == "Runs"
    return at


def table_ids(at: AppTest) -> list[str]:
    return list(at.dataframe[0].value["id"])


def label(at: AppTest, run_id: str) -> str:
    """How the page names a run: its entry in the compare picker (whose options follow the table)."""
    return at.multiselect(key="runs_compare").options[table_ids(at).index(run_id)]


def test_an_empty_history_says_where_runs_will_appear(home):
    at = runs_page()
    assert at.info[0].value.startswith("No runs kept yet")
    assert str(home) in at.caption[0].value


def test_the_table_lists_every_run_newest_first_and_filters_narrow_it(kept):
    at = runs_page()
    ids = [kept[k]["run"]["id"] for k in ("vit_naive", "lm_weight", "lm_naive")]
    assert table_ids(at) == ids
    table = at.dataframe[0].value
    assert list(table["barrier"]) == [f"{kept[k]['barrier']:.4f}" for k in ("vit_naive", "lm_weight", "lm_naive")]
    assert list(table["status"]) == ["done"] * 3
    assert list(table["duration"]) == ["-"] * 3  # saved without their wall time
    names = methods()
    at.multiselect(key="runs_filter_method").select(names["naive"]).run()
    assert table_ids(at) == [ids[0], ids[2]]
    at.multiselect(key="runs_filter_pair").select(pair_label(*CACHED_PAIRS[0])).run()
    assert table_ids(at) == [ids[2]]
    assert any(c.value == "1 of 3 run(s)." for c in at.caption)


def test_comparing_runs_draws_each_curve_under_its_own_name(kept):
    at = runs_page()
    a, b = kept["lm_naive"], kept["lm_weight"]
    at.multiselect(key="runs_compare").select(a["run"]["id"]).select(b["run"]["id"]).run()
    assert not at.exception
    fig = chart(at, "runs_compare_chart")
    la, lb = label(at, a["run"]["id"]), label(at, b["run"]["id"])
    assert la.startswith(methods()["naive"] + " · ") and lb.startswith(methods()["weight"] + " · ")
    assert curves(fig) == {la: pytest.approx(a["loss"], abs=0), lb: pytest.approx(b["loss"], abs=0)}
    rows = at.dataframe[1].value
    assert list(rows["vs first"]) == pytest.approx([0, b["barrier"] - a["barrier"]], rel=1e-12, abs=1e-15)
    at.multiselect(key="runs_compare").select(kept["vit_naive"]["run"]["id"]).run()  # per image vs per byte
    assert at.error[0].value.endswith("one measures loss per byte, the other per image.")
    assert not any(c.key == "runs_compare_chart" for c in at.get("plotly_chart"))


def test_two_runs_of_one_method_stay_apart(kept, tiny_env):
    again = history.save_run({k: v for k, v in kept["lm_naive"].items() if k != "run"})
    at = runs_page()
    at.multiselect(key="runs_compare").select(kept["lm_naive"]["run"]["id"]).select(again["run"]["id"]).run()
    data = [t for t in chart(at, "runs_compare_chart")["data"]
            if t.get("showlegend", True) and t.get("legendgroup") != "key"]  # not the chord / barrier key
    assert len({t["name"] for t in data}) == 2
    assert len({t["line"]["color"] for t in data}) == 2  # same method, two colours


def test_opening_a_run_shows_its_curve_and_numbers(kept):
    at = runs_page()
    rec = kept["vit_naive"]
    assert at.selectbox(key="runs_open").value == rec["run"]["id"]  # the newest
    assert [m.value for m in at.metric if m.label == "Barrier"] == [f"{rec['barrier']:.4f}"]
    assert curves(chart(at, "runs_open_chart"))[methods()["naive"]] == pytest.approx(rec["loss"], abs=0)
    acc = curves(chart(at, "runs_open_accuracy"))[methods()["naive"]]
    assert acc == pytest.approx([100 * x for x in rec["accuracy"]])


def test_delete_asks_first_and_removes_only_that_run(kept, home):
    at = runs_page()
    gone = kept["lm_weight"]["run"]["id"]
    at.selectbox(key="runs_open").select(gone).run()
    at.button(key="runs_delete").click().run()
    assert at.warning[0].value.startswith("Delete run ") and str(history.run_file(gone)) in at.warning[0].value
    at.button(key="runs_delete_no").click().run()
    assert history.run_file(gone).exists() and "runs_delete" in [b.key for b in at.button]
    at.button(key="runs_delete").click().run()
    at.button(key="runs_delete_yes").click().run()
    assert not at.exception
    assert not history.run_file(gone).exists()
    assert at.success[0].value.startswith("Deleted run ")
    assert sorted(table_ids(at)) == sorted(kept[k]["run"]["id"] for k in ("lm_naive", "vit_naive"))
    assert sorted(p.name for p in home.iterdir()) == sorted(
        f"run-{kept[k]['run']['id']}.json" for k in ("lm_naive", "vit_naive"))


def test_a_corrupt_file_is_named_and_the_others_still_show(kept, home):
    bad = home / f"run-{history.new_run_id()}.json"
    bad.write_text("{oops")
    (home / "notes.txt").write_text("mine")
    at = runs_page()
    said = [w.value for w in at.warning]
    assert any(str(bad) in w and "is not valid JSON" in w for w in said)
    assert any(str(home / "notes.txt") in w and "is not a run file of this tool" in w for w in said)
    assert len(table_ids(at)) == 3
    assert (home / "notes.txt").read_text() == "mine" and bad.read_text() == "{oops"


def test_open_on_connectivity_draws_the_run_beside_the_cached_curves(kept):
    at = runs_page()
    rec = kept["lm_weight"]
    at.selectbox(key="runs_open").select(rec["run"]["id"]).run()
    at.button(key="runs_to_connectivity").click().run()
    assert not at.exception
    assert at.title[0].value == "Connectivity"
    assert at.selectbox(key="pair").value == f"{rec['model_a']}__{rec['model_b']}"
    assert at.selectbox(key="method").value == "weight"
    got = curves(chart(at, "barrier_chart"))
    live = [n for n in got if n != methods()["weight"] and n.startswith(methods()["weight"])]
    assert len(live) == 1 and got[live[0]] == pytest.approx(rec["loss"], abs=0)


def test_a_live_run_finished_on_connectivity_is_kept(home):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.selectbox(key="pair").select(f"{UNCACHED_PAIR[0]}__{UNCACHED_PAIR[1]}").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    at.button(key="run").click().run()
    assert at.session_state["live_run"].join(TIMEOUT)
    at.run()
    record = at.session_state["live_runs"][UNCACHED_PAIR]["naive"]
    kept = history.list_runs()
    assert len(kept) == 1 and kept[0]["run"]["status"] == "done"
    assert {k: v for k, v in kept[0].items() if k != "run"} == json.loads(json.dumps(record))
    at.switch_page(RUNS).run()
    assert table_ids(at) == [kept[0]["run"]["id"]]


# ---------------------------------------------------------------------------------------------
# Stopped and failed runs, durations, notes


def unfinished(status: str, partial: dict | None, message: str, phase: str | None = "interpolate") -> dict:
    a, b = CACHED_PAIRS[0]
    cfg = RunConfig(a, b, "weight", eval_items=1024, points=5).to_dict()
    return history.save_unfinished(cfg, status, phase, message, {"load": 0.2, "measure B": 1.5, "align": 3.0},
                                   12.4, partial)


def test_stopped_and_failed_runs_are_listed_with_status_and_duration_and_no_none(kept, tiny_env):
    timed = history.save_run({k: v for k, v in kept["lm_naive"].items() if k != "run"}, seconds=75.2)
    stopped = unfinished("stopped", {"lambdas": [0.0, 0.25], "loss": [1.5, 1.75]},
                         "The run was stopped on request during interpolation, point 3/5.")
    failed = unfinished("failed", None, "The run failed unexpectedly (MemoryError: ).", phase=None)
    at = runs_page()
    table = at.dataframe[0].value
    assert table_ids(at)[:3] == [failed["run"]["id"], stopped["run"]["id"], timed["run"]["id"]]
    assert list(table["status"])[:3] == ["failed", "stopped", "done"]
    assert list(table["duration"])[:3] == ["12 s", "12 s", "1 min 15 s"]
    assert list(table["barrier"])[:3] == ["-", "-", f"{timed['barrier']:.4f}"]
    assert list(table["evaluated on"])[:3] == ["1,024", "1,024", f"{timed['eval_tokens']:,}"]
    cells = [v for col in table.columns for v in table[col]]
    assert not table.isna().any().any() and "None" not in map(str, cells) and all(isinstance(v, str) for v in cells)
    assert set(at.multiselect(key="runs_filter_status").options) == {"done", "stopped", "failed"}
    assert stopped["run"]["id"] not in at.multiselect(key="runs_compare").options  # no curve to compare


def test_opening_a_stopped_run_shows_where_it_ended_and_the_points_it_measured(home, tiny_env):
    stopped = unfinished("stopped", {"lambdas": [0.0, 0.25], "loss": [1.5, 1.75]},
                         "The run was stopped on request during interpolation, point 3/5.")
    at = runs_page()
    assert at.selectbox(key="runs_open").value == stopped["run"]["id"]
    assert at.warning[0].value == ("Stopped after 12 s, in: walking the path. The run was stopped on request during "
                                   "interpolation, point 3/5.")
    fig = chart(at, "runs_open_partial")
    assert (fig["data"][0]["x"], fig["data"][0]["y"]) == ([0.0, 0.25], [1.5, 1.75])
    timings = at.dataframe[1].value
    assert list(timings["phase"]) == ["Loading the models", "Measuring B before it moves", "Aligning B onto A"]
    assert "runs_to_connectivity" not in [b.key for b in at.button]  # no record to draw there
    at.button(key="runs_delete").click().run()
    at.button(key="runs_delete_yes").click().run()
    assert not history.run_file(stopped["run"]["id"]).exists()


def test_a_note_is_saved_into_the_run_file(kept, home):
    at = runs_page()
    run_id = kept["vit_naive"]["run"]["id"]
    at.text_area(key=f"runs_note_{run_id}").input("Seed pair for the talk").run()
    at.button(key="runs_note_save").click().run()
    assert not at.exception and at.success[0].value == "Note saved."
    on_disk = json.loads(history.run_file(run_id).read_text())
    assert on_disk["run"]["note"] == "Seed pair for the talk"
    assert {k: v for k, v in on_disk.items() if k != "run"} == {k: v for k, v in kept["vit_naive"].items() if k != "run"}
    assert list(at.dataframe[0].value["note"]) == ["Seed pair for the talk", "-", "-"]
    again = runs_page()  # a new session reads it back
    assert again.text_area(key=f"runs_note_{run_id}").value == "Seed pair for the talk"


def test_a_live_run_stopped_on_connectivity_is_kept_as_stopped(home):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.selectbox(key="pair").select(f"{UNCACHED_PAIR[0]}__{UNCACHED_PAIR[1]}").run()
    at.selectbox(key="method").select("weight").run()
    at.button(key="run").click().run()
    run = at.session_state["live_run"]
    while "align" not in run.snapshot().phases and run.running:
        time.sleep(0.01)
    at.button(key="stop").click().run()
    assert run.join(TIMEOUT)
    (entry,) = history.list_runs()
    assert (entry["run"]["status"], entry["run"]["phase"], entry["method"]) == ("stopped", "align", "weight")
    assert entry["run"]["message"] == run.snapshot().message and entry["run"]["seconds"] > 0
    assert set(entry["timings"]) == {"load", "measure B", "align"} and "partial" not in entry
    assert entry["arch"]["task"] == "lm" and entry["config"]["model_a"] == UNCACHED_PAIR[0]


# ---------------------------------------------------------------------------------------------
# The worker keeps every run: its record, or what it reached


def path_ticks(points: int, upto: int):
    """A stand-in run_pair: the path's first `upto` points, as engine.interpolate reports them, then a stop."""

    def run(cfg, progress, cancel):
        progress(Update("load", 2, 2, "model B", 0.3, 0.0))
        for i in range(upto):
            lam = i / (points - 1)
            progress(Update("interpolate", i + 1, points, f"lambda = {lam:.2f}: loss {1 + lam:.4f}, train 2.0000",
                            1.0 + i, 1.0))
        cancel.cancel("stopped on request")
        cancel.check(f"interpolation, point {upto + 1}/{points}")

    return run


def test_the_worker_keeps_a_done_run_and_what_a_stopped_or_failed_one_reached():
    kept, record = [], {"method": "naive"}
    done = live_run.LiveRun(RunConfig("a", "b"), run=lambda cfg, progress, cancel: record, keep=kept.append).start()
    assert done.join(TIMEOUT) and done.snapshot().message == ""
    assert (kept[0].state, kept[0].record) == ("done", record) and kept[0].seconds >= 0

    gone = live_run.LiveRun(RunConfig("a", "b", points=41), run=path_ticks(41, 3), keep=kept.append).start()
    assert gone.join(TIMEOUT) and gone.snapshot().state == "stopped"
    out = kept[1]
    assert (out.state, out.record, out.phase) == ("stopped", None, "interpolate")
    assert out.message == "The run was stopped on request during interpolation, point 4/41."
    assert out.partial == {"lambdas": [0.0, 1 / 40, 2 / 40], "loss": [1.0, 1.025, 1.05]}  # λ from the grid, not the text
    assert out.timings == {"load": 0.3, "interpolate": 3.0}

    def bad_input(cfg, progress, cancel):
        raise DataError("The evaluation set is empty.")

    failed = live_run.LiveRun(RunConfig("a", "b"), run=bad_input, keep=kept.append).start()
    assert failed.join(TIMEOUT)
    assert (kept[2].state, kept[2].message, kept[2].phase, kept[2].partial) == \
        ("failed", "The evaluation set is empty.", None, None)

    def full(out):
        raise OutputError("Could not write /x (No space left on device).")

    failed_keep = live_run.LiveRun(RunConfig("a", "b"), run=lambda cfg, progress, cancel: record, keep=full).start()
    assert failed_keep.join(TIMEOUT)
    snap = failed_keep.snapshot()
    assert (snap.state, snap.record) == ("done", record)
    assert snap.message == ("The run finished but could not be kept in the run history: Could not write /x "
                            "(No space left on device).")
    stopped_full = live_run.LiveRun(RunConfig("a", "b"), run=path_ticks(5, 1), keep=full).start()
    assert stopped_full.join(TIMEOUT)
    assert stopped_full.snapshot().message == (
        "The run was stopped on request during interpolation, point 2/5. It could not be kept in the run history: "
        "Could not write /x (No space left on device).")


@pytest.mark.slow
def test_a_dual_run_keeps_its_element_and_a_later_run_of_the_pair_starts_from_it(home):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.selectbox(key="pair").select(f"{UNCACHED_PAIR[0]}__{UNCACHED_PAIR[1]}").run()
    at.selectbox(key="method").select("dual").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    at.number_input(key="option_dual_time_budget_s").set_value(1.0).run()
    at.button(key="run").click().run()
    assert at.session_state["live_run"].join(TIMEOUT)
    at.run()
    assert not at.exception
    (first,) = history.list_runs()
    element = history.element_path(first["run"]["id"])
    assert history.run_element(first) == element and first["element_file"]["path"] == str(element)
    assert history.scan_runs()[1] == []  # the element file is read through its run, not skipped as foreign

    start = at.selectbox(key="option_dual_start")  # the pair's kept elements follow the aligners
    assert start.options[-1].startswith(f"run {first['run']['id']}: dual, ") and ", barrier " in start.options[-1]
    start.select(str(element)).run()
    at.button(key="run").click().run()
    assert at.session_state["live_run"].join(TIMEOUT)
    at.run()
    assert not at.exception
    second = history.list_runs()[0]
    began = second["alignment"]["diagnostics"]["start_element"]
    assert began["file"] == str(element) and began["sha256"] == first["element_file"]["sha256"]
    assert history.run_element(second) not in (None, element)

    history.delete_run(first["run"]["id"])  # a run goes with its element, and only its own
    assert not element.exists() and history.run_element(history.list_runs()[0]) is not None
    at.selectbox(key="method").select("naive").run()
    at.selectbox(key="method").select("dual").run()
    offered = at.selectbox(key="option_dual_start").options
    assert not any(first["run"]["id"] in o for o in offered) and any(second["run"]["id"] in o for o in offered)


def test_a_dual_run_that_cannot_be_kept_leaves_no_element_behind(home):
    given = {}

    def run(cfg, progress, cancel, save_element=None):  # writes its element, then returns a record the history refuses
        given["file"] = save_element
        save_element.parent.mkdir(parents=True, exist_ok=True)
        save_element.write_bytes(b"element")
        return {"method": "dual", "element_file": {"path": str(save_element)}}

    r = live_run.start({}, RunConfig("a", "b", "dual"), run=run)
    assert r.join(TIMEOUT) and given["file"] == history.element_path(r.run_id)
    assert not given["file"].exists() and "could not be kept in the run history" in r.snapshot().message
    assert live_run.element_run_id(RunConfig("a", "b", "weight")) is None  # weight matching keeps none
    assert history.RUN_ID.fullmatch(live_run.element_run_id(RunConfig("a", "b", "learned")))
