"""Alignment figures (Alignment page): permutations, within-head maps, residual maps, matching costs and
optimisation histories of one record. Pure: record fields in, figures out.

Inputs are the JSON fields of a record's `alignment` (engine/align/diagnostics.py: describe_element). Every
matrix has model A's index on the rows and model B's on the columns: the engine's permutations read
"A's slot i takes B's slot perm[i]" (engine/symmetry.py, LayerElement), so row i has its one in column perm[i].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import PurePath

import plotly.graph_objects as go

from app.figures.style import (
    BEFORE_COLOUR,
    CELL_BASE,
    CLASS_LABELS,
    METHOD_COLOURS,
    group_colour,
    loss_unit,
    method_colour,
    ramp,
)


def permutation_matrix(perm: Sequence[int]) -> list[list[int]]:
    """P with P[i][perm[i]] = 1: rows are A's slots, columns B's."""
    n = len(perm)
    return [[1 if j == perm[i] else 0 for j in range(n)] for i in range(n)]


def layer_label(part: str) -> str:
    """'blocks.3' -> 'layer 3'; 'outer' (embeddings, final norm, head) -> 'embeddings & head'."""
    if part == "outer":
        return "embeddings & head"
    return f"layer {part.split('.', 1)[1]}" if part.startswith("blocks.") else part


def _square(fig: go.Figure, n: int, axis_suffix: str = "") -> None:
    """Square cells, row 0 on top: matrix convention, so the identity is the main diagonal."""
    fig.update_layout({
        f"xaxis{axis_suffix}": {"scaleanchor": f"y{axis_suffix}", "constrain": "domain", "range": [-0.5, n - 0.5]},
        f"yaxis{axis_suffix}": {"autorange": "reversed", "constrain": "domain"},
    })


def _head_heatmap(perm: Sequence[int], colour: str, unit: str = "head") -> go.Heatmap:
    n = len(perm)
    text = [[f"A {unit} {i} ← B {unit} {j}" if j == perm[i] else "" for j in range(n)] for i in range(n)]
    return go.Heatmap(
        z=permutation_matrix(perm), x=list(range(n)), y=list(range(n)), text=text,
        colorscale=ramp(colour, CELL_BASE), zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
        hovertemplate=f"A {unit} %{{y}}, B {unit} %{{x}}<br>%{{text}}<extra></extra>",
    )


def gqa_blocks(perm: Sequence[int], n_kv_heads: int) -> list[tuple[int, int, int]]:
    """(A's KV group c, B's KV group it takes, heads per group) for grouped-query attention; [] without.

    Query heads may only move with their KV group (docs/MATH.md section 1), so every one of the permutation
    sits inside the block of group c's rows and group tau(c)'s columns.
    """
    h = len(perm)
    if n_kv_heads <= 0 or n_kv_heads >= h or h % n_kv_heads:
        return []
    rep = h // n_kv_heads
    return [(c, perm[c * rep] // rep, rep) for c in range(n_kv_heads)]


def _gqa_shapes(perm: Sequence[int], n_kv_heads: int) -> list[dict]:
    shapes = []
    h = len(perm)
    for c, tau, rep in gqa_blocks(perm, n_kv_heads):
        if c:  # thin grid between groups on both axes
            for axis in ("x", "y"):
                lo, hi = -0.5, h - 0.5
                at = c * rep - 0.5
                line = {"type": "line", "line": {"color": "#888888", "width": 1, "dash": "dot"}}
                shapes.append({**line, "x0": at, "x1": at, "y0": lo, "y1": hi} if axis == "x"
                              else {**line, "x0": lo, "x1": hi, "y0": at, "y1": at})
        shapes.append({"type": "rect", "x0": tau * rep - 0.5, "x1": (tau + 1) * rep - 0.5,
                       "y0": c * rep - 0.5, "y1": (c + 1) * rep - 0.5,
                       "line": {"color": "#333333", "width": 2}, "fillcolor": "rgba(0,0,0,0)"})
    return shapes


def head_permutation_figure(perm: Sequence[int], n_kv_heads: int = 0, colour: str = METHOD_COLOURS["weight"],
                            title: str = "") -> go.Figure:
    """One layer's head permutation as a 0/1 matrix; KV groups outlined when h_kv < h."""
    n = len(perm)
    fig = go.Figure(_head_heatmap(perm, colour))
    for s in _gqa_shapes(perm, n_kv_heads):
        fig.add_shape(s)
    ticks = {"tickvals": list(range(n)), "ticktext": [str(i) for i in range(n)]} if n <= 32 else {}
    fig.update_layout(
        title={"text": title} if title else None,
        xaxis={"title": {"text": "Model B head (as trained)"}, **ticks},
        yaxis={"title": {"text": "Model A head"}, **ticks},
        margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10}, height=380,
    )
    _square(fig, n)
    return fig


