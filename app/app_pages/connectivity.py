"""Connectivity: the loss (and accuracy) along the straight line between two models.

Opens at once on the precomputed records in the cached_results/ store (every cached method of the
pair overlaid); the Run button recomputes the path live on a small evaluation subset and draws it
beside them. The live run works in a thread of its own (app.live_run): the page polls its progress,
phase by phase with the time left, and Stop ends it. Every record, curve, group element and figure
can be downloaded (app.exports). Nothing here touches torch: the engine returns result records,
app.figures draws them.
"""

from __future__ import annotations

import streamlit as st

from app import downloads, exports, live_run, messages, sidebar, url_state
from app.figures import path as path_figs
from app.figures import style
from engine import api

# Evaluation subsets for a live run. Measured on one busy CPU core with a zoo LM: 8,192 tokens take
# about 10 s for the 21-point path, the whole test split (~196k tokens) minutes; the 360-image
# digits test split is small enough to use whole.
LM_TOKENS = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, None)
VIT_IMAGES = (45, 90, 180, None)
ANY_ITEMS = (256, 1_024, 8_192, 32_768, None)  # directories: tokens or images, unknown until loaded
DEFAULT_ITEMS = {"lm": 8_192, "vit": None, None: 8_192}
# Points on lambda for a live run: every point scores the test subset and a train sample, so a short
# path is what makes a first look at two real checkpoints affordable on a CPU (a GPT-2-small point
# on 1,024 tokens takes about half a minute on one busy core); 21 is the cached curves' grid.
POINTS = (3, 5, 11, 21, 41)
DEFAULT_POINTS = 21


@st.cache_data(show_spinner=False)
def cached_records(model_a: str, model_b: str, store: str, stamp: int) -> tuple[list[dict], list[str]]:
    """Every usable cached record of the pair, one per method, and a sentence per record skipped
    (unreadable or incomplete: the others still show); `stamp` (the store's) renews it after a rebuild."""
    recs, skipped = api.pair_records(model_a, model_b, store)
    order = {m: i for i, m in enumerate(sidebar.methods())}  # registry order: naive first, then aligners
    return sorted(recs, key=lambda r: (order.get(r["method"], len(order)), r["method"])), skipped


def load_cached(sel: sidebar.Selection) -> list[dict]:
    if sel.custom:
        return []  # the store is keyed by zoo names; directories are only ever run live
    recs, skipped = cached_records(sel.model_a, sel.model_b, str(api.cache_dir()), api.store_stamp())
    for s in skipped:
        st.warning(s)
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
        help="Test-set subset the live run scores at each point on λ; its train curve scores a "
             "train-split sample of the same size (capped for language models).",
    )


def points_picker() -> int:
    url_state.bind("path_points", "points", POINTS, int, default=DEFAULT_POINTS)
    return st.select_slider(
        "Points on λ", POINTS, key="path_points",
        help="Evenly spaced points from λ = 0 to 1, the endpoints included; the time of the path grows with "
             "them. The barrier is read on these points: fewer can miss the peak.")


def options_picker(method: str, files: dict[str, str] | None = None) -> dict:
    """The method's run options (engine.options), one widget each from its declaration, in a closed
    expander; a widget left empty (or a box left clear) leaves its option to the method's default. A
    choice that may also be a file offers `files` (path -> label) after its choices: the elements this pair's
    earlier runs kept (element_starts)."""
    specs = api.option_specs(method)
    if not specs:
        return {}
    values, files = {}, files or {}
    with st.expander("Method options"):
        for name, spec in specs.items():
            key, label, help_ = f"option_{method}_{name}", spec.label[:1].upper() + spec.label[1:], spec.help
            if spec.kind in ("choice", "choice_or_file"):
                extra = list(files) if spec.kind == "choice_or_file" else []
                values[name] = st.selectbox(label, [None, *spec.choices, *extra], key=key, help=help_,
                                            format_func=lambda v: "default" if v is None else files.get(v, v))
            elif spec.kind == "flag":
                values[name] = st.checkbox(label, key=key, help=help_) or None
            elif spec.kind == "count":
                values[name] = st.number_input(label, min_value=1, max_value=spec.most, value=None, step=1, key=key,
                                               help=help_, placeholder="default")
            else:  # seconds, rate, fraction: their bounds are checked when the config is made
                values[name] = st.number_input(label, min_value=0.0, value=None, key=key, help=help_,
                                               placeholder="default", format="%g")
    return values


