"""The Connectivity page under streamlit's AppTest (no browser), recipe in docs/DESIGN.md section 10.

Most tests run on the tiny stand-in zoo and store (tiny_zoo.py); one checks the committed
cached_results/ when they hold a record.
"""

import shutil
from pathlib import Path

import pytest
from plotly_json import chart, curves, summary
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS, UNCACHED_PAIR

from app import live_run
from app.figures import path as path_figs
from app.figures import style
from app.sidebar import OPENING_PAIR, methods, pair_key
from engine import zoo
from engine.results import CACHE, cache_file, cached_record, list_cached

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
NAIVE = methods()["naive"]  # legend name of the baseline curve, from the engine's registry
TIMEOUT = 60  # generous: the first run imports torch, and the machine's cores may be busy training


def page() -> AppTest:
    return AppTest.from_file(APP, default_timeout=TIMEOUT).run()


def finish(at: AppTest) -> AppTest:
    """Wait for the live run the last click started (it works in a thread), then rerun the page:
    what the page's poll does in a browser."""
    assert at.session_state["live_run"].join(TIMEOUT), "the live run did not end"
    return at.run()


def test_opens_on_the_cached_curves_of_the_learned_pe_pair(tiny_env):
    _, store = tiny_env
    at = page()
    assert not at.exception
    assert at.title[0].value == "Connectivity"
    # the reference's setting, not the zoo's first pair (NoPE, the worst-connected)
    assert at.selectbox(key="pair").value == pair_key(*OPENING_PAIR) == pair_key(*CACHED_PAIRS[0])
    assert zoo.pairs()[0] != OPENING_PAIR
    a, b = CACHED_PAIRS[0]
    naive, weight = cached_record(a, b, "naive", store), cached_record(a, b, "weight", store)
    names = methods()
    got = curves(chart(at, "barrier_chart"))
    assert got == {names["naive"]: pytest.approx(naive["loss"], abs=0),
                   names["weight"]: pytest.approx(weight["loss"], abs=0)}
    assert chart(at, "barrier_chart")["layout"]["yaxis"]["title"]["text"] == "Loss (nats/byte)"  # test and train
    assert not at.metric  # the chart comes first; the numbers are one table under it
    rows = summary(at)
    assert list(rows) == [names["naive"], names["weight"]]
    assert [rows[n]["barrier"] for n in rows] == [naive["barrier"], weight["barrier"]]
    assert [rows[n]["midpoint"] for n in rows] == [naive["midpoint_barrier"], weight["midpoint_barrier"]]
    assert rows[names["weight"]]["vs naive"] == f"{weight['barrier'] - naive['barrier']:+.4f}"
    assert rows[names["naive"]]["vs naive"] == "-"  # nothing to compare: a dash, not "None"
    assert "accuracy drop (pt)" not in rows[names["naive"]]  # an LM has no accuracy
    # the sidebar's method is highlighted: thick and opaque, the other curves lighter
    widths = {t["name"]: (t["line"]["width"], t.get("opacity", 1)) for t in chart(at, "barrier_chart")["data"]
              if t["name"] in rows}
    assert at.selectbox(key="method").value == "naive" and widths[names["naive"]] == (path_figs.HIGHLIGHT_WIDTH, 1)
    assert widths[names["weight"]][0] < path_figs.HIGHLIGHT_WIDTH and widths[names["weight"]][1] < 1
    at.selectbox(key="method").select("weight").run()
    widths = {t["name"]: t["line"]["width"] for t in chart(at, "barrier_chart")["data"] if t["name"] in rows}
    assert widths[names["weight"]] == path_figs.HIGHLIGHT_WIDTH and widths[names["naive"]] < path_figs.HIGHLIGHT_WIDTH
    at.toggle(key="log_y").set_value(True).run()
    assert chart(at, "barrier_chart")["layout"]["yaxis"]["type"] == "log"
    assert any(naive["eval_set"] in c.value for c in at.caption)
    assert len(at.get("plotly_chart")) == 1  # an LM has no accuracy panel