def _grid(n: int, max_cols: int) -> tuple[int, int]:
    cols = min(n, max_cols)
    return -(-n // cols), cols


def head_permutations_overview(perms: Sequence[Sequence[int]], n_kv_heads: int = 0,
                               colour: str = METHOD_COLOURS["weight"], max_cols: int = 6) -> go.Figure:
    """Every layer's head permutation side by side (rows of at most `max_cols`); rows are A's heads, columns B's."""
    fig = go.Figure()
    if not perms:
        return fig
    rows, cols = _grid(len(perms), max_cols)
    fig.set_subplots(rows, cols, subplot_titles=[f"layer {i}" for i in range(len(perms))],
                     horizontal_spacing=0.04, vertical_spacing=0.12)
    for i, perm in enumerate(perms):
        r, c = divmod(i, cols)
        fig.add_trace(_head_heatmap(perm, colour), row=r + 1, col=c + 1)
        for s in _gqa_shapes(perm, n_kv_heads):
            fig.add_shape(s, row=r + 1, col=c + 1)
        suffix = "" if i == 0 else str(i + 1)
        _square(fig, len(perm), suffix)
        # head numbers only while they stay legible
        ticks = {"tickvals": list(range(len(perm))), "tickfont": {"size": 10}} if len(perm) <= 16 else \
            {"showticklabels": False}
        fig.update_layout({f"xaxis{suffix}": ticks | ({"title": {"text": "B head"}} if r == rows - 1 else {}),
                           f"yaxis{suffix}": ticks | ({"title": {"text": "A head"}} if c == 0 else {})})
    fig.update_layout(margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=90 + 210 * rows)
    return fig


def head_cost_figure(cost: Sequence[Sequence[float]], perm: Sequence[int], n_kv_heads: int = 0,
                     title: str = "") -> go.Figure:
    """The head cost matrix a matching chose from (rows A's heads, columns B's as trained; dark = cheap)
    with the chosen permutation drawn on it as open squares; KV groups outlined when h_kv < h."""
    n = len(cost)
    chosen = [[" (chosen)" if j == perm[i] else "" for j in range(n)] for i in range(n)]
    fig = go.Figure(go.Heatmap(
        z=[list(row) for row in cost], x=list(range(n)), y=list(range(n)), customdata=chosen,
        colorscale="Blues", reversescale=True, colorbar={"title": {"text": "cost"}, "thickness": 12},
        hovertemplate="A head %{y}, B head %{x}: cost %{z:.4g}%{customdata}<extra></extra>",
    ))
    fig.add_trace(go.Scatter(
        x=list(perm), y=list(range(n)), mode="markers", name="chosen permutation",
        marker={"symbol": "square-open", "size": max(8, min(28, 320 // max(n, 1))), "color": "#E45756",
                "line": {"width": 3}},
        customdata=[cost[i][perm[i]] for i in range(n)],
        hovertemplate="A head %{y} ← B head %{x}: cost %{customdata:.4g} (chosen)<extra></extra>",
    ))
    for s in _gqa_shapes(perm, n_kv_heads):
        fig.add_shape(s)
    ticks = {"tickvals": list(range(n))} if n <= 32 else {}
    fig.update_layout(
        title={"text": title} if title else None,
        xaxis={"title": {"text": "Model B head (as trained)"}, **ticks},
        yaxis={"title": {"text": "Model A head"}, **ticks},
        legend={"orientation": "h", "yanchor": "top", "y": -0.15, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10}, height=420,
    )
    _square(fig, n)
    return fig


SIMILARITY_AXIS = "Cosine of a neuron's weights with its B partner"


def mlp_similarity_figure(similarity: dict, colour: str = METHOD_COLOURS["weight"], title: str = "") -> go.Figure:
    """Sorted per-neuron similarity of one layer (percentiles): each A neuron with the B neuron it was
    matched to, against the B neuron of the same index (what interpolating without the permutation pairs)."""
    fig = go.Figure()
    for key, name, line in (("same_index", "same index (no neuron permutation)",
                             {"color": BEFORE_COLOUR, "width": 2, "dash": "dash"}),
                            ("matched", "matched partner", {"color": colour, "width": 3})):
        y = list(similarity.get(key) or [])
        if not y:
            continue
        x = [100 * k / (len(y) - 1) for k in range(len(y))] if len(y) > 1 else [0.0]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name, line=line,
                                 hovertemplate=f"{name}: %{{x:.0f}} % of A's neurons below %{{y:.3f}}<extra></extra>"))
    fig.add_hline(y=0, line={"color": "#888888", "width": 1})
    fig.update_layout(
        title={"text": title} if title else None,
        xaxis={"title": {"text": "A's neurons, sorted by similarity (percentile)"}, "ticksuffix": " %",
               "range": [0, 100]},
        yaxis={"title": {"text": SIMILARITY_AXIS}, "range": [-1.05, 1.05]},
        legend={"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10}, height=360,
    )
    return fig


def _median(q: Sequence[float]) -> float:
    return q[len(q) // 2]  # the stored values are percentiles: the middle one is the median


def mlp_similarity_overview(similarities: Sequence[dict], colour: str = METHOD_COLOURS["weight"]) -> go.Figure:
    """Per layer, the median similarity of A's neurons with their matched B partner and with B's neuron
    of the same index: how much the matching found that the raw index order does not."""
    x = [f"layer {i}" for i in range(len(similarities))]
    fig = go.Figure()
    for key, name, c in (("same_index", "same index", BEFORE_COLOUR), ("matched", "matched partner", colour)):
        y = [_median(s[key]) for s in similarities]
        fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=c, text=[f"{v:.2f}" for v in y],
                             textposition="outside", hovertemplate=f"%{{x}}, {name}: median %{{y:.3f}}<extra></extra>"))
    fig.update_layout(barmode="group", yaxis={"title": {"text": f"Median {SIMILARITY_AXIS[0].lower()}"
                                                                f"{SIMILARITY_AXIS[1:]}"}, "range": [-0.1, 1.1]},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=320)
    return fig


def residual_concentration(residual: dict) -> list[float] | None:
    """Per A residual coordinate, the largest |weight| it takes from one B coordinate, sorted descending:
    all ones for a permutation, about sqrt(2 ln D / D) for a rotation that spreads every coordinate."""
    M = residual_matrix(residual)
    if M is None:
        return None
    return sorted((max(abs(v) for v in row) for row in M), reverse=True)


def residual_concentration_figure(residual: dict, colour: str = METHOD_COLOURS["weight"]) -> go.Figure | None:
    """How permutation-like the residual map is (residual_concentration); None for the identity."""
    top = residual_concentration(residual)
    if top is None:
        return None
    n = len(top)
    fig = go.Figure(go.Scatter(
        x=[100 * (k + 0.5) / n for k in range(n)], y=top, mode="lines", line={"color": colour, "width": 3},
        name="largest |Ω| per coordinate", hovertemplate="%{x:.0f} %: largest |Ω| %{y:.3f}<extra></extra>",
    ))
    fig.add_hline(y=1, line={"color": "#333333", "dash": "dash", "width": 1.5})
    fig.add_annotation(x=100, y=1, xanchor="right", yanchor="bottom", showarrow=False, text="a permutation")
    fig.update_layout(
        xaxis={"title": {"text": "A's residual coordinates, sorted (percentile)"}, "ticksuffix": " %",
               "range": [0, 100]},
        yaxis={"title": {"text": "Largest |Ω| from one B coordinate"}, "range": [0, 1.1]},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=340, showlegend=False,
    )
    return fig


ABLATION_ORDER = ("none", "heads", "mlp", "mlp_scale", "qk", "vo", "residual_perm", "residual_orth", "all")


def ablation_rows(runs: Sequence[dict]) -> list[dict]:
    """The runs of a class ablation in reading order: naive, each class alone, all classes together."""
    rank = {k: i for i, k in enumerate(ABLATION_ORDER)}
    return sorted(runs, key=lambda r: (rank.get(r["label"], len(rank) - 1), r["label"]))


def ablation_label(label: str) -> str:
    return {"none": "none (naive)", "all": "all classes"}.get(label, f"{label} alone")


def ablation_figure(runs: Sequence[dict], unit: str = "nats/token") -> go.Figure:
    """Barrier with each symmetry class alone and with all of them, beside naive (horizontal bars)."""
    rows = ablation_rows(runs)
    colour = {"none": method_colour("naive"), "all": method_colour("weight")}
    fig = go.Figure(go.Bar(
        y=[ablation_label(r["label"]) for r in rows], x=[r["barrier"] for r in rows], orientation="h",
        marker_color=[colour.get(r["label"], "#F8BF87") for r in rows],
        text=[f"{r['barrier']:.3f}" for r in rows], textposition="outside",
        customdata=[", ".join(r["classes"]) or "none" for r in rows],
        hovertemplate=f"%{{y}}: barrier %{{x:.4f}} {unit}<br>classes: %{{customdata}}<extra></extra>",
    ))
    top = max((r["barrier"] for r in rows), default=1.0)
    fig.update_layout(
        xaxis={"title": {"text": f"Barrier ({unit})"}, "range": [min(0.0, *(r["barrier"] for r in rows)) * 1.1,
                                                                 1.2 * top if top > 0 else 1]},
        yaxis={"title": {"text": "Symmetry classes weight matching may use"}, "autorange": "reversed"},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=120 + 36 * len(rows), showlegend=False,
    )
    return fig


def matching_cost_figure(cost: dict, method: str = "weight", method_name: str = "") -> go.Figure:
    """Grouped bars per layer: the normalised distance before and after alignment (engine/align/diagnostics.py)."""
    before, after = cost.get("before", {}), cost.get("after", {})
    parts = [p for p in before if p != "outer"] + (["outer"] if "outer" in before else [])
    x = [layer_label(p) for p in parts]
    fig = go.Figure()
    for name, values, colour in (("before alignment", before, BEFORE_COLOUR),
                                 (f"after {method_name or method}", after, method_colour(method))):
        y = [values.get(p) for p in parts]
        fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=colour, text=[f"{v:.3f}" for v in y],
                             textposition="outside", hovertemplate=f"%{{x}}, {name}: %{{y:.4f}}<extra></extra>"))
    top = max([v for v in [*before.values(), *after.values()] if v is not None] or [1.0])
    fig.update_layout(
        barmode="group",
        yaxis={"title": {"text": "‖θ_A − g·θ_B‖² / (‖θ_A‖² + ‖θ_B‖²)"}, "range": [0, 1.15 * top]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=340,
    )
    return fig


def group_name(n_kv_heads: int, n_heads: int) -> str:
    """What a within-head map acts on: a KV group under grouped-query attention, else one head."""
    return "KV group" if 0 < n_kv_heads < n_heads else "head"


def rope_scalars_figure(modulus: Sequence[Sequence[float]], angle: Sequence[Sequence[float]],
                        omegas: Sequence[float] | None = None, title: str = "", group: str = "KV group") -> go.Figure:
    """The complex scalars z_j = r e^{i phi} of each KV group's (or head's) Q/K map in H(d): one point per
    frequency pair, angle phi around the circle, modulus r (the scale on q; k gets 1/r) outward; `omegas`,
    each pair's frequency (engine.api.rope_frequencies), for the hover."""
    fig = go.Figure()
    for c, (r, phi) in enumerate(zip(modulus, angle)):
        n = len(r)
        w = list(omegas) if omegas else [None] * n
        fig.add_trace(go.Scatterpolar(
            r=list(r), theta=[_degrees(p) for p in phi], mode="markers", name=f"{group} {c}",
            marker={"color": group_colour(c), "size": 9, "line": {"color": "white", "width": 1}},
            customdata=[[j, wj if wj is not None else float("nan")] for j, wj in enumerate(w)],
            hovertemplate=(f"{group} {c}, pair %{{customdata[0]}}"
                           + (" (ω = %{customdata[1]:.3g})" if omegas else "")
                           + "<br>r = %{r:.4f}, φ = %{theta:.1f}°<extra></extra>"),
        ))
    fig.update_layout(
        title={"text": title} if title else None,
        polar={"radialaxis": {"rangemode": "tozero", "angle": 90,
                              "tickangle": 90, "tickfont": {"size": 10}},
               "angularaxis": {"direction": "counterclockwise", "rotation": 0, "ticksuffix": "°"}},
        legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02},
        margin={"l": 30, "r": 30, "t": 50 if title else 30, "b": 30}, height=420,
    )
    return fig


