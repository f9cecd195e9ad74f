"""Runs: the live runs kept in the user's run history, across sessions and server restarts.

Every live run that finishes on the Connectivity page is kept by the engine (engine.api.save_run) in a
directory of the user's own, never in the shipped cached_results/. This page lists them with
filters, draws several on one chart to compare their barrier curves, reopens one (its curve, its
numbers, its downloads, or on the Connectivity page beside the cached curves) and deletes one after
a confirmation. Nothing here touches torch: the engine reads the store, app.figures draws.
"""

from __future__ import annotations

import json
from pathlib import PurePath

import streamlit as st

from app import downloads, exports, sidebar, url_state
from app.figures import path as path_figs
from app.figures import runs as run_figs
from app.figures import style
from engine import api
from engine.api import LMCError

CONNECTIVITY = "app_pages/connectivity.py"
TASKS = {"lm": "LM", "vit": "ViT", None: "?"}
FILTERS = (("pair", "Pair"), ("method", "Method"), ("pe", "Positional encoding"), ("status", "Status"))


@st.cache_data(show_spinner=False, max_entries=4)
def scan(home: str, stamp: int) -> tuple[list[dict], list[str]]:
    """api.scan_runs of the history in `home`, read again only when `stamp` (api.runs_stamp) changes: every
    filter or pick reruns the page, and reading every record each time grows with the history."""
    return api.scan_runs(home)


def pair_name(a: str, b: str) -> str:
    """'LM · RoPE · seeds 0, 1' for a zoo pair, the directories' last parts otherwise."""
    if a in api.ENTRIES and b in api.ENTRIES:
        return sidebar.pair_label(a, b)
    return f"{PurePath(a).name or a} / {PurePath(b).name or b}"


def label(entry: dict, names: dict[str, str]) -> str:
    """One run in a picker or legend: method, pair, when, and the id's suffix (runs stay apart)."""
    when = (entry.get("created") or entry["run"].get("saved") or "")[5:16].replace("T", " ")
    return (f"{names.get(entry['method'], entry['method'])} · {pair_name(entry['model_a'], entry['model_b'])} · "
            f"{when} ({entry['run']['id'][-6:]})")


def facets(entry: dict, names: dict[str, str]) -> dict[str, str]:
    """The values the filters pick from."""
    row = api.run_summary(entry)
    return {"pair": pair_name(row["model_a"], row["model_b"]), "method": names.get(row["method"], row["method"]),
            "pe": sidebar.PE_LABELS.get(row["pe"], row["pe"] or "?"), "status": row["status"]}


def keep_valid(key: str, valid) -> None:
    """Drop from a picker's kept value what the store no longer holds (a run deleted, a filter narrowed)."""
    if key in st.session_state:
        v = st.session_state[key]
        if isinstance(v, list):
            st.session_state[key] = [x for x in v if x in valid]
        elif v not in valid:
            del st.session_state[key]


def say(kind: str, text: str) -> None:
    st.session_state["runs_said"] = (kind, text)


def delete(run_id: str, name: str) -> None:
    st.session_state.pop("runs_confirm", None)
    try:
        api.delete_run(run_id)
    except LMCError as e:
        say("error", str(e))
        return
    say("success", f"Deleted run {name}.")


def to_connectivity(entry: dict) -> None:
    """Put the run's pair and method in the sidebar and its record among the session's live curves."""
    a, b, method = entry["model_a"], entry["model_b"], entry["method"]
    keys = {(x, y): sidebar.pair_key(x, y) for x, y in api.pairs()}
    if (a, b) in keys:
        st.session_state["pair"] = keys[(a, b)]
    else:
        st.session_state.update(pair=sidebar.CUSTOM, model_a_dir=a, model_b_dir=b)
    if method in sidebar.methods():
        st.session_state["method"] = method
    record = {k: v for k, v in entry.items() if k != "run"}
    st.session_state.setdefault("live_runs", {}).setdefault((a, b), {})[method] = record


