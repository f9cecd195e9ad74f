"""Alignment figures (Alignment page): permutations, within-head maps, residual maps, matching costs and
optimisation histories of one record. Pure: record fields in, figures out.

Inputs are the JSON fields of a record's `alignment` (engine/align/common.py: describe_element). Every
matrix has model A's index on the rows and model B's on the columns: the engine's permutations read
"A's slot i takes B's slot perm[i]" (engine/symmetry.py, LayerElement), so row i has its one in column perm[i].
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.figures.style import BEFORE_COLOUR, CELL_BASE, METHOD_COLOURS, group_colour, method_colour, ramp


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
        colorscale=ramp(colour, CELL_BASE), zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
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
        z=z, x=list(range(nb)), y=list(range(nb)), colorscale=ramp(colour), zmin=0,
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
            marker={"color": group_colour(c), "size": 9, "line": {"color": "white", "width": 1}},
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
                legendgroup=f"g{c}", showlegend=col == 1, line={"color": group_colour(c), "width": 2},
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
        colorscale=ramp(colour), zmin=0, colorbar={"title": {"text": "|Ω|"}, "thickness": 12},
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
