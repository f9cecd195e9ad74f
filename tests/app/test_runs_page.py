"""The Runs page under AppTest: the run history (engine.history) listed, filtered, compared, reopened
and deleted; a live run finished on Connectivity is kept there. Records are real engine runs on the
tiny stand-in zoo (tiny_zoo.py); each test has its own history (LMC_EXPLORER_HOME)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plotly_json import chart
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS, UNCACHED_PAIR

from app import live_run
from app.sidebar import methods
from engine import history
from engine.errors import OutputError
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


def curves(fig: dict) -> dict[str, list[float]]:
    return {t["name"]: list(t["y"]) for t in fig["data"] if t.get("showlegend", True) and t.get("legendgroup") != "key"}


def test_an_empty_history_says_where_runs_will_appear(home):
    at = runs_page()
    assert at.info[0].value.startswith("No runs kept yet")
    assert str(home) in at.caption[0].value


def test_the_table_lists_every_run_newest_first_and_filters_narrow_it(kept):
    at = runs_page()
    ids = [kept[k]["run"]["id"] for k in ("vit_naive", "lm_weight", "lm_naive")]
    assert table_ids(at) == ids
    table = at.dataframe[0].value
    assert list(table["barrier"]) == [kept[k]["barrier"] for k in ("vit_naive", "lm_weight", "lm_naive")]
    assert list(table["status"]) == ["done"] * 3
    names = methods()
    at.multiselect(key="runs_filter_method").select(names["naive"]).run()
    assert table_ids(at) == [ids[0], ids[2]]
    at.multiselect(key="runs_filter_pe").select("NoPE").run()
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
# The worker keeps what it finished, and only that


def test_the_worker_keeps_a_done_run_and_never_a_stopped_one():
    kept, record = [], {"method": "naive"}
    done = live_run.LiveRun(RunConfig("a", "b"), run=lambda cfg, progress, cancel: record, keep=kept.append).start()
    assert done.join(TIMEOUT) and kept == [record] and done.snapshot().message == ""

    def stopped(cfg, progress, cancel):
        cancel.cancel("stopped on request")
        cancel.check("step 1")

    gone = live_run.LiveRun(RunConfig("a", "b"), run=stopped, keep=kept.append).start()
    assert gone.join(TIMEOUT) and gone.snapshot().state == "stopped" and kept == [record]

    def full(rec):
        raise OutputError("Could not write /x (No space left on device).")

    failed_keep = live_run.LiveRun(RunConfig("a", "b"), run=lambda cfg, progress, cancel: record, keep=full).start()
    assert failed_keep.join(TIMEOUT)
    snap = failed_keep.snapshot()
    assert (snap.state, snap.record) == ("done", record)
    assert snap.message == ("The run finished but could not be kept in the run history: Could not write /x "
                            "(No space left on device).")
