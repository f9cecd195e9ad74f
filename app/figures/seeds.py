"""Figures of a multi-model record (engine.multi, docs/MATH.md section 10): the pairwise barrier matrices before
and after alignment side by side, and the loss over the triangle of three aligned models. Pure: a record in,
a Plotly figure out."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.figures.style import loss_unit

BASIS = {"reference": "to the first model", "barycentre": "to their barycentre"}


def short_names(rec: dict) -> list[str]:
    """The models as the axes name them: 'seed 2' for zoo seeds of one recipe, else the names as stored."""
    names = rec["models"]
    stems = {n.rpartition("-s")[0] for n in names}
    if len(stems) == 1 and all(n.rpartition("-s")[2].isdigit() for n in names):
        return [f"seed {n.rpartition('-s')[2]}" for n in names]
    return list(names)


def off_diagonal(m: list[list[float]]) -> list[float]:
    """The entries above the diagonal: each pair once."""
    return [m[i][j] for i in range(len(m)) for j in range(i + 1, len(m))]


def barrier_heatmaps(rec: dict, key: str = "barrier") -> go.Figure:
    """The N x N matrices of `key` (barrier or midpoint_barrier) before and after alignment, on one colour scale
    that starts at 0, each cell labelled with its value."""
    names, unit = short_names(rec), loss_unit(rec)
    before, after = rec["before"][key], rec["after"][key]
    top = max(max(off_diagonal(before) + off_diagonal(after)), 1e-12)
    what = key.replace("_", " ")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("Before alignment (as trained)", f"After alignment ({BASIS[rec['to']]})"))
    for col, m in ((1, before), (2, after)):
        fig.add_trace(go.Heatmap(
            z=m, x=names, y=names, zmin=0, zmax=top, colorscale="Reds", showscale=col == 2,
            colorbar={"title": {"text": unit}, "thickness": 12}, xgap=2, ygap=2,
            text=[[f"{v:.3f}" for v in row] for row in m], texttemplate="%{text}",
            hovertemplate=f"%{{y}} / %{{x}}: {what} %{{z:.4f}} {unit}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    fig.update_layout(title={"text": f"Pairwise {what} ({len(rec['lambdas'])} points per path)"}, height=380,
                      margin={"t": 80, "b": 40})
    return fig


def triangle(rec: dict) -> go.Figure:
    """The loss at every point of the triangle's barycentric grid as a ternary plot (each corner one aligned
    model), the centroid starred; hovering a point gives its weights, loss and excess over the vertices' plane."""
    tri, unit = rec["triangle"], loss_unit(rec)
    names = [short_names(rec)[i] for i in tri["models"]]
    ws = tri["weights"]
    hover = [f"weights {w[0]:.2f}, {w[1]:.2f}, {w[2]:.2f}<br>loss {l:.4f} {unit}<br>excess {e:+.4f}"
             + (f"<br>accuracy {a:.1%}" if a is not None else "")
             for w, l, e, a in zip(ws, tri["loss"], tri["excess"], tri["accuracy"] or [None] * len(ws))]
    lo, hi = min(tri["loss"] + [tri["centroid"]["loss"]]), max(tri["loss"] + [tri["centroid"]["loss"]])
    fig = go.Figure(go.Scatterternary(
        a=[w[0] for w in ws], b=[w[1] for w in ws], c=[w[2] for w in ws], mode="markers", name="grid",
        marker={"size": 22, "symbol": "hexagon", "color": tri["loss"], "colorscale": "Viridis", "cmin": lo, "cmax": hi,
                "colorbar": {"title": {"text": unit}, "thickness": 12}, "line": {"width": 0}},
        text=hover, hovertemplate="%{text}<extra></extra>"))
    c = tri["centroid"]
    fig.add_trace(go.Scatterternary(
        a=[1 / 3], b=[1 / 3], c=[1 / 3], mode="markers", name="centroid",
        marker={"size": 16, "symbol": "star", "color": [c["loss"]], "colorscale": "Viridis", "cmin": lo, "cmax": hi,
                "line": {"width": 1.5, "color": "white"}},
        hovertemplate=f"centroid: loss {c['loss']:.4f} {unit}, excess {c['excess']:+.4f}<extra></extra>"))
    fig.update_layout(
        title={"text": f"Loss over the triangle of the aligned models ({len(ws)} points)"}, height=480,
        showlegend=False, ternary={"aaxis": {"title": {"text": names[0]}, "showticklabels": False},
                                   "baxis": {"title": {"text": names[1]}, "showticklabels": False},
                                   "caxis": {"title": {"text": names[2]}, "showticklabels": False}})
    return fig
