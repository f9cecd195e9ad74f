"""Run-history figures (Runs page): the barrier curves of several kept runs on one chart. Pure.

Each run is drawn by path.barrier_figure (curve, dashed chord, barrier bar), under its own legend
entry, so runs of one method stay apart; when the runs do not all differ in method, each gets a
colour of its own instead of its method's.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.figures.path import KEY_GROUP, barrier_figure, has_train, legend_key, loss_axis_title
from app.figures.style import group_colour, loss_unit


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
