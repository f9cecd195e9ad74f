"""app.figures is pure: records in, plotly figures out, the traces carry exactly the record's numbers."""

import ast
import json
from pathlib import Path

import pytest
from path_records import lm_record, vit_record

from app.figures import path as path_figs
from app.figures import style


def traces(fig, suffix=None):
    """Traces by role: curves carry the legend; chords and barrier bars are named '<curve>: chord|barrier'."""
    if suffix is None:
        return [t for t in fig.data if t.showlegend is not False and t.legendgroup != path_figs.KEY_GROUP]
    return [t for t in fig.data if t.name.endswith(f": {suffix}")]


def test_barrier_curve_is_the_record():
    rec = lm_record()
    fig = path_figs.barrier_figure([rec])
    (curve,) = traces(fig)
    assert list(curve.x) == rec["lambdas"] and list(curve.y) == rec["loss"]
    (chord,) = traces(fig, "chord")
    assert list(chord.x) == [0.0, 1.0] and list(chord.y) == [rec["loss"][0], rec["loss"][-1]]
    assert chord.line.dash == style.CHORD_DASH and chord.line.width < curve.line.width
    # the legend explains the chord and the barrier bar once, whatever the number of curves
    assert [t.name for t in fig.data if t.legendgroup == path_figs.KEY_GROUP] == \
        ["chord between the endpoints", "barrier: largest rise above the chord"]
    # the barrier bar stands at the worst grid point and is exactly `barrier` long
    (bar,) = traces(fig, "barrier")
    assert list(bar.x) == [0.5, 0.5]
    assert bar.y[1] == rec["loss"][2] and bar.y[1] - bar.y[0] == pytest.approx(rec["barrier"], abs=1e-12)


def test_axis_titles_carry_units():
    lm = path_figs.barrier_figure([lm_record()])
    assert lm.layout.yaxis.title.text == "Test loss (nats/byte)"
    assert lm.layout.xaxis.title.text.startswith("λ")
    vit = path_figs.barrier_figure([vit_record()])
    assert vit.layout.yaxis.title.text == "Test loss (nats/image)"
    other = {**lm_record(), "eval_set": "user text/test, 4,096 tokens (gpt2), context 128"}
    assert style.loss_unit(other) == "nats/token"


def test_every_method_is_overlaid_in_its_own_colour():
    recs = [lm_record("naive"), lm_record("weight", (2.0, 2.05, 2.1, 2.0, 1.9))]
    fig = path_figs.barrier_figure(recs, method_names={"naive": "Naive (no alignment)"})
    curves = traces(fig)
    assert [c.name for c in curves] == ["Naive (no alignment)", "weight"]
    assert [list(c.y) for c in curves] == [r["loss"] for r in recs]
    assert [c.line.color for c in curves] == [style.METHOD_COLOURS["naive"], style.METHOD_COLOURS["weight"]]
    # bars at the same λ are dodged apart so neither hides the other
    assert [list(b.x) for b in traces(fig, "barrier")] == [[0.5, 0.5], [0.5 + path_figs.BAR_DODGE] * 2]
    # chord and barrier bar share the curve's colour and legend group, so the legend toggles all three
    for c in curves:
        group = [t for t in fig.data if t.legendgroup == c.legendgroup]
        assert len(group) == 3 and {t.line.color for t in group} == {c.line.color}


def test_unknown_method_colour_is_stable():
    # the same colour in every process (Python's str hash is salted per process)
    assert style.method_colour("my-aligner") == "#BAB0AC" and "#BAB0AC" in style._SPARE
    assert style.method_colour("other") == "#72B7B2"  # and names spread over the spares


def test_live_run_is_drawn_beside_cached_and_told_apart():
    cached, live = lm_record(), lm_record(loss=(2.1, 2.2, 2.4, 2.1, 2.0))
    live["eval_tokens"] = 1024
    fig = path_figs.barrier_figure([cached], [live])
    c, v = traces(fig)
    assert list(v.y) == live["loss"] and v.marker.symbol == "diamond" and c.marker.symbol == "circle"
    assert v.name == "naive, live (1,024 tokens)"
    assert c.line.color == v.line.color  # same method, same colour
    # the live run is solid and bolder than any cached curve, the sidebar's method included
    assert v.line.dash == "solid" and v.line.width == path_figs.LIVE_WIDTH > path_figs.HIGHLIGHT_WIDTH
    highlighted = path_figs.barrier_figure([cached], [live], highlight="naive")
    assert [t.line.width for t in traces(highlighted)] == [path_figs.HIGHLIGHT_WIDTH, path_figs.LIVE_WIDTH]


