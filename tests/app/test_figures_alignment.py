"""The alignment and symmetry figures of app.figures: pure, and their traces carry exactly the input's numbers."""

import json
import math

import numpy as np
import pytest
from plotly_json import decode_plotly

from app.figures import alignment as alignment_figs
from app.figures import style
from app.figures import symmetry as symmetry_figs
from engine import api

LAYERS = [
    {"head_perm": [1, 0, 3, 2], "kv_perm": [0, 1], "mlp_perm": [0, 1, 3, 2, 4, 5, 7, 6],
     "qk_singular_values": [[2.0, 1.0], [1.5, 0.5]], "vo_singular_values": [[3.0, 1.0], [1.0, 1.0]],
     "rope_scalars": {"abs": [[1.0, 1.2], [0.9, 1.1]], "angle": [[0.0, math.pi / 2], [-math.pi / 4, math.pi]]}},
    {"head_perm": [2, 3, 0, 1], "kv_perm": [1, 0], "mlp_perm": list(range(8))},
]


def test_permutation_matrix_rows_are_a_columns_are_b():
    # A's slot i takes B's slot perm[i] (engine/symmetry.py), so row i has its one in column perm[i]
    assert alignment_figs.permutation_matrix([2, 0, 1]) == [[0, 0, 1], [1, 0, 0], [0, 1, 0]]


def test_head_permutation_heatmap_is_the_matrix_with_kv_groups_outlined():
    fig = alignment_figs.head_permutation_figure(LAYERS[1]["head_perm"], n_kv_heads=2, colour="#123456")
    (heat,) = fig.data
    assert [list(r) for r in heat.z] == alignment_figs.permutation_matrix([2, 3, 0, 1])
    assert heat.colorscale[-1][1] == "#123456"
    assert fig.layout.yaxis.autorange == "reversed"  # head 0 on top: the identity is the main diagonal
    assert fig.layout.xaxis.title.text == "Model B head (as trained)"
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    # A's group 0 (rows 0-1) takes B's group 1 (columns 2-3) and vice versa
    assert sorted((s.y0, s.x0) for s in rects) == [(-0.5, 1.5), (1.5, -0.5)]
    assert alignment_figs.gqa_blocks([2, 3, 0, 1], 2) == [(0, 1, 2), (1, 0, 2)]
    assert alignment_figs.gqa_blocks([1, 0, 3, 2], 4) == []  # no grouped-query attention, nothing to outline
    assert not alignment_figs.head_permutation_figure([1, 0, 3, 2], n_kv_heads=4).layout.shapes


def test_overview_has_one_heatmap_per_layer_on_its_own_axes():
    fig = alignment_figs.head_permutations_overview([L["head_perm"] for L in LAYERS], n_kv_heads=2)
    assert [[list(r) for r in t.z] for t in fig.data] == [alignment_figs.permutation_matrix(L["head_perm"]) for L in LAYERS]
    assert [t.xaxis for t in fig.data] == ["x", "x2"]
    assert [a.text for a in fig.layout.annotations] == ["layer 0", "layer 1"]
    assert len(alignment_figs.head_permutations_overview([]).data) == 0


def test_overview_axes_are_titled_once_per_row_and_column():
    fig = alignment_figs.head_permutations_overview([L["head_perm"] for L in LAYERS] * 4, max_cols=6)  # 2 rows
    titled_x = [k for k in fig.layout if k.startswith("xaxis") and fig.layout[k].title.text == "B head"]
    titled_y = [k for k in fig.layout if k.startswith("yaxis") and fig.layout[k].title.text == "A head"]
    assert sorted(titled_x) == ["xaxis7", "xaxis8"] and sorted(titled_y) == ["yaxis", "yaxis7"]


COST = [[4.0, 1.0, 9.0, 9.0], [0.5, 6.0, 9.0, 9.0], [9.0, 9.0, 2.0, 3.0], [9.0, 9.0, 0.25, 7.0]]