def show_numbers(entry: dict) -> None:
    unit = style.loss_unit(entry)
    cols = st.columns(4)
    cols[0].metric("Barrier", f"{entry['barrier']:.4f}", help=f"In {unit}.")
    cols[1].metric("Midpoint barrier", f"{entry['midpoint_barrier']:.4f}", help=f"In {unit}.")
    cols[2].metric("Endpoint loss A / B", f"{entry['endpoint_loss_a']:.3f} / {entry['endpoint_loss_b']:.3f}")
    if entry.get("accuracy"):
        cols[3].metric("Accuracy drop", f"{100 * entry['accuracy_drop']:.1f} pt")
    train = (f" Train barrier {entry['train_barrier']:.4f} on {entry['train_eval_set']}."
             if path_figs.has_train(entry) else "")
    st.caption(f"Barriers in {unit}; {entry.get('eval_set', 'evaluation set not recorded')}, "
               f"{len(entry['lambdas'])} points on λ.{train} Run {entry['run']['id']}, {entry['run']['status']}.")


def train_toggle(records: list[dict], key: str) -> bool:
    """"Show train curves" (on by default) when any record has one; False when none has."""
    if not any(path_figs.has_train(r) for r in records):
        return False
    return st.toggle("Show train curves", value=True, key=key,
                     help="The same points on a sample of the train split, thin and dotted in the run's colour.")


def compare_section(chosen: list[dict], names: dict[str, str], charts: downloads.Charts) -> None:
    try:
        rows = api.compare_runs(chosen)
    except LMCError as e:
        st.error(str(e))
        return
    labels = [label(e, names) for e in chosen]
    show_train = st.session_state.get("runs_compare_train", True)
    charts.show(run_figs.comparison_figure(chosen, labels, "Loss along the linear path", show_train=show_train),
                key="runs_compare_chart")
    train_toggle(chosen, "runs_compare_train")
    unit = style.loss_unit(chosen[0])
    any_train = any(path_figs.has_train(e) for e in chosen)
    table = []
    for lab, r, e in zip(labels, rows, chosen):
        row = {"run": lab, "barrier": r["barrier"], "vs first": r["barrier_vs_first"],
               "midpoint barrier": r["midpoint_barrier"], "endpoint A": r["endpoint_loss_a"],
               "endpoint B": r["endpoint_loss_b"]}
        if any_train:  # a run from before train curves has none: "-"
            row["train barrier"] = f"{e['train_barrier']:.4f}" if path_figs.has_train(e) else "-"
        table.append(row)
    config = {k: st.column_config.NumberColumn(k, format="%.4f", help=f"In {unit}.")
              for k in ("barrier", "vs first", "midpoint barrier", "endpoint A", "endpoint B")}
    config["train barrier"] = st.column_config.TextColumn(
        "train barrier", help=f"The barrier on a sample of the train split, in {unit}; - for a run made before "
                              "train curves.")
    st.dataframe(table, hide_index=True, key="runs_compare_table", column_config=config)
    curves = [(e, lab, "history") for e, lab in zip(chosen, labels)]
    st.download_button("Compared curves (CSV)", lambda: exports.curves_csv(curves), "runs__curves.csv", "text/csv",
                       key="runs_compare_csv", on_click="ignore", icon=":material/download:")


def open_section(entry: dict, names: dict[str, str], charts: downloads.Charts) -> None:
    name = label(entry, names)
    show_numbers(entry)
    title = f"{names.get(entry['method'], entry['method'])}: {pair_name(entry['model_a'], entry['model_b'])}"
    show_train = st.session_state.get("runs_open_train", True)
    charts.show(path_figs.barrier_figure([entry], title=title, method_names=names, show_train=show_train),
                key="runs_open_chart")
    train_toggle([entry], "runs_open_train")
    if entry.get("accuracy"):
        charts.show(path_figs.accuracy_figure([entry], title="Accuracy along the linear path", method_names=names,
                                              show_train=show_train), key="runs_open_accuracy")
    with st.expander("Run config"):
        st.code(json.dumps(entry.get("config", {}), indent=1), language="json")
    downloads.record_downloads(entry, key="runs_open")
    c1, c2 = st.columns(2)
    if c1.button("Open on Connectivity", key="runs_to_connectivity", on_click=to_connectivity, args=(entry,),
                 icon=":material/show_chart:", width="stretch",
                 help="The pair and method in the sidebar, this run's curve beside the cached ones."):
        st.switch_page(CONNECTIVITY)
    run_id = entry["run"]["id"]
    with c2:
        if st.session_state.get("runs_confirm") == run_id:
            st.warning(f"Delete run {name} for good? Its file {api.run_file(run_id)} is removed.")
            y, n = st.columns(2)
            y.button("Delete", key="runs_delete_yes", type="primary", on_click=delete, args=(run_id, name),
                     width="stretch")
            n.button("Cancel", key="runs_delete_no", on_click=lambda: st.session_state.pop("runs_confirm", None),
                     width="stretch")
        else:
            st.button("Delete…", key="runs_delete", icon=":material/delete:", width="stretch",
                      on_click=lambda: st.session_state.update(runs_confirm=run_id))


