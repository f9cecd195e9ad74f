"""The Symmetry page under AppTest: presets give group dimensions from a config alone, zoo models and
directories the engine's invariance checks, break tests, RoPE breaking and sinusoidal spectrum."""

from dataclasses import replace
from pathlib import Path

import pytest
from plotly_json import chart
from streamlit.testing.v1 import AppTest
from tiny_zoo import TINY

from app.figures import style
from engine.checks import EXACT_TOL
from engine.groups import sinusoidal_spectrum
from engine.models import save_model
from engine.models.reference import build
from engine.report import symmetry_report

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
PAGE = "app_pages/symmetry.py"
TIMEOUT = 60  # the first run imports torch; the machine's cores may be busy


def page(source: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["sym_source"] = source  # straight to the picker under test
    at.switch_page(PAGE).run()
    assert not at.exception
    return at


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_presets_count_dimensions_from_the_config_alone():
    from app.app_pages.symmetry import PRESETS

    at = page("preset")
    assert [t.value for t in at.title] == ["Symmetry"]  # drawn once
    assert len(at.expander) >= 1 and sum(e.label.startswith("Four positional encodings") for e in at.expander) == 1
    assert at.selectbox(key="sym_preset").value == "GPT-2 small"
    # h (d^2 + d^2) + key-bias h d + value-bias h d = 12 (2 * 64^2 + 2 * 64) (docs/MATH.md section 1)
    assert metrics(at)["Attention per layer"] == "99,840"
    assert not at.status  # no weights, nothing to wait for
    with pytest.raises(KeyError):
        at.get_by_key("checks_chart")
    assert any("From the config alone" in c.value for c in at.caption)

    at.selectbox(key="sym_preset").select("Llama-2-7B").run()
    assert not at.exception
    # RoPE: h (d + d^2) = 32 (128 + 128^2)
    assert metrics(at)["Attention per layer"] == "528,384"
    rep = symmetry_report(PRESETS["Llama-2-7B"], dims_only=True)
    bars = chart(at, "dims_chart")["data"][0]
    assert list(bars["y"]) == [v for v in rep["group_dim"]["by_kind"].values() if v]
    rope = chart(at, "rope_chart")["data"]
    strength = next(t for t in rope if t["name"].startswith("max"))
    assert list(strength["x"]) == [r["omega_ctx"] for r in rep["rope"]]
    assert list(strength["y"]) == [r["strength"] for r in rep["rope"]]
    # the same shape under each PE: RoPE's Q/K part is d per head, the others d^2
    pes = {t["name"]: list(t["y"]) for t in chart(at, "pe_chart")["data"]}
    assert pes["RoPE"][0] == 32 * 128 and pes["NoPE"][0] == 32 * 128 ** 2
    assert pes["RoPE + QK-norm"][0] == 128 // 2  # one gain scale per pair, for the whole layer

    at.selectbox(key="sym_preset").select("Qwen3-8B (QK-norm)").run()
    assert not at.exception
    # QK-norm: d/2 = 64 per layer (not per KV group), no key-bias shift; V/O 8 KV groups of GL(128)
    assert metrics(at)["Q/K per layer"] == "64"
    assert metrics(at)["Attention per layer"] == f"{64 + 8 * 128 ** 2:,}"
    assert any("QK-norm" in c.value for c in at.caption)


def test_a_zoo_model_shows_the_engines_checks_and_breaks(tiny_env):
    at = page("zoo")
    at.selectbox(key="sym_model").select("lm-rope-s0").run()
    assert not at.exception
    rep = symmetry_report("lm-rope-s0")  # seeded: the page's cached call returns the same numbers
    assert at.status[0].label == f"{len(rep['checks'])} invariance checks, {len(rep['breaks'])} break tests"
    drawn = {}
    for t in chart(at, "checks_chart")["data"]:
        drawn |= dict(zip(t["y"], t["x"]))
    for r in rep["checks"] + rep["breaks"]:
        assert drawn[r["group"]] == pytest.approx(max(r["max_rel_change"], style.LOG_FLOOR))
    assert {"qk_gl", "qk_other_layout"} <= set(drawn)  # RoPE's own break tests
    table = at.dataframe[0].value
    assert len(table) == len(rep["checks"]) + len(rep["breaks"])
    rows = rep["checks"] + rep["breaks"]
    assert table["exact (measured)"].tolist() == [r["max_rel_change"] < EXACT_TOL for r in rows]
    layer0 = rep["group_dim"]["per_layer"][0]
    assert metrics(at)["Attention per layer"] == f"{layer0['attention']:,}"
    assert at.get_by_key("rope_chart") is not None


def test_a_sinusoidal_directory_shows_the_table_spectrum(tiny_env, tmp_path):
    model = build(replace(TINY, pe="sinusoidal"), seed=0)
    save_model(model, tmp_path / "sin")
    at = page("dir")
    at.text_input(key="sym_dir").input(str(tmp_path / "sin")).run()
    assert not at.exception
    s = sinusoidal_spectrum(TINY.n_ctx, TINY.d_model)["singular_values"]
    y = chart(at, "spectrum_chart")["data"][0]["y"]
    assert list(y) == pytest.approx([max(v / s[0], style.LOG_FLOOR) for v in s])
    claimed = dict(zip(at.dataframe[0].value["group"], at.dataframe[0].value["claimed"]))
    assert claimed["residual_orth"] == "approximate"  # the fixed table breaks exact residual rotations
    # dimensions only: the same directory's config, no checks
    at.checkbox(key="sym_dims_only").check().run()
    assert not at.exception and not at.status
    with pytest.raises(KeyError):
        at.get_by_key("checks_chart")


def test_a_bad_directory_is_an_error_not_a_traceback(tiny_env):
    at = page("dir")
    at.text_input(key="sym_dir").input("/nonexistent/model").run()
    assert not at.exception
    assert at.error[0].value == "Model /nonexistent/model is neither a zoo model nor an existing directory."
    assert not at.status  # refused before any check starts
    assert not at.get("plotly_chart")


def test_side_by_side_puts_two_models_or_shapes_next_to_each_other(tiny_env):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["sym_mode"] = "side"
    at.switch_page(PAGE).run()
    assert not at.exception
    # the tiny zoo has a RoPE LM but no sinusoidal one: RoPE beside GPT-2's published shape
    assert (at.selectbox(key="sym_left").value, at.selectbox(key="sym_right").value) == ("lm-rope-s0", "GPT-2 small")
    left = chart(at, "dims_chart_left")
    assert left["layout"]["yaxis"]["type"] == "log" and "log scale" in left["layout"]["yaxis"]["title"]["text"]
    rep = symmetry_report("lm-rope-s0")
    assert list(left["data"][0]["y"]) == [v for v in rep["group_dim"]["by_kind"].values() if v]
    table = at.dataframe[0].value  # the left model's checks, coloured by measured change
    assert list(table.columns) == ["test", "group", "max relative change", "measured"]
    assert set(table["measured"]) <= {"exact", "small change", "changes the output", "not measured"}
    assert (table[table["test"] == "break test"]["measured"] == "changes the output").all()
    assert any(m.value.startswith("Exact (the output changes by less than 1e-10)") for m in at.markdown)
    from app.app_pages.symmetry import PRESETS

    at.selectbox(key="sym_right").select("Llama-2-7B").run()
    assert not at.exception
    llama = symmetry_report(PRESETS["Llama-2-7B"], dims_only=True)["group_dim"]["by_kind"]
    assert list(chart(at, "dims_chart_right")["data"][0]["y"]) == [v for v in llama.values() if v]
    assert [m.value for m in at.metric if m.label == "Q/K per layer"][1] == f"{32 * 128:,}"  # RoPE: h d