def test_head_cost_matrix_with_the_chosen_permutation_drawn_on_it():
    perm = [1, 0, 3, 2]
    fig = alignment_figs.head_cost_figure(COST, perm, n_kv_heads=2, title="t")
    heat, chosen = fig.data
    assert [list(r) for r in heat.z] == COST
    assert list(chosen.x) == perm and list(chosen.y) == [0, 1, 2, 3]
    assert list(chosen.customdata) == [1.0, 0.5, 3.0, 0.25]  # the hover names both heads and the cost
    assert "A head %{y}" in heat.hovertemplate and "B head %{x}" in heat.hovertemplate
    assert "cost %{z" in heat.hovertemplate and heat.customdata[0][1] == " (chosen)" and heat.customdata[0][0] == ""
    assert fig.layout.xaxis.title.text == "Model B head (as trained)" and fig.layout.yaxis.title.text == "Model A head"
    assert len([s for s in fig.layout.shapes if s.type == "rect"]) == 2
    assert not alignment_figs.head_cost_figure(COST, perm, n_kv_heads=4).layout.shapes


SIM = {"matched": [-0.1, 0.2, 0.5, 0.7, 0.9], "same_index": [-0.4, -0.1, 0.0, 0.1, 0.3]}


def test_matched_neurons_sorted_against_same_index():
    fig = alignment_figs.mlp_similarity_figure(SIM, colour="#abcdef")
    same, matched = fig.data
    assert list(matched.y) == SIM["matched"] and list(same.y) == SIM["same_index"]
    assert list(matched.x) == [0.0, 25.0, 50.0, 75.0, 100.0] and matched.line.color == "#abcdef"
    assert same.line.color == style.BEFORE_COLOUR and same.line.dash == "dash"
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text == alignment_figs.SIMILARITY_AXIS
    over = alignment_figs.mlp_similarity_overview([SIM, {"matched": [1.0] * 5, "same_index": [0.0] * 5}])
    same, matched = over.data
    assert list(matched.y) == [0.5, 1.0] and list(same.y) == [0.0, 0.0]  # the medians
    assert list(matched.x) == ["layer 0", "layer 1"] and over.layout.yaxis.title.text


def test_matching_cost_bars_before_grey_after_in_the_methods_colour():
    cost = {"before": {"outer": 0.8, "blocks.0": 0.6, "blocks.1": 0.7},
            "after": {"outer": 0.1, "blocks.0": 0.4, "blocks.1": 0.5}}
    fig = alignment_figs.matching_cost_figure(cost, "dual", "Dual learned matching")
    before, after = fig.data
    assert list(before.x) == ["layer 0", "layer 1", "embeddings & head"]
    assert list(before.y) == [0.6, 0.7, 0.8] and list(after.y) == [0.4, 0.5, 0.1]
    assert before.marker.color == style.BEFORE_COLOUR and after.marker.color == style.METHOD_COLOURS["dual"]
    assert after.name == "after Dual learned matching"
    assert fig.layout.barmode == "group" and "‖θ_A − g·θ_B‖²" in fig.layout.yaxis.title.text


