"""Live runs: the worker thread and its token (app.live_run), and the Connectivity page's Run / Stop
controls under AppTest on the tiny stand-in zoo (tiny_zoo.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS, UNCACHED_PAIR

from app import live_run
from app.sidebar import pair_key
from engine.errors import DataError
from engine.progress import PHASES, Update
from engine.results import RunConfig

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
TIMEOUT = 60
STOP_S = 2.0  # a stopped run must end within this (one evaluation batch of the tiny models is far less)


# ---------------------------------------------------------------------------------------------
# LiveRun with stand-in engines: the thread, the token, the outcome


def engine_until_stopped(ticks: list):
    """A stand-in run_pair: reports align ticks until its token is set, as the engine does."""

    def run(cfg, progress, cancel, **kw):  # kw: save_element, for learned and dual runs
        progress(Update("load", 2, 2, "model B", 0.1, 0.0))
        step = 0
        while True:
            step += 1
            cancel.check(f"step {step}")
            progress(Update("align", step, 10**6, f"step {step}", 0.01 * step, 1.0))
            ticks.append(step)
            time.sleep(0.002)

    return run


def test_stop_ends_the_worker_and_the_snapshot_says_where():
    ticks = []
    run = live_run.LiveRun(RunConfig("a", "b", "dual"), run=engine_until_stopped(ticks)).start()
    while len(ticks) < 3:
        time.sleep(0.001)
    assert run.running and run.snapshot().state == "running"
    run.stop()
    assert run.join(STOP_S)
    snap = run.snapshot()
    assert snap.state == "stopped" and snap.finished and snap.record is None
    assert snap.message.startswith("The run was stopped on request during step ")
    assert snap.current.phase == "align" and list(snap.phases) == ["load", "align"]
    n = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == n  # nothing runs after the stop


def test_outcomes_done_failed_and_unexpected():
    done = live_run.LiveRun(RunConfig("a", "b"), run=lambda cfg, progress, cancel: {"method": "naive"}).start()
    assert done.join(TIMEOUT) and done.snapshot().state == "done" and done.snapshot().record == {"method": "naive"}

    def bad_input(cfg, progress, cancel):
        raise DataError("The evaluation set is empty.")

    failed = live_run.LiveRun(RunConfig("a", "b"), run=bad_input).start()
    assert failed.join(TIMEOUT)
    assert (failed.snapshot().state, failed.snapshot().message) == ("failed", "The evaluation set is empty.")

    def bug(cfg, progress, cancel):
        raise ZeroDivisionError("division by zero")

    crashed = live_run.LiveRun(RunConfig("a", "b"), run=bug).start()
    assert crashed.join(TIMEOUT)
    assert crashed.snapshot().message == "The run failed unexpectedly (ZeroDivisionError: division by zero)."


def test_a_session_gone_longer_than_the_grace_stops_its_run():
    now = [0.0]
    alive = [True]
    stepped, proceed = threading.Event(), threading.Event()

    def run(cfg, progress, cancel):
        for step in range(1, 10):
            cancel.check(f"step {step}")
            progress(Update("align", step, 9, f"step {step}", 0.0, None))
            stepped.set()
            proceed.wait(TIMEOUT)
            proceed.clear()
        return {}

    r = live_run.LiveRun(RunConfig("a", "b"), run=run, alive=lambda: alive[0], clock=lambda: now[0]).start()

    def reported() -> None:  # the worker has reported its next step and waits
        assert stepped.wait(TIMEOUT)
        stepped.clear()

    reported()  # step 1, connected
    alive[0], now[0] = False, 5.0
    proceed.set()
    reported()  # step 2: disconnected since 5 s
    now[0] = 5.0 + live_run.SESSION_GRACE_S - 1
    proceed.set()
    reported()  # step 3: not long enough
    assert not r.token.cancelled
    now[0] = 5.0 + live_run.SESSION_GRACE_S
    proceed.set()
    reported()  # step 4 finds the grace spent and sets the token
    assert r.token.cancelled
    proceed.set()
    assert r.join(TIMEOUT)
    assert r.snapshot().message == "The run was stopped because its session ended during step 5."


def test_starting_a_run_stops_the_one_going():
    state: dict = {}
    ticks = []
    first = live_run.start(state, RunConfig("a", "b", "dual"), run=engine_until_stopped(ticks))
    while not ticks:
        time.sleep(0.001)
    second = live_run.start(state, RunConfig("a", "b", "weight"), run=engine_until_stopped([]))
    assert first.join(STOP_S) and first.snapshot().message.startswith("The run was stopped because a new run started")
    assert live_run.current(state) is second and second.running
    assert live_run.stop(state) and second.join(STOP_S)
    assert not live_run.stop(state)  # nothing left to stop


def test_phase_rows_and_headline_read_the_snapshot():
    cfg = RunConfig("a", "b", "weight")
    est = {"load": 1.0, "measure B": 2.0, "align": 30.0, "interpolate": 12.0, "attribution": 3.0}
    phases = {"load": Update("load", 2, 2, "model B", 0.4, 0.0),
              "measure B": Update("measure B", 1, 1, "batch 1/1", 2.2, 0.0),
              "align": Update("align", 2, 4, "sweep 3: layer 2/4", 1.5, 1.5)}
    snap = live_run.Snapshot(cfg, "running", phases, phases["align"], est, 4.1)
    # measuring B took 2.2 s of an estimated 2: the phases to come at 1.1 times their estimates
    assert live_run.phase_rows(snap) == [
        ("load", 1.0, "Loading the models: done in 0 s"),
        ("measure B", 1.0, "Measuring B before it moves: done in 2 s"),
        ("align", 0.5, "Aligning B onto A: sweep 3: layer 2/4 · about 2 s left in this sweep"),
        ("interpolate", 0.0, "Walking the path: about 13 s"),
        ("attribution", 0.0, "Finding where the barrier lives: about 3 s"),
    ]
    assert live_run.headline(snap) == "Running for 4 s, about 48 s left"  # 1.1 x (30 + 12 + 3) s less 1.5 s in align
    ending = live_run.Snapshot(cfg, "running", phases, Update("align", 4, 4, "sweep 9: layer 4/4", 40.0, 0.2),
                               {**est, "interpolate": 0.1, "attribution": 0.0}, 44.0)
    assert live_run.headline(ending) == "Running for 44 s, under 1 s left"  # never "about 0 s"
    stopped = live_run.Snapshot(cfg, "stopped", phases, phases["align"], est, 4.6, "The run was stopped …")
    assert live_run.phase_rows(stopped)[2] == ("align", 0.5, "Aligning B onto A: stopped at sweep 3: layer 2/4")
    assert live_run.headline(stopped) == "Stopped after 5 s"
    assert live_run.before_run(est, "weight") == ("About 48 s (loading the models 1 s, measuring B before it moves "
                                                  "2 s, aligning B onto A 30 s, walking the path 12 s, finding where "
                                                  "the barrier lives 3 s), at the pace of earlier runs of this "
                                                  "architecture.")
    assert live_run.before_run({**est, "align": None}, "weight") is None
    assert live_run.estimated(snap) == ("Estimated before the start: about 48 s, at the pace of earlier runs of this "
                                        "architecture.")  # the snapshot's estimates, before the run's pace
    arithmetic = live_run.Snapshot(cfg, "running", {}, None, est, 0.0, sources=dict.fromkeys(est, "arithmetic"))
    assert live_run.estimated(arithmetic).endswith("about 48 s, from the run's arithmetic at this machine's measured "
                                                   "speed.")
    assert live_run.estimated(live_run.Snapshot(cfg, "running", {}, None, {}, 0.0)) is None
    mixed = {p: "records" for p in est} | {"align": "arithmetic"}
    assert live_run.before_run(est, "weight", mixed) == (
        "About 48 s (loading the models 1 s, measuring B before it moves 2 s, aligning B onto A 30 s, walking the "
        "path 12 s, finding where the barrier lives 3 s), loading the models, measuring B before it moves, walking "
        "the path, finding where the barrier lives at the pace of earlier runs of this architecture; aligning B onto "
        "A from the run's arithmetic at this machine's measured speed.")
    quick = {"load": 0.01, "align": 0.0, "interpolate": 0.2, "attribution": 0.1}
    assert live_run.before_run(quick, "naive", dict.fromkeys(quick, "arithmetic")) == (
        "Under 1 s (loading the models under 1 s, walking the path under 1 s, finding where the barrier lives "
        "under 1 s), from the run's arithmetic at this machine's measured speed.")
    assert [r[0] for r in live_run.phase_rows(live_run.Snapshot(RunConfig("a", "b"), "running", {}, None, {}, 0))] \
        == ["load", "align", "interpolate", "attribution"]  # naive measures nothing before the path


def test_a_time_budget_alone_is_what_the_estimate_aligns_for(tiny_env):
    """A dual run given only a time budget runs no step default: the estimate before it says weight matching's
    start and the budget, not the default's 400 steps."""
    from engine import api

    a, b = CACHED_PAIRS[0]
    start = live_run.estimates_for(RunConfig(a, b, "weight"), [])[0]["align"]
    steps = live_run.estimates_for(RunConfig(a, b, "dual"), [])[0]["align"]
    for budget in (600.0, 1e-3):
        cfg = RunConfig(a, b, "dual", options=api.method_options("dual", {"time_budget_s": budget}))
        assert live_run.estimates_for(cfg, [])[0]["align"] == pytest.approx(start + budget)
    assert start < steps < start + 600  # 400 steps of the tiny pair: well under ten minutes
    capped = RunConfig(a, b, "dual", steps=400, options=api.method_options("dual", {"time_budget_s": 600.0}))
    assert live_run.estimates_for(capped, [])[0]["align"] == pytest.approx(steps)  # the steps end it first


