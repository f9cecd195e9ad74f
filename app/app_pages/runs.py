"""Runs: the live runs kept in the user's run history, across sessions and server restarts.

Every live run of the Connectivity page is kept by its worker in a directory of the user's own, never
in the shipped cached_results/: a finished one as its record (engine.api.save_run), a stopped or
failed one with what it reached (engine.api.save_unfinished). This page lists them with their status
and duration and filters, draws several finished ones on one chart to compare their barrier curves,
reopens one (its curve, its numbers, its downloads, or on the Connectivity page beside the cached
curves; for a stopped or failed one the phase it reached, why it ended and the points it measured),
keeps a note per run (written into its file, engine.api.set_note) and deletes one after a
confirmation. A missing value reads "-", never "None". Nothing here touches torch: the engine reads
the store, app.figures draws.
"""

from __future__ import annotations

import json
from pathlib import PurePath

import streamlit as st

from app import downloads, exports, live_run, sidebar, url_state
from app.figures import path as path_figs
from app.figures import runs as run_figs
from app.figures import style
from engine import api
from engine.api import LMCError

CONNECTIVITY = "app_pages/connectivity.py"
TASKS = {"lm": "LM", "vit": "ViT"}
NONE = "-"  # what a cell without a value reads
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


def when(entry: dict) -> str:
    """'2026-12-01 03:26': when the run was made (its record's time, else the time it was kept)."""
    return (entry.get("created") or entry["run"].get("saved") or "")[:16].replace("T", " ")


def label(entry: dict, names: dict[str, str]) -> str:
    """One run in a picker or legend: method, pair, when, the status if it did not finish, and the id's
    suffix (runs stay apart)."""
    status = "" if entry["run"]["status"] == "done" else f" · {entry['run']['status']}"
    return (f"{names.get(entry['method'], entry['method'])} · {pair_name(entry['model_a'], entry['model_b'])} · "
            f"{when(entry)[5:]}{status} ({entry['run']['id'][-6:]})")


def number(v, fmt: str = ".4f") -> str:
    """A number as the table shows it, or NONE."""
    return NONE if v is None else format(v, fmt)


def duration(entry: dict) -> str:
    """The run's wall time ('2 min 5 s'), or NONE for a run kept before durations were."""
    s = entry["run"].get("seconds")
    return NONE if s is None else api.fmt_seconds(s)


def items(n: int | None, task: str | None) -> str:
    """Scored items a run evaluated: '8,192', or the whole test split."""
    return f"{n:,}" if isinstance(n, int) else {"vit": "all test images"}.get(task, "whole test split")


def table_row(entry: dict, tag: dict[str, str]) -> dict:
    """One run in the history's table: text in every cell, NONE where a run has no value."""
    row = api.run_summary(entry)
    return {"created": when(entry) or NONE, "pair": tag["pair"], "task": TASKS.get(row["task"], NONE),
            "method": tag["method"], "positional encoding": tag["pe"], "status": row["status"],
            "duration": duration(entry), "barrier": number(row["barrier"]),
            "midpoint barrier": number(row["midpoint_barrier"]), "evaluated on": items(row["eval_items"], row["task"]),
            "note": row["note"] or NONE, "id": row["id"]}


def facets(entry: dict, names: dict[str, str]) -> dict[str, str]:
    """The values the filters pick from."""
    row = api.run_summary(entry)
    return {"pair": pair_name(row["model_a"], row["model_b"]), "method": names.get(row["method"], row["method"]),
            "pe": sidebar.PE_LABELS.get(row["pe"], row["pe"] or NONE), "status": row["status"]}


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


def save_note(run_id: str, key: str) -> None:
    try:
        api.set_note(run_id, st.session_state.get(key, ""))
    except LMCError as e:
        say("error", str(e))
        return
    say("success", "Note saved.")