@st.cache_data(show_spinner=False, max_entries=2)
def kept_runs(home: str, stamp: int) -> list[dict]:
    """The finished runs of the run history (newest first), read again only when `stamp` changes."""
    try:
        return [r for r in api.scan_runs(home)[0] if r["run"]["status"] == "done"]
    except api.LMCError:
        return []


def element_starts(model_a: str, model_b: str) -> dict[str, str]:
    """The elements the run history keeps for this pair (its learned and dual runs), newest first: file ->
    what the start picker says of it."""
    out = {}
    for r in kept_runs(str(api.runs_dir()), api.runs_stamp()):
        f = api.run_element(r) if (r["model_a"], r["model_b"]) == (model_a, model_b) else None
        if f is not None:
            steps = (r["alignment"].get("diagnostics") or {}).get("steps_done")
            out[str(f)] = (f"run {r['run']['id']}: {r['method']}" + (f", {steps:,} steps" if steps else "")
                           + f", barrier {r['barrier']:.3f}")
    return out


def references(live_runs: dict, cached: list[dict]) -> list[dict]:
    """Records to estimate a run's time from, best first: this session's live runs (this machine,
    newest first), the run history's (kept across restarts), then the pair's cached records."""
    mine = [r for runs in live_runs.values() for r in runs.values()]
    kept = kept_runs(str(api.runs_dir()), api.runs_stamp())
    return sorted(mine, key=lambda r: r.get("created", ""), reverse=True) + kept + list(cached)


def collect(run: live_run.LiveRun | None, live_runs: dict) -> None:
    """Keep a finished run's record with the session's live curves (once)."""
    if run is None or run.collected:
        return
    snap = run.snapshot()
    if snap.finished:
        if snap.record is not None:
            live_runs.setdefault((snap.cfg.model_a, snap.cfg.model_b), {})[snap.record["method"]] = snap.record
        run.collected = True


def live_panel() -> None:
    """The session's run: a bar per phase with the time left, Stop beside them while it runs, the outcome
    after.

    Drawn as a fragment that reruns every live_run.POLL_S seconds while the run is going, at the top of
    the main pane (the page puts it there); when it ends, the whole page reruns to draw the new curve."""
    run = live_run.current(st.session_state)
    if run is None:
        return
    snap = run.snapshot()
    if snap.finished and not run.collected:
        st.rerun()
    cfg, names = snap.cfg, sidebar.methods()
    state = {"done": "complete", "failed": "error"}.get(snap.state, "running" if not snap.finished else "complete")
    bars, stop = st.columns([5, 1], vertical_alignment="top") if not snap.finished else (st.container(), None)
    with bars, st.status(live_run.headline(snap), state=state, expanded=not snap.finished):
        task = api.ENTRIES[cfg.model_a].task if cfg.model_a in api.ENTRIES else None
        unit = {"lm": " tokens", "vit": " images"}.get(task, " items") if cfg.eval_items else ""
        st.caption(f"{names.get(cfg.method, cfg.method)}: `{api.display_name(cfg.model_a)}` / "
                   f"`{api.display_name(cfg.model_b)}`, {items_label(cfg.eval_items, task)}{unit}")
        if not snap.finished and live_run.estimated(snap):
            st.caption(live_run.estimated(snap))
        if snap.state != "failed":  # a failed run's bars would stand still forever: the error says it all
            for _, fraction, text in live_run.phase_rows(snap):
                st.progress(fraction, text=text)
    if stop is not None:
        stop.button("Stop", key="stop", on_click=run.stop, disabled=snap.state == "stopping", width="stretch",
                    icon=":material/stop_circle:", type="primary",
                    help="End the run within one layer, step or batch; the Runs page keeps it as stopped.")
    elif snap.state == "stopped":
        st.warning(snap.message)


def plane_section(sel: sidebar.Selection, names: dict[str, str], charts: downloads.Charts) -> None:
    """The loss over the plane through A, B and weight-matched B, from the store (zoo pairs)."""
    if sel.custom:
        return
    try:
        plane = api.plane_record(sel.model_a, sel.model_b)
    except api.LMCError as e:
        messages.error(e)
        return
    with st.expander("Loss plane: A, B and aligned B", icon=":material/landscape:", expanded=False):
        if plane is None:
            st.caption("No loss plane is stored for this pair: `python -m engine plane A B` computes one, "
                       "`python -m engine cache build --planes` the zoo's.")
            return
        p = plane["points"]
        st.caption(f"The loss over the plane through A, B and B aligned onto A by "
                   f"{names.get(plane['method'], plane['method']).lower()} ({plane['eval_set']}). B and aligned B compute one function, in two places of "
                   f"weight space: aligned B lies {p['B_aligned'][0]:.1f} from A, B "
                   f"{(p['B'][0] ** 2 + p['B'][1] ** 2) ** 0.5:.1f}. Dashed: the naive segment from A to B; "
                   "solid: the aligned one.")
        charts.show(path_figs.plane_figure(plane, names), key="plane_chart")


