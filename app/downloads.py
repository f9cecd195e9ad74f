"""Download buttons and savable charts: the streamlit side of app.exports.

Every chart is drawn through a page's `Charts`, which passes CHART_CONFIG (the chart's camera button
saves an SVG drawn by the browser) and keeps the figure, so the page can offer all its figures as one
self-contained HTML file. Every file is built only when its button is clicked (deferred data): a rerun
writes none of them (a dual record's JSON and group element took about 0.1 s of every rerun).
"""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from app import exports

CHART_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg", "scale": 1}}


def chart_config(name: str) -> dict:
    """CHART_CONFIG with the saved SVG named after the chart."""
    return {**CHART_CONFIG, "toImageButtonOptions": {**CHART_CONFIG["toImageButtonOptions"], "filename": name}}


def _title(fig: go.Figure) -> str:
    t = fig.layout.title.text if fig.layout.title else None
    return t or ""


class Charts:
    """The figures one page draws, in order, for its 'every figure' download."""

    def __init__(self, page: str):
        self.page = page
        self.figs: dict[str, go.Figure] = {}

    def show(self, fig: go.Figure, key: str, name: str | None = None, **kwargs):
        """st.plotly_chart with an SVG camera button; the figure is kept under `name` (default: its title)."""
        label = name or _title(fig) or key
        if label in self.figs:  # two charts with one title stay apart
            label = f"{label} ({key})"
        self.figs[label] = fig
        return st.plotly_chart(fig, key=key, config=chart_config(key), **kwargs)

    def download_button(self, key: str, label: str = "Every figure on this page (HTML)") -> None:
        if not self.figs:
            return
        figs, title = dict(self.figs), f"LMC Explorer: {self.page}"
        st.download_button(label, data=lambda: exports.figures_html(figs, title, CHART_CONFIG),
                           file_name=f"{self.page.lower().replace(' ', '_')}_figures.html", mime="text/html",
                           key=key, on_click="ignore", icon=":material/download:",
                           help="Interactive charts in one page that opens offline. A chart's camera "
                                "button (top right of the chart) saves it as SVG.")


def record_downloads(rec: dict, key: str) -> None:
    """Buttons for one record: the record itself (JSON) and, for aligned runs, its group element."""
    name = exports.stem(rec)
    cols = st.columns(3)
    cols[0].download_button("Result record (JSON)", lambda: exports.record_json(rec), f"{name}.json", "application/json",
                            key=f"{key}_record", on_click="ignore", icon=":material/download:")
    if rec.get("method") != "naive" and (rec.get("alignment") or {}).get("element"):
        cols[1].download_button("Group element (npz)", lambda: exports.element_npz(rec), f"{name}__element.npz",
                                "application/octet-stream", key=f"{key}_element_npz", on_click="ignore",
                                icon=":material/download:",
                                help="Permutations and maps as NumPy arrays: numpy.load(file)['layer0.head_perm'].")
        cols[2].download_button("Group element (JSON)", lambda: exports.element_json(rec), f"{name}__element.json",
                                "application/json", key=f"{key}_element_json", on_click="ignore",
                                icon=":material/download:")
