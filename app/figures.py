"""Result records -> plotly figures. Pure: no streamlit, no engine state, same input same figure.

A record is the dict `engine.api.run_pair` returns (fields in engine/results.py). Every figure takes
the cached records of one pair plus optional live ones, so cached and recomputed curves share axes.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import plotly.graph_objects as go

# One colour per alignment method, the same in every chart of the app (Vega's Tableau-10 order),
# so a method is recognisable across pages without reading the legend.
METHOD_COLOURS = {
    "naive": "#4C78A8",
    "weight": "#F58518",
    "activation": "#54A24B",
    "learned": "#E45756",
    "dual": "#B279A2",
}
_SPARE = ("#72B7B2", "#EECA3B", "#9D755D", "#FF9DA6", "#BAB0AC")

LAMBDA_AXIS = "λ  (0 = model A, 1 = model B)"
LAMBDA_TICKS = [0, 0.25, 0.5, 0.75, 1]
BAR_DODGE = 0.008  # λ units between the barrier bars of successive curves


def method_colour(method: str) -> str:
    """Fixed colour for a method; unknown ones get a stable spare (crc32, since hash() is salted per process)."""
    return METHOD_COLOURS.get(method) or _SPARE[zlib.crc32(method.encode()) % len(_SPARE)]


def loss_unit(record: dict) -> str:
    """Loss is a mean cross-entropy per scored item: per image for ViTs, per byte for byte-level LMs."""
    if "eval_images" in record:
        return "nats/image"
    return "nats/byte" if "(bytes)" in record.get("eval_set", "") else "nats/token"


def chord(lambdas: Sequence[float], y: Sequence[float]) -> list[float]:
    """The straight line between the endpoint values: the reference a barrier is measured from."""
    return [(1 - t) * y[0] + t * y[-1] for t in lambdas]


def barrier_point(record: dict) -> tuple[float, float, float]:
    """(λ, loss, chord value) where the loss rises furthest above the chord (MATH.md section 5)."""
    lam, loss = record["lambdas"], record["loss"]
    c = chord(lam, loss)
    i = max(range(len(lam)), key=lambda j: loss[j] - c[j])
    return lam[i], loss[i], c[i]


def curve_name(record: dict, method_names: dict[str, str] | None = None, live: bool = False) -> str:
    """Legend label: the method's display name; a live run also says how much data it saw."""
    name = (method_names or {}).get(record["method"], record["method"])
    if not live:
        return name
    images = "eval_images" in record
    n = record.get("eval_images" if images else "eval_tokens")
    return f"{name}, live ({n:,} {'images' if images else 'tokens'})" if n is not None else f"{name}, live"


def _group(record: dict, live: bool) -> str:
    """Legend group: clicking a legend entry hides a curve together with its chord and barrier bar."""
    return f"{record['method']}-live" if live else record["method"]


def _curve_traces(record: dict, y: list[float], name: str, value_fmt: str, live: bool) -> list[go.Scatter]:
    """The path curve and its dashed chord under one legend entry; live runs are dotted with open markers."""
    colour = method_colour(record["method"])
    lam = record["lambdas"]
    above = [v - c for v, c in zip(y, chord(lam, y))]
    curve = go.Scatter(
        x=lam, y=y, name=name, legendgroup=_group(record, live), mode="lines+markers",
        line={"color": colour, "width": 2 if live else 3, "dash": "dot" if live else "solid"},
        marker={"size": 6, "symbol": "circle-open" if live else "circle", "color": colour},
        customdata=above,
        hovertemplate=f"{value_fmt}, %{{customdata:+.4f}} vs chord<extra>{name}</extra>",
    )
    line = go.Scatter(
        x=[lam[0], lam[-1]], y=[y[0], y[-1]], name=f"{name}: chord", legendgroup=_group(record, live),
        showlegend=False, mode="lines", line={"color": colour, "width": 1.5, "dash": "dash"}, opacity=0.7,
        hoverinfo="skip",
    )
    return [curve, line]


