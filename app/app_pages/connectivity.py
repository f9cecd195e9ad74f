"""Connectivity: the loss (and accuracy) along the straight line between two models.

Opens at once on the precomputed records in the cached_results/ store (every cached method of the
pair overlaid); the Run button recomputes the path live on a small evaluation subset and draws it
beside them. Nothing here touches torch: the engine returns result records, app.figures draws them.
"""

from __future__ import annotations

import time
import warnings

import streamlit as st

from app import figures, sidebar
from engine import zoo
from engine.api import run_pair
from engine.errors import LMCError
from engine.results import RunConfig, StoreWarning, cache_dir, cached_record, list_cached

# Evaluation subsets for a live run. Measured on one busy CPU core with a zoo LM: 8,192 tokens take
# about 10 s for the 21-point path, the whole test split (~196k tokens) minutes; the 360-image
# digits test split is small enough to use whole.
LM_TOKENS = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, None)
VIT_IMAGES = (45, 90, 180, None)
ANY_ITEMS = (256, 1_024, 8_192, 32_768, None)  # directories: tokens or images, unknown until loaded
DEFAULT_ITEMS = {"lm": 8_192, "vit": None, None: 8_192}


@st.cache_data(show_spinner=False)
def cached_records(model_a: str, model_b: str, store: str, stamp: int) -> tuple[list[dict], list[str]]:
    """Every usable cached record of the pair, one per method, and a sentence per record skipped
    (unreadable or incomplete: the others still show); `stamp` (manifest mtime) renews it after a rebuild."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        rows = [r for r in list_cached(store) if (r["model_a"], r["model_b"]) == (model_a, model_b)]
        recs = [cached_record(model_a, model_b, r["method"], store) for r in rows]
    skipped = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
    order = {m: i for i, m in enumerate(sidebar.methods())}  # registry order: naive first, then aligners
    return sorted((r for r in recs if r), key=lambda r: (order.get(r["method"], len(order)), r["method"])), skipped


def load_cached(sel: sidebar.Selection) -> list[dict]:
    if sel.custom:
        return []  # the store is keyed by zoo names; directories are only ever run live
    store = cache_dir()
    manifest = store / "manifest.json"
    stamp = manifest.stat().st_mtime_ns if manifest.is_file() else 0
    recs, skipped = cached_records(sel.model_a, sel.model_b, str(store), stamp)
    for s in skipped:
        st.warning(s[0].upper() + s[1:])
    return recs


def items_label(n: int | None, task: str | None) -> str:
    return f"{n:,}" if n is not None else {"vit": "all test images"}.get(task, "whole test split")


def eval_items_picker(sel: sidebar.Selection) -> int | None:
    options = {"lm": LM_TOKENS, "vit": VIT_IMAGES}.get(sel.task, ANY_ITEMS)
    label = {"lm": "Evaluation tokens", "vit": "Evaluation images"}.get(sel.task, "Evaluation tokens / images")
    # One key per task: the option lists differ, and a kept value outside the new list would fail.
    return st.select_slider(
        label, options, value=DEFAULT_ITEMS[sel.task], key=f"eval_items_{sel.task or 'custom'}",
        format_func=lambda n: items_label(n, sel.task),
        help="Test-set subset the live run scores at each of the 21 points on λ.",
    )


def run_live(sel: sidebar.Selection, eval_items: int | None) -> dict | None:
    """One engine call with a progress bar; an LMCError becomes its one sentence in st.error."""
    bar = st.progress(0, text="Loading and aligning the models…")
    error = None
    with st.status("Interpolating…", expanded=False) as status:
        t0 = time.perf_counter()

        def progress(done: int, total: int, message: str) -> None:
            bar.progress(done / total, text=f"{done}/{total}: {message}")

        try:
            rec = run_pair(RunConfig(sel.model_a, sel.model_b, sel.method, eval_items=eval_items), progress)
        except LMCError as e:
            error = str(e)
            status.update(label="Run failed", state="error")
        else:
            status.write(rec["eval_set"])
            status.update(label=f"Done in {time.perf_counter() - t0:.1f} s", state="complete")
    if error:
        st.error(error)
        return None
    return rec


def show_metrics(recs: list[dict], names: dict[str, str]) -> None:
    """A column per cached method (its chart colour beside the name), aligned ones against naive;
    the endpoints once below: alignment moves B to an equivalent model, so all methods share them."""
    base = next((r for r in recs if r["method"] == "naive"), None)
    unit = figures.loss_unit(recs[0])
    for col, rec in zip(st.columns(max(len(recs), 4)), recs):
        with col:
            dot = f'<span style="color:{figures.method_colour(rec["method"])}">●</span>'
            st.markdown(f"{dot} **{names.get(rec['method'], rec['method'])}**", unsafe_allow_html=True)
            delta = None if base is None or rec is base else f"{rec['barrier'] - base['barrier']:+.4f} vs naive"
            st.metric("Barrier", f"{rec['barrier']:.4f}", delta, delta_color="inverse",
                      help=f"Largest rise of the loss above the chord between the endpoint losses, in {unit}.")
            st.metric("Midpoint barrier", f"{rec['midpoint_barrier']:.4f}",
                      help=f"Loss minus chord at λ = 0.5, in {unit}.")
            if rec.get("accuracy"):
                st.metric("Accuracy drop", f"{100 * rec['accuracy_drop']:.1f} pt",
                          help="Largest fall of test accuracy below the chord between the endpoint accuracies.")
    r = base or recs[0]
    ends = f"Barriers in {unit}. Endpoint test loss: A {r['endpoint_loss_a']:.4f}, B {r['endpoint_loss_b']:.4f}"
    if r.get("accuracy"):
        ends += f"; accuracy: A {100 * r['accuracy'][0]:.1f} %, B {100 * r['accuracy'][-1]:.1f} %"
    st.caption(ends + ".")


def eval_caption(recs: list[dict]) -> str:
    sets = sorted({f"{r.get('eval_set', '?')}, {len(r['lambdas'])} points on λ" for r in recs})
    return "Cached curves: " + "; ".join(sets) + "." if sets else ""


st.title("Connectivity")
st.caption(
    "Interpolate the weights of two models trained from different seeds, θ(λ) = (1 − λ) θ_A + λ θ_B, and "
    "measure the test loss along the way. The **barrier** is the largest rise of that loss above the dashed "
    "chord between the endpoint losses: near zero, the two models are linearly mode connected."
)

sel = sidebar.selection()
st.subheader(sel.title)
if sel.model_a and sel.model_b:
    st.caption(f"Model A `{zoo.display_name(sel.model_a)}`, model B `{zoo.display_name(sel.model_b)}`: "
               "same architecture, different random seeds for initialisation and data order.")
names = sidebar.methods()
live_runs = st.session_state.setdefault("live_runs", {})  # (model_a, model_b) -> {method: record}

try:
    cached = load_cached(sel)
except LMCError as e:
    st.error(str(e))
    cached = []

if cached:
    show_metrics(cached, names)
elif not sel.custom:
    st.info("Nothing is cached for this pair yet: press **Run** to compute the path live.")

left, right = st.columns([3, 1], gap="large")
with right, st.container(border=True):
    st.markdown("**Recompute live**")
    eval_items = eval_items_picker(sel)
    ready = bool(sel.model_a and sel.model_b)
    clicked = st.button("Run", key="run", type="primary", disabled=not ready, width="stretch",
                        help=f"Interpolate with {names.get(sel.method, sel.method)} on the chosen subset.")
    if not ready:
        st.caption("Enter both model directories in the sidebar.")
    if clicked:
        rec = run_live(sel, eval_items)
        if rec is not None:
            live_runs.setdefault((sel.model_a, sel.model_b), {})[rec["method"]] = rec
    live = list(live_runs.get((sel.model_a, sel.model_b), {}).values())
    for rec in live:
        st.markdown(f"{figures.curve_name(rec, names, live=True)}: barrier **{rec['barrier']:.4f}**, "
                    f"midpoint {rec['midpoint_barrier']:.4f} {figures.loss_unit(rec)}")

with left:
    if cached or live:
        st.plotly_chart(figures.barrier_figure(cached, live, "Loss along the linear path", names),
                        key="barrier_chart")
        if any(r.get("accuracy") for r in cached + live):
            st.plotly_chart(figures.accuracy_figure(cached, live, "Accuracy along the linear path", names),
                            key="accuracy_chart")
        if cached:
            st.caption(eval_caption(cached))

st.subheader("The model zoo")
rows = zoo.manifest()
if rows:
    cols = ["name", "task", "pe", "seed", "parameters", "test_loss", "test_accuracy", "meets_bar", "steps"]
    st.dataframe(
        [{k: r.get(k) for k in cols} for r in rows], hide_index=True, key="zoo_table",
        column_config={
            "pe": "positional encoding",
            "test_loss": st.column_config.NumberColumn("test loss", format="%.3f"),
            "test_accuracy": st.column_config.NumberColumn("test accuracy", format="%.3f"),
            "meets_bar": st.column_config.CheckboxColumn("meets quality bar"),
            "parameters": st.column_config.NumberColumn(format="localized"),
        },
    )
else:
    st.info("The zoo is not built yet: `python -m engine zoo build` trains it into assets/zoo/.")
