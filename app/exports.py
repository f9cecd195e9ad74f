"""Every result the app shows, as a file: pure functions from records and figures to bytes.

    record_json    the result record as the engine writes it (engine.results.write_record's JSON)
    curves_csv     one row per grid point of every curve, test and train: method, source, split, λ, loss,
                   accuracy
    element_npz    the group element of an aligned record (alignment.element; dual runs also
                   alignment.element_a) as named NumPy arrays; element_json the same as JSON
    figures_html   figures on one self-contained HTML page (plotly.js inside, once: opens offline)
    symmetry_json, symmetry_markdown   a symmetry report (engine.api's files)

An exported figure is laid out to be read alone (paper_figure): every axis pushes the margins to fit
its tick labels, its title stands off the ticks, and a title names the figure, the pair, the methods
and the engine commit of the records it draws (describe). File names name the pair, the method and
the run (file_stem): a kept run by its id, any other record by when it was made, so a live and a
cached record never share a name. No export holds a machine path (scrub): a model directory is
named by its last part.

Figures are exported as HTML, not PNG or SVG files from the server: plotly's static export needs
kaleido, which drives a Chrome browser the app does not install. Each chart's camera button, in the
app and on an exported page, saves an SVG drawn by the browser itself (downloads.CHART_CONFIG); on
an exported page that SVG carries the full title and axes.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath

import numpy as np
import plotly.graph_objects as go

from engine import api
from engine.api import LMCError

CSV_COLUMNS = ("method", "curve", "source", "split", "eval_set", "lambda", "loss", "accuracy")


def _name(model: str) -> str:
    """A model's short name for a file: the zoo name, or a directory's last part."""
    return PurePath(model).name or model


def safe(raw: str) -> str:
    """`raw` with every run of characters outside [A-Za-z0-9._-] made one '_': a file name on every system."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def stem(rec: dict) -> str:
    """'lm-rope-s0__lm-rope-s1__dual': a file stem naming the pair and method, safe on every system."""
    return safe(f"{_name(rec['model_a'])}__{_name(rec['model_b'])}__{rec['method']}")


def run_tag(rec: dict) -> str:
    """Which run a record is: a kept run's id ('20261202T132414Z-a1b2c3'), else when the record was made
    ('20261202T132414Z'), else its config hash: a live run and the cached record of its pair and method
    differ in it."""
    run = rec.get("run")
    if isinstance(run, dict) and isinstance(run.get("id"), str):
        return safe(run["id"])
    created = rec.get("created")
    if isinstance(created, str) and created:
        return re.sub(r"[^0-9TZ]", "", created)
    return safe(str(rec.get("config_hash") or "undated"))[:12]


def file_stem(rec: dict) -> str:
    """'lm-rope-s0__lm-rope-s1__dual__20261202T132414Z': the pair, the method and the run (run_tag)."""
    return f"{stem(rec)}__{run_tag(rec)}"


# An absolute path of two or more parts inside a text ('/home/x/models/a' -> 'a'); not a URL's path
# (preceded by ':' or '/'), a ratio ('nats/byte') or a relative path (preceded by a word character).
_EMBEDDED_PATH = re.compile(r"(?<![\w.:/~-])~?/(?:[\w.+@-]+/)+([\w.+@-]+)")