def _degrees(rad: float) -> float:

    return math.degrees(rad)


LOG_TICKS = "~g"  # d3 format: a plain number, trailing zeros trimmed (0.8, 1, 2.5, 1e-5)


def singular_values_figure(maps: dict[str, Sequence[Sequence[float]]], group: str = "KV group") -> go.Figure:
    """Singular values of the within-head GL maps, one panel per map kind ('Q/K map', 'V/O map'), one line
    per KV group (or head): all ones for an orthogonal map, a spread for a genuinely non-orthogonal one."""
    fig = go.Figure()
    items = [(k, v) for k, v in maps.items() if v]
    if not items:
        return fig
    fig.set_subplots(1, len(items), subplot_titles=[k for k, _ in items], horizontal_spacing=0.08)
    for col, (_, groups) in enumerate(items, start=1):
        for c, s in enumerate(groups):
            fig.add_trace(go.Scatter(
                x=list(range(1, len(s) + 1)), y=list(s), mode="lines+markers", name=f"{group} {c}",
                legendgroup=f"g{c}", showlegend=col == 1, line={"color": group_colour(c), "width": 2},
                marker={"size": 4}, hovertemplate=f"{group} {c}: σ_%{{x}} = %{{y:.4f}}<extra></extra>",
            ), row=1, col=col)
        fig.update_xaxes(title_text="index k (largest first)", row=1, col=col)
        # every tick a number ('0.8', '2'): plotly's default writes a log axis's in-decade ticks as bare
        # leading digits, which read '3, 2, 1, 9, 8' down an axis from 3 to 0.8
        fig.update_yaxes(type="log", tickformat=LOG_TICKS, row=1, col=col)
    fig.update_yaxes(title_text="singular value σ_k (log)", row=1, col=1)
    fig.update_layout(legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02},
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=360)
    return fig


