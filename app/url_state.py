"""The view in the URL: the pair, the method and each view's options as query parameters.

A widget bound here (`bind`, called just before the widget is drawn) takes its value from its
query parameter the first time it is drawn in a session, when that value is one of its options;
at the end of every run `publish` writes the bound widgets' values back. The page is the URL's
path (st.navigation). So a reload, a server restart or a pasted link opens the same view, and a
bad or stale parameter is ignored rather than an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import streamlit as st

SEEDED = "_url_seeded"  # widget keys already restored in this session
BOUND = "_url_bound"  # widget key -> query parameter, for the widgets drawn in this run


def _parse_bool(s: str) -> bool:
    if s in ("1", "true"):
        return True
    if s in ("0", "false"):
        return False
    raise ValueError(s)


PARSE: dict[type, Callable[[str], object]] = {bool: _parse_bool, int: int, float: float, str: str}


def begin() -> None:
    """Start a run: no widget bound yet."""
    st.session_state[BOUND] = {}


def bind(key: str, param: str, options: Sequence | None = None, kind: type = str, default=None) -> None:
    """Bind widget `key` to query parameter `param` (see the module docstring); `options` are the
    values the widget accepts (None: any value of `kind`). `default` (not None) is the widget's first
    value when the URL has none: give it here, not to the widget, which must not get both."""
    if default is not None and key not in st.session_state:
        st.session_state[key] = default
    st.session_state.setdefault(BOUND, {})[key] = param
    seeded = st.session_state.setdefault(SEEDED, set())
    if key in seeded:
        return
    seeded.add(key)
    raw = st.query_params.get(param)
    if raw is None:
        return
    try:
        value = PARSE[kind](raw)
    except (ValueError, KeyError):
        return
    if options is None or value in list(options):
        st.session_state[key] = value


def _text(v) -> str:
    return ("1" if v else "0") if isinstance(v, bool) else str(v)


def publish() -> None:
    """Write the bound widgets' current values into the URL (only when they changed)."""
    bound = st.session_state.get(BOUND, {})
    want = {param: _text(st.session_state[key]) for key, param in bound.items()
            if st.session_state.get(key) not in (None, "")}
    if dict(st.query_params.to_dict()) != want:
        st.query_params.from_dict(want)