def test_switching_to_a_vit_pair_adds_the_accuracy_panel(tiny_env):
    _, store = tiny_env
    at = page()
    at.selectbox(key="pair").select(pair_key(*CACHED_PAIRS[1])).run()
    assert not at.exception
    rec = cached_record(*CACHED_PAIRS[1], "naive", store)
    assert curves(chart(at, "barrier_chart"))[NAIVE] == pytest.approx(rec["loss"], abs=0)
    acc = curves(chart(at, "accuracy_chart"))[NAIVE]
    assert acc == pytest.approx([100 * a for a in rec["accuracy"]])
    assert chart(at, "barrier_chart")["layout"]["yaxis"]["title"]["text"] == "Loss (nats/image)"  # test and train
    assert summary(at)[NAIVE]["accuracy drop (pt)"] == pytest.approx(100 * rec["accuracy_drop"], abs=1e-12)
    assert at.select_slider(key="eval_items_vit").value is None  # ViT default: the whole test split


def test_uncached_pair_says_so_and_run_draws_a_live_curve(tiny_env):
    at = page()
    at.selectbox(key="pair").select(pair_key(*UNCACHED_PAIR)).run()
    assert not at.exception
    assert "Nothing is cached" in at.info[0].value
    assert not at.get("plotly_chart")
    assert at.select_slider(key="eval_items_lm").value == 8192  # the interactive default
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    finish(at.button(key="run").click().run())
    assert not at.exception
    assert [p.value for p in at.progress] == [100, 100, 100, 100]  # naive: load, align (nothing), path, attribution
    assert at.status[0].label.startswith("Done in")
    live = at.session_state["live_runs"][UNCACHED_PAIR]["naive"]
    assert live["eval_tokens"] == 1024 and live["model_a"] == UNCACHED_PAIR[0]
    assert curves(chart(at, "barrier_chart")) == {f"{NAIVE}, live (1,024 tokens)": pytest.approx(live["loss"], abs=0)}
    # the result survives reruns (the button is momentary, session_state is not)
    at.run()
    assert at.button(key="run").value is False
    assert curves(chart(at, "barrier_chart"))


def test_a_short_live_path_has_the_points_picked(tiny_env):
    at = page()
    assert at.select_slider(key="path_points").value == 21  # the cached curves' grid
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    at.select_slider(key="path_points").set_value(5).run()
    finish(at.button(key="run").click().run())
    assert not at.exception
    live = at.session_state["live_runs"][CACHED_PAIRS[0]]["naive"]
    assert live["lambdas"] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0], abs=1e-12)
    assert len(live["loss"]) == 5
    assert curves(chart(at, "barrier_chart"))[f"{NAIVE}, live (1,024 tokens)"] == pytest.approx(live["loss"], abs=0)


def test_live_run_with_the_picked_method_is_drawn_beside_the_cached_curves(tiny_env):
    at = page()
    names = methods()
    assert at.selectbox(key="method").options == list(names.values())  # the picker is the registry
    at.selectbox(key="method").select("weight").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    finish(at.button(key="run").click().run())
    assert not at.exception
    live = at.session_state["live_runs"][CACHED_PAIRS[0]]["weight"]
    assert live["method"] == "weight" and live["eval_tokens"] == 1024
    drawn = curves(chart(at, "barrier_chart"))
    assert list(drawn) == [names["naive"], names["weight"], f"{names['weight']}, live (1,024 tokens)"]
    assert drawn[f"{names['weight']}, live (1,024 tokens)"] == pytest.approx(live["loss"], abs=0)


def test_the_method_options_widgets_reach_the_run_and_its_record(tiny_env):
    at = page()
    at.selectbox(key="method").select("weight").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    (box,) = [e for e in at.main.expander if e.label == "Method options"]
    assert [w.label for w in box.selectbox] == ["Head cost", "MLP score"]  # WeightOptions, in order
    assert [w.label for w in box.checkbox] == ["Scale blocks by fan-in"]
    assert [w.label for w in box.number_input] == ["Stopping tolerance"]
    at.selectbox(key="option_weight_head_cost").select("normalised")
    at.checkbox(key="option_weight_block_scale").check()
    finish(at.button(key="run").click().run())
    assert not at.exception
    live = at.session_state["live_runs"][CACHED_PAIRS[0]]["weight"]
    assert live["config"]["extra"] == (("head_cost", "normalised"), ("block_scale", "True"))
    assert live["alignment"]["diagnostics"]["settings"] | {"seen_tokens": None} == {
        "head_cost": "normalised", "mlp_score": "inner", "block_scale": True, "seen_tokens": None, "stop_tol": None}
    at.selectbox(key="method").select("learned").run()
    at.number_input(key="option_learned_time_budget_s").set_value(0.0).run()
    assert [e.value for e in at.main.error] == [
        "Option time_budget_s (--time-budget) must be a positive number of seconds, not 0.0."]
    assert at.button(key="run").disabled


