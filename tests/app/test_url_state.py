"""The view in the URL (app/url_state.py): a link with the pair, the method, the page and a view's
options opens that view; the app writes the current view back; bad or stale parameters are ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
PAGE = "app_pages/alignment.py"
PAIR_KEY = "__".join(CACHED_PAIRS[0])  # the tiny store's two-layer pair with a weight-matching record
TIMEOUT = 60  # the first run imports torch; the machine's cores may be busy


@pytest.fixture
def env(tiny_env):
    return tiny_env


def opened(params: dict, page: str = PAGE) -> AppTest:
    """A new session opened from a link: `page` with query parameters `params`."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update(params)
    at.switch_page(page).run()
    assert not at.exception
    return at


def test_a_link_opens_its_pair_method_tab_and_layer(env):
    at = opened({"pair": PAIR_KEY, "method": "weight", "tab": "One layer", "layer": "1"})
    assert at.selectbox(key="pair").value == PAIR_KEY and at.selectbox(key="method").value == "weight"
    assert at.session_state["align_tab"] == "One layer"
    assert at.select_slider(key="align_layer").value == 1
    assert at.query_params["layer"] == "1" and at.query_params["method"] == "weight"


def test_the_url_follows_the_view(env):
    at = opened({})
    at.selectbox(key="pair").select(PAIR_KEY).run()
    at.selectbox(key="method").select("weight").run()
    assert at.query_params["pair"] == PAIR_KEY and at.query_params["method"] == "weight"
    assert "layer" not in at.query_params  # the "One layer" tab is closed: no slider, no parameter
    at.session_state["align_tab"] = "One layer"
    at.run()
    at.select_slider(key="align_layer").set_value(1).run()
    assert at.query_params["tab"] == "One layer" and at.query_params["layer"] == "1"
    # a reload is a new session on the same URL: the same view
    again = opened(dict(at.query_params))
    assert again.selectbox(key="method").value == "weight" and again.select_slider(key="align_layer").value == 1


def test_bad_and_stale_parameters_are_ignored(env):
    at = opened({"pair": "no-such-pair", "method": "magic", "tab": "Nope", "layer": "99", "points": "x"})
    assert at.selectbox(key="method").value == "naive"
    assert at.selectbox(key="pair").value != "no-such-pair"
    assert at.query_params["method"] == "naive" and "magic" not in at.query_params.values()


def test_connectivity_and_symmetry_options_round_trip(env):
    at = opened({"pair": PAIR_KEY, "points": "11", "log": "1"}, "app_pages/connectivity.py")
    assert at.select_slider(key="path_points").value == 11 and at.toggle(key="log_y").value is True
    assert at.query_params["points"] == "11" and at.query_params["log"] == "1"
    sym = opened({"view": "side"}, "app_pages/symmetry.py")
    assert sym.session_state["sym_mode"] == "side" and sym.query_params["view"] == "side"
