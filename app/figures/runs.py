"""Run-history figures (Runs page): the barrier curves of several kept runs on one chart, and the
points a stopped or failed run had measured. Pure.

Each run is drawn by path.barrier_figure (curve, dashed chord, barrier bar), under its own legend
entry, so runs of one method stay apart; when the runs do not all differ in method, each gets a
colour of its own instead of its method's.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.figures.path import (
    KEY_GROUP,
    LAMBDA_AXIS,
    LAMBDA_TICKS,
    barrier_figure,
    has_train,
    legend_key,
    loss_axis_title,
)
from app.figures.style import group_colour, loss_unit, method_colour


def _recolour(trace, colour: str) -> None:
    """Give every coloured part of a trace (line, marker, marker outline) one colour."""
    if getattr(trace, "line", None) is not None and trace.line.color is not None:
        trace.line.color = colour
    marker = getattr(trace, "marker", None)
    if marker is not None:
        if marker.color is not None:
            marker.color = colour
        if marker.line is not None and marker.line.color is not None:
            marker.line.color = colour


def comparison_figure(records: Sequence[dict], labels: Sequence[str], title: str = "",
                      show_train: bool = True) -> go.Figure:
    """Loss vs λ of every record, named by `labels` (one per record, distinct); with `show_train`, the
    train curves of the records that have one, thin and dotted in their run's colour."""
    if len(labels) != len(records) or len(set(labels)) != len(labels):
        raise ValueError("comparison_figure needs one distinct label per record")
    own_colours = len({r["method"] for r in records}) < len(records)
    fig = go.Figure()
    for k, (rec, label) in enumerate(zip(records, labels)):
        one = barrier_figure([rec], title=title, method_names={rec["method"]: label}, show_train=show_train)
        for trace in one.data:
            if trace.legendgroup == KEY_GROUP:  # the chord / barrier key: once for the chart, below
                continue
            trace.legendgroup = f"run-{k}"  # one legend click hides a run's curve, chord and bar together
            if own_colours:
                _recolour(trace, group_colour(k))
            fig.add_trace(trace)
        if k == 0:
            fig.layout = one.layout
    if records:
        train = show_train and any(has_train(r) for r in records)
        legend_key(fig, barrier=True, train=train)
        fig.layout.yaxis.title.text = loss_axis_title(loss_unit(records[0]), train)  # the first run's layout
    return fig


def partial_figure(entry: dict, title: str = "") -> go.Figure:
    """The test loss at the points of the path a stopped or failed run measured before it ended
    (its "partial" object), on the whole λ axis, so the part it did not reach shows as empty."""
    part = entry["partial"]
    unit = "nats/image" if (entry.get("arch") or {}).get("task") == "vit" else "nats/token"  # a byte-level LM's token is a byte
    fig = go.Figure(go.Scatter(x=part["lambdas"], y=part["loss"], mode="lines+markers", name="measured before the end",
                               line={"color": method_colour(entry["method"])},
                               hovertemplate="λ = %{x:.3f}<br>loss %{y:.4f}<extra></extra>"))
    fig.update_layout(title={"text": title} if title else None, height=360, showlegend=False,
                      xaxis={"title": {"text": LAMBDA_AXIS}, "range": [-0.03, 1.03], "tickvals": LAMBDA_TICKS},
                      yaxis={"title": {"text": loss_axis_title(unit, False)}},
                      margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10})
    return fig
