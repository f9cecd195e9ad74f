"""The sidebar every page shares: which pair of models, which alignment method.

The entry script draws it once per rerun, before the page runs; pages read the choice with
`selection()`. Pickers are built from the engine's registries (zoo pairs, aligners), so a new zoo
entry or method appears here without touching the app.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from app import live_run, messages, url_state
from engine import api

# Short labels fit the sidebar picker; long ones head the page.
TASK_LABELS = {"lm": "LM", "vit": "ViT"}
TASK_TITLES = {"lm": "Byte-level language model (Austen)", "vit": "Vision Transformer (8×8 digits)"}
PE_LABELS = {"none": "NoPE", "learned": "learned PE", "sinusoidal": "sinusoidal PE", "rope": "RoPE"}
PE_TITLES = {"none": "no positional encoding", "learned": "learned positions", "sinusoidal": "sinusoidal positions",
             "rope": "rotary positions (RoPE)"}
CUSTOM = "custom"  # the pair picker's entry for two model directories of the user's own


@dataclass(frozen=True)
class Selection:
    model_a: str  # zoo name or model directory
    model_b: str
    method: str
    task: str | None  # "lm" | "vit"; None for directories (unknown until the engine loads them)
    title: str
    custom: bool


def methods() -> dict[str, str]:
    """Method name -> display name, from the engine's aligner registry (naive first)."""
    return api.method_names()


def pair_key(a: str, b: str) -> str:
    return f"{a}__{b}"


def pair_label(a: str, b: str) -> str:
    """'LM · RoPE · seeds 0, 1' for a zoo pair: short enough for the sidebar."""
    ea, eb = api.ENTRIES[a], api.ENTRIES[b]
    return f"{TASK_LABELS[ea.task]} · {PE_LABELS[ea.pe]}{_size(ea, ' · ')} · seeds {ea.seed}, {eb.seed}"


def _size(e, sep: str) -> str:
    """'' for the zoo's own size and recipe; ' · D 128' for a wider pair; ' · medium, 6 x 256' for the medium
    tier; ' · dropout 0.1' for a pair trained with residual dropout."""
    drop = f"{sep}dropout {e.dropout:g}" if e.dropout else ""
    if e.tier != "small":
        cfg = e.config()
        return f"{sep}{e.tier}, {cfg.n_layers} × {cfg.d_model}{drop}"
    return (f"{sep}D {e.width}" if e.width else "") + drop


def pair_title(a: str, b: str) -> str:
    ea = api.ENTRIES[a]
    return f"{TASK_TITLES[ea.task]}, {PE_TITLES[ea.pe]}{_size(ea, ', ')}"


def _zoo_pairs() -> dict[str, tuple[str, str]]:
    return {pair_key(a, b): (a, b) for a, b in api.pairs()}


# The pair the app opens on: learned PE, the reference's setting, rather than the zoo's first pair (NoPE, whose
# aligned path stays highest of the small pairs but the sinusoidal one)
OPENING_PAIR = ("lm-learned-s0", "lm-learned-s1")


def opening_pair() -> str:
    pairs = _zoo_pairs()
    key = pair_key(*OPENING_PAIR)
    return key if key in pairs else next(iter(pairs))


# Pages that draw their own models, not the sidebar's pair: the pickers stay (so the pair survives a visit)
# under a line saying they do not apply here.
OWN_MODELS = {"symmetry": "The Symmetry page diagnoses the model picked on the page.",
              "seeds": "The Seeds page shows its own set of seeds.",
              "runs": "The Runs page lists the runs kept, of any pair."}


def render(page: str = "") -> None:
    """Draw the shared pickers; their values live in st.session_state under the widget keys. `page`:
    the page's url path, for the line saying whether the pair applies there."""
    pairs = _zoo_pairs()
    with st.sidebar:
        st.header("Models")
        if page in OWN_MODELS:
            st.caption(f"{OWN_MODELS[page]} The pair below is used by Connectivity and Alignment.")
        url_state.bind("pair", "pair", [*pairs, CUSTOM], default=opening_pair())
        key = st.selectbox(
            "Pair", [*pairs, CUSTOM], key="pair",
            format_func=lambda k: pair_label(*pairs[k]) if k in pairs else "Two model directories…",
            help="Two zoo models with the same architecture, trained from different seeds.",
        )
        if key == CUSTOM:
            url_state.bind("model_a_dir", "a")
            url_state.bind("model_b_dir", "b")
            messages.directory_inputs()  # each directory's error right under its input, both when both are bad
        else:
            a, b = pairs[key]
            st.caption(f"A: `{a}`  \nB: `{b}`")
        names = methods()
        url_state.bind("method", "method", list(names))
        st.selectbox("Alignment method", list(names), key="method", format_func=names.get,
                     help="How B is aligned onto A before interpolating (used by Run).")


def selection() -> Selection:
    """The pair and method picked in the sidebar (render() must have run in this rerun)."""
    key = st.session_state.get("pair") or opening_pair()
    method = st.session_state.get("method") or "naive"
    if key == CUSTOM:
        a = (st.session_state.get("model_a_dir") or "").strip()
        b = (st.session_state.get("model_b_dir") or "").strip()
        return Selection(a, b, method, None, "Two model directories", custom=True)
    a, b = _zoo_pairs()[key]
    return Selection(a, b, method, api.ENTRIES[a].task, pair_title(a, b), custom=False)


def live_run_panel() -> None:
    """The session's live run, on the pages other than Connectivity: where it is, the time left and
    Stop, redrawn every live_run.POLL_S seconds while it goes; its curve waits on the Connectivity page."""
    run = live_run.current(st.session_state)
    if run is None or (run.snapshot().finished and run.collected):
        return

    @st.fragment(run_every=live_run.POLL_S if run.running else None)
    def panel() -> None:
        snap = run.snapshot()
        with st.container(border=True):
            st.markdown(f"**Live run**: {methods().get(snap.cfg.method, snap.cfg.method)}")
            st.caption(live_run.headline(snap))
            if not snap.finished and snap.current is not None:
                st.progress(snap.current.fraction, text=live_run.PHASE_LABELS.get(snap.current.phase, snap.current.phase))
                st.button("Stop", key="sidebar_stop", on_click=run.stop, disabled=snap.state == "stopping",
                          width="stretch", icon=":material/stop_circle:")
            elif snap.finished:
                st.caption("Its curve is on the Connectivity page." if snap.state == "done" else snap.message)

    with st.sidebar:
        panel()
