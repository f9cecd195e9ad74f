"""Download buttons and savable charts: the streamlit side of app.exports.

Every chart is drawn through a page's `Charts`, which passes a chart config (the chart's camera button
saves an SVG drawn by the browser) and keeps the figure under a heading in words (HEADINGS, not the
chart's widget key), so the page can offer all its figures as one self-contained HTML file, each titled
with the pair, the methods and the engine commit of the records the page draws. Every file is built only
when its button is clicked (deferred data): a rerun writes none of them (a dual record's JSON and group
element took about 0.1 s of every rerun).
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import streamlit as st

from app import exports

CHART_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg", "scale": 1}}

# What each chart of the app shows, by its widget key: the heading of a figure without a title of its own
# in the page's figure download (a key such as 'cost_chart' means nothing to a reader).
HEADINGS = {
    "barrier_chart": "Loss along the linear path",
    "accuracy_chart": "Accuracy along the linear path",
    "plane_chart": "Loss over the plane through A, B and aligned B",
    "widen_chart": "Loss along the path across widths",
    "attribution_blocks": "Barrier with one block interpolated alone",
    "attribution_classes": "Barrier rise without each symmetry class",
    "cost_chart": "Matching cost per layer",
    "heads_overview": "Head permutations, every layer",
    "mlp_similarity": "Matched MLP neurons, every layer",
    "residual_map": "Residual map",
    "head_cost": "Head cost and the chosen permutation",
    "head_perm": "Head permutation",
    "mlp_similarity_layer": "Matched MLP neurons, one layer",
    "rope_scalars": "Q/K maps: RoPE complex scalars",
    "singular_values": "Singular values of the within-head maps",
    "ablation_chart": "Class ablation: the barrier with each class alone",
    "sweeps_chart": "Coordinate descent, sweep by sweep",
    "correlation_chart": "Matched activation correlation per layer",
    "history_chart": "Optimisation of the transform, step by step",
    "runs_compare_chart": "Compared runs: loss along the linear path",
    "runs_open_chart": "Loss along the linear path",
    "runs_open_accuracy": "Accuracy along the linear path",
    "runs_open_partial": "Loss along the linear path, as far as the run went",
    "seeds_barriers": "Pairwise barriers before and after alignment",
    "seeds_triangle": "Loss over the triangle of three aligned models",
    "checks_chart": "Invariance checks and break tests",
    "dims_chart": "Group dimension by part, whole model",
    "dims_layer_chart": "Group dimension per layer",
    "pe_chart": "The same shape under each positional encoding",
    "rope_chart": "How strongly RoPE breaks GL(d), pair by pair",
    "spectrum_chart": "The sinusoidal table's spectrum",
}


def heading(fig: go.Figure, key: str, name: str | None = None) -> str:
    """A chart's heading: `name`, else the figure's own title, else HEADINGS[key], else the key in words."""
    return name or exports.figure_title(fig) or HEADINGS.get(key) or key.replace("_", " ").capitalize()


def chart_config(name: str) -> dict:
    """CHART_CONFIG with the saved SVG named `name` (made file-safe)."""
    return {**CHART_CONFIG, "toImageButtonOptions": {**CHART_CONFIG["toImageButtonOptions"],
                                                     "filename": exports.safe(name)}}


class Charts:
    """The figures one page draws, in order, under their headings, for its 'every figure' download."""

    def __init__(self, page: str):
        self.page = page
        self.figs: dict[str, go.Figure] = {}

    def show(self, fig: go.Figure, key: str, name: str | None = None, **kwargs):
        """st.plotly_chart with an SVG camera button; the figure is kept under `heading` (name, title, HEADINGS)."""
        label = heading(fig, key, name)
        if label in self.figs:  # two charts with one heading stay apart
            label = f"{label} ({len(self.figs) + 1})"
        self.figs[label] = fig
        return st.plotly_chart(fig, key=key, config=chart_config(f"{self.page.lower()}__{label}"), **kwargs)

    def download_button(self, key: str, label: str = "Every figure on this page (HTML)",
                        about: Sequence[tuple[dict, str]] = (), subject: str = "") -> None:
        """The page's figures as one offline HTML file, titled with `about` ((record, the name a reader sees)
        per record drawn: pair, methods, engine commit) or `subject` (what a page without records shows)."""
        if not self.figs:
            return
        figs, about = dict(self.figs), list(about)
        subtitle = exports.describe(about) or exports.scrub(subject)
        title = f"LMC Explorer, {self.page}" + (f": {exports.scrub(subject)}" if subject else "")
        config = {**CHART_CONFIG, "toImageButtonOptions": {**CHART_CONFIG["toImageButtonOptions"],
                                                           "filename": exports.figures_file_name(
                                                               self.page, about, subject).removesuffix(".html")}}
        st.download_button(label, data=lambda: exports.figures_html(figs, title, config, subtitle),
                           file_name=exports.figures_file_name(self.page, about, subject), mime="text/html",
                           key=key, on_click="ignore", icon=":material/download:",
                           help="Interactive charts in one page that opens offline, each titled with the pair, the "
                                "methods and the engine commit. A chart's camera button (top right of the chart) "
                                "saves it as SVG.")


def record_downloads(rec: dict, key: str) -> None:
    """Buttons for one record: the record itself (JSON) and, for aligned runs, its group element; the files
    name the pair, the method and the run (exports.file_stem)."""
    name = exports.file_stem(rec)
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