def barrier_figure(records: Sequence[dict], live: Sequence[dict] = (), title: str = "",
                   method_names: dict[str, str] | None = None) -> go.Figure:
    """Loss vs λ per record: curve, dashed chord between the endpoints, the barrier as a vertical bar.

    The bar spans chord -> curve at the grid point of largest excess, so its length is the record's
    `barrier` field.
    """
    fig = go.Figure()
    every = [(r, False) for r in records] + [(r, True) for r in live]
    unit = loss_unit(every[0][0]) if every else "nats"
    for k, (r, is_live) in enumerate(every):
        name = curve_name(r, method_names, is_live)
        fig.add_traces(_curve_traces(r, list(r["loss"]), name, f"loss %{{y:.4f}} {unit}", is_live))
        lam_b, loss_b, chord_b = barrier_point(r)
        colour = method_colour(r["method"])
        # Methods share their endpoints, so their chords coincide and bars at the same λ would hide
        # each other: later bars are nudged right by a hair (the hover still gives the exact λ).
        x_bar = lam_b + BAR_DODGE * k
        fig.add_trace(go.Scatter(
            x=[x_bar, x_bar], y=[chord_b, loss_b], name=f"{name}: barrier", legendgroup=_group(r, is_live),
            showlegend=False, mode="lines+markers", line={"color": colour, "width": 4},
            marker={"symbol": "line-ew", "size": 14, "line": {"width": 2, "color": colour}},
            hovertemplate=f"barrier {r['barrier']:.4f} {unit} at λ = {lam_b:.2f}<extra>{name}</extra>",
        ))
    fig.update_layout(yaxis={"title": {"text": f"Test loss ({unit})"}},
                      **_common_layout(title))
    return fig


def accuracy_figure(records: Sequence[dict], live: Sequence[dict] = (), title: str = "",
                    method_names: dict[str, str] | None = None) -> go.Figure:
    """Accuracy (%) vs λ for classifier records with the dashed chord; records without accuracy are skipped."""
    fig = go.Figure()
    every = [(r, False) for r in records if r.get("accuracy")] + [(r, True) for r in live if r.get("accuracy")]
    for r, is_live in every:
        name = curve_name(r, method_names, is_live)
        acc = [100 * a for a in r["accuracy"]]
        fig.add_traces(_curve_traces(r, acc, name, "accuracy %{y:.1f} %", is_live))
    fig.update_layout(yaxis={"title": {"text": "Test accuracy (%)"}, "ticksuffix": " %"}, **_common_layout(title))
    return fig


def _common_layout(title: str) -> dict:
    # "x unified" hover lists every method at one λ: the comparison a reader wants to make.
    return {
        "title": {"text": title} if title else None,
        "xaxis": {"title": {"text": LAMBDA_AXIS}, "range": [-0.03, 1.03], "tickvals": LAMBDA_TICKS},
        "hovermode": "x unified",
        # below the axis: with several methods a legend on top wraps into the title
        "legend": {"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0},
        "margin": {"l": 10, "r": 10, "t": 50 if title else 20, "b": 10},
        "height": 420,
    }


# =============================================================================================
# Alignment and symmetry figures (app_pages/alignment.py, app_pages/symmetry.py)
#
# Inputs are the JSON fields of a record's `alignment` (engine/align/common.py: describe_element)
# and of `engine.report.symmetry_report`. Every matrix has model A's index on the rows and model
# B's on the columns: the engine's permutations read "A's slot i takes B's slot perm[i]"
# (engine/symmetry.py, LayerElement), so row i has its one in column perm[i].

BEFORE_COLOUR = "#BAB0AC"  # "before alignment" is neutral grey; "after" is the method's own colour
# KV groups (and query heads) are told apart by a qualitative palette, the same in every chart.
GROUP_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                 "#9D755D")
CHECK_COLOURS = {"exact": "#54A24B", "approximate": "#EECA3B", "break": "#E45756"}
CHECK_LABELS = {"exact": "symmetry (exact)", "approximate": "symmetry (approximate)", "break": "break test"}
# Group-dimension components: one colour per part of the group, on every symmetry chart.
PART_COLOURS = {
    "qk": "#4C78A8", "vo": "#72B7B2", "key_bias": "#9D755D", "value_bias": "#D6A5C9", "mlp": "#54A24B",
    "mlp_scale": "#54A24B", "residual_orth": "#B279A2", "pe_shift": "#EECA3B", "ln_reader_gauge": "#FF9DA6",
}
PART_LABELS = {
    "qk": "Q/K maps", "vo": "V/O maps", "key_bias": "key-bias shift", "value_bias": "value-bias fold",
    "mlp": "MLP scaling", "mlp_scale": "MLP scaling", "residual_orth": "residual rotation",
    "pe_shift": "embedding / PE shift", "ln_reader_gauge": "LayerNorm reader gauge",
}
PE_COLOURS = {"none": "#BAB0AC", "learned": "#4C78A8", "sinusoidal": "#F58518", "rope": "#E45756"}
PE_NAMES = {"none": "NoPE", "learned": "learned PE", "sinusoidal": "sinusoidal PE", "rope": "RoPE"}
REL_CHANGE_AXIS = "Largest relative logit change ‖f(g·θ) − f(θ)‖ / ‖f(θ)‖"
LOG_FLOOR = 1e-18  # a change of exactly 0 is drawn here on log axes (the hover gives the true value)


