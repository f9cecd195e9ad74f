"""Every result the app shows, as a file: pure functions from records and figures to bytes.

    record_json    the result record as the engine writes it (engine.results.write_record's JSON)
    curves_csv     one row per grid point of every curve, test and train: method, source, split, λ, loss,
                   accuracy
    element_npz    the group element of an aligned record (alignment.element; dual runs also
                   alignment.element_a) as named NumPy arrays; element_json the same as JSON
    figure_html    a figure as a self-contained HTML page (plotly.js inside: opens offline)
    figures_html   several figures on one such page (plotly.js once)

Figures are exported as HTML, not PNG or SVG files from the server: plotly's static export needs
kaleido, which drives a Chrome browser the app does not install. In the app each chart's camera
button saves an SVG drawn by the browser itself (downloads.CHART_CONFIG).
"""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath

import numpy as np
import plotly.graph_objects as go

from engine.api import LMCError

CSV_COLUMNS = ("method", "curve", "source", "split", "eval_set", "lambda", "loss", "accuracy")


def _name(model: str) -> str:
    """A model's short name for a file: the zoo name, or a directory's last part."""
    return PurePath(model).name or model


def stem(rec: dict) -> str:
    """'lm-rope-s0__lm-rope-s1__dual': a file stem naming the pair and method, safe on every system."""
    raw = f"{_name(rec['model_a'])}__{_name(rec['model_b'])}__{rec['method']}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def record_json(rec: dict) -> bytes:
    """The record as JSON. NaN and infinities stay as the engine writes them (Python's json reads them)."""
    return json.dumps(rec, indent=1, allow_nan=True).encode()


def curves_csv(curves: Sequence[tuple[dict, str, str]]) -> bytes:
    """(record, legend name, source) per curve -> CSV with CSV_COLUMNS, one row per grid point.

    `source` says where a curve came from ("cached" or "live"); `split` is the record's evaluation split
    (test, or val), then "train" for the rows of its train curve when it has one; accuracy is empty
    for LMs.
    """
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for rec, name, source in curves:
        n = len(rec["lambdas"])
        split = (rec.get("config") or {}).get("eval_split", "test")
        parts = [(split, rec.get("eval_set", ""), rec["loss"], rec.get("accuracy"))]
        if rec.get("train_loss"):
            parts.append(("train", rec.get("train_eval_set", ""), rec["train_loss"], rec.get("train_accuracy")))
        for part, eval_set, loss, acc in parts:
            for lam, v, a in zip(rec["lambdas"], loss, acc or [None] * n):
                w.writerow([rec["method"], name, source, part, eval_set, repr(float(lam)), repr(float(v)),
                            "" if a is None else repr(float(a))])
    return out.getvalue().encode()


def _element_arrays(element: dict, prefix: str) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for i, layer in enumerate(element.get("layers", [])):
        for k, v in layer.items():
            if isinstance(v, dict):  # rope_scalars: {"abs": [h_kv, r/2], "angle": [h_kv, r/2]}
                for part, x in v.items():
                    arrays[f"{prefix}layer{i}.{k}.{part}"] = np.asarray(x)
            else:
                arrays[f"{prefix}layer{i}.{k}"] = np.asarray(v)
    for k, v in element.get("residual", {}).items():
        arrays[f"{prefix}residual.{k}"] = np.asarray(v)  # kind: a unicode string array, no pickling needed
    return arrays


def element_of(rec: dict) -> dict:
    """The record's group element(s): {"element": ..., "element_a": ... (dual only)}."""
    al = rec.get("alignment") or {}
    if rec.get("method") == "naive" or not al.get("element"):
        raise LMCError(f"The {rec.get('method', '?')} record of {rec.get('model_a')} / {rec.get('model_b')} holds "
                       "no group element: nothing was aligned.")
    return {k: al[k] for k in ("element", "element_a") if al.get(k)}


def element_npz(rec: dict) -> bytes:
    """The group element as named arrays: 'layer0.head_perm', 'layer0.rope_scalars.abs', 'residual.perm',
    'residual.matrix', ...; a dual run's A-side transform under 'a.'. np.load reads it without pickle."""
    parts = element_of(rec)
    arrays = _element_arrays(parts["element"], "")
    if "element_a" in parts:
        arrays |= _element_arrays(parts["element_a"], "a.")
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def element_json(rec: dict) -> bytes:
    """The group element with what it belongs to: pair, method, classes."""
    body = {"model_a": rec["model_a"], "model_b": rec["model_b"], "method": rec["method"],
            "classes": (rec.get("alignment") or {}).get("classes", []), **element_of(rec)}
    return json.dumps(body, indent=1, allow_nan=True).encode()


def figure_html(fig: go.Figure, config: Mapping | None = None) -> bytes:
    """A self-contained interactive page of `fig` (plotly.js embedded: about 5 MB, works offline)."""
    return fig.to_html(full_html=True, include_plotlyjs=True, config=dict(config or {})).encode()


def figures_html(figs: Mapping[str, go.Figure], title: str, config: Mapping | None = None) -> bytes:
    """Several figures on one self-contained page, each under its name, plotly.js embedded once."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    body = "\n".join(
        f"<section><h2>{html.escape(name)}</h2>\n"
        + pio.to_html(fig, full_html=False, include_plotlyjs=False, config=dict(config or {})) + "</section>"
        for name, fig in figs.items())
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")
    return page.encode()