def test_rope_scalars_polar_one_trace_per_kv_group_in_degrees():
    z = LAYERS[0]["rope_scalars"]
    fig = alignment_figs.rope_scalars_figure(z["abs"], z["angle"], api.rope_frequencies(
        {"pe": "rope", "rotary_dim": 4, "rope_base": 10000.0}))
    assert len(fig.data) == 2 and all(t.type == "scatterpolar" for t in fig.data)
    assert list(fig.data[0].r) == [1.0, 1.2]
    assert list(fig.data[1].theta) == pytest.approx([-45.0, 180.0])
    assert [t.marker.color for t in fig.data] == list(style.GROUP_COLOURS[:2])
    # the hover names each pair's frequency omega_j = base^(-2j/r), r = 2 * pairs
    assert fig.data[0].customdata[1][1] == pytest.approx(10000.0 ** (-2 * 1 / 4))
    assert "ω" in fig.data[0].hovertemplate
    assert "ω" not in alignment_figs.rope_scalars_figure(z["abs"], z["angle"]).data[0].hovertemplate
    # with Llama 3's frequency scaling the hover names the scaled frequencies: the slow pair (wavelength 628, beyond
    # 8 / 1) divided by the factor, the fast one (wavelength 2 pi, between 8 / 4 and 8 / 1) blended
    scaled = api.rope_frequencies({"pe": "rope", "rotary_dim": 4, "rope_base": 10000.0, "rope_scaling": (
        '{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8, '
        '"rope_type": "llama3"}')})
    smooth = (8 / (2 * math.pi) - 1) / (4 - 1)
    assert scaled == pytest.approx([(1 - smooth) / 8 + smooth, 0.01 / 8], rel=1e-12)


def test_singular_values_one_panel_per_map_log_scale():
    L = LAYERS[0]
    fig = alignment_figs.singular_values_figure({"Q/K map": L["qk_singular_values"], "V/O map": L["vo_singular_values"]})
    assert [list(t.y) for t in fig.data] == L["qk_singular_values"] + L["vo_singular_values"]
    assert [t.xaxis for t in fig.data] == ["x", "x", "x2", "x2"]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    # every tick a plain number, not plotly's bare in-decade digits ('3, 2, 1, 9, 8' down from 3 to 0.8)
    assert fig.layout.yaxis.tickformat == fig.layout.yaxis2.tickformat == "~g"
    assert [t.showlegend for t in fig.data] == [True, True, False, False]  # one legend entry per KV group
    assert len(alignment_figs.singular_values_figure({"Q/K map": None}).data) == 0


def test_residual_map_orientation_and_identity():
    # permutation: column i has its one in row perm[i] (engine.align.solvers.residual_perm_of)
    assert alignment_figs.residual_matrix({"kind": "permutation", "perm": [1, 2, 0]}) == alignment_figs.permutation_matrix([1, 2, 0])
    O = [[0.0, -1.0], [1.0, 0.0]]  # B's coordinate j feeds A's coordinate i with weight O[j][i]
    assert alignment_figs.residual_matrix({"kind": "orthogonal", "matrix": O}) == [[0.0, 1.0], [-1.0, 0.0]]
    # how permutation-like: the largest |weight| per A coordinate, sorted; all ones for a permutation
    assert alignment_figs.residual_concentration({"kind": "permutation", "perm": [1, 2, 0]}) == [1, 1, 1]
    c = 2 ** -0.5
    R = {"kind": "orthogonal", "matrix": [[c, -c, 0.0], [c, c, 0.0], [0.0, 0.0, -1.0]]}
    assert alignment_figs.residual_concentration(R) == [1.0, c, c]
    fig = alignment_figs.residual_concentration_figure(R)
    assert list(fig.data[0].y) == [1.0, c, c] and fig.layout.yaxis.title.text and fig.layout.xaxis.title.text
    assert alignment_figs.residual_concentration_figure({"kind": "identity", "perm": [0, 1]}) is None


def test_within_head_maps_name_heads_unless_grouped_query():
    assert alignment_figs.group_name(2, 4) == "KV group" and alignment_figs.group_name(4, 4) == "head"
    z = LAYERS[0]["rope_scalars"]
    fig = alignment_figs.rope_scalars_figure(z["abs"], z["angle"], group="head")
    assert [t.name for t in fig.data] == ["head 0", "head 1"] and "KV" not in fig.data[0].hovertemplate
    sv = alignment_figs.singular_values_figure({"V/O map": LAYERS[0]["vo_singular_values"]}, group="head")
    assert [t.name for t in sv.data] == ["head 0", "head 1"]