def test_methods_differ_by_dash_as_well_as_colour_and_the_chosen_one_stands_out():
    methods = list(style.METHOD_COLOURS)
    recs = [lm_record(m) for m in methods]
    fig = path_figs.barrier_figure(recs, highlight="learned", log_y=True)
    dashes = [c.line.dash for c in traces(fig)]
    assert len(set(dashes)) == len(methods)  # learned and dual included: no two share a pattern
    assert style.CHORD_DASH not in dashes  # and none looks like a chord
    on = {c.name: (c.line.width, c.opacity) for c in traces(fig)}
    assert on["learned"] == (path_figs.HIGHLIGHT_WIDTH, 1.0)
    assert all(w < path_figs.HIGHLIGHT_WIDTH and o == path_figs.DIM_OPACITY for n, (w, o) in on.items() if n != "learned")
    assert fig.layout.yaxis.type == "log" and "log scale" in fig.layout.yaxis.title.text
    assert path_figs.barrier_figure(recs).layout.yaxis.type is None


def test_summary_rows_compare_each_curve_with_naive_on_the_same_evaluation():
    naive, weight = lm_record(), lm_record("weight", (2.0, 2.05, 2.1, 2.0, 1.9))
    live = {**lm_record("weight", (2.1, 2.2, 2.3, 2.1, 2.0)), "eval_set": "austen/test, 1,024 tokens"}
    rows = path_figs.summary_rows([naive, weight], [live])
    assert [r["curve"] for r in rows] == ["naive", "weight", "weight, live (8,192 tokens)"]
    assert rows[1]["vs naive"] == pytest.approx(weight["barrier"] - naive["barrier"], abs=1e-15)
    assert rows[0]["vs naive"] is None and rows[2]["vs naive"] is None  # no live naive of that evaluation
    assert rows[2]["barrier"] == live["barrier"] and "accuracy drop (pt)" not in rows[0]
    assert path_figs.summary_rows([vit_record()])[0]["accuracy drop (pt)"] == pytest.approx(67.5)


def test_accuracy_curve_in_percent_and_skips_lms():
    rec = vit_record()
    fig = path_figs.accuracy_figure([rec, lm_record("weight")])
    (curve,) = traces(fig)
    assert list(curve.y) == pytest.approx([100 * a for a in rec["accuracy"]])
    (chord,) = traces(fig, "chord")
    assert list(chord.y) == pytest.approx([98.0, 97.0])
    assert fig.layout.yaxis.title.text == "Test accuracy (%)"


def test_hover_names_value_and_unit():
    fig = path_figs.barrier_figure([lm_record()])
    (curve,) = traces(fig)
    assert "nats/byte" in curve.hovertemplate and "vs chord" in curve.hovertemplate
    (bar,) = traces(fig, "barrier")
    assert "barrier" in bar.hovertemplate and "λ = 0.50" in bar.hovertemplate


def test_figures_serialise_and_empty_input_is_an_empty_figure():
    json.loads(path_figs.barrier_figure([lm_record()], [vit_record()]).to_json())
    assert len(path_figs.barrier_figure([]).data) == 0
    assert len(path_figs.accuracy_figure([lm_record()]).data) == 0


def imports(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    out = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return out | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_figures_import_no_streamlit_and_the_app_no_torch():
    fig_dir = Path(path_figs.__file__).parent
    assert {"style.py", "path.py", "alignment.py", "symmetry.py"} <= {f.name for f in fig_dir.glob("*.py")}
    for f in fig_dir.glob("*.py"):
        assert not imports(f) & {"streamlit", "torch", "engine"}, f.name
    app_dir = fig_dir.parent
    # the app stays thin over the engine: tensors never reach a page
    assert [f.name for f in app_dir.rglob("*.py") if "torch" in imports(f)] == []