def residual_matrix(residual: dict) -> list[list[float]] | None:
    """Rows A's residual coordinates, columns B's: the permutation, or Omega transposed (B's coordinate
    j feeds A's coordinate i with weight Omega[j][i]); None for the identity."""
    if residual.get("kind") == "permutation":
        return permutation_matrix(residual["perm"])
    if "matrix" in residual:
        O = residual["matrix"]
        return [[O[j][i] for j in range(len(O))] for i in range(len(O[0]))]
    return None


# how a run drew λ per training step (the record's diagnostics.settings.lambdas)
LAMBDA_SAMPLING = {"narrow": "λ ~ U(0.4, 0.6)", "uniform": "λ ~ U(0, 1)", "fixed": "λ = 0.5",
                   "adaptive": "λ: half U(0, 1), half near the worst validation λ"}


def history_figure(diagnostics: dict, method: str, unit: str = "nats/token",
                   method_names: dict[str, str] | None = None) -> go.Figure:
    """Learned / dual optimisation per validation check: the validation barrier (the largest excess over
    the chord at λ = 0.1, 0.3, ..., 0.9, which picks the kept element) and the training loss (right axis); for dual also the one-sided optimiser at the
    same budget (dashed), so any gap is visibly an optimisation effect."""
    names = method_names or {}
    fig = go.Figure()
    sampled = LAMBDA_SAMPLING.get(diagnostics["settings"]["lambdas"], "λ sampled")
    hist = diagnostics.get("history")
    what = "validation barrier, worst of λ = 0.1 … 0.9"

    def add(hist: dict, m: str, label: str, dash: str) -> None:
        colour = method_colour(m)
        fig.add_trace(go.Scatter(
            x=hist["step"], y=hist["val_barrier"], mode="lines+markers", name=f"{label}<br>{what}",
            line={"color": colour, "width": 3, "dash": dash}, marker={"size": 6},
            hovertemplate=f"step %{{x}}: %{{y:.4f}} {unit}<extra>{label}</extra>",
        ))
        steps = [s for s, v in zip(hist["step"], hist["train_loss"]) if v is not None]
        train = [v for v in hist["train_loss"] if v is not None]
        if train:
            fig.add_trace(go.Scatter(
                x=steps, y=train, mode="lines", name=f"{label}<br>training batch, {sampled}",
                line={"color": colour, "width": 1.5, "dash": "dot"}, opacity=0.7,
                yaxis="y2",
                hovertemplate=f"step %{{x}}: %{{y:.4f}} {unit}<extra>{label}, training</extra>",
            ))

    if hist:
        add(hist, method, names.get(method, method), "solid")
        best = diagnostics.get("best_step")
        if best in hist["step"]:
            v = hist["val_barrier"][hist["step"].index(best)]
            fig.add_trace(go.Scatter(
                x=[best], y=[v], mode="markers", name="kept (best validation)",
                marker={"symbol": "star", "size": 16, "color": method_colour(method),
                        "line": {"color": "black", "width": 1}},
                hovertemplate=f"kept: step %{{x}}, %{{y:.4f}} {unit}<extra></extra>",
            ))
    one = diagnostics.get("one_sided_same_budget")
    if one and one.get("history"):
        add(one["history"], "learned", f"{names.get('learned', 'one-sided')}, same budget", "dash")
    fig.update_layout(
        xaxis={"title": {"text": "optimisation step"}},
        yaxis={"title": {"text": f"Validation barrier ({unit})"}},
        legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.1, "tracegroupgap": 6},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=400, hovermode="x unified",
    )
    fig.update_layout(yaxis2={"title": {"text": f"Training loss ({unit})"}, "overlaying": "y", "side": "right",
                              "showgrid": False})
    return fig


