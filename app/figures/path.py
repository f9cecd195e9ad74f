"""Linear-path figures (Connectivity page): loss and accuracy against λ for the cached and live records of
one pair. Pure: records in, figures out.

A record is the dict `engine.api.run_pair` returns (fields in engine/results.py). Every figure takes
the cached records of one pair plus optional live ones, so cached and recomputed curves share axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.figures.style import loss_unit, method_colour

LAMBDA_AXIS = "λ  (0 = model A, 1 = model B)"
LAMBDA_TICKS = [0, 0.25, 0.5, 0.75, 1]
BAR_DODGE = 0.008  # λ units between the barrier bars of successive curves



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