st.title("Runs")
st.caption(
    "Every live run that finishes on the Connectivity page is kept here, across sessions and restarts, in "
    f"`{api.runs_dir()}` (one JSON record per run; set LMC_EXPLORER_HOME to keep them elsewhere). Pick "
    "several to compare their barrier curves, or open one."
)
said = st.session_state.pop("runs_said", None)
if said:
    getattr(st, said[0])(said[1])
try:
    runs, skipped = scan(str(api.runs_dir()), api.runs_stamp())
except LMCError as e:
    st.error(str(e))
    st.stop()
for s in skipped:
    st.warning(f"Skipped a file of the run history: {s}")
if not runs:
    st.info("No runs kept yet: a live run finished on the Connectivity page appears here.")
    st.stop()

names = sidebar.methods()
charts = downloads.Charts("Runs")
by_id = {e["run"]["id"]: e for e in runs}
tags = {i: facets(e, names) for i, e in by_id.items()}
picked = {}
for col, (f, title) in zip(st.columns(len(FILTERS)), FILTERS):
    options = sorted({t[f] for t in tags.values()})
    keep_valid(f"runs_filter_{f}", options)
    picked[f] = col.multiselect(title, options, key=f"runs_filter_{f}", placeholder="All")
shown = [i for i in by_id if all(not picked[f] or tags[i][f] in picked[f] for f, _ in FILTERS)]

st.dataframe(
    [{"created": by_id[i].get("created"), "pair": tags[i]["pair"], "task": TASKS.get(api.run_summary(by_id[i])["task"]),
      "method": tags[i]["method"], "positional encoding": tags[i]["pe"], "barrier": by_id[i]["barrier"],
      "midpoint barrier": by_id[i]["midpoint_barrier"], "evaluated on": api.run_summary(by_id[i])["eval_items"],
      "status": tags[i]["status"], "id": i} for i in shown],
    hide_index=True, key="runs_table",
    column_config={"barrier": st.column_config.NumberColumn(format="%.4f"),
                   "midpoint barrier": st.column_config.NumberColumn(format="%.4f"),
                   "evaluated on": st.column_config.NumberColumn(format="localized", help="Tokens or images; "
                                                                  "empty: the whole test split.")},
)
st.caption(f"{len(shown)} of {len(runs)} run(s).")

st.subheader("Compare")
keep_valid("runs_compare", shown)
chosen = st.multiselect("Runs to draw on one chart", shown, key="runs_compare",
                        format_func=lambda i: label(by_id[i], names), placeholder="Pick runs to compare")
if chosen:
    compare_section([by_id[i] for i in chosen], names, charts)

st.subheader("Open a run")
if shown:
    url_state.bind("runs_open", "run", shown)
    keep_valid("runs_open", shown)
    run_id = st.selectbox("Run", shown, key="runs_open", format_func=lambda i: label(by_id[i], names))
    open_section(by_id[run_id], names, charts)
    drawn = [*chosen, *([run_id] if run_id not in chosen else [])]
    charts.download_button(key="runs_figures", about=[(by_id[i], label(by_id[i], names)) for i in drawn])
else:
    st.info("No run matches the filters.")
