"""Linear-path figures (Connectivity page): loss and accuracy against λ for the cached and live records of
one pair. Pure: records in, figures out.

A record is the dict `engine.api.run_pair` returns (fields in engine/results.py). Every figure takes
the cached records of one pair plus optional live ones, so cached and recomputed curves share axes.
A record's train curve (train_loss, train_accuracy: the same points on a sample of the train split)
is drawn beside its test curve when it has one; a run without one (run_pair(train_curve=False), as a
library caller may ask) has none.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.figures.style import CHORD_DASH, TRAIN_DASH, loss_unit, method_colour, method_dash

LAMBDA_AXIS = "λ  (0 = model A, 1 = model B)"
LAMBDA_TICKS = [0, 0.25, 0.5, 0.75, 1]
BAR_DODGE = 0.008  # λ units between the barrier bars of successive curves



def chord(lambdas: Sequence[float], y: Sequence[float]) -> list[float]:
    """The straight line between the endpoint values: the reference a barrier is measured from."""
    return [(1 - t) * y[0] + t * y[-1] for t in lambdas]


def barrier_point(record: dict) -> tuple[float, float, float]:
    """(λ, loss, chord value) where the loss rises furthest above the chord (docs/MATH.md section 5)."""
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


KEY_GROUP = "key"  # the legend entries that explain the chord and the barrier bar, not curves of their own
KEY_COLOUR = "#555555"
DIM_OPACITY = 0.45  # methods other than the highlighted one recede
# A cached curve is at most HIGHLIGHT_WIDTH wide, in its method's dash pattern, with small dots; a live run
# (recomputed on this page) is LIVE_WIDTH wide, solid, with large diamonds: told apart at a glance, even
# when both are of the sidebar's method.
HIGHLIGHT_WIDTH, OTHER_WIDTH, LIVE_WIDTH = 3.0, 1.5, 5.0
LIVE_MARKER = {"symbol": "diamond", "size": 10}


def _style(record: dict, live: bool, highlight: str | None) -> tuple[float, float]:
    """(line width, opacity): the sidebar's method stands out, the others stay readable behind it."""
    on = highlight is None or record["method"] == highlight
    return (LIVE_WIDTH if live else HIGHLIGHT_WIDTH if on else OTHER_WIDTH), (1.0 if on else DIM_OPACITY)


def _curve_traces(record: dict, y: list[float], name: str, value_fmt: str, live: bool,
                  highlight: str | None = None) -> list[go.Scatter]:
    """The path curve and its thin dashed chord under one legend entry. Each cached curve has its method's
    dash pattern as well as its colour (style.method_dash); a live run is solid and bold, with diamonds."""
    colour = method_colour(record["method"])
    width, opacity = _style(record, live, highlight)
    lam = record["lambdas"]
    above = [v - c for v, c in zip(y, chord(lam, y))]
    marker = {**LIVE_MARKER, "line": {"color": "white", "width": 1}} if live else {"size": 6, "symbol": "circle"}
    curve = go.Scatter(
        x=lam, y=y, name=name, legendgroup=_group(record, live), mode="lines+markers", opacity=opacity,
        line={"color": colour, "width": width, "dash": "solid" if live else method_dash(record["method"])},
        marker={**marker, "color": colour},
        customdata=above,
        hovertemplate=f"{value_fmt}, %{{customdata:+.4f}} vs chord<extra>{name}</extra>",
    )
    line = go.Scatter(
        x=[lam[0], lam[-1]], y=[y[0], y[-1]], name=f"{name}: chord", legendgroup=_group(record, live),
        showlegend=False, mode="lines", line={"color": colour, "width": 1, "dash": CHORD_DASH},
        opacity=0.8 * opacity, hoverinfo="skip",
    )
    return [curve, line]


TRAIN_KEY = "train split: the same points, dotted"
TRAIN_WIDTH = 1.5  # thinner than any test curve


def has_train(record: dict) -> bool:
    """Whether a record carries a train curve (a run without one does not)."""
    return bool(record.get("train_loss"))


def _train_trace(record: dict, y: list[float], name: str, value_fmt: str, live: bool,
                 highlight: str | None = None) -> go.Scatter:
    """A record's train curve: its method's colour, thin and fine-dotted (style.TRAIN_DASH), small open
    squares, in the test curve's legend group (one legend click hides both); the legend's key names it."""
    colour = method_colour(record["method"])
    _, opacity = _style(record, live, highlight)
    return go.Scatter(
        x=record["lambdas"], y=y, name=f"{name}, train", legendgroup=_group(record, live), showlegend=False,
        mode="lines+markers", opacity=opacity, line={"color": colour, "width": TRAIN_WIDTH, "dash": TRAIN_DASH},
        marker={"size": 5, "symbol": "square-open", "color": colour},
        hovertemplate=f"train {value_fmt}<extra>{name}, train</extra>",
    )