def test_history_validation_training_kept_step_and_one_sided():
    hist = {"step": [0, 5, 10], "train_loss": [None, 2.0, 1.8], "val_midpoint_loss": [3.0, 2.1, 1.9],
            "val_barrier": [1.2, 0.4, 0.5], "val_worst_lambda": [0.5, 0.3, 0.9]}
    d = {"history": hist, "best_step": 5, "settings": {"lambdas": "narrow"},
         "one_sided_same_budget": {"history": {**hist, "val_barrier": [1.2, 0.6, 0.7]}}}
    fig = alignment_figs.history_figure(d, "dual", "nats/byte", {"dual": "Dual", "learned": "One-sided"})
    val, train, kept, one_val, one_train = fig.data
    assert list(val.y) == [1.2, 0.4, 0.5] and "barrier" in val.name  # the validation barrier, not the midpoint
    assert val.line.color == style.METHOD_COLOURS["dual"]
    assert list(train.x) == [5, 10] and list(train.y) == [2.0, 1.8]  # step 0 has no training loss
    assert train.yaxis == "y2" and "λ ~ U(0.4, 0.6)" in train.name  # the loss on its own axis
    assert list(kept.x) == [5] and list(kept.y) == [0.4]  # the kept element is the lowest barrier
    assert list(one_val.y) == [1.2, 0.6, 0.7] and one_val.line.dash == "dash"
    assert one_val.line.color == style.METHOD_COLOURS["learned"] and one_train.line.dash == "dot"
    assert fig.layout.yaxis.title.text == "Validation barrier (nats/byte)"
    assert fig.layout.yaxis2.title.text == "Training loss (nats/byte)"
    adaptive = alignment_figs.history_figure(d | {"settings": {"lambdas": "adaptive"}}, "learned", "nats/image")
    assert "worst validation λ" in adaptive.data[1].name and "0.4" not in adaptive.data[1].name


def test_weight_sweeps_and_activation_correlation():
    sweeps = [{"sweep": 1, "objective": 10.0, "residual_change": 0.3}, {"sweep": 2, "objective": 9.0,
                                                                         "residual_change": 0.0}]
    fig = alignment_figs.sweeps_figure(sweeps)
    assert list(fig.data[0].x) == [1, 2] and list(fig.data[0].y) == [10.0, 9.0]
    fig = alignment_figs.correlation_figure([0.4, 0.3])
    assert list(fig.data[0].y) == [0.4, 0.3] and fig.data[0].marker.color == style.METHOD_COLOURS["activation"]


CHECKS = [
    {"group": "heads", "kind": "S_4 head permutation", "max_rel_change": 0.0, "exact": True, "note": ""},
    {"group": "qk", "kind": "GL(8)", "max_rel_change": 3e-16, "exact": True, "note": ""},
    {"group": "residual_orth", "kind": "O(32)", "max_rel_change": 0.4, "exact": False, "note": "approximate"},
    {"group": "residual_perm", "kind": "S_32", "max_rel_change": None, "exact": False, "note": "refused"},
]
BREAKS = [{"group": "qk_gl", "kind": "GL(8) on Q/K of a RoPE model", "max_rel_change": 0.25, "exact": False}]


def test_invariance_bars_log_scale_by_status_with_the_exactness_line():
    fig = symmetry_figs.invariance_figure(CHECKS, BREAKS, tol=1e-10)
    by_name = {t.name: t for t in fig.data}
    exact = by_name[style.CHECK_LABELS["exact"]]
    assert list(exact.y) == ["heads", "qk"]
    assert list(exact.x) == [style.LOG_FLOOR, 3e-16]  # an exact zero sits on the floor of the log axis
    assert exact.customdata[0][1] == 0.0  # ... and the hover says 0
    assert list(by_name[style.CHECK_LABELS["approximate"]].y) == ["residual_orth"]
    assert list(by_name[style.CHECK_LABELS["break"]].x) == [0.25]
    assert [t.marker.color for t in fig.data] == [style.CHECK_COLOURS[s] for s in ("exact", "approximate", "break")]
    assert "residual_perm" not in {y for t in fig.data for y in t.y}  # not measured: no bar
    (line,) = fig.layout.shapes
    assert line.x0 == line.x1 == 1e-10
    assert fig.layout.xaxis.type == "log" and "1e-10" in fig.layout.xaxis.title.text