def scrub(obj):
    """`obj` (JSON values: dicts, lists, strings, numbers) with no machine path: a string that is an absolute
    path (without blanks, or an existing one) becomes its last part (a model directory's name), a path inside
    a text the same; a number that is not finite becomes null (JSON has no NaN or Infinity, and strict
    readers refuse them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str):
        whole = obj.startswith(("/", "~/")) and (not any(c.isspace() for c in obj) or os.path.exists(obj))
        if whole and PurePath(obj).name:
            return PurePath(obj).name
        return _EMBEDDED_PATH.sub(r"\1", obj)
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return obj


def record_json(rec: dict) -> bytes:
    """The record as JSON, its model directories by name and its non-finite numbers null (scrub)."""
    return json.dumps(scrub(rec), indent=1, allow_nan=False).encode()


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
                w.writerow([rec["method"], scrub(name), source, part, scrub(eval_set), repr(float(lam)),
                            repr(float(v)), "" if a is None else repr(float(a))])
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
    return json.dumps(scrub(body), indent=1, allow_nan=False).encode()


def symmetry_json(report: dict) -> bytes:
    """A symmetry report as JSON (engine.api.symmetry_json), its model named without a machine path."""
    return api.symmetry_json(scrub(report))


def symmetry_markdown(report: dict, statement: str | None = None) -> bytes:
    """A symmetry report as Markdown (engine.api.symmetry_markdown), its model named without a machine path."""
    return api.symmetry_markdown(scrub(report), None if statement is None else scrub(statement))


def _commit(rec: dict) -> str:
    prov = rec.get("provenance") or {}
    c = prov.get("git_commit")
    if not isinstance(c, str) or not c:
        return "not recorded"
    return c[:7] + (" with uncommitted engine changes" if prov.get("engine_modified") else "")


def describe(about: Sequence[tuple[dict, str]]) -> str:
    """What a page's figures draw, for their titles: 'lm-rope-s0 vs lm-rope-s1: Naive, Weight matching<br>
    engine commit e74ceae', from (record, the name a reader sees) per record; with several commits each
    names its records."""
    if not about:
        return ""
    pairs = list(dict.fromkeys(f"{api.display_name(r['model_a'])} vs {api.display_name(r['model_b'])}"
                               for r, _ in about))
    names = list(dict.fromkeys(name for _, name in about))
    commits: dict[str, list[str]] = {}
    for r, name in about:
        commits.setdefault(_commit(r), []).append(name)
    if len(commits) == 1:
        engine = f"engine commit {next(iter(commits))}"
    else:
        engine = "engine commits " + "; ".join(f"{c} ({', '.join(dict.fromkeys(n))})" for c, n in commits.items())
    return scrub(f"{'; '.join(pairs)}: {', '.join(names)}<br>{engine}")


def figures_file_name(page: str, about: Sequence[tuple[dict, str]] = (), subject: str = "") -> str:
    """'connectivity__lm-rope-s0__lm-rope-s1__naive-weight__20261202T132414Z__figures.html': the page, the
    pair, the methods and the newest record's run (run_tag), or the page and `subject` without records."""
    if not about:
        return safe(f"{page.lower()}__{scrub(subject)}" if subject else page.lower()) + "__figures.html"
    recs = [r for r, _ in about]
    methods = "-".join(dict.fromkeys(r["method"] for r in recs))
    newest = max(recs, key=lambda r: str(r.get("created") or ""))
    return safe(f"{page.lower()}__{stem(recs[0]).rsplit('__', 1)[0]}__{methods}__{run_tag(newest)}") + "__figures.html"


TITLE_PX = 80  # the room a figure's title (one line) and subtitle (two lines) take above it on an exported page


def paper_figure(fig: go.Figure, heading: str, subtitle: str = "") -> go.Figure:
    """A copy of `fig` that reads alone: titled `heading` (and `subtitle`: the pair, methods and commit),
    every axis pushing the margins to fit its tick labels, its title standing off them, no machine path.

    In the app, streamlit's template draws the figure; outside it, plotly.js keeps a margin as given, so a
    narrow one clipped tick labels ('.5' for 3.5) and put an axis title on them."""
    out = go.Figure(scrub(fig.to_plotly_json()))
    out.update_xaxes(automargin=True, title_standoff=12)
    out.update_yaxes(automargin=True, title_standoff=12)
    m, height = out.layout.margin, out.layout.height or 450
    out.update_layout(
        title={"text": scrub(heading), "subtitle": {"text": subtitle, "font": {"size": 12, "color": "#555555"}},
               "x": 0.01, "xanchor": "left", "xref": "container", "y": 1, "yanchor": "top", "yref": "container",
               "pad": {"t": 10}, "font": {"size": 17}},
        margin={"t": (m.t if m.t is not None else 40) + (TITLE_PX if subtitle else TITLE_PX // 2),
                "l": max(m.l or 0, 60), "r": max(m.r or 0, 20), "b": max(m.b or 0, 50)},
        height=height + (TITLE_PX if subtitle else TITLE_PX // 2), paper_bgcolor="white", plot_bgcolor="white",
    )
    out.update_xaxes(showline=True, linecolor="#888888", gridcolor="#E5E5E5")
    out.update_yaxes(showline=True, linecolor="#888888", gridcolor="#E5E5E5")
    return out


def figure_title(fig: go.Figure) -> str:
    """The figure's own title text, or ""."""
    return (fig.layout.title.text if fig.layout.title else None) or ""


def figures_html(figs: Mapping[str, go.Figure], title: str, config: Mapping | None = None,
                 subtitle: str = "") -> bytes:
    """Several figures on one self-contained page, each under its heading and laid out by paper_figure with
    `subtitle` (describe), plotly.js embedded once."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    title, subtitle = scrub(title), scrub(subtitle)
    body = "\n".join(
        f"<section><h2>{html.escape(scrub(name))}</h2>\n"
        + pio.to_html(paper_figure(fig, name, subtitle), full_html=False, include_plotlyjs=False,
                      config=dict(config or {})) + "</section>"
        for name, fig in figs.items())
    about = "".join(f"<p>{html.escape(line)}</p>\n" for line in subtitle.split("<br>") if line)
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{about}{body}\n</body></html>\n")
    return page.encode()
