"""One way to tell a user what is wrong, the same on every page: an error box holding the engine's own
sentence, full width in the main pane or right under the input it concerns, and the pair check every
page runs before it shows or runs anything.

The sentences come from the engine (engine.api.check_pair / model_info): one per cause, naming model A
or B by its full path and the families plainly ("GPT-2 LM" vs "ViT"). Every bad model is told, not only
the first: two bad directories get two sentences.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import streamlit as st

from engine import api
from engine.api import LMCError

if TYPE_CHECKING:  # the sidebar draws its inputs' errors with this module: no import back at run time
    from app.sidebar import Selection


def error(problem: LMCError | str) -> None:
    """An error box with the engine's sentence, in the container it is called in: full width in the main
    pane (outside any column), or in the sidebar under the input it concerns."""
    st.error(str(problem), icon=":material/error:")


def _stamp(name_or_path: str) -> int:
    """Changes when a directory's config does: the pair check is cached on it."""
    f = Path(name_or_path).expanduser() / "config.json"
    try:
        return f.stat().st_mtime_ns
    except OSError:
        return 0


@st.cache_data(show_spinner=False, max_entries=64)
def _pair(model_a: str, model_b: str, stamp_a: int, stamp_b: int) -> tuple[str | None, str | None]:
    """(description, None) for a usable pair, (None, the reason) for one that is not; from the configs alone."""
    try:
        return api.describe_pair(model_a, model_b), None
    except LMCError as e:
        return None, str(e)


def pair_problem(model_a: str, model_b: str) -> str | None:
    """Why two models cannot be interpolated (each readable, but of two kinds or shapes), or None."""
    return _pair(model_a, model_b, _stamp(model_a), _stamp(model_b))[1]


def check_pair(sel: Selection) -> str | None:
    """What the sidebar's pair is, in a sentence; or None when it cannot be used. A zoo pair's reasons
    (each bad model's, else the pair's) are drawn here, full width; two directories' are under their
    inputs in the sidebar (directory_inputs), so the page only points there. A custom pair with a
    directory still missing gets a prompt, not an error."""
    if sel.custom and not (sel.model_a and sel.model_b):
        st.info("Enter the directories of model A and model B in the sidebar.", icon=":material/folder_open:")
        return None
    bad = [p for p in (model_problem(sel.model_a, "Model A"), model_problem(sel.model_b, "Model B")) if p]
    description, problem = _pair(sel.model_a, sel.model_b, _stamp(sel.model_a), _stamp(sel.model_b))
    problems = bad or ([problem] if problem else [])
    if problems and sel.custom:
        st.info("The model directories cannot be used: the sidebar says why, under the inputs.",
                icon=":material/folder_open:")
        return None
    for p in problems:
        error(p)
    return None if problems else description


def _model_stamp(name_or_path: str) -> int:
    """Changes when a zoo model is built, or a directory, its config or its weights change."""
    try:
        folder = Path(name_or_path).expanduser().stat().st_mtime_ns
    except OSError:
        folder = 0
    return hash((api.zoo_stamp(name_or_path), _stamp(name_or_path), folder))


@st.cache_data(show_spinner=False, max_entries=64)
def _model(name_or_path: str, role: str, stamp: int) -> tuple[api.ModelInfo | None, str | None]:
    """(model_info, None) for a usable model, (None, the reason) for one that is not; from its config alone."""
    try:
        return api.model_info(name_or_path, role), None
    except LMCError as e:
        return None, str(e)


def model_problem(name_or_path: str, role: str = "Model") -> str | None:
    """The one reason a model cannot be used (from its config alone), or None."""
    return _model(name_or_path, role, _model_stamp(name_or_path))[1]


def check_model(name_or_path: str, role: str = "Model") -> api.ModelInfo | None:
    """model_info of one model, or its one error drawn where this is called (then None)."""
    info, problem = _model(name_or_path, role, _model_stamp(name_or_path))
    if problem:
        error(problem)
    return info


def directory_input(label: str, key: str, role: str) -> str:
    """A text input for a model directory with, right under it, the one reason the directory cannot be
    used (none while it is empty); its stripped value."""
    value = st.text_input(label, key=key, placeholder=f"path/to/{role.lower().replace(' ', '_')}").strip()
    problem = model_problem(value, role) if value else None
    if problem:
        error(problem)
    return value


def directory_inputs() -> None:
    """Model A's and model B's directory inputs, each with its own error under it, and under both the
    reason the two cannot be interpolated together when each is fine alone."""
    a = directory_input("Model A directory", "model_a_dir", "Model A")
    b = directory_input("Model B directory", "model_b_dir", "Model B")
    if a and b and not (model_problem(a, "Model A") or model_problem(b, "Model B")):
        problem = pair_problem(a, b)
        if problem:
            error(problem)