def test_an_unbuilt_zoo_is_refused_before_any_run(monkeypatch, tmp_path):
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    at = page()
    assert not at.exception
    a, b = OPENING_PAIR
    assert [e.value for e in at.main.error] == [  # every model not built, not only A
        f"Model A: Zoo model {a} is not built yet; run `python -m engine zoo build --only {a}`.",
        f"Model B: Zoo model {b} is not built yet; run `python -m engine zoo build --only {b}`."]
    assert at.button(key="run").disabled and not at.status  # nothing started, no stale progress
    assert "zoo is not built" in at.info[-1].value
    assert not at.get("plotly_chart")


def test_model_directories_run_and_bad_ones_show_an_error(tiny_env):
    zoo_dir, _ = tiny_env
    at = page()
    at.selectbox(key="pair").select("custom").run()
    assert at.button(key="run").disabled  # nothing to run before both directories are given
    assert "Enter the directories" in at.info[0].value and not at.error
    at.text_input(key="model_a_dir").input("/nonexistent/model").run()
    at.text_input(key="model_b_dir").input(str(zoo_dir / "lm-rope-s1")).run()
    assert not at.exception and at.button(key="run").disabled
    assert at.sidebar.error[0].value == "Model A /nonexistent/model is neither a zoo model nor an existing directory."
    at.text_input(key="model_a_dir").input(str(zoo_dir / "vit-learned-s0")).run()
    assert not at.exception and at.button(key="run").disabled
    assert at.sidebar.error[0].value.startswith("Model A is a reference ViT and model B a reference LM:")
    assert str(zoo_dir / "vit-learned-s0") in at.sidebar.error[0].value  # named by its full path
    assert not at.main.error and "the sidebar says why" in at.main.info[0].value
    at.text_input(key="model_a_dir").input(str(zoo_dir / "lm-rope-s0")).run()
    assert any("Two reference LMs of the same shape" in c.value for c in at.caption)  # not "different seeds"
    at.select_slider(key="eval_items_custom").set_value(256).run()
    finish(at.button(key="run").click().run())
    assert not at.exception and not at.error
    assert list(curves(chart(at, "barrier_chart"))) == [f"{NAIVE}, live (256 tokens)"]


def sidebar_inputs(at: AppTest) -> list[str]:
    """The sidebar's directory inputs and error boxes, top to bottom: 'input A', 'error: <sentence>', ..."""
    out = []

    def walk(node):
        if node.type == "text_input":
            out.append({"model_a_dir": "input A", "model_b_dir": "input B"}[node.key])
        elif node.type == "error":
            out.append(f"error: {node.value}")
        for c in getattr(node, "children", {}).values():
            walk(c)

    walk(at.sidebar)
    return out


def test_each_bad_directory_is_told_right_under_its_own_input(tiny_env, tmp_path):
    zoo_dir, _ = tiny_env
    empty = tmp_path / "empty"
    empty.mkdir()
    at = page()
    at.selectbox(key="pair").select("custom").run()
    at.text_input(key="model_a_dir").input("/nonexistent/model").run()
    assert sidebar_inputs(at) == [  # at once, while B is still empty
        "input A", "error: Model A /nonexistent/model is neither a zoo model nor an existing directory.", "input B"]
    at.text_input(key="model_b_dir").input(str(empty)).run()
    assert not at.exception and at.button(key="run").disabled
    b_empty = f"error: Model B directory {empty} is empty: a model directory holds config.json and the weights."
    assert sidebar_inputs(at) == [  # both bad: both told, each under its own input
        "input A", "error: Model A /nonexistent/model is neither a zoo model nor an existing directory.",
        "input B", b_empty]
    assert not at.main.error  # not in the main pane, away from the inputs
    at.text_input(key="model_a_dir").input(str(zoo_dir / "lm-rope-s0")).run()
    assert sidebar_inputs(at) == ["input A", "input B", b_empty]
    at.text_input(key="model_b_dir").input(str(zoo_dir / "vit-learned-s1")).run()
    (pair,) = at.sidebar.error  # each fine alone, not together: under both inputs
    assert sidebar_inputs(at)[:2] == ["input A", "input B"] and pair.value.startswith("Model A is a reference LM")
    at.text_input(key="model_b_dir").input(str(zoo_dir / "lm-rope-s1")).run()
    assert not at.error and not at.button(key="run").disabled