def sweeps_figure(sweeps: Sequence[dict], method: str = "weight") -> go.Figure:
    """Weight matching's coordinate descent: the objective ||theta_A - g.theta_B||^2 after each sweep."""
    fig = go.Figure(go.Scatter(
        x=[s["sweep"] for s in sweeps], y=[s["objective"] for s in sweeps], mode="lines+markers",
        line={"color": method_colour(method), "width": 3}, name="objective",
        customdata=[s.get("residual_change") for s in sweeps],
        hovertemplate="sweep %{x}: %{y:.2f}<br>largest change of Ω: %{customdata:.2e}<extra></extra>",
    ))
    fig.update_layout(xaxis={"title": {"text": "coordinate-descent sweep"}, "dtick": 1},
                      yaxis={"title": {"text": "‖θ_A − g·θ_B‖² (sum of squared weights)"}},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=320, showlegend=False)
    return fig


def correlation_figure(corr: Sequence[float], method: str = "activation") -> go.Figure:
    """Activation matching: mean correlation of matched MLP neurons per layer."""
    fig = go.Figure(go.Bar(
        x=[f"layer {i}" for i in range(len(corr))], y=list(corr), marker_color=method_colour(method),
        text=[f"{c:.2f}" for c in corr], textposition="outside",
        hovertemplate="%{x}: mean matched correlation %{y:.3f}<extra></extra>",
    ))
    fig.update_layout(yaxis={"title": {"text": "Mean correlation of matched neurons"}, "range": [0, 1.1]},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=300, showlegend=False)
    return fig