def legend_key(fig: go.Figure, barrier: bool, train: bool = False) -> None:
    """Legend entries for what every curve carries: the chord, (loss chart) the barrier bar, and the
    train curves' line style when any is drawn."""
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="chord between the endpoints",
                             legendgroup=KEY_GROUP, line={"color": KEY_COLOUR, "width": 1, "dash": CHORD_DASH},
                             hoverinfo="skip"))
    if barrier:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="barrier: largest rise above the chord",
                                 legendgroup=KEY_GROUP, hoverinfo="skip",
                                 marker={"symbol": "line-ns", "size": 14, "line": {"width": 4, "color": KEY_COLOUR}}))
    if train:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines+markers", name=TRAIN_KEY, legendgroup=KEY_GROUP,
                                 line={"color": KEY_COLOUR, "width": TRAIN_WIDTH, "dash": TRAIN_DASH},
                                 marker={"size": 5, "symbol": "square-open", "color": KEY_COLOUR}, hoverinfo="skip"))


LABEL_SIDES = ("top right", "top left", "bottom right", "bottom left")


def label_sides(tops: Sequence[float]) -> list[str]:
    """Where each barrier's value is written beside the top of its bar: bars next in height take the next
    of LABEL_SIDES, so the values of two, three or four barriers of about one height never overlap."""
    rank = sorted(range(len(tops)), key=lambda k: tops[k])
    sides = [""] * len(tops)
    for i, k in enumerate(rank):
        sides[k] = LABEL_SIDES[i % len(LABEL_SIDES)]
    return sides


def barrier_label(barrier: float) -> str:
    """A barrier written beside its bar: three significant digits ('0.134', '1.31', '0.00781')."""
    return f"{barrier:.3g}"


def loss_axis_title(unit: str, train: bool, log_y: bool = False) -> str:
    """'Test loss (nats/byte)'; 'Loss (...)' when train curves share the axis."""
    return f"{'Loss' if train else 'Test loss'} ({unit}{', log scale' if log_y else ''})"


def barrier_figure(records: Sequence[dict], live: Sequence[dict] = (), title: str = "",
                   method_names: dict[str, str] | None = None, highlight: str | None = None,
                   log_y: bool = False, show_train: bool = True) -> go.Figure:
    """Loss vs λ per record: curve, thin dashed chord between the endpoints, the barrier as a vertical bar.

    The bar spans chord -> curve at the grid point of largest excess, so its length is the record's
    `barrier` field. `highlight` (a method) is drawn thick and opaque, the others lighter; `log_y`
    puts the loss on a log axis (a barrier far above the endpoints then leaves them readable). With
    `show_train`, a record's train curve (train_loss) is drawn too, thin and dotted in its colour.
    """
    fig = go.Figure()
    every = [(r, False) for r in records] + [(r, True) for r in live]
    unit = loss_unit(every[0][0]) if every else "nats"
    train = show_train and any(has_train(r) for r, _ in every)
    peaks = [barrier_point(r) for r, _ in every]
    sides = label_sides([loss_b for _, loss_b, _ in peaks])
    for k, (r, is_live) in enumerate(every):
        name = curve_name(r, method_names, is_live)
        fig.add_traces(_curve_traces(r, list(r["loss"]), name, f"loss %{{y:.4f}} {unit}", is_live, highlight))
        if train and has_train(r):
            fig.add_trace(_train_trace(r, list(r["train_loss"]), name, f"loss %{{y:.4f}} {unit}", is_live, highlight))
        lam_b, loss_b, chord_b = peaks[k]
        colour = method_colour(r["method"])
        width, opacity = _style(r, is_live, highlight)
        # Methods share their endpoints, so their chords coincide and their bars stand near the same λ:
        # later bars are nudged right by a hair (the hover still gives the exact λ), only the top of a
        # bar is capped, and its value is written beside the cap, on a side of its own (label_sides).
        x_bar = lam_b + BAR_DODGE * k
        fig.add_trace(go.Scatter(
            x=[x_bar, x_bar], y=[chord_b, loss_b], name=f"{name}: barrier", legendgroup=_group(r, is_live),
            showlegend=False, mode="lines+markers+text", line={"color": colour, "width": width + 1}, opacity=opacity,
            marker={"symbol": "line-ew", "size": [0, 14], "line": {"width": 2, "color": colour}},
            text=["", barrier_label(r["barrier"])], textposition=sides[k], textfont={"color": colour, "size": 12},
            cliponaxis=False,  # the tallest bar's value stands above the axis' top, drawn whole
            hovertemplate=f"barrier {r['barrier']:.4f} {unit} at λ = {lam_b:.2f}<extra>{name}</extra>",
        ))
    if every:
        legend_key(fig, barrier=True, train=train)
    yaxis = {"title": {"text": loss_axis_title(unit, train, log_y)}}
    if log_y:
        yaxis |= {"type": "log"}
    fig.update_layout(yaxis=yaxis, **_common_layout(title))
    return fig