def test_group_dimension_bars_leave_out_discrete_parts():
    by_kind = {"heads": 0, "mlp": 0, "qk": 512, "vo": 16384, "residual_orth": 8128, "pe_shift": 0}
    fig = symmetry_figs.group_dim_figure(by_kind)
    assert list(fig.data[0].x) == ["Q/K maps", "V/O maps", "residual rotation"]
    assert list(fig.data[0].y) == [512, 16384, 8128]
    assert list(fig.data[0].text) == ["512", "16.4k", "8,128"]
    assert list(fig.data[0].marker.color) == [style.PART_COLOURS[k] for k in ("qk", "vo", "residual_orth")]
    per_layer = [{"layer": i, "qk": 128, "vo": 4096, "key_bias": 0, "value_bias": 0, "mlp": 0, "ln_reader_gauge": 0}
                 for i in range(2)]
    fig = symmetry_figs.group_dim_per_layer_figure(per_layer)
    assert [t.name for t in fig.data] == ["Q/K maps", "V/O maps"] and fig.layout.barmode == "stack"
    assert style.compact(8_386_560) == "8.39M" and style.compact(4096) == "4,096"


def test_pe_comparison_reads_per_layer_parts_from_layer_zero():
    def gd(qk, res, shift):
        return {"per_layer": [{"qk": qk, "vo": 4096}], "by_kind": {"residual_orth": res, "pe_shift": shift}}

    fig = symmetry_figs.pe_comparison_figure({"none": gd(4096, 8128, 0), "rope": gd(128, 8128, 0),
                                        "sinusoidal": gd(4096, 0, 0), "learned": gd(4096, 8128, 128)})
    ys = {t.name: list(t.y) for t in fig.data}
    assert ys == {"NoPE": [4096, 4096, 8128, 0], "RoPE": [128, 4096, 8128, 0],
                  "sinusoidal PE": [4096, 4096, 0, 0], "learned PE": [4096, 4096, 8128, 128]}
    order = ("none", "rope", "sinusoidal", "learned")
    assert [t.marker.color for t in fig.data] == [style.PE_COLOURS[p] for p in order]


def test_rope_breaking_against_omega_times_context_on_a_log_axis():
    rows = [{"pair": 0, "omega": 1.0, "omega_ctx": 128.0, "strength": 1.0, "rms": 0.7},
            {"pair": 1, "omega": 1e-3, "omega_ctx": 0.128, "strength": 0.127, "rms": 0.07}]
    fig = symmetry_figs.rope_breaking_figure(rows)
    strength = next(t for t in fig.data if t.name.startswith("max"))
    assert list(strength.x) == [128.0, 0.128] and list(strength.y) == [1.0, 0.127]
    assert fig.layout.xaxis.type == "log" and "ω_j · T" in fig.layout.xaxis.title.text
    (band,) = fig.layout.shapes
    assert band.x1 == 1  # shaded where omega T < 1


def test_sinusoidal_spectrum_relative_to_the_largest_with_the_threshold():
    fig = symmetry_figs.sinusoidal_spectrum_figure([10.0, 1.0, 1e-6, 0.0], rtol=1e-6)
    assert list(fig.data[0].y) == [1.0, 0.1, 1e-7, style.LOG_FLOOR]
    assert list(fig.data[0].customdata) == [10.0, 1.0, 1e-6, 0.0]
    colours = list(fig.data[0].marker.color)
    assert colours[:2] == [style.PE_COLOURS["sinusoidal"]] * 2 and colours[2:] == [style.CHECK_COLOURS["break"]] * 2
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 1e-6 and fig.layout.yaxis.type == "log"