def test_a_corrupt_cached_record_is_skipped_with_a_warning(tiny_env, monkeypatch, tmp_path):
    _, store = tiny_env
    broken = tmp_path / "store"
    shutil.copytree(store, broken)
    cache_file(*CACHED_PAIRS[0], "naive", broken).write_text("{not json")
    monkeypatch.setenv("LMC_CACHE_DIR", str(broken))
    at = page()
    assert not at.exception and not at.error
    assert "is not valid JSON" in at.warning[0].value and "__naive.json" in at.warning[0].value
    weight = cached_record(*CACHED_PAIRS[0], "weight", broken)  # the pair's other method still shows
    assert [r["barrier"] for r in summary(at).values()] == [weight["barrier"]]
    assert at.button(key="run")  # the page still offers a live run


def test_zoo_table_lists_the_manifest(tiny_env):
    at = page()
    names = list(at.dataframe[-1].value["name"])
    assert names == [r["name"] for r in zoo.manifest()] and "lm-learned-s0" in names


@pytest.mark.skipif(not list_cached(CACHE), reason="cached_results/ holds no records yet")
def test_committed_cached_results_are_what_the_page_draws(monkeypatch):
    monkeypatch.delenv("LMC_CACHE_DIR", raising=False)
    monkeypatch.delenv("LMC_ZOO_DIR", raising=False)
    rows = {(r["model_a"], r["model_b"]) for r in list_cached(CACHE)}
    pair = next(p for p in zoo.pairs() if p in rows)
    at = page()
    at.selectbox(key="pair").select(pair_key(*pair)).run()
    assert not at.exception
    fig = chart(at, "barrier_chart")
    methods = sorted(r["method"] for r in list_cached(CACHE) if (r["model_a"], r["model_b"]) == pair)
    drawn = curves(fig)
    assert len(drawn) == len(methods)
    for m in methods:
        rec = cached_record(*pair, m, CACHE)
        assert pytest.approx(rec["loss"], abs=0) in drawn.values()
        assert rec["barrier"] in [r["barrier"] for r in summary(at).values()]
    unit = style.loss_unit(cached_record(*pair, methods[0], CACHE))
    train = any("train_loss" in cached_record(*pair, m, CACHE) for m in methods)  # records rebuilt since train curves
    assert fig["layout"]["yaxis"]["title"]["text"] == f"{'Loss' if train else 'Test loss'} ({unit})"