# ---------------------------------------------------------------------------------------------
# Where the barrier lives: the record's `attribution` (engine/attribution.py; docs/MATH.md section 5).
# A block's excess is the loss it adds over the endpoints when it alone is interpolated to λ = 0.5; a class's
# rise is how much the midpoint barrier grows when that class is taken out of the aligned element.

PARTS = ("all", "attention", "mlp")
PART_NAMES = {"all": "whole block", "attention": "its attention alone", "mlp": "its MLP alone"}
PART_SHORT = {"attention": "attention", "mlp": "MLP"}
PART_OFFSET, PART_WIDTH = 0.29, 0.27  # a layer's three bars side by side around its tick
PART_STYLE = {"all": {}, "attention": {"opacity": 0.6, "pattern": {"shape": "/"}},
              "mlp": {"opacity": 0.6, "pattern": {"shape": "."}}}  # told apart without colour too
CLASS_ORDER = ("heads", "mlp", "mlp_scale", "qk", "vo", "residual")


def attribution_of(rec: dict) -> dict | None:
    """The record's attribution, or None for records written before the engine measured it."""
    att = rec.get("attribution")
    return att if att and att.get("blocks") else None


def attribution_missing(rec: dict, custom: bool = False) -> str | None:
    """The info line for a record without an attribution (None when it has one): how to get it. `custom`: the
    pair is two model directories, which only ever run live (the store holds zoo pairs)."""
    if attribution_of(rec):
        return None
    if rec.get("attribution_skipped"):
        return rec["attribution_skipped"] + " The CLI's `--attribution` runs it."
    if (rec.get("config") or {}).get("path", "weights") != "weights":
        return ("No barrier attribution: it is measured on the weight path, and this record walked the "
                f"{rec['config']['path']} path.")
    cmd = ("" if custom else
           f" (or `python -m engine cache build --only {rec['model_a']} --methods {rec['method']} --force`)")
    return ("This record predates the barrier attribution (which layer and which symmetry class hold the barrier), "
            f"or was run with `--no-attribution`. Rerun the pair to get it: press **Run** on the Connectivity "
            f"page{cmd}.")


def attribution_blocks(att: dict) -> list[tuple[str, dict[str, dict]]]:
    """(block, {part: row}) in the engine's path order: embedding, layer 0, ..., head."""
    groups: dict[str, dict[str, dict]] = {}
    for row in att["blocks"]:
        groups.setdefault(row["block"], {})[row["part"]] = row
    return list(groups.items())


def pair_label(rec: dict) -> str:
    return f"{PurePath(rec['model_a']).name or rec['model_a']} / {PurePath(rec['model_b']).name or rec['model_b']}"


def class_label(c: str, used: Sequence[str] = ()) -> str:
    """A class in the reader's words; 'residual' (the engine's one residual class) is whichever map the run used."""
    if c == "residual":
        return CLASS_LABELS["residual_perm" if "residual_perm" in used else "residual_orth"]
    return CLASS_LABELS.get(c, c)


def decimals(*values: float) -> int:
    """Decimals that give the largest of `values` two significant digits (at least 2, at most 6)."""
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    return 2 if top == 0 else min(6, max(2, 1 - math.floor(math.log10(top))))


