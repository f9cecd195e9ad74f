"""The Symmetry page under AppTest: presets give group dimensions from a config alone, zoo models and
directories the engine's invariance checks, break tests, RoPE breaking and sinusoidal spectrum."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from plotly_json import chart
from streamlit.testing.v1 import AppTest
from tiny_zoo import TINY

from app.figures import style
from app.figures.symmetry import check_name
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


@pytest.mark.parametrize(("preset", "phrase"), [("Llama-3.2-1B (RoPE frequency scaling)", "llama3 frequency scaling"),
                                                ("OLMo-1B (LayerNorm without parameters)", "hf_olmo LM"),
                                                ("Gemma-2B (multi-query, GeGLU)", "hf_gemma LM"),
                                                ("Phi-2 (partial RoPE, one norm per block)", "hf_phi LM")])
def test_the_llama_3_olmo_gemma_and_phi_presets_read_and_keep_the_rope_group(preset: str, phrase: str):
    from app.app_pages.symmetry import PRESETS

    at = page("preset")
    at.selectbox(key="sym_preset").select(preset).run()
    assert not at.exception
    assert any(phrase in m.value for m in at.markdown)
    rep = symmetry_report(PRESETS[preset], dims_only=True)
    a = rep["arch"]
    # the RoPE commutant: one complex scalar per frequency pair and KV group, scaled frequencies or not, and GL on
    # the dims RoPE leaves alone (Phi-2 rotates 32 of 80)
    d, r = a["d_head"], a["rotary_dim"]
    assert rep["group_dim"]["by_kind"]["qk"] == a["n_layers"] * a["n_kv_heads"] * ((d - r) ** 2 + r)


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
        assert drawn[check_name(r["group"])] == pytest.approx(max(r["max_rel_change"], style.LOG_FLOOR))
    assert {"Q/K: any invertible map", "Q/K: the other RoPE pairing"} <= set(drawn)  # RoPE's own break tests
    table = at.dataframe[0].value
    assert len(table) == len(rep["checks"]) + len(rep["breaks"])
    rows = rep["checks"] + rep["breaks"]
    assert table["exact (measured)"].tolist() == ["yes" if r["max_rel_change"] < EXACT_TOL else "no" for r in rows]
    assert table["max relative change"].tolist() == [f"{r['max_rel_change']:.2e}" for r in rows]
    assert table["transform"].tolist() == [r["kind"] for r in rows]  # which group exactly, in the engine's words
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
    table = at.dataframe[0].value
    claimed = dict(zip(table["what is changed"], table["claimed"]))
    assert claimed["residual rotation"] == "approximate"  # the fixed table breaks exact residual rotations
    assert claimed["residual: a random rotation"] == "not a symmetry"
    # a check with nothing to measure says so in words: no empty cell, no None
    unmeasured = table[table["measured"] == "not measured"]
    assert len(unmeasured) >= 1 and (unmeasured["max relative change"] == "not measured").all()
    assert not table.isna().any().any() and "None" not in table.astype(str).to_numpy()
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


def side_view() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["sym_mode"] = "side"
    at.switch_page(PAGE).run()
    assert not at.exception
    return at


def cells(at, key: str) -> list[dict]:
    """The rows of a side's table: 'parts_table_left' is the first table with a 'part' column,
    'checks_table_right' the second with a 'test' column (AppTest gives dataframes no key)."""
    kind, _, side = key.rpartition("_")
    column = {"parts_table": "part", "checks_table": "test"}[kind]
    found = [d.value for d in at.dataframe if column in d.value.columns]
    return found[("left", "right").index(side)].to_dict("records")


def test_side_by_side_names_each_part_of_each_group_in_words(tiny_env):
    from app.app_pages.symmetry import PRESETS

    at = side_view()
    assert [t.value for t in at.title] == ["Symmetry"]  # drawn once in this view too
    assert sum(e.label.startswith("Four positional encodings") for e in at.expander) == 1
    # the tiny zoo has a RoPE LM but no sinusoidal one: RoPE beside GPT-2's published shape
    assert (at.selectbox(key="sym_left").value, at.selectbox(key="sym_right").value) == ("lm-rope-s0", "GPT-2 small")
    rope = symmetry_report("lm-rope-s0")
    gpt2 = symmetry_report(PRESETS["GPT-2 small"], dims_only=True)
    left = {r["part"]: r for r in cells(at, "parts_table_left")}
    right = {r["part"]: r for r in cells(at, "parts_table_right")}
    a, g = rope["arch"], gpt2["arch"]
    assert a["rotary_dim"] == a["d_head"] == 8 and g["d_head"] == 64
    # the same part, two groups: RoPE's commutant beside GL(64), each named so a student can tell them apart
    assert left["Q/K maps"]["group"] == "one complex scalar per frequency pair (4 per head): q turns and scales, " \
                                        "k undoes it"
    assert right["Q/K maps"]["group"] == "GL(64): any invertible 64×64 map per head, undone on the keys by its " \
                                         "inverse transpose"
    assert right["V/O maps"]["group"] == "GL(64): any invertible 64×64 map per head, undone in the output projection"
    assert right["Heads"]["group"] == "any permutation of the 12 heads (discrete)"
    # per layer and whole model told apart: d = 8 per head, 4 heads, 2 layers; h d^2 = 12 * 64^2, 12 layers
    assert (left["Q/K maps"]["per layer"], left["Q/K maps"]["whole model"]) == ("32", "64")
    assert (right["Q/K maps"]["per layer"], right["Q/K maps"]["whole model"]) == ("49,152", "589,824")
    assert (left["Residual stream"]["per layer"], left["Residual stream"]["whole model"]) == ("-", "496")  # O(32)
    assert left["Total"]["whole model"] == f"{rope['group_dim']['total']:,}"
    assert right["Total"]["per layer"] == f"{gpt2['group_dim']['per_layer'][0]['total']:,}"
    m = [(x.label, x.value) for x in at.metric]
    assert m == [("Dimension per layer", f"{rope['group_dim']['per_layer'][0]['total']:,}"),
                 ("Whole model (2 layers)", f"{rope['group_dim']['total']:,}"),
                 ("Dimension per layer", "105,216"), ("Whole model (12 layers)", "1,557,120")]
    # words, not code names; no None in any cell of this view
    tables = [cells(at, k) for k in ("parts_table_left", "parts_table_right", "checks_table_left")]
    for row in (r for t in tables for r in t):
        for v in row.values():
            assert isinstance(v, str) and v != "None" and "None" not in v, row
    checks = cells(at, "checks_table_left")
    assert list(checks[0]) == ["test", "what is changed", "transform", "max relative change", "measured"]
    what = {r["what is changed"]: r for r in checks}
    assert {"Q/K maps", "Q/K: the other RoPE pairing", "residual rotation"} <= set(what)
    assert not any("_" in w for w in what)
    assert what["Q/K maps"]["transform"].startswith("RoPE commutant H(8)")  # the transform column is back
    assert what["Q/K: the other RoPE pairing"]["measured"] == "changes the output"


def test_side_by_side_draws_the_same_parts_on_one_axis_with_zeros_as_zeros(tiny_env):
    from app.app_pages.symmetry import PRESETS

    at = side_view()
    rope = symmetry_report("lm-rope-s0")["group_dim"]["by_kind"]
    gpt2 = symmetry_report(PRESETS["GPT-2 small"], dims_only=True)["group_dim"]["by_kind"]
    left, right = chart(at, "dims_chart_left"), chart(at, "dims_chart_right")
    labels = ["Q/K maps", "V/O maps", "key-bias shift", "value-bias fold", "residual rotation", "LayerNorm reader gauge"]
    assert list(left["data"][0]["x"]) == list(right["data"][0]["x"]) == labels
    assert list(left["data"][0]["y"]) == [rope["qk"], rope["vo"], 0, 0, rope["residual_orth"], 0]
    assert list(right["data"][0]["y"]) == [gpt2[k] for k in ("qk", "vo", "key_bias", "value_bias", "residual_orth",
                                                             "ln_reader_gauge")]
    # the parts the RoPE model lacks read 0 at the foot of the log axis, in the part's colour
    zeros = [(n["x"], n["text"], n["font"]["color"]) for n in left["layout"]["annotations"]]
    assert zeros == [("key-bias shift", "<b>0</b>", style.PART_COLOURS["key_bias"]),
                     ("value-bias fold", "<b>0</b>", style.PART_COLOURS["value_bias"]),
                     ("LayerNorm reader gauge", "<b>0</b>", style.PART_COLOURS["ln_reader_gauge"])]
    assert "annotations" not in right["layout"] or not right["layout"]["annotations"]
    assert left["layout"]["yaxis"]["range"] == right["layout"]["yaxis"]["range"]  # one scale for both sides
    assert left["layout"]["yaxis"]["type"] == "log"
    assert left["layout"]["yaxis"]["title"]["text"] == "Group dimension, whole model, 2 layers (free parameters, log scale)"
    assert "12 layers" in right["layout"]["yaxis"]["title"]["text"]

    at.selectbox(key="sym_right").select("Llama-2-7B").run()
    assert not at.exception
    llama = symmetry_report(PRESETS["Llama-2-7B"], dims_only=True)["group_dim"]["by_kind"]
    assert list(chart(at, "dims_chart_right")["data"][0]["x"]) == ["Q/K maps", "V/O maps", "MLP scaling",
                                                                   "residual rotation"]
    assert list(chart(at, "dims_chart_right")["data"][0]["y"]) == [llama[k] for k in ("qk", "vo", "mlp_scale",
                                                                                      "residual_orth")]
    assert {r["part"]: r["per layer"] for r in cells(at, "parts_table_right")}["Q/K maps"] == f"{32 * 128:,}"


def test_side_by_side_offers_its_downloads(tiny_env, downloads):
    side_view()
    assert {"symmetry_side_left_json", "symmetry_side_left_md", "symmetry_side_right_json", "symmetry_side_right_md",
            "symmetry_side_figures"} <= set(downloads)
    left, right = "lm-rope-s0", "GPT-2_small"
    assert downloads["symmetry_side_left_md"][1] == f"{left}__symmetry.md"
    assert downloads["symmetry_side_right_json"][1] == f"{right}__symmetry.json"
    md = downloads["symmetry_side_left_md"][0].decode()
    assert md.startswith("# Symmetry report: lm-rope-s0\n") and "\nlm-rope-s0 (reference)" in md
    assert json.loads(downloads["symmetry_side_right_json"][0])["model"] == "config"
    page, name = downloads["symmetry_side_figures"][0].decode(), downloads["symmetry_side_figures"][1]
    assert name == "symmetry__lm-rope-s0_vs_GPT-2_small__figures.html"
    assert "<h2>Group dimension by part, whole model: lm-rope-s0</h2>" in page
    assert "<h2>Group dimension by part, whole model: GPT-2 small</h2>" in page
    for key, (data, _, _, _) in downloads.items():
        for p in (str(Path(APP).parents[1]), str(Path.home()), "/tmp"):
            assert p not in data.decode(errors="replace"), (key, p)


# ---------------------------------------------------------------------------------------------
# The figures' zeros


def test_a_zero_part_reads_0_on_either_axis():
    from app.figures import symmetry as figs

    fig = figs.group_dim_figure({"qk": 64, "vo": 512, "pe_shift": 0}, parts=["qk", "vo", "pe_shift"], top=1000)
    assert list(fig.data[0].y) == [64, 512, 0] and list(fig.data[0].text) == ["64", "512", ""]
    (zero,) = fig.layout.annotations
    assert (zero.x, zero.y, zero.text) == ("embedding / PE shift", 0, "<b>0</b>")
    assert fig.layout.yaxis.range == (0, 3.5)  # log10(1000) + 0.5: the shared top, not this figure's own
    assert not figs.group_dim_figure({"qk": 64, "vo": 512}).layout.annotations  # nothing is zero

    def gd(qk, res, shift):
        return {"per_layer": [{"qk": qk, "vo": 4096}], "by_kind": {"residual_orth": res, "pe_shift": shift}}

    fig = figs.pe_comparison_figure({"none": gd(4096, 8128, 0), "sinusoidal": gd(4096, 0, 0),
                                     "learned": gd(4096, 8128, 128)})
    # three encodings per part: bar i of 3 in slot j sits at j - 0.4 + (i + 0.5) * 0.8 / 3
    marks = sorted((round(n.x, 6), n.font.color) for n in fig.layout.annotations)
    want = [(3 - 0.4 + 0.5 * 0.8 / 3, style.PE_COLOURS["none"]),
            (2 - 0.4 + 1.5 * 0.8 / 3, style.PE_COLOURS["sinusoidal"]), (3 - 0.4 + 1.5 * 0.8 / 3, style.PE_COLOURS["sinusoidal"])]
    assert marks == sorted((round(x, 6), c) for x, c in want)
    assert (fig.layout.bargap, fig.layout.bargroupgap) == (0.2, 0)