@st.cache_data(show_spinner=False)
def stored_widen(store: str, stamp: int) -> tuple[list[dict], list[str]]:
    """The stored width-heterogeneous records and a sentence per file skipped; `stamp` renews it after a build."""
    return api.widen_records(store)


def widen_section(sel: sidebar.Selection, names: dict[str, str], charts: downloads.Charts) -> None:
    """Across widths: a narrow zoo model lifted exactly into a wider one's shape, B aligned onto it, the path in
    B's width (docs/MATH.md section 8), from the store. Open when the sidebar pair holds a wider model."""
    if sel.custom:
        return
    try:
        recs, skipped = stored_widen(str(api.cache_dir()), api.widen_stamp())
    except api.LMCError as e:
        messages.error(e)
        return
    zoo = api.widen_pairs()
    recs = [r for r in recs if r.get("arch", {}).get("task", sel.task) == sel.task]
    if not recs and sel.task not in {api.ENTRIES[a].task for a, _ in zoo}:
        return
    pairs = list(dict.fromkeys((r["model_a"], r["model_b"]) for r in recs))
    mine = [p for p in pairs if p[1] in (sel.model_a, sel.model_b)]
    with st.expander("Across widths: a narrow model lifted into a wider one", icon=":material/open_in_full:",
                     expanded=bool(mine)):
        for s in skipped:
            st.warning(s)
        if not recs:
            st.caption("No width-heterogeneous run is stored: `python -m engine widen A B` computes one, "
                       "`python -m engine cache build --widen` the zoo's.")
            return
        label = {p: f"{api.display_name(p[0])} into {api.display_name(p[1])}" for p in pairs}
        pick = pairs[0] if len(pairs) == 1 else st.selectbox(
            "Pair", pairs, index=pairs.index(mine[0]) if mine else 0, format_func=label.get, key="widen_pick")
        shown = [r for r in recs if (r["model_a"], r["model_b"]) == pick]
        lift = shown[0]["lift"]
        wa, wb = lift["widths_a"], lift["widths_b"]
        st.caption(
            f"`{api.display_name(pick[0])}` (D = {wa['d_model']}, {wa['n_heads']} heads of {wa['d_head']}, MLP "
            f"{wa['d_mlp']}) lifted into the shape of `{api.display_name(pick[1])}` (D = {wb['d_model']}, "
            f"{wb['n_heads']} heads of {wb['d_head']}, MLP {wb['d_mlp']}): its units embedded, the rest zero, the "
            f"stream scaled by {lift['stream_scale']:.3f} so that RMSNorm sees what it saw. The lifted model computes A's "
            f"function (test loss {lift['loss_a']:.4f}, lifted {lift['loss_a_lifted']:.4f}); B is aligned onto it "
            f"and the path runs in width {wb['d_model']}.")
        charts.show(path_figs.barrier_figure(shown, [], f"Loss along the path in width {wb['d_model']}", names,
                                             highlight=sel.method if any(r["method"] == sel.method for r in shown)
                                             else None, show_train=False), key="widen_chart")
        rows = _vs_naive_text(path_figs.summary_rows(shown, [], names))
        fmt = st.column_config.NumberColumn
        st.dataframe([{k: v for k, v in r.items() if k != "train barrier"} for r in rows], hide_index=True,
                     key="widen_table", width="stretch", column_config={
                         "barrier": fmt("barrier", format="%.4f"), "vs naive": st.column_config.TextColumn("vs naive"),
                         "midpoint": fmt("midpoint", format="%.4f"),
                         "accuracy drop (pt)": fmt("acc. drop", format="%.1f")})


def export_section(cached: list[dict], live: list[dict], names: dict[str, str], charts: downloads.Charts) -> None:
    """Downloads: one record and its group element, every curve as CSV, every figure as HTML."""
    curves = [(r, path_figs.curve_name(r, names), "cached") for r in cached] + \
             [(r, path_figs.curve_name(r, names, live=True), "live") for r in live]
    with st.expander("Export", icon=":material/download:"):
        pick = st.selectbox("Record", range(len(curves)), format_func=lambda i: curves[i][1], key="export_pick")
        downloads.record_downloads(curves[pick][0], key="export")
        c1, c2 = st.columns(2)
        pair = exports.stem(curves[0][0]).rsplit("__", 1)[0]
        c1.download_button("Every curve (CSV)", lambda: exports.curves_csv(curves), f"{pair}__curves.csv", "text/csv",
                           key="export_curves", on_click="ignore", icon=":material/download:",
                           help="One row per point of every test and train curve: method, curve, source, split, evaluation "
                                "set, λ, loss, accuracy.")
        with c2:
            charts.download_button(key="export_figures", about=[(r, name) for r, name, _ in curves])


