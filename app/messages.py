"""One way to tell a user what is wrong, the same on every page: a full-width error box holding the
engine's own sentence, and the pair check every page runs before it shows or runs anything.

The sentences come from the engine (engine.api.check_pair / model_info): one per cause, naming model A
or B by its full path and the families plainly ("GPT-2 LM" vs "ViT").
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app.sidebar import Selection
from engine import api
from engine.api import LMCError


def error(problem: LMCError | str) -> None:
    """The page's error box, drawn full width (call it outside any column)."""
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


def check_pair(sel: Selection) -> str | None:
    """What the sidebar's pair is, in a sentence; or, drawn full width, the one reason it cannot be used
    (then None). A custom pair with a directory still missing gets a prompt, not an error."""
    if sel.custom and not (sel.model_a and sel.model_b):
        st.info("Enter the directories of model A and model B in the sidebar.", icon=":material/folder_open:")
        return None
    description, problem = _pair(sel.model_a, sel.model_b, _stamp(sel.model_a), _stamp(sel.model_b))
    if problem:
        error(problem)
    return description


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


def check_model(name_or_path: str, role: str = "Model") -> api.ModelInfo | None:
    """model_info of one model, or its one error drawn full width (then None)."""
    info, problem = _model(name_or_path, role, _model_stamp(name_or_path))
    if problem:
        error(problem)
    return info