# ---------------------------------------------------------------------------------------------
# The page


@pytest.fixture
def at(tiny_env):
    t = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    yield t
    try:
        run = t.session_state["live_run"]
    except KeyError:
        return
    run.stop()  # never leave a worker behind
    run.join(TIMEOUT)


def wait_for(run: live_run.LiveRun, phase: str, done: int = 1, says: str = "") -> None:
    """Until the run's `phase` has done `done` units, its last message containing `says`."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        u = run.snapshot().phases.get(phase)
        if u is not None and u.done >= done and says in u.message:
            return
        assert run.running, run.snapshot().message
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach {phase}")


def start_long_run(at: AppTest) -> live_run.LiveRun:
    """Weight matching on the uncached tiny pair: random weights take many sweeps, seconds of work."""
    at.selectbox(key="pair").select(pair_key(*UNCACHED_PAIR)).run()
    at.selectbox(key="method").select("weight").run()
    at.button(key="run").click().run()
    assert not at.exception
    return at.session_state["live_run"]


def test_stop_button_ends_the_run_and_the_page_says_it_stopped(at):
    run = start_long_run(at)
    assert at.button(key="stop").label == "Stop"
    assert at.status[0].label.startswith("Running for")
    wait_for(run, "align", says="sweep")
    at.run()  # the page's poll: a bar per phase, the aligner's with the time its sweep has left
    texts = [p.proto.text for p in at.progress]
    assert texts[0].startswith("Loading the models: done in")
    assert texts[1].startswith("Measuring B before it moves: done in")
    assert texts[2].startswith("Aligning B onto A: sweep ") and texts[2].endswith(" left in this sweep")
    assert texts[3].startswith("Walking the path: about ")  # no earlier run of this pair: the run's arithmetic
    assert any(c.value.startswith("Estimated before the start: about ") for c in at.caption)
    t0 = time.monotonic()
    at.button(key="stop").click().run()
    assert run.join(STOP_S), "the run went on after Stop"
    assert time.monotonic() - t0 < STOP_S + 1
    at.run()
    assert not at.exception
    assert at.status[0].label.startswith("Stopped after")
    # during weight matching as a rule; a loaded machine may let the last sweep end before the click
    assert at.warning[0].value.startswith("The run was stopped on request during ")
    assert "stop" not in [b.key for b in at.button]
    assert UNCACHED_PAIR not in at.session_state["live_runs"]  # a stopped run leaves no curve
    assert not at.get("plotly_chart")


def test_a_new_run_stops_the_one_going(at):
    first = start_long_run(at)
    wait_for(first, "load", 2)
    at.selectbox(key="method").select("naive").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    assert first.running  # changing the pickers leaves the run alone
    at.button(key="run").click().run()  # the page asks first; "Keep it" leaves the run going
    assert at.session_state["live_run"] is first and at.warning[0].value.startswith("A run is still going")
    at.button(key="keep_run").click().run()
    assert first.running and not at.warning
    at.button(key="run").click().run()
    at.button(key="confirm_run").click().run()
    second = at.session_state["live_run"]
    assert second is not first
    assert first.join(STOP_S)
    assert first.snapshot().message.startswith("The run was stopped because a new run started during")
    assert second.join(TIMEOUT) and second.snapshot().state == "done"
    at.run()
    assert list(at.session_state["live_runs"][UNCACHED_PAIR]) == ["naive"]  # the stopped run left no curve
    assert at.session_state["live_runs"][UNCACHED_PAIR]["naive"]["eval_tokens"] == 1024


def test_a_run_outlives_its_page_and_the_sidebar_can_stop_it(at):
    run = start_long_run(at)
    wait_for(run, "load", 2)
    at.switch_page("app_pages/symmetry.py").run()
    assert not at.exception and run.running  # another page: the run goes on ...
    assert any(m.value.startswith("**Live run**") for m in at.sidebar.markdown)
    at.sidebar.button(key="sidebar_stop").click().run()  # ... and the sidebar stops it
    assert run.join(STOP_S)
    assert run.snapshot().message.startswith("The run was stopped on request during")


def test_the_time_a_run_takes_is_said_before_it_starts(at):
    # the cached pair's records carry their timings: the estimate scales them to the chosen subset
    at.selectbox(key="method").select("weight").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    said = ("About ", "Under 1 s (")  # a tiny model's run may take under a second
    assert any(c.value.startswith(said) and "aligning B onto A" in c.value for c in at.caption)
    assert any(c.value.endswith("at the pace of earlier runs of this architecture.") for c in at.caption)
    at.selectbox(key="method").select("dual").run()  # no cached dual record of this architecture: the arithmetic
    assert any(c.value.startswith(said) and c.value.endswith(
        "; aligning B onto A from the run's arithmetic at this machine's measured speed.") for c in at.caption)
    assert pair_key(*CACHED_PAIRS[0]) == at.selectbox(key="pair").value


def test_a_pair_without_any_earlier_run_is_estimated_from_its_arithmetic(at, monkeypatch, tmp_path):
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path))  # an empty run history: no kept run of this architecture
    at.selectbox(key="pair").select(pair_key(*UNCACHED_PAIR)).run()
    at.selectbox(key="method").select("learned").run()
    said = [c.value for c in at.caption if c.value.startswith("About ")]
    assert len(said) == 1 and said[0].endswith("), from the run's arithmetic at this machine's measured speed.")
    assert "aligning B onto A" in said[0] and "walking the path" in said[0]


def test_every_engine_phase_has_a_label():
    assert tuple(live_run.PHASE_LABELS) == PHASES


def test_the_served_app_does_not_collect_garbage_after_every_rerun(monkeypatch):
    """The page reruns every POLL_S while a run works; streamlit's default full gc.collect after each
    rerun holds the interpreter lock for about 0.5 s once two GPT-2-small models are loaded, and starved
    the worker thread (weight matching about ten times slower than from the CLI). The project's
    .streamlit/config.toml turns it off; read here by streamlit's own config parser, as `streamlit run`
    from the repository root (make run, the browser tests) reads it."""
    from streamlit import config

    monkeypatch.chdir(Path(APP).parents[1])
    try:
        config.get_config_options(force_reparse=True)
        assert config.get_option("runner.postScriptGC") is False
        assert config.get_where_defined("runner.postScriptGC").endswith(".streamlit/config.toml")
    finally:
        monkeypatch.undo()
        config.get_config_options(force_reparse=True)