def test_every_new_figure_reaches_the_browser_with_its_traces_and_numbers():
    """What the browser receives: each figure's JSON decodes to as many traces as the figure draws (at
    least one), of the same types, carrying the same x, y, z, r and theta values."""
    L = LAYERS[0]
    figs = [
        alignment_figs.head_permutation_figure(L["head_perm"], 2), alignment_figs.head_permutations_overview([L["head_perm"]] * 7),
        alignment_figs.head_cost_figure(COST, L["head_perm"], 2), alignment_figs.mlp_similarity_figure(SIM),
        alignment_figs.mlp_similarity_overview([SIM]),
        alignment_figs.rope_scalars_figure(L["rope_scalars"]["abs"], L["rope_scalars"]["angle"], [1.0, 0.01]),
        alignment_figs.singular_values_figure({"V/O map": L["vo_singular_values"]}),
        alignment_figs.residual_concentration_figure({"kind": "permutation", "perm": [1, 0]}),
        symmetry_figs.invariance_figure(CHECKS, BREAKS), symmetry_figs.group_dim_figure({"qk": 1}),
        symmetry_figs.sinusoidal_spectrum_figure([1.0, 0.5]),
    ]
    for f in figs:
        sent = decode_plotly(json.loads(f.to_json()))["data"]
        assert len(sent) == len(f.data) > 0
        for got, trace in zip(sent, f.data):
            assert got["type"] == trace.type
            for k in ("x", "y", "z", "r", "theta"):
                if k in trace and trace[k] is not None:
                    assert np.asarray(got[k]).tolist() == np.asarray(trace[k]).tolist(), (trace.type, k)


# ---------------------------------------------------------------------------------------------
# Where the barrier lives: the record's `attribution` (engine/attribution.py)


def block(name, layer, part, a, b):
    return {"block": name, "layer": layer, "part": part, "excess_a": a, "excess_b": b, "excess": (a + b) / 2}


def attributed(method="weight", classes=True, **att):
    """A two-layer LM record whose layer 0 holds the most (0.88 of a 0.78 barrier; MLP 0.66, attention 0.50)
    and whose MLP permutations buy the most (1.16)."""
    blocks = [block("embedding", None, "all", 0.10, 0.06),
              block("layer 0", 0, "all", 0.90, 0.86), block("layer 0", 0, "attention", 0.52, 0.48),
              block("layer 0", 0, "mlp", 0.70, 0.62),
              block("layer 1", 1, "all", 0.32, 0.28), block("layer 1", 1, "attention", 0.05, 0.15),
              block("layer 1", 1, "mlp", -0.04, 0.0),
              block("head", None, "all", 0.03, 0.01)]
    rises = [("vo", 0.05), ("residual", 0.40), ("mlp", 1.16), ("heads", 0.12), ("qk", -0.01)]  # not in reading order
    return {
        "method": method, "model_a": "lm-rope-s0", "model_b": "lm-rope-s1",
        "eval_set": "austen/test, 8,192 tokens (bytes), context 128",
        "alignment": {"classes": ["heads", "mlp", "qk", "residual_orth", "vo"] if classes else []},
        "attribution": {"lambda": 0.5, "midpoint_barrier": 0.78, "blocks": blocks,
                        "sum_of_layers": sum(b["excess"] for b in blocks if b["part"] == "all"),
                        "classes": [{"class": c, "midpoint_barrier": 0.78 + r, "rise": r} for c, r in rises]
                        if classes else [],
                        "eval_set": "austen/test, 8,192 tokens (bytes), context 128", "seconds": 1.0} | att,
    }