def _num(v: float, d: int) -> str:
    s = f"{v:.{d}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s  # no "-0.00"


def _block_name(block: str) -> str:
    return block if block.startswith("layer") else f"the {block}"


def attribution_sentence(rec: dict) -> str:
    """One sentence: the block that raises the loss most when interpolated alone, its parts, against the
    midpoint barrier (what alignment left of it, for an aligner), and the class whose removal would raise the
    barrier most."""
    att = attribution_of(rec)
    mb = att["midpoint_barrier"]
    block, parts = max(((b, p) for b, p in attribution_blocks(att) if "all" in p), key=lambda g: g[1]["all"]["excess"])
    top = parts["all"]["excess"]
    inner = sorted(((p, parts[p]["excess"]) for p in PART_SHORT if p in parts), key=lambda x: -x[1])
    best = max(att.get("classes") or [], key=lambda c: c["rise"], default=None)
    d = decimals(top, mb, *(v for _, v in inner), *([best["rise"]] if best else []))
    text = f"Interpolated alone, {_block_name(block)} raises the loss most: by {_num(top, d)} {loss_unit(rec)}"
    if inner:
        text += " (" + ", ".join(f"its {PART_SHORT[p]} {_num(v, d)}" for p, v in inner) + ")"
    left = "" if rec["method"] == "naive" else " that alignment left"
    text += f", against the {_num(mb, d)} midpoint barrier{left}"
    if best is not None and best["rise"] > 0:
        used = (rec.get("alignment") or {}).get("classes") or ()
        text += f"; without the {class_label(best['class'], used)} the barrier would rise by {_num(best['rise'], d)}"
    elif best is not None:
        text += "; taking out any one class would not raise it"
    return text + "."


def matching_sentence(rec: dict, method_name: str = "") -> str | None:
    """For a record without an attribution: the layer whose weights stay furthest apart after alignment (the
    matching cost, 0 identical, 1 unrelated), against the others; None without per-layer costs."""
    cost = rec["alignment"].get("matching_cost") or {}
    before, after = cost.get("before") or {}, cost.get("after") or {}
    layers = {p: v for p, v in after.items() if p.startswith("blocks.") and v is not None}
    if not layers:
        return None
    worst = max(layers, key=layers.get)
    others = [v for p, v in layers.items() if p != worst]
    rest = f"; the other layers {min(others):.3f} to {max(others):.3f}" if len(others) > 1 else \
        f"; the other layer {others[0]:.3f}" if others else ""
    title = layer_label(worst).capitalize()
    if rec["method"] == "naive":
        return (f"{title} is the least alike: its weights lie {layers[worst]:.3f} apart (normalised squared distance, "
                f"0 identical, 1 unrelated){rest}; naive interpolation moves nothing.")
    was = f", from {before[worst]:.3f} before" if before.get(worst) is not None else ""
    return (f"{title} is aligned worst: its weights stay {layers[worst]:.3f} apart after "
            f"{(method_name or rec['method']).lower()} (normalised squared distance, 0 identical, 1 unrelated){was}"
            f"{rest}.")


def attribution_caption(rec: dict) -> str:
    """What a bar is, and how far the whole blocks' sum is from the barrier (their interaction)."""
    att = attribution_of(rec)
    mb, total = att["midpoint_barrier"], att.get("sum_of_layers", float("nan"))
    d = decimals(mb, total)
    return (f"A bar: what the block adds to an endpoint's loss when it alone is interpolated to λ = {att['lambda']:g}, "
            f"the rest of the model left at the endpoint (mean over A and B, {loss_unit(rec)}). The whole blocks sum to "
            f"{_num(total, d)} against the {_num(mb, d)} midpoint barrier: the difference is how the blocks interact.")