def _vs_naive_text(rows: list[dict]) -> list[dict]:
    """'vs naive' as text: '+0.1234', or '-' where there is nothing to compare (the naive curve itself)."""
    for row in rows:
        if "vs naive" in row:
            row["vs naive"] = "-" if row["vs naive"] is None else f"{row['vs naive']:+.4f}"
    return rows


def summary_table(cached: list[dict], live: list[dict], names: dict[str, str]) -> None:
    """The numbers, once, under the chart: one narrow row per curve, the endpoints in a caption."""
    rows = _vs_naive_text(path_figs.summary_rows(cached, live, names))
    for row in rows:  # a record without a train curve: "-", not an empty number
        if "train barrier" in row:
            row["train barrier"] = "-" if row["train barrier"] is None else f"{row['train barrier']:.4f}"
    unit = style.loss_unit((cached or live)[0])
    fmt = st.column_config.NumberColumn
    st.dataframe(rows, hide_index=True, key="summary_table", width="stretch", column_config={
        "curve": st.column_config.TextColumn("curve", width="medium"),
        "barrier": fmt("barrier", format="%.4f", help=f"Largest rise of the loss above the chord, in {unit}."),
        "vs naive": st.column_config.TextColumn("vs naive", help="Barrier minus the naive barrier on the same "
                                                                  "evaluation; - for the naive curve itself."),
        "midpoint": fmt("midpoint", format="%.4f", help=f"Loss minus chord at λ = 0.5, in {unit}."),
        "train barrier": st.column_config.TextColumn(
            "train barrier", help=f"The barrier of the same path on a sample of the train split, in {unit}; "
                                  "- for a record made before train curves."),
        "accuracy drop (pt)": fmt("acc. drop", format="%.1f",
                                  help="Largest fall of test accuracy below the chord, in percentage points."),
        "path": st.column_config.TextColumn("path", help="What was interpolated: the weights, or each head's "
                                                         "circuits."),
    })
    r = next((x for x in cached if x["method"] == "naive"), (cached or live)[0])
    ends = f"Barriers in {unit}. Endpoint test loss: A {r['endpoint_loss_a']:.4f}, B {r['endpoint_loss_b']:.4f}"
    if r.get("accuracy"):
        ends += f"; accuracy: A {100 * r['accuracy'][0]:.1f} %, B {100 * r['accuracy'][-1]:.1f} %"
    st.caption(ends + ". Aligning moves B to an equivalent model, so every method shares these endpoints.")


def eval_caption(recs: list[dict]) -> str:
    sets = sorted({f"{r.get('eval_set', '?')}, {len(r['lambdas'])} points on λ"
                   + (f" (train: {r['train_eval_set']})" if path_figs.has_train(r) else "") for r in recs})
    return "Cached curves: " + "; ".join(sets) + "." if sets else ""


st.title("Connectivity")
st.caption(
    "Interpolate the weights of two models of one architecture, θ(λ) = (1 − λ) θ_A + λ θ_B, and "
    "measure the test loss along the way. The **barrier** is the largest rise of that loss above the dashed "
    "chord between the endpoint losses: near zero, the two models are linearly mode connected."
)

sel = sidebar.selection()
st.subheader(sel.title)
description = messages.check_pair(sel)  # from the configs: a pair that cannot work is refused here
if description:
    st.caption(f"Model A `{api.display_name(sel.model_a)}`, model B `{api.display_name(sel.model_b)}`: "
               f"{description}")
CONFIRM = "confirm_new_run"  # set when Run is pressed while a run goes on: the page asks first
names = sidebar.methods()
live_runs = st.session_state.setdefault("live_runs", {})  # (model_a, model_b) -> {method: record}
run = live_run.current(st.session_state)
collect(run, live_runs)
if run is not None and run.snapshot().state == "failed":  # full width, not in the run panel's column
    messages.error(run.snapshot().message)
charts = downloads.Charts("Connectivity")

try:
    cached = load_cached(sel)
except api.LMCError as e:
    messages.error(e)
    cached = []