def test_attribution_bars_per_block_in_path_order_with_the_midpoint_line():
    rec = attributed()
    fig = alignment_figs.attribution_figure(rec, "Weight matching")
    whole, attention, mlp, line = fig.data
    assert [t.name for t in (whole, attention, mlp)] == ["whole block", "its attention alone", "its MLP alone"]
    assert list(whole.y) == pytest.approx([0.08, 0.88, 0.30, 0.02])  # embedding, layer 0, layer 1, head
    assert list(attention.y) == pytest.approx([0.50, 0.10]) and list(mlp.y) == pytest.approx([0.66, -0.02])
    # a layer's three bars side by side around its tick; embedding and head alone on theirs
    d = alignment_figs.PART_OFFSET
    assert list(whole.x) == pytest.approx([0, 1 - d, 2 - d, 3])
    assert list(attention.x) == [1, 2] and list(mlp.x) == pytest.approx([1 + d, 2 + d])
    assert list(fig.layout.xaxis.ticktext) == ["embedding", "layer 0", "layer 1", "head"]
    assert list(fig.layout.xaxis.tickvals) == [0, 1, 2, 3]
    assert list(line.y) == [0.78, 0.78] and list(line.x) == [-0.5, 3.5] and line.name == "midpoint barrier (0.78)"
    assert list(whole.text) == ["0.08", "0.88", "0.30", "0.02"]
    assert list(whole.customdata[1][1:]) == [0.90, 0.86]  # the hover gives both endpoints' excess
    assert mlp.customdata[0][0] == "layer 0, its MLP alone"
    assert whole.marker.color == style.METHOD_COLOURS["weight"] and mlp.marker.pattern.shape
    assert fig.layout.yaxis.title.text == "Loss excess (nats/byte)"
    assert fig.layout.yaxis.range[0] < -0.02 and fig.layout.yaxis.range[1] > 0.88  # every bar and its label inside
    assert fig.layout.title.subtitle.text == "lm-rope-s0 / lm-rope-s1, Weight matching"
    assert fig.layout.xaxis.automargin and fig.layout.yaxis.automargin
    json.loads(fig.to_json())


def test_class_rise_bars_in_reading_order_with_readable_names():
    rec = attributed()
    fig = alignment_figs.class_rise_figure(rec, "Weight matching")
    (bars,) = fig.data
    assert list(bars.y) == ["head permutations", "MLP neuron permutations", "Q/K maps", "V/O maps", "residual rotation"]
    assert list(bars.x) == [0.12, 1.16, -0.01, 0.05, 0.40]
    assert list(bars.customdata) == pytest.approx([0.90, 1.94, 0.77, 0.83, 1.18])  # the barrier without the class
    colour = style.METHOD_COLOURS["weight"]
    assert list(bars.marker.color) == [colour, colour, style.BEFORE_COLOUR, colour, colour]  # qk buys nothing
    assert fig.layout.xaxis.title.text == "Rise of the barrier without it<br>(nats/byte)"  # two lines: the column is narrow
    assert fig.layout.yaxis.autorange == "reversed" and fig.layout.title.subtitle.text.endswith("Weight matching")
    assert not any("_" in label for label in bars.y)  # no code names
    # a residual permutation run's residual class is named as such
    perm = attributed()
    perm["alignment"]["classes"] = ["heads", "mlp", "residual_perm"]
    assert alignment_figs.class_rise_figure(perm).data[0].y[-1] == "residual permutation"
    json.loads(fig.to_json())