def _group_colour(i: int) -> str:
    return GROUP_COLOURS[i % len(GROUP_COLOURS)]


def _ramp(colour: str, base: str = "#FFFFFF") -> list[list]:
    """Base-to-colour scale: matrices of an alignment are drawn in the method's own colour."""
    return [[0.0, base], [1.0, colour]]


CELL_BASE = "#EEEEEE"  # empty cells of a small 0/1 matrix: light grey, split by white gaps, so the grid reads


def permutation_matrix(perm: Sequence[int]) -> list[list[int]]:
    """P with P[i][perm[i]] = 1: rows are A's slots, columns B's."""
    n = len(perm)
    return [[1 if j == perm[i] else 0 for j in range(n)] for i in range(n)]


def moved_fraction(perm: Sequence[int]) -> float:
    """Share of slots whose B partner is not the slot of the same index."""
    return sum(p != i for i, p in enumerate(perm)) / len(perm) if perm else 0.0


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
        colorscale=_ramp(colour, CELL_BASE), zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
        hovertemplate=f"A {unit} %{{y}}, B {unit} %{{x}}<br>%{{text}}<extra></extra>",
    )


def gqa_blocks(perm: Sequence[int], n_kv_heads: int) -> list[tuple[int, int, int]]:
    """(A's KV group c, B's KV group it takes, heads per group) for grouped-query attention; [] without.

    Query heads may only move with their KV group (MATH.md section 1), so every one of the permutation
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
        fig.update_layout({f"xaxis{suffix}": ticks, f"yaxis{suffix}": ticks})
    fig.update_layout(margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=70 + 200 * rows)
    return fig


def mlp_moved_figure(mlp_perms: Sequence[Sequence[int]], colour: str = METHOD_COLOURS["weight"]) -> go.Figure:
    """Per layer, the share of hidden neurons whose B partner has a different index (%)."""
    frac = [100 * moved_fraction(p) for p in mlp_perms]
    moved = [sum(q != i for i, q in enumerate(p)) for p in mlp_perms]
    fig = go.Figure(go.Bar(
        x=[f"layer {i}" for i in range(len(mlp_perms))], y=frac, marker_color=colour,
        customdata=[[k, len(p)] for k, p in zip(moved, mlp_perms)], text=[f"{f:.0f} %" for f in frac],
        textposition="outside", hovertemplate="%{x}: %{customdata[0]} of %{customdata[1]} neurons moved<extra></extra>",
    ))
    fig.update_layout(yaxis={"title": {"text": "Neurons moved (%)"}, "range": [0, 110], "ticksuffix": " %"},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=300, showlegend=False)
    return fig


MLP_BINS = 32  # a pooled MLP permutation keeps cells a few pixels wide at the page's chart size


def binned_permutation(perm: Sequence[int], max_bins: int = MLP_BINS) -> tuple[list[list[float]], int]:
    """The permutation matrix pooled into square bins of `size` neurons: z[I][J] is the share of A-bin I's
    neurons whose B partner lies in B-bin J (1 on the diagonal for the identity). Returns (z, size)."""
    m = len(perm)
    size = max(1, -(-m // max_bins))
    nb = -(-m // size)
    counts = [[0] * nb for _ in range(nb)]
    for i, p in enumerate(perm):
        counts[i // size][p // size] += 1
    rows = [min(size, m - I * size) for I in range(nb)]
    return [[c / rows[I] for c in row] for I, row in enumerate(counts)], size


def mlp_permutation_figure(perm: Sequence[int], colour: str = METHOD_COLOURS["weight"], max_bins: int = MLP_BINS,
                           title: str = "") -> go.Figure:
    """A layer's MLP permutation, pooled to at most max_bins x max_bins so a 3,072-wide MLP stays legible.

    The colour scale ends at the largest share present: a permutation between independently trained
    models is close to uniform, and a scale fixed at 1 would show it as blank.
    """
    z, size = binned_permutation(perm, max_bins)
    nb = len(z)
    edges = [f"{k * size}–{min((k + 1) * size, len(perm)) - 1}" if size > 1 else str(k) for k in range(nb)]
    unit = f"neurons, bins of {size}" if size > 1 else "neuron"
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(nb)), y=list(range(nb)), colorscale=_ramp(colour), zmin=0,
        customdata=[[[edges[i], edges[j]] for j in range(nb)] for i in range(nb)],
        colorbar={"title": {"text": "share of<br>A's bin"}, "thickness": 12},
        hovertemplate="A neurons %{customdata[0]} ← B neurons %{customdata[1]}: %{z:.0%}<extra></extra>",
    ))
    fig.update_layout(
        title={"text": title} if title else None,
        xaxis={"title": {"text": f"Model B {unit}"}, "showticklabels": False},
        yaxis={"title": {"text": f"Model A {unit}"}, "showticklabels": False},
        margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10}, height=380,
    )
    _square(fig, nb)
    return fig


def matching_cost_figure(cost: dict, method: str = "weight", method_name: str = "") -> go.Figure:
    """Grouped bars per layer: the normalised distance before and after alignment (engine/align/common.py)."""
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


def rope_frequency(j: int, rotary_dim: int, base: float) -> float:
    """omega_j = base^(-2j/r) (MATH.md section 1; RoFormer's frequencies)."""
    return base ** (-2 * j / rotary_dim)


def rope_scalars_figure(modulus: Sequence[Sequence[float]], angle: Sequence[Sequence[float]],
                        rope_base: float | None = None, title: str = "") -> go.Figure:
    """The complex scalars z_j = r e^{i phi} of each KV group's Q/K map in H(d): one point per frequency
    pair, angle phi around the circle, modulus r (the scale on q; k gets 1/r) outward."""
    fig = go.Figure()
    for c, (r, phi) in enumerate(zip(modulus, angle)):
        n = len(r)
        omegas = [rope_frequency(j, 2 * n, rope_base) for j in range(n)] if rope_base else [None] * n
        fig.add_trace(go.Scatterpolar(
            r=list(r), theta=[_degrees(p) for p in phi], mode="markers", name=f"KV group {c}",
            marker={"color": _group_colour(c), "size": 9, "line": {"color": "white", "width": 1}},
            customdata=[[j, w if w is not None else float("nan")] for j, w in enumerate(omegas)],
            hovertemplate=(f"KV group {c}, pair %{{customdata[0]}}"
                           + (" (ω = %{customdata[1]:.3g})" if rope_base else "")
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
    import math  # local: this section is appended below the file's own imports

    return math.degrees(rad)


def singular_values_figure(maps: dict[str, Sequence[Sequence[float]]]) -> go.Figure:
    """Singular values of the within-head GL maps, one panel per map kind ('Q/K map', 'V/O map'), one line
    per KV group: all ones for an orthogonal map, a spread for a genuinely non-orthogonal one."""
    fig = go.Figure()
    items = [(k, v) for k, v in maps.items() if v]
    if not items:
        return fig
    fig.set_subplots(1, len(items), subplot_titles=[k for k, _ in items], horizontal_spacing=0.08)
    for col, (_, groups) in enumerate(items, start=1):
        for c, s in enumerate(groups):
            fig.add_trace(go.Scatter(
                x=list(range(1, len(s) + 1)), y=list(s), mode="lines+markers", name=f"KV group {c}",
                legendgroup=f"g{c}", showlegend=col == 1, line={"color": _group_colour(c), "width": 2},
                marker={"size": 4}, hovertemplate=f"KV group {c}: σ_%{{x}} = %{{y:.4f}}<extra></extra>",
            ), row=1, col=col)
        fig.update_xaxes(title_text="index k (largest first)", row=1, col=col)
        fig.update_yaxes(type="log", row=1, col=col)
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


def residual_figure(residual: dict, colour: str = METHOD_COLOURS["weight"]) -> go.Figure | None:
    """|Omega| as a heatmap (the sign in the hover), the scale ending at its largest entry; None when the
    residual map is the identity."""
    M = residual_matrix(residual)
    if M is None:
        return None
    n = len(M)
    fig = go.Figure(go.Heatmap(
        z=[[abs(v) for v in row] for row in M], customdata=M, x=list(range(n)), y=list(range(n)),
        colorscale=_ramp(colour), zmin=0, colorbar={"title": {"text": "|Ω|"}, "thickness": 12},
        hovertemplate="A coordinate %{y} ← B coordinate %{x}: Ω = %{customdata:.4f}<extra></extra>",
    ))
    fig.update_layout(xaxis={"title": {"text": "Model B residual coordinate"}},
                      yaxis={"title": {"text": "Model A residual coordinate"}},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=440)
    _square(fig, n)
    return fig


def history_figure(diagnostics: dict, method: str, unit: str = "nats/token",
                   method_names: dict[str, str] | None = None) -> go.Figure:
    """Learned / dual optimisation: validation midpoint loss and training loss per step; for dual also the
    one-sided optimiser at the same budget (dashed), so any gap is visibly an optimisation effect."""
    names = method_names or {}
    fig = go.Figure()

    def add(hist: dict, m: str, label: str, dash: str) -> None:
        colour = method_colour(m)
        fig.add_trace(go.Scatter(
            x=hist["step"], y=hist["val_midpoint_loss"], mode="lines+markers", name=f"{label}<br>validation, λ = 0.5",
            line={"color": colour, "width": 3, "dash": dash}, marker={"size": 6},
            hovertemplate=f"step %{{x}}: %{{y:.4f}} {unit}<extra>{label}</extra>",
        ))
        steps = [s for s, v in zip(hist["step"], hist["train_loss"]) if v is not None]
        train = [v for v in hist["train_loss"] if v is not None]
        if train:
            fig.add_trace(go.Scatter(
                x=steps, y=train, mode="lines", name=f"{label}<br>training batch, λ ~ U(0.4, 0.6)",
                line={"color": colour, "width": 1.5, "dash": "dot"}, opacity=0.7,
                hovertemplate=f"step %{{x}}: %{{y:.4f}} {unit}<extra>{label}, training</extra>",
            ))

    hist = diagnostics.get("history")
    if hist:
        add(hist, method, names.get(method, method), "solid")
        best = diagnostics.get("best_step")
        if best in hist["step"]:
            v = hist["val_midpoint_loss"][hist["step"].index(best)]
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
        yaxis={"title": {"text": f"Loss at the midpoint ({unit})"}},
        legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02, "tracegroupgap": 6},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=400, hovermode="x unified",
    )
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


# ---- symmetry page


def check_status(row: dict, is_break: bool) -> str:
    """'exact' | 'approximate' | 'break': how the engine classifies a check row."""
    if is_break:
        return "break"
    return "exact" if row.get("exact") else "approximate"


def invariance_figure(checks: Sequence[dict], breaks: Sequence[dict] = (), tol: float = 1e-10) -> go.Figure:
    """Horizontal log bars of max_rel_change: symmetries should sit left of the exactness line at `tol`,
    break tests far right of it. Rows with no measurement (None) are left out."""
    rows = [(r, check_status(r, False)) for r in checks] + [(r, "break") for r in breaks]
    rows = [(r, s) for r, s in rows if r.get("max_rel_change") is not None]
    fig = go.Figure()
    for status in ("exact", "approximate", "break"):
        sel = [r for r, s in rows if s == status]
        if not sel:
            continue
        fig.add_trace(go.Bar(
            y=[r["group"] for r in sel], x=[max(r["max_rel_change"], LOG_FLOOR) for r in sel], orientation="h",
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


def compact(v: float) -> str:
    """4,096 stays exact; 8,386,560 -> '8.39M': bar labels that fit beside each other."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e4, "k")):
        if abs(v) >= div:
            return f"{v / (div if suffix != 'k' else 1e3):.3g}{suffix}"
    return f"{v:,}"


def group_dim_figure(by_kind: dict[str, int]) -> go.Figure:
    """Continuous dimension per component of the group; discrete parts (dimension 0) are left out.

    A linear axis on purpose: RoPE's Q/K part next to the V/O part should look as small as it is.
    """
    items = [(k, v) for k, v in by_kind.items() if v]
    fig = go.Figure(go.Bar(
        x=[PART_LABELS.get(k, k) for k, _ in items], y=[v for _, v in items],
        marker_color=[PART_COLOURS.get(k, "#888888") for k, _ in items],
        text=[compact(v) for _, v in items], textposition="outside",
        hovertemplate="%{x}: %{y:,} dimensions<extra></extra>",
    ))
    top = max((v for _, v in items), default=1)
    fig.update_layout(yaxis={"title": {"text": "Group dimension (free parameters)"}, "range": [0, 1.15 * top]},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=360, showlegend=False)
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


def pe_comparison_figure(dims_by_pe: dict[str, dict]) -> go.Figure:
    """The same shape under each positional encoding: grouped bars of the group parts the PE changes.

    `dims_by_pe` maps pe -> a group_dimension dict; per-layer parts are read from layer 0.
    """
    fig = go.Figure()
    labels = [label for _, label in PE_COMPARE_PARTS]
    top = 1
    for pe, gd in dims_by_pe.items():
        layer0 = gd["per_layer"][0] if gd["per_layer"] else {}
        y = [layer0.get(k, 0) if k in ("qk", "vo") else gd["by_kind"].get(k, 0) for k, _ in PE_COMPARE_PARTS]
        top = max(top, *y)
        fig.add_trace(go.Bar(
            x=labels, y=y, name=PE_NAMES.get(pe, pe),
            marker_color=PE_COLOURS.get(pe, "#888888"), text=[compact(v) for v in y], textposition="outside",
            hovertemplate=f"{PE_NAMES.get(pe, pe)}, %{{x}}: %{{y:,}}<extra></extra>",
        ))
    fig.update_layout(barmode="group", yaxis={"title": {"text": "Group dimension (free parameters)"},
                                              "range": [0, 1.15 * top]},
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
               "range": [_log10(min(lo, 0.1) / 2), _log10(hi * 2)], "exponentformat": "power"},
        yaxis={"title": {"text": "Breaking strength (0 = GL(2) symmetric)"}, "range": [0, 1.08]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 50, "b": 10}, height=360,
    )
    return fig


def _log10(v: float) -> float:
    import math  # local: this section is appended below the file's own imports

    return math.log10(v)


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
    fig.add_annotation(x=1, xref="paper", y=_log10(rtol), xanchor="right", yanchor="bottom", showarrow=False,
                       text=f"{rtol:g} σ_max", font={"color": "#333333", "size": 12})
    fig.update_layout(
        xaxis={"title": {"text": "index k (largest first)"}},
        yaxis={"title": {"text": "σ_k / σ_max (log)"}, "type": "log", "exponentformat": "power"},
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=340, showlegend=False,
    )
    return fig