if not cached and description and not sel.custom:
    st.info("Nothing is cached for this pair yet: press **Run** to compute the path live.")

top = st.container()  # a running run's bars and Stop, full width above the chart (filled once Run is read)
left, right = st.columns([3, 1], gap="large")
with right, st.container(border=True):
    st.markdown("**Recompute live**")
    eval_items = eval_items_picker(sel)
    points = points_picker()
    options = options_picker(sel.method, element_starts(sel.model_a, sel.model_b))
    cfg = None
    if description:
        try:
            cfg = api.RunConfig(sel.model_a, sel.model_b, sel.method, eval_items=eval_items, points=points,
                                options=api.method_options(sel.method, options))
        except api.LMCError as e:
            messages.error(e)
    ready = cfg is not None
    estimates, sources = live_run.estimates_for(cfg, references(live_runs, cached)) if ready else ({}, {})
    clicked = st.button("Run", key="run", type="primary", disabled=not ready, width="stretch",
                        help=f"Interpolate with {names.get(sel.method, sel.method)} on the chosen subset; "
                             "a run still going is stopped first, once you confirm.")
    if clicked and run is not None and run.running:
        st.session_state[CONFIRM] = True
    elif clicked:
        run = live_run.start(st.session_state, cfg, estimates, sources=sources)
    if st.session_state.get(CONFIRM) and ready:
        st.warning("A run is still going: starting this one stops it.")
        yes, no = st.columns(2)
        if yes.button("Stop it, run this", key="confirm_run", width="stretch"):
            st.session_state.pop(CONFIRM)
            run = live_run.start(st.session_state, cfg, estimates, sources=sources)
        elif no.button("Keep it", key="keep_run", width="stretch"):
            st.session_state.pop(CONFIRM)
            st.rerun()
    if ready and (run is None or not run.running):
        st.caption(live_run.before_run(estimates, sel.method, sources) or
                   "The models cannot be read to estimate the time from: the bars tell once it starts.")
    going = run is not None and run.running
    with top if going else st.container():
        st.fragment(live_panel, run_every=live_run.POLL_S if going else None)()
    live = list(live_runs.get((sel.model_a, sel.model_b), {}).values())

with left:
    if cached or live:
        log_y = st.session_state.get("log_y", False)
        any_train = any(path_figs.has_train(r) for r in cached + live)
        show_train = any_train and st.session_state.get("show_train", True)
        charts.show(path_figs.barrier_figure(cached, live, "Loss along the linear path", names, highlight=sel.method,
                                             log_y=log_y, show_train=show_train), key="barrier_chart")
        toggles = st.columns(2)
        url_state.bind("log_y", "log", kind=bool)
        toggles[0].toggle("Log scale", key="log_y",
                          help="Loss on a log axis: a high barrier leaves the endpoints readable.")
        if any_train:
            url_state.bind("show_train", "train", kind=bool, default=True)
            toggles[1].toggle("Show train curves", key="show_train",
                              help="The same points on a sample of the train split, thin and dotted: a barrier on "
                                   "both splits is one of the loss landscape, not of generalisation.")
        summary_table(cached, live, names)
        if any(r.get("accuracy") for r in cached + live):
            charts.show(path_figs.accuracy_figure(cached, live, "Accuracy along the linear path", names,
                                                  highlight=sel.method, show_train=show_train), key="accuracy_chart")
        if cached:
            st.caption(eval_caption(cached) + " The sidebar's method is drawn thick."
                       + (" Dotted: the train curves." if any_train else " These records hold the test split only."))
        export_section(cached, live, names, charts)
    plane_section(sel, names, charts)
    widen_section(sel, names, charts)

st.subheader("The model zoo")
rows = api.zoo_manifest()
if rows:
    cols = ["name", "task", "pe", "d_model", "seed", "parameters", "test_loss", "test_accuracy", "meets_bar", "steps"]
    st.dataframe(
        [{k: r.get(k) for k in cols} for r in rows], hide_index=True, key="zoo_table",
        column_config={
            "pe": "positional encoding",
            "d_model": st.column_config.NumberColumn("width (D)"),
            "test_loss": st.column_config.NumberColumn("test loss", format="%.3f"),
            "test_accuracy": st.column_config.NumberColumn("test accuracy", format="%.3f"),
            "meets_bar": st.column_config.CheckboxColumn("meets quality bar"),
            "parameters": st.column_config.NumberColumn(format="localized"),
        },
    )
else:
    st.info("The zoo is not built yet: `python -m engine zoo build` trains it into assets/zoo/.")