def accuracy_figure(records: Sequence[dict], live: Sequence[dict] = (), title: str = "",
                    method_names: dict[str, str] | None = None, highlight: str | None = None,
                    show_train: bool = True) -> go.Figure:
    """Accuracy (%) vs λ for classifier records with the dashed chord; records without accuracy are
    skipped. With `show_train`, a record's train accuracy (train_accuracy) is drawn thin and dotted."""
    fig = go.Figure()
    every = [(r, False) for r in records if r.get("accuracy")] + [(r, True) for r in live if r.get("accuracy")]
    train = show_train and any(r.get("train_accuracy") for r, _ in every)
    for r, is_live in every:
        name = curve_name(r, method_names, is_live)
        acc = [100 * a for a in r["accuracy"]]
        fig.add_traces(_curve_traces(r, acc, name, "accuracy %{y:.1f} %", is_live, highlight))
        if train and r.get("train_accuracy"):
            fig.add_trace(_train_trace(r, [100 * a for a in r["train_accuracy"]], name, "accuracy %{y:.1f} %",
                                       is_live, highlight))
    if every:
        legend_key(fig, barrier=False, train=train)
    fig.update_layout(yaxis={"title": {"text": f"{'Accuracy' if train else 'Test accuracy'} (%)"}, "ticksuffix": " %"},
                      **_common_layout(title))
    return fig


def summary_rows(records: Sequence[dict], live: Sequence[dict] = (),
                 method_names: dict[str, str] | None = None) -> list[dict]:
    """One row per curve for the table under the chart: barrier, its change against naive (cached
    naive for cached rows, the live naive run of the same evaluation for live ones), the midpoint
    barrier, for classifiers the accuracy drop, and the train barrier when any record has a train curve
    (None for a record without a train curve)."""
    rows = []
    for recs, is_live in ((records, False), (live, True)):
        base = {r.get("eval_set"): r for r in recs if r["method"] == "naive"}
        for r in recs:
            b = base.get(r.get("eval_set"))
            row = {"curve": curve_name(r, method_names, is_live), "barrier": r["barrier"],
                   "vs naive": None if b is None or b is r else r["barrier"] - b["barrier"],
                   "midpoint": r["midpoint_barrier"]}
            if any(has_train(x) for x in (*records, *live)):
                row["train barrier"] = r.get("train_barrier") if has_train(r) else None
            if any(x.get("accuracy") for x in (*records, *live)):
                acc = r.get("accuracy_drop")
                row["accuracy drop (pt)"] = None if acc is None else 100 * acc
            if any(x.get("path", "weights") != "weights" for x in (*records, *live)):
                row["path"] = r.get("path", "weights")  # circuit paths beside weight paths
            rows.append(row)
    return rows


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


def plane_figure(plane: dict, method_names: dict[str, str] | None = None) -> go.Figure:
    """The loss over the plane through A, B and aligned B (engine.plane): a contour map with the naive
    segment A-B (dashed) and the aligned segment A-B' drawn on it, the three models marked."""
    names = method_names or {}
    unit = "nats/image" if plane.get("task") == "vit" else loss_unit(plane)
    p = plane["points"]
    method = plane["method"]
    fig = go.Figure(go.Contour(
        x=plane["x"], y=plane["y"], z=plane["loss"], colorscale="Viridis", ncontours=24,
        colorbar={"title": {"text": f"loss ({unit})", "side": "right"}},
        hovertemplate=f"x %{{x:.2f}}, y %{{y:.2f}}: %{{z:.4f}} {unit}<extra></extra>",
    ))
    for end, name, colour, dash in ((p["B"], "naive: A to B", method_colour("naive"), "dash"),
                                    (p["B_aligned"], f"{names.get(method, method)}: A to aligned B",
                                     method_colour(method), "solid")):
        fig.add_trace(go.Scatter(x=[p["A"][0], end[0]], y=[p["A"][1], end[1]], mode="lines", name=name,
                                 line={"color": colour, "width": 3, "dash": dash}, hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=[p["A"][0], p["B"][0], p["B_aligned"][0]], y=[p["A"][1], p["B"][1], p["B_aligned"][1]],
        mode="markers+text", text=["A", "B", "aligned B"], textposition="top center", name="models",
        marker={"size": 12, "color": "white", "line": {"color": "black", "width": 2}},
        textfont={"color": "white", "size": 14}, hoverinfo="text", showlegend=False,
    ))
    fig.update_layout(
        xaxis={"title": {"text": "along A → aligned B (weight-space distance)"}, "constrain": "domain"},
        yaxis={"title": {"text": "toward B, orthogonal"}, "scaleanchor": "x", "scaleratio": 1},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        margin={"l": 10, "r": 10, "t": 40, "b": 10}, height=520,
    )
    return fig