def test_the_sentence_names_the_block_holding_most_and_the_class_buying_most():
    assert alignment_figs.attribution_sentence(attributed()) == (
        "Interpolated alone, layer 0 raises the loss most: by 0.88 nats/byte (its MLP 0.66, its attention 0.50), "
        "against the 0.78 midpoint barrier that alignment left; without the MLP neuron permutations the barrier "
        "would rise by 1.16.")
    # small numbers keep two significant digits; an outer block has no parts; no class raising it is said so
    rec = attributed()
    att = rec["attribution"]
    att["midpoint_barrier"] = 0.0061
    att["blocks"][0] = block("embedding", None, "all", 0.0100, 0.0056)
    for c in att["classes"]:
        c["rise"] = -abs(c["rise"]) / 1000
    for b in att["blocks"][1:]:
        b["excess"] /= 1000
    vit = rec | {"eval_images": 360, "eval_set": "digits/test, 360 images"}
    assert alignment_figs.attribution_sentence(vit) == (
        "Interpolated alone, the embedding raises the loss most: by 0.0078 nats/image, against the 0.0061 midpoint "
        "barrier that alignment left; taking out any one class would not raise it.")


def test_naive_records_show_blocks_but_no_class_figure():
    rec = attributed("naive", classes=False)
    assert alignment_figs.class_rise_figure(rec) is None
    assert "naive interpolation uses no symmetry class" in alignment_figs.class_rise_note(rec)
    assert alignment_figs.class_rise_note(attributed()) is None
    assert alignment_figs.attribution_sentence(rec) == (
        "Interpolated alone, layer 0 raises the loss most: by 0.88 nats/byte (its MLP 0.66, its attention 0.50), "
        "against the 0.78 midpoint barrier.")
    assert list(alignment_figs.attribution_figure(rec).data[0].y) == pytest.approx([0.08, 0.88, 0.30, 0.02])
    assert alignment_figs.attribution_figure(rec).data[0].marker.color == style.METHOD_COLOURS["naive"]


def test_without_an_attribution_the_layer_furthest_apart_after_alignment_is_named():
    rec = attributed()
    rec["alignment"]["matching_cost"] = {"before": {"outer": 0.8, "blocks.0": 0.62, "blocks.1": 0.73, "blocks.2": 0.64},
                                         "after": {"outer": 0.02, "blocks.0": 0.39, "blocks.1": 0.44, "blocks.2": 0.41}}
    assert alignment_figs.matching_sentence(rec, "Weight matching") == (
        "Layer 1 is aligned worst: its weights stay 0.440 apart after weight matching (normalised squared distance, "
        "0 identical, 1 unrelated), from 0.730 before; the other layers 0.390 to 0.410.")
    naive = attributed("naive", classes=False)
    naive["alignment"]["matching_cost"] = {"before": {"blocks.0": 0.6, "blocks.1": 0.7},
                                           "after": {"blocks.0": 0.6, "blocks.1": 0.7}}
    assert alignment_figs.matching_sentence(naive) == (
        "Layer 1 is the least alike: its weights lie 0.700 apart (normalised squared distance, 0 identical, "
        "1 unrelated); the other layer 0.600; naive interpolation moves nothing.")
    assert alignment_figs.matching_sentence(attributed()) is None  # no per-layer cost to tell from


def test_the_caption_gives_the_blocks_interaction():
    text = alignment_figs.attribution_caption(attributed())
    assert "sum to 1.28 against the 0.78 midpoint barrier" in text and "nats/byte" in text and "λ = 0.5" in text


def test_a_record_without_attribution_says_how_to_get_it():
    rec = attributed()
    del rec["attribution"]
    note = alignment_figs.attribution_missing(rec)
    assert "predates the barrier attribution" in note and "**Run** on the Connectivity page" in note
    assert "`python -m engine cache build --only lm-rope-s0 --methods weight --force`" in note
    assert "cache build" not in alignment_figs.attribution_missing(rec, custom=True)  # directories only run live
    assert alignment_figs.attribution_missing(attributed()) is None
    assert alignment_figs.class_rise_figure(rec) is None
    assert alignment_figs.attribution_missing(attributed(blocks=[])) is not None  # an empty attribution is none
    circuits = rec | {"config": {"path": "circuits"}}
    assert "this record walked the circuits path" in alignment_figs.attribution_missing(circuits)