def attribution_figure(rec: dict, method_name: str = "") -> go.Figure:
    """Per-block excess in path order: a whole bar per block, a layer's attention and MLP beside it, and the
    midpoint barrier as a dashed line across."""
    att, unit = attribution_of(rec), loss_unit(rec)
    groups = attribution_blocks(att)
    mb, colour = att["midpoint_barrier"], method_colour(rec["method"])
    values = [r["excess"] for _, parts in groups for r in parts.values()]
    d = decimals(mb, *values)
    n_bars = len(values)
    fig = go.Figure()
    for part in PARTS:
        x, y, hover = [], [], []
        for k, (block, parts) in enumerate(groups):
            if part not in parts:
                continue
            r = parts[part]
            x.append(k + (0.0 if len(parts) == 1 else (PARTS.index(part) - 1) * PART_OFFSET))
            y.append(r["excess"])
            hover.append([block if part == "all" else f"{block}, {PART_NAMES[part]}", r["excess_a"], r["excess_b"]])
        if not x:
            continue
        style = PART_STYLE[part]
        fig.add_trace(go.Bar(
            x=x, y=y, width=PART_WIDTH, name=PART_NAMES[part], customdata=hover, cliponaxis=False,
            marker={"color": colour, "opacity": style.get("opacity", 1.0), "line": {"color": colour, "width": 1},
                    **({"pattern": style["pattern"]} if "pattern" in style else {})},
            text=[_num(v, d) for v in y] if n_bars <= 24 else None, textposition="outside", textfont={"size": 10},
            hovertemplate=(f"%{{customdata[0]}}: %{{y:.4f}} {unit}<br>from A %{{customdata[1]:.4f}}, "
                           "from B %{customdata[2]:.4f}<extra></extra>"),
        ))
    fig.add_trace(go.Scatter(
        x=[-0.5, len(groups) - 0.5], y=[mb, mb], mode="lines", name=f"midpoint barrier ({_num(mb, d)})",
        line={"color": "#333333", "width": 2, "dash": "dash"},
        hovertemplate=f"midpoint barrier: %{{y:.4f}} {unit}<extra></extra>",
    ))
    lo, hi = min(0.0, mb, *values), max(0.0, mb, *values)
    pad = 0.15 * ((hi - lo) or 1.0)  # room for the values printed outside the bars
    fig.update_layout(
        title={"text": "Where the barrier lives: each block alone", "yref": "container", "y": 0.98, "yanchor": "top",
               "subtitle": {"text": f"{pair_label(rec)}, {method_name or rec['method']}"}},
        xaxis={"tickvals": list(range(len(groups))), "ticktext": [b for b, _ in groups], "range": [-0.5, len(groups) - 0.5],
               "title": {"text": "Block interpolated alone, in path order"}, "automargin": True},
        yaxis={"title": {"text": f"Loss excess ({unit})"}, "range": [lo - (pad if lo < 0 else 0), hi + pad],
               "zeroline": True, "automargin": True},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        bargap=0, margin={"l": 10, "r": 10, "t": 110, "b": 10}, height=440,
    )
    return fig


def class_rise_note(rec: dict) -> str | None:
    """Why a record has no class rises to draw (None when it has some)."""
    if (attribution_of(rec) or {}).get("classes"):
        return None
    if rec["method"] == "naive":
        return "No class figure: naive interpolation uses no symmetry class, so there is none to take out."
    return "No class figure: the run used no symmetry class, so there is none to take out."


def class_rise_figure(rec: dict, method_name: str = "") -> go.Figure | None:
    """Per class the run used, the rise of the midpoint barrier without it (what it buys); None without classes."""
    att, unit = attribution_of(rec), loss_unit(rec)
    if not (att and att.get("classes")):
        return None
    rank = {c: i for i, c in enumerate(CLASS_ORDER)}
    rows = sorted(att["classes"], key=lambda c: (rank.get(c["class"], len(rank)), c["class"]))
    used = (rec.get("alignment") or {}).get("classes") or ()
    rises = [c["rise"] for c in rows]
    d = decimals(*rises)
    colour = method_colour(rec["method"])
    fig = go.Figure(go.Bar(
        y=[class_label(c["class"], used) for c in rows], x=rises, orientation="h", cliponaxis=False,
        marker_color=[colour if v > 0 else BEFORE_COLOUR for v in rises],
        text=[_num(v, d) for v in rises], textposition="outside", textfont={"size": 10},
        customdata=[c["midpoint_barrier"] for c in rows],
        hovertemplate=(f"without %{{y}}: midpoint barrier %{{customdata:.4f}} {unit}, "
                       "a rise of %{x:.4f}<extra></extra>"),
    ))
    lo, hi = min(0.0, *rises), max(0.0, *rises)
    pad = 0.25 * ((hi - lo) or 1.0)
    fig.update_layout(
        title={"text": "What each symmetry class buys", "yref": "container", "y": 0.98, "yanchor": "top",
               "subtitle": {"text": f"{pair_label(rec)}, {method_name or rec['method']}"}},
        xaxis={"title": {"text": f"Rise of the barrier without it<br>({unit})"}, "zeroline": True,  # fits a narrow column
               "range": [lo - (pad if lo < 0 else 0), hi + (pad if hi > 0 else 0)], "automargin": True},
        yaxis={"autorange": "reversed", "automargin": True},
        margin={"l": 10, "r": 10, "t": 80, "b": 10}, height=120 + 36 * len(rows) + 80, showlegend=False,
    )
    return fig
