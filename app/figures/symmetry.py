"""Symmetry figures (Symmetry page): invariance checks, group dimensions, the RoPE-breaking and sinusoidal
spectrum views, and the group told part by part in words (group_parts). Pure: `engine.report.symmetry_report`
fields in, figures and table rows out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from app.figures.style import (
    CHECK_COLOURS,
    CHECK_LABELS,
    LOG_FLOOR,
    PART_COLOURS,
    PART_LABELS,
    PE_COLOURS,
    PE_NAMES,
    REL_CHANGE_AXIS,
    compact,
)

# The engine's checks and break tests (engine/checks.py: the spec's kinds, the translations, the break
# transforms) in a reader's words; the engine's own `kind` text says which group exactly.
TEST_NAMES = {
    "heads": "head permutation", "mlp": "MLP neuron permutation", "mlp_scale": "MLP neuron scaling",
    "qk": "Q/K maps", "vo": "V/O maps", "residual_perm": "residual permutation", "residual_orth": "residual rotation",
    "key_bias_shift": "key-bias shift", "value_bias_fold": "value-bias fold", "pe_shift": "embedding / PE shift",
    "qk_gl": "Q/K: any invertible map", "qk_other_layout": "Q/K: the other RoPE pairing",
    "qk_orthogonal": "Q/K: a rotation", "qk_rope_phase": "Q/K: RoPE phases on the weights",
    "qk_rope_modulus": "Q/K: RoPE moduli on the weights", "qk_gain_within_pair": "q/k norm gains unequal in a pair",
    "residual_gl": "residual: any invertible map", "residual_orth_any": "residual: a random rotation",
    "residual_perm_any": "residual: a random permutation", "relu_negative_scale": "MLP: a negative neuron scale",
    "swiglu_gate_scale": "MLP: scaling the gate branch", "mlp_scale_nonhomogeneous": "MLP: scaling a neuron",
    "heads_across_kv_groups": "heads moved across KV groups",
}


def check_name(group: str) -> str:
    """A check's or break test's name in words (an unknown one with its underscores read as spaces)."""
    return TEST_NAMES.get(group, group.replace("_", " "))


def check_status(row: dict, is_break: bool) -> str:
    """'exact' | 'approximate' | 'break': how the engine classifies a check row."""
    if is_break:
        return "break"
    return "exact" if row.get("exact") else "approximate"


def invariance_figure(checks: Sequence[dict], breaks: Sequence[dict] = (), tol: float = 1e-10,
                      names: Mapping[str, str] | None = None) -> go.Figure:
    """Horizontal log bars of max_rel_change: symmetries should sit left of the exactness line at `tol`,
    break tests far right of it. Rows with no measurement (None) are left out; a row is labelled
    names[group] (e.g. TEST_NAMES), else by its group."""
    names = names or {}
    rows = [(r, check_status(r, False)) for r in checks] + [(r, "break") for r in breaks]
    rows = [(r, s) for r, s in rows if r.get("max_rel_change") is not None]
    fig = go.Figure()
    for status in ("exact", "approximate", "break"):
        sel = [r for r, s in rows if s == status]
        if not sel:
            continue
        fig.add_trace(go.Bar(
            y=[names.get(r["group"], r["group"]) for r in sel], x=[max(r["max_rel_change"], LOG_FLOOR) for r in sel], orientation="h",
            name=CHECK_LABELS[status], marker_color=CHECK_COLOURS[status],
            customdata=[[r["kind"], r["max_rel_change"]] for r in sel],
            hovertemplate="%{customdata[0]}<br>max relative change %{customdata[1]:.2e}<extra></extra>",
        ))
    # The line is named in the axis title: an annotation beside it collides with the legend.
    fig.add_vline(x=tol, line={"color": "#333333", "dash": "dash", "width": 1.5})
    fig.update_layout(
        barmode="overlay",
        xaxis={"title": {"text": f"{REL_CHANGE_AXIS} (log; dashed: exact below {tol:.0e})"}, "type": "log",
               "exponentformat": "power"},
        yaxis={"autorange": "reversed", "title": {"text": None}},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 60, "b": 10}, height=120 + 28 * max(len(rows), 1),
    )
    return fig




def change_band(change: float | None, tol: float = 1e-10) -> str | None:
    """What a measured relative change says, whatever was claimed: 'exact' below tol, 'approximate' below
    APPROX_LIMIT, 'break' above; None when nothing was measured."""
    if change is None:
        return None
    return "exact" if change < tol else "approximate" if change < APPROX_LIMIT else "break"


APPROX_LIMIT = 1e-3  # a change this large is a change of the function, not float error or a near-symmetry


def _dims_axis(log_y: bool, top: float, what: str = "") -> dict:
    """Group dimensions span orders of magnitude (RoPE's Q/K: d, GL(d): d²): a log axis by default. `what`
    says what is counted ('whole model', 'per layer')."""
    title = {"text": "Group dimension" + (f", {what}" if what else "") + " (free parameters"
                     + (", log scale)" if log_y else ")")}
    if log_y:
        return {"title": title, "type": "log", "range": [0, math.log10(max(top, 10)) + 0.5]}
    return {"title": title, "range": [0, 1.15 * top]}


def _zero_marks(fig: go.Figure, xs: Sequence, colours: Sequence[str]) -> None:
    """A '0' at the foot of the axis for each zero bar: on a log axis a zero has no bar at all, and on a
    linear one a bar of height 0 looks like a missing value. `xs` are categories or category positions."""
    for x, c in zip(xs, colours):
        fig.add_annotation(x=x, y=0, yref="y", text="<b>0</b>", showarrow=False, yanchor="bottom",
                           font={"color": c, "size": 13})


def group_dim_figure(by_kind: dict[str, int], log_y: bool = True, parts: Sequence[str] | None = None,
                     top: float | None = None, what: str = "") -> go.Figure:
    """Continuous dimension per component of the group; by default the parts of dimension 0 (the discrete
    permutations, and parts this model lacks) are left out.

    `parts` draws exactly those parts, a zero as a '0' at the foot of the axis, so two models compared side
    by side show the same parts; `top` fixes the axis to a shared maximum; `what` names the count in the axis
    title. Log scale by default: at Llama sizes the Q/K part under RoPE (d) beside V/O (d²) would vanish on
    a linear axis; the bar labels give the numbers."""
    items = [(k, by_kind.get(k, 0)) for k in parts] if parts is not None else [(k, v) for k, v in by_kind.items() if v]
    labels = [PART_LABELS.get(k, k) for k, _ in items]
    colours = [PART_COLOURS.get(k, "#888888") for k, _ in items]
    fig = go.Figure(go.Bar(
        x=labels, y=[v for _, v in items], marker_color=colours,
        text=[compact(v) if v else "" for _, v in items], textposition="outside",
        hovertemplate="%{x}: %{y:,} dimensions<extra></extra>",
    ))
    zeros = [i for i, (_, v) in enumerate(items) if not v]
    _zero_marks(fig, [labels[i] for i in zeros], [colours[i] for i in zeros])
    top = top if top is not None else max((v for _, v in items), default=1)
    fig.update_layout(yaxis=_dims_axis(log_y, top, what), margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=360,
                      showlegend=False)
    return fig


PER_LAYER_PARTS = ("qk", "vo", "key_bias", "value_bias", "mlp", "ln_reader_gauge")


def group_dim_per_layer_figure(per_layer: Sequence[dict]) -> go.Figure:
    """Stacked per-layer dimension by component (every layer of a homogeneous stack is the same)."""
    fig = go.Figure()
    x = [f"layer {row['layer']}" for row in per_layer]
    for part in PER_LAYER_PARTS:
        y = [row.get(part, 0) for row in per_layer]
        if not any(y):
            continue
        fig.add_trace(go.Bar(x=x, y=y, name=PART_LABELS[part], marker_color=PART_COLOURS[part],
                             hovertemplate=f"%{{x}}, {PART_LABELS[part]}: %{{y:,}}<extra></extra>"))
    fig.update_layout(barmode="stack", yaxis={"title": {"text": "Group dimension per layer (free parameters)"}},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0,
                              "traceorder": "normal"},
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, height=340)
    return fig


PE_COMPARE_PARTS = (("qk", "Q/K maps per layer"), ("vo", "V/O maps per layer"),
                    ("residual_orth", "residual rotation"), ("pe_shift", "embedding / PE shift"))


def pe_comparison_figure(dims_by_pe: dict[str, dict], log_y: bool = True) -> go.Figure:
    """The same shape under each positional encoding: grouped bars of the group parts the PE changes.

    `dims_by_pe` maps pe -> a group_dimension dict; per-layer parts are read from layer 0. Log scale by
    default, so RoPE's d beside everyone else's d² stays visible at any size; a part of dimension 0 has no
    bar, so a '0' in its encoding's colour stands at the foot of its slot.
    """
    fig = go.Figure()
    labels = [label for _, label in PE_COMPARE_PARTS]
    top, n = 1, len(dims_by_pe)
    for i, (pe, gd) in enumerate(dims_by_pe.items()):
        layer0 = gd["per_layer"][0] if gd["per_layer"] else {}
        y = [layer0.get(k, 0) if k in ("qk", "vo") else gd["by_kind"].get(k, 0) for k, _ in PE_COMPARE_PARTS]
        top = max(top, *y)
        fig.add_trace(go.Bar(
            x=labels, y=y, name=PE_NAMES.get(pe, pe),
            marker_color=PE_COLOURS.get(pe, "#888888"), text=[compact(v) if v else "" for v in y],
            textposition="outside",
            hovertemplate=f"{PE_NAMES.get(pe, pe)}, %{{x}}: %{{y:,}}<extra></extra>",
        ))
        # bar i of n in category j sits at j - 0.4 + (i + 0.5) * 0.8 / n (bargap 0.2, no group gap)
        zeros = [j - 0.4 + (i + 0.5) * 0.8 / n for j, v in enumerate(y) if not v]
        _zero_marks(fig, zeros, [PE_COLOURS.get(pe, "#888888")] * len(zeros))
    fig.update_layout(barmode="group", bargap=0.2, bargroupgap=0, yaxis=_dims_axis(log_y, top),
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, height=360)
    return fig


def rope_breaking_figure(rows: Sequence[dict]) -> go.Figure:
    """RoPE breaking strength per frequency pair against omega_j * T (log x): pairs with omega T << 1
    barely rotate over the context, so GL(2) on them is almost a symmetry (engine.checks.rope_breaking)."""
    x = [r["omega_ctx"] for r in rows]
    fig = go.Figure()
    lo, hi = min(x, default=1e-3), max(x, default=1e3)
    # The shaded band is explained by a legend entry: annotations on log axes are placed in log10 units.
    fig.add_vrect(x0=min(lo, 0.1) / 2, x1=1, fillcolor="#EECA3B", opacity=0.15, line_width=0)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="ω·T < 1: nearly GL(2) on the pair",
                             marker={"symbol": "square", "size": 12, "color": "#EECA3B", "opacity": 0.4}))
    fig.add_trace(go.Scatter(
        x=x, y=[r["strength"] for r in rows], mode="lines+markers", name="max |sin(ω n)|, n < T",
        line={"color": PE_COLOURS["rope"], "width": 3}, customdata=[[r["pair"], r["omega"]] for r in rows],
        hovertemplate="pair %{customdata[0]}, ω = %{customdata[1]:.3g}<br>ω·T = %{x:.3g}: %{y:.3f}<extra></extra>",
    ))
    if rows and "rms" in rows[0]:
        fig.add_trace(go.Scatter(
            x=x, y=[r["rms"] for r in rows], mode="lines", name="RMS of |sin(ω n)| over n < T",
            line={"color": PE_COLOURS["rope"], "width": 1.5, "dash": "dot"}, hoverinfo="skip",
        ))
    if rows and "measured" in rows[0]:
        fig.add_trace(go.Scatter(
            x=x, y=[r["measured"] for r in rows], mode="markers", name="measured logit change",
            marker={"color": "#333333", "symbol": "x", "size": 7},
        ))
    fig.update_layout(
        xaxis={"title": {"text": "ω_j · T  (radians turned over the context, log)"}, "type": "log",
               "range": [math.log10(min(lo, 0.1) / 2), math.log10(hi * 2)], "exponentformat": "power"},
        yaxis={"title": {"text": "Breaking strength (0 = GL(2) symmetric)"}, "range": [0, 1.08]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 50, "b": 10}, height=360,
    )
    return fig


def sinusoidal_spectrum_figure(singular_values: Sequence[float], rtol: float = 1e-6) -> go.Figure:
    """Singular values of the sinusoidal table, relative to the largest (log y): the ones under
    rtol * sigma_max make the exact residual group tiny and residual alignment approximate."""
    s = list(singular_values)
    top = s[0] if s and s[0] > 0 else 1.0
    rel = [max(v / top, LOG_FLOOR) for v in s]
    small = [v < rtol for v in rel]
    fig = go.Figure(go.Scatter(
        x=list(range(1, len(s) + 1)), y=rel, mode="lines+markers", name="σ_k / σ_max",
        line={"color": PE_COLOURS["sinusoidal"], "width": 2},
        marker={"size": 6, "color": [CHECK_COLOURS["break"] if b else PE_COLOURS["sinusoidal"] for b in small]},
        customdata=s, hovertemplate="σ_%{x} = %{customdata:.3g} (%{y:.2e} σ_max)<extra></extra>",
    ))
    fig.add_hline(y=rtol, line={"color": "#333333", "dash": "dash", "width": 1.5})
    fig.add_annotation(x=1, xref="paper", y=math.log10(rtol), xanchor="right", yanchor="bottom", showarrow=False,
                       text=f"{rtol:g} σ_max", font={"color": "#333333", "size": 12})
    fig.update_layout(
        xaxis={"title": {"text": "index k (largest first)"}},
        yaxis={"title": {"text": "σ_k / σ_max (log)"}, "type": "log", "exponentformat": "power"},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=340, showlegend=False,
    )
    return fig


# ---------------------------------------------------------------------------------------------
# The group, part by part, in words


def _free_rotation_dims(res: int) -> int:
    """n with n (n - 1) / 2 = res: the dimension of the subspace whose rotations O(n) are exact."""
    return round((1 + math.sqrt(1 + 8 * res)) / 2) if res else 0


def group_parts(arch: dict, group_dim: dict) -> list[dict]:
    """The symmetry group of a model as rows {part, group, per layer, whole model}: what each part may change,
    in words a student reads, and its continuous dimension in one layer and in the whole model, told apart.

    `arch` and `group_dim` are a symmetry_report's (engine.groups.group_dimension). Permutations are discrete
    (0); the residual rotation and the embedding shift are one for the model ('-' per layer); a last row adds
    them up."""
    a, gd = arch, group_dim
    d, h, hkv, r, m, D = a["d_head"], a["n_heads"], a["n_kv_heads"], a["rotary_dim"], a["d_mlp"], a["d_model"]
    layer = gd["per_layer"][0] if gd["per_layer"] else {}
    kinds = gd["by_kind"]
    unit = "head" if hkv == h else "KV group"
    gl = f"GL({d}): any invertible {d}×{d} map per {unit}"
    rows = [("Heads", f"any permutation of the {h} heads (discrete)" if hkv == h else
             f"any permutation of the {hkv} KV groups, and of the {h // hkv} query heads within each (discrete)",
             0, 0)]
    if a.get("qk_norm"):
        qk = f"one positive scale per frequency pair ({r // 2}), shared by every head of the layer (QK-norm)"
    elif a["pe"] == "rope":
        qk = f"one complex scalar per frequency pair ({r // 2} per {unit}): q turns and scales, k undoes it"
        if r < d:
            qk += f"; GL({d - r}) on the {d - r} dims RoPE leaves alone"
    else:
        qk = f"{gl}, undone on the keys by its inverse transpose"
    rows.append(("Q/K maps", qk, layer.get("qk", 0), kinds.get("qk", 0)))
    rows.append(("V/O maps", f"{gl}, undone in the output projection", layer.get("vo", 0), kinds.get("vo", 0)))
    if layer.get("key_bias"):
        where = f" on the {d - r} dims RoPE leaves alone" if r else ""
        shift = f"a shift of the key bias{where}, per {unit}: every key's score moves alike, which the softmax ignores"
        rows.append(("Key-bias shift", shift, layer["key_bias"], kinds.get("key_bias", 0)))
    if layer.get("value_bias"):
        rows.append(("Value-bias fold", f"a shift of the value bias per {unit}, folded into the output bias",
                     layer["value_bias"], kinds.get("value_bias", 0)))
    rows.append(("MLP neurons", f"any permutation of the {m:,} neurons (discrete)", 0, 0))
    if layer.get("mlp"):
        scaling = ("one positive scale per neuron, undone on its output (ReLU)" if a["mlp"] == "relu" else
                   "one nonzero scale per neuron on the up branch, undone on its output (SwiGLU)")
        rows.append(("MLP scaling", scaling, layer["mlp"], kinds.get("mlp_scale", 0)))
    if layer.get("ln_reader_gauge"):
        gauge = "a multiple of the all-ones direction added to each column that reads the stream, which LayerNorm removes"
        rows.append(("LayerNorm reader gauge", gauge, layer["ln_reader_gauge"], kinds.get("ln_reader_gauge", 0)))
    res = kinds.get("residual_orth", 0)
    if a["pe"] == "sinusoidal":
        n = _free_rotation_dims(res)
        stream = (f"rotations of the {D}-dim stream that fix the sinusoidal table: exact only on the {n} dims it "
                  f"does not reach, O({n})" if n > 1 else
                  f"only the identity is exact: the sinusoidal table reaches all {D} dims")
        stream += f"; the rest of O({D}) is approximate"
    else:
        stream = f"O({D}): any rotation of the {D}-dim stream, one for all layers"
    rows.append(("Residual stream", stream, None, res))
    if kinds.get("pe_shift"):
        shift = ("a constant moved from the token embeddings to the position table" if a["task"] == "lm" else
                 "constants moved between the class token, the patch bias and the position table")
        rows.append(("Embedding shift", shift, None, kinds["pe_shift"]))
    rows.append(("Total", "", layer.get("total", 0), gd["total"]))
    return [{"part": p, "group": g, "per layer": "-" if pl is None else f"{pl:,}", "whole model": f"{w:,}"}
            for p, g, pl, w in rows]
