"""Train curves beside test curves: the figures (pure), the Connectivity page and the Runs page.

The tiny store's records are real engine runs (tiny_zoo.py), so they carry train curves; a record from
before train curves is made by dropping its train fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from path_records import LAMBDAS, lm_record, vit_record
from plotly_json import chart, summary
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS

from app.figures import path as path_figs
from app.figures import runs as run_figs
from app.figures import style
from app.sidebar import methods
from engine import history
from engine.results import TRAIN_FIELDS, cached_record

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
TIMEOUT = 60
NAMES = methods()
NAIVE, WEIGHT = NAMES["naive"], NAMES["weight"]


def with_train(rec: dict, train_loss, train_acc=None) -> dict:
    chord = path_figs.chord(LAMBDAS, train_loss)
    return {**rec, "train_loss": list(train_loss), "train_accuracy": train_acc,
            "train_barrier": max(v - c for v, c in zip(train_loss, chord)),
            "train_eval_set": "austen/train, 8,192 tokens (bytes), context 128"}


def old(rec: dict) -> dict:
    """The record as written before train curves."""
    return {k: v for k, v in rec.items() if k not in TRAIN_FIELDS}


def by_name(fig) -> dict:
    """Every trace by name (plotly objects or chart JSON)."""
    data = fig.data if hasattr(fig, "data") else fig["data"]
    return {(t.name if hasattr(t, "name") else t["name"]): t for t in data}


# ---------------------------------------------------------------------------------------------
# Figures


def test_a_train_curve_is_drawn_thin_and_dotted_in_its_method_s_colour():
    rec = with_train(lm_record("weight"), (1.8, 2.0, 2.2, 1.9, 1.7))
    fig = path_figs.barrier_figure([rec])
    t = by_name(fig)
    test, train = t["weight"], t["weight, train"]
    assert list(train.x) == LAMBDAS and list(train.y) == rec["train_loss"]
    assert train.line.color == test.line.color == style.METHOD_COLOURS["weight"]
    assert train.line.dash == style.TRAIN_DASH and train.line.width < test.line.width
    # the train pattern is no method's test line and no chord
    assert style.TRAIN_DASH not in {style.method_dash(m) for m in (*style.METHOD_DASHES, "my-aligner")}
    assert style.TRAIN_DASH != style.CHORD_DASH
    # one legend click hides the method's test and train curves; the legend's key names the train style
    assert train.legendgroup == test.legendgroup and train.showlegend is False
    key = [x for x in fig.data if x.legendgroup == path_figs.KEY_GROUP]
    assert [x.name for x in key][-1] == path_figs.TRAIN_KEY and "train" in path_figs.TRAIN_KEY
    assert key[-1].line.dash == style.TRAIN_DASH
    assert "train loss" in train.hovertemplate and "nats/byte" in train.hovertemplate
    assert fig.layout.yaxis.title.text == "Loss (nats/byte)"


def test_show_train_off_and_old_records_draw_no_train_line():
    new = with_train(lm_record("naive"), (1.8, 2.0, 2.2, 1.9, 1.7))
    off = path_figs.barrier_figure([new], show_train=False)
    assert "naive, train" not in by_name(off) and path_figs.TRAIN_KEY not in by_name(off)
    assert off.layout.yaxis.title.text == "Test loss (nats/byte)"
    mixed = path_figs.barrier_figure([new, lm_record("weight")])
    assert [n for n in by_name(mixed) if n.endswith(", train")] == ["naive, train"]
    only_old = path_figs.barrier_figure([lm_record("naive")])
    assert path_figs.TRAIN_KEY not in by_name(only_old)
    assert only_old.layout.yaxis.title.text == "Test loss (nats/byte)"


def test_the_summary_has_a_train_barrier_per_curve_none_for_old_records():
    new = with_train(lm_record("naive"), (1.8, 2.0, 2.2, 1.9, 1.7))
    rows = path_figs.summary_rows([new, lm_record("weight")])
    assert [r["train barrier"] for r in rows] == [new["train_barrier"], None]
    assert new["train_barrier"] == pytest.approx(2.2 - 1.75, abs=1e-12)
    assert "train barrier" not in path_figs.summary_rows([lm_record()])[0]


def test_train_accuracy_is_drawn_in_percent():
    rec = with_train(vit_record(), (0.1, 0.5, 0.9, 0.4, 0.15), [1.0, 0.8, 0.5, 0.85, 0.99])
    fig = path_figs.accuracy_figure([rec])
    train = by_name(fig)["naive, train"]
    assert list(train.y) == pytest.approx([100.0, 80.0, 50.0, 85.0, 99.0])
    assert train.line.dash == style.TRAIN_DASH and fig.layout.yaxis.title.text == "Accuracy (%)"
    assert "naive, train" not in by_name(path_figs.accuracy_figure([rec], show_train=False))


def test_compared_runs_of_one_method_draw_train_curves_in_their_run_s_colour():
    a = with_train(lm_record(), (1.8, 2.0, 2.2, 1.9, 1.7))
    b = with_train(lm_record(loss=(2.1, 2.2, 2.4, 2.1, 2.0)), (1.9, 2.1, 2.3, 2.0, 1.8))
    fig = run_figs.comparison_figure([a, b], ["run a", "run b"])
    t = by_name(fig)
    assert list(t["run a, train"].y) == a["train_loss"] and list(t["run b, train"].y) == b["train_loss"]
    assert t["run a, train"].line.color == t["run a"].line.color == style.group_colour(0)
    assert t["run b, train"].line.color == t["run b"].line.color == style.group_colour(1)
    assert [x.name for x in fig.data].count(path_figs.TRAIN_KEY) == 1
    assert fig.layout.yaxis.title.text == "Loss (nats/byte)"
    off = run_figs.comparison_figure([a, old(b)], ["run a", "run b"], show_train=False)
    assert not any(n.endswith(", train") for n in by_name(off))
    assert off.layout.yaxis.title.text == "Test loss (nats/byte)"


# ---------------------------------------------------------------------------------------------
# Connectivity


def page() -> AppTest:
    return AppTest.from_file(APP, default_timeout=TIMEOUT).run()


def test_connectivity_draws_each_method_s_train_curve_with_a_toggle_and_a_table_column(tiny_env):
    _, store = tiny_env
    naive, weight = (cached_record(*CACHED_PAIRS[0], m, store) for m in ("naive", "weight"))
    at = page()
    assert not at.exception
    t = by_name(chart(at, "barrier_chart"))
    for name, rec in ((NAIVE, naive), (WEIGHT, weight)):
        train = t[f"{name}, train"]
        assert list(train["y"]) == pytest.approx(rec["train_loss"], abs=0)
        assert train["line"]["dash"] == style.TRAIN_DASH and train["line"]["color"] == t[name]["line"]["color"]
        assert train["line"]["dash"] != t[name]["line"]["dash"]
    assert path_figs.TRAIN_KEY in t
    assert at.toggle(key="show_train").value is True
    rows = summary(at)
    assert [rows[n]["train barrier"] for n in (NAIVE, WEIGHT)] == \
        [f"{naive['train_barrier']:.4f}", f"{weight['train_barrier']:.4f}"]
    assert any("(train: austen/train, " in c.value for c in at.caption)
    at.toggle(key="show_train").set_value(False).run()
    fig = chart(at, "barrier_chart")
    assert not any(n.endswith(", train") for n in by_name(fig)) and path_figs.TRAIN_KEY not in by_name(fig)
    assert fig["layout"]["yaxis"]["title"]["text"] == "Test loss (nats/byte)"
    assert summary(at)[NAIVE]["train barrier"] == f"{naive['train_barrier']:.4f}"  # the numbers stay


def test_connectivity_shows_a_dash_for_a_record_from_before_train_curves(tiny_env, monkeypatch, tmp_path):
    _, store = tiny_env
    mixed = tmp_path / "store"
    shutil.copytree(store, mixed)
    f = mixed / f"{CACHED_PAIRS[0][0]}__{CACHED_PAIRS[0][1]}__weight.json"
    f.write_text(json.dumps(old(json.loads(f.read_text()))))
    monkeypatch.setenv("LMC_CACHE_DIR", str(mixed))
    at = page()
    assert not at.exception and not at.warning
    names = list(by_name(chart(at, "barrier_chart")))
    assert f"{NAIVE}, train" in names and f"{WEIGHT}, train" not in names and WEIGHT in names
    rows = summary(at)
    assert rows[WEIGHT]["train barrier"] == "-" and rows[NAIVE]["train barrier"] != "-"


def test_a_vit_pair_draws_train_accuracy(tiny_env):
    _, store = tiny_env
    rec = cached_record(*CACHED_PAIRS[1], "naive", store)
    at = page()
    at.selectbox(key="pair").select(f"{CACHED_PAIRS[1][0]}__{CACHED_PAIRS[1][1]}").run()
    assert not at.exception
    train = by_name(chart(at, "accuracy_chart"))[f"{NAIVE}, train"]
    assert list(train["y"]) == pytest.approx([100 * a for a in rec["train_accuracy"]])


# ---------------------------------------------------------------------------------------------
# Runs


@pytest.fixture
def two_runs(tiny_env, tmp_path, monkeypatch) -> tuple[dict, dict]:
    """A kept LM naive run with a train curve and a weight-matching run from before train curves."""
    _, store = tiny_env
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path / "home"))
    new = history.save_run(cached_record(*CACHED_PAIRS[0], "naive", store))
    before = history.save_run(old(cached_record(*CACHED_PAIRS[0], "weight", store)))
    return new, before


def test_runs_compare_and_open_draw_train_curves_when_present(two_runs):
    new, before = two_runs
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page("app_pages/runs.py").run()
    at.multiselect(key="runs_compare").select(new["run"]["id"]).select(before["run"]["id"]).run()
    assert not at.exception
    opts = at.multiselect(key="runs_compare").options
    ids = list(at.dataframe[0].value["id"])
    la, lb = opts[ids.index(new["run"]["id"])], opts[ids.index(before["run"]["id"])]
    t = by_name(chart(at, "runs_compare_chart"))
    assert list(t[f"{la}, train"]["y"]) == pytest.approx(new["train_loss"], abs=0)
    assert t[f"{la}, train"]["line"]["dash"] == style.TRAIN_DASH and f"{lb}, train" not in t
    table = {r["run"]: r for r in at.dataframe[1].value.to_dict("records")}
    assert table[la]["train barrier"] == f"{new['train_barrier']:.4f}" and table[lb]["train barrier"] == "-"
    at.toggle(key="runs_compare_train").set_value(False).run()
    assert f"{la}, train" not in by_name(chart(at, "runs_compare_chart"))
    # opening the newer run (the one before train curves): no train line, no toggle
    assert at.selectbox(key="runs_open").value == before["run"]["id"]
    assert not any(n.endswith(", train") for n in by_name(chart(at, "runs_open_chart")))
    assert not [w for w in at.toggle if w.key == "runs_open_train"]
    at.selectbox(key="runs_open").select(new["run"]["id"]).run()
    assert list(by_name(chart(at, "runs_open_chart"))[f"{NAIVE}, train"]["y"]) == pytest.approx(new["train_loss"], abs=0)
    assert at.toggle(key="runs_open_train").value is True
    assert any(f"Train barrier {new['train_barrier']:.4f} on austen/train" in c.value for c in at.caption)