def test_the_stored_loss_plane_is_drawn_with_both_segments(tiny_env, monkeypatch, tmp_path):
    import json

    from engine.api import plane_file, plane_pair

    store = tmp_path / "store"
    shutil.copytree(tiny_env[1], store)
    monkeypatch.setenv("LMC_CACHE_DIR", str(store))
    at = page()
    assert not at.exception and "No loss plane is stored" in " ".join(c.value for c in at.caption)
    plane = plane_pair(*CACHED_PAIRS[0], "weight", grid=3, eval_items=256)
    f = plane_file(*CACHED_PAIRS[0], root=store)
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(plane))
    at = page()
    fig = chart(at, "plane_chart")
    contour = fig["data"][0]
    assert contour["type"] == "contour" and [list(r) for r in contour["z"]] == plane["loss"]
    segments = {t["name"]: (list(t["x"]), list(t["y"])) for t in fig["data"][1:3]}
    p = plane["points"]
    assert segments["naive: A to B"] == ([0.0, p["B"][0]], [0.0, p["B"][1]])
    assert segments[f"{methods()['weight']}: A to aligned B"] == ([0.0, p["B_aligned"][0]], [0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Layout: the chart first, a running run's bars and Stop above it; live and cached curves apart


def top_level(at: AppTest, find) -> int:
    """Index among the main pane's top-level elements of the one that holds the first node `find` accepts."""

    def holds(node) -> bool:
        return find(node) or any(holds(c) for c in getattr(node, "children", {}).values())

    return next(i for i, node in enumerate(at.main.children.values()) if holds(node))


def column_of(at: AppTest, find) -> float:
    """Width (share of its row) of the innermost column holding the first node `find` accepts; 1 outside any."""

    def search(node, weight):
        if find(node):
            return weight
        for c in getattr(node, "children", {}).values():
            got = search(c, c.weight if c.type == "column" else weight)
            if got is not None:
                return got
        return None

    return search(at.main, 1.0)


def is_key(key: str):
    return lambda node: getattr(node, "key", None) == key or key in str(getattr(getattr(node, "proto", None), "id", ""))


def test_a_running_run_shows_its_bars_and_stop_above_the_chart_and_its_outcome_beside_it(tiny_env):
    at = page()
    at.selectbox(key="method").select("weight").run()
    at.button(key="run").click().run()
    assert not at.exception
    run = at.session_state["live_run"]
    try:
        status, stop, chart_at = top_level(at, lambda n: n.type == "status"), top_level(at, is_key("stop")), \
            top_level(at, is_key("barrier_chart"))
        assert status == stop < chart_at == top_level(at, is_key("run"))  # one row above the chart and the controls
        assert column_of(at, lambda n: n.type == "status") == pytest.approx(5 / 6)  # wide, not the narrow panel
        assert column_of(at, is_key("stop")) == pytest.approx(1 / 6)
        assert len(at.status[0].get("progress")) == len(live_run.phases_of("weight"))  # a bar per phase
    finally:
        run.stop()
        run.join(TIMEOUT)
    at.run()
    assert not at.exception
    # once ended, the outcome sits in the run panel beside the chart, which comes first again
    assert top_level(at, lambda n: n.type == "status") == top_level(at, is_key("barrier_chart"))
    assert column_of(at, lambda n: n.type == "status") == pytest.approx(1 / 4)


def test_a_live_curve_stands_apart_from_the_cached_ones_and_every_barrier_is_labelled(tiny_env):
    _, store = tiny_env
    names = methods()
    at = page()
    at.selectbox(key="method").select("weight").run()
    at.select_slider(key="eval_items_lm").set_value(1024).run()
    finish(at.button(key="run").click().run())
    assert not at.exception
    live_name = f"{names['weight']}, live (1,024 tokens)"
    traces = {t["name"]: t for t in chart(at, "barrier_chart")["data"]}
    cached, live = traces[names["weight"]], traces[live_name]  # the sidebar's method, cached and recomputed
    assert live["line"]["dash"] == "solid" != cached["line"]["dash"] == style.method_dash("weight")
    assert live["line"]["width"] > cached["line"]["width"] == max(traces[n]["line"]["width"] for n in names.values()
                                                                  if n in traces)
    assert live["marker"]["symbol"] == "diamond" and cached["marker"]["symbol"] == "circle"
    # each barrier bar is capped at its top only, its value written beside the cap, no two on one side
    records = {names["naive"]: cached_record(*CACHED_PAIRS[0], "naive", store),
               names["weight"]: cached_record(*CACHED_PAIRS[0], "weight", store),
               live_name: at.session_state["live_runs"][CACHED_PAIRS[0]]["weight"]}
    sides = []
    for name, rec in records.items():
        bar = traces[f"{name}: barrier"]
        assert list(bar["text"]) == ["", f"{rec['barrier']:.3g}"]
        assert list(bar["marker"]["size"]) == [0, 14]
        assert bar["y"][1] - bar["y"][0] == pytest.approx(rec["barrier"], abs=1e-12)
        sides.append(bar["textposition"])
    assert len(set(sides)) == len(records)