def note_editor(entry: dict) -> None:
    """The user's note on the run, saved into its file on request."""
    run_id = entry["run"]["id"]
    key = f"runs_note_{run_id}"  # one per run: another run shows its own note
    st.text_area("Note", value=entry["run"].get("note", ""), key=key, max_chars=api.MAX_NOTE, height=80,
                 placeholder="What this run was for, what it showed…")
    st.button("Save note", key="runs_note_save", on_click=save_note, args=(run_id, key), icon=":material/save:")


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
               f"{len(entry['lambdas'])} points on λ.{train} Run {entry['run']['id']}, {entry['run']['status']}, "
               f"{'took ' + duration(entry) if entry['run'].get('seconds') is not None else 'duration not recorded'}.")


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
        if any_train:  # a run without a train curve: "-"
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


def unfinished_section(entry: dict, names: dict[str, str], charts: downloads.Charts) -> None:
    """A stopped or failed run: where it got to, why it ended, its phase times and the points it measured."""
    run = entry["run"]
    phase = live_run.PHASE_LABELS.get(run.get("phase"), "before its first phase")
    text = f"{run['status'].capitalize()} after {duration(entry)}, in: {phase.lower()}. {run.get('message', '')}"
    (st.error if run["status"] == "failed" else st.warning)(text.strip())
    times = entry.get("timings") or {}
    if times:
        st.dataframe([{"phase": live_run.PHASE_LABELS.get(p, p), "seconds": f"{s:.1f}"} for p, s in times.items()],
                     hide_index=True, key="runs_open_timings")
    if entry.get("partial"):
        title = f"{names.get(entry['method'], entry['method'])}: the points measured before the run ended"
        charts.show(run_figs.partial_figure(entry, title), key="runs_open_partial")
    else:
        st.caption("It ended before the path: no point of it was measured.")
    with st.expander("Run config"):
        st.code(json.dumps(entry.get("config", {}), indent=1), language="json")
    st.download_button("Run (JSON)", json.dumps(entry, indent=1), f"run-{run['id']}.json", "application/json",
                       key="runs_open_json", on_click="ignore", icon=":material/download:")


def open_section(entry: dict, names: dict[str, str], charts: downloads.Charts) -> None:
    name = label(entry, names)
    if not api.run_finished(entry):
        unfinished_section(entry, names, charts)
        note_editor(entry)
        delete_controls(entry["run"]["id"], name, st.container())
        return
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
    note_editor(entry)
    c1, c2 = st.columns(2)
    if c1.button("Open on Connectivity", key="runs_to_connectivity", on_click=to_connectivity, args=(entry,),
                 icon=":material/show_chart:", width="stretch",
                 help="The pair and method in the sidebar, this run's curve beside the cached ones."):
        st.switch_page(CONNECTIVITY)
    delete_controls(entry["run"]["id"], name, c2)


def delete_controls(run_id: str, name: str, where) -> None:
    """Delete…, then a confirmation naming the file."""
    with where:
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
    "Every live run of the Connectivity page is kept here, across sessions and restarts, in "
    f"`{api.runs_dir()}` (one JSON file per run; set LMC_EXPLORER_HOME to keep them elsewhere): a finished one "
    "with its record, a stopped or failed one with what it reached. Pick several finished runs to compare their "
    "barrier curves, or open one."
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
    st.info("No runs kept yet: a live run of the Connectivity page appears here once it ends.")
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
    [table_row(by_id[i], tags[i]) for i in shown], hide_index=True, key="runs_table",
    column_config={"status": st.column_config.TextColumn(help="done, or stopped / failed before its record: those "
                                                              "keep the phase they reached and the points they "
                                                              "measured."),
                   "duration": st.column_config.TextColumn(help="Wall time from start to end; - for a run kept "
                                                                "before durations were."),
                   "barrier": st.column_config.TextColumn(help="- for a run that ended before its path."),
                   "evaluated on": st.column_config.TextColumn(help="Scored tokens or images.")},
)
st.caption(f"{len(shown)} of {len(runs)} run(s).")

st.subheader("Compare")
comparable = [i for i in shown if api.run_finished(by_id[i])]  # a run that ended before its path has no curve
keep_valid("runs_compare", comparable)
chosen = st.multiselect("Finished runs to draw on one chart", comparable, key="runs_compare",
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
