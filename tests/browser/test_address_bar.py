"""The view in the address bar, in a real browser: a pasted link opens its page, method and options,
and the app writes the whole view (the pair too) back into the URL (app/url_state.py; AppTest covers
the URL following later picks: tests/app/test_url_state.py)."""

import time
from urllib.parse import parse_qs, urlparse

import pytest

from app.sidebar import OPENING_PAIR
from tests.browser.server import wait_idle

pytestmark = pytest.mark.e2e

SHOTS = __import__("pathlib").Path(__file__).resolve().parents[2] / "bench" / "screenshots"


def query(page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlparse(page.url).query).items()}


def wait_query(page, key: str, value: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while query(page).get(key) != value:
        assert time.monotonic() < deadline, f"the URL never got {key}={value}: {page.url}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_pasted_link_opens_its_view_and_the_url_names_it_whole(page, streamlit_url):
    page.goto(f"{streamlit_url}/alignment?method=weight&tab=One+layer&layer=1")
    page.wait_for_selector('h1:has-text("Alignment")')
    wait_idle(page)
    sidebar = page.locator('[data-testid="stSidebar"]')
    method = sidebar.get_by_role("combobox", name="Alignment method")
    assert method.input_value() == "Weight matching"
    page.wait_for_selector('[data-testid="stSlider"]', timeout=120_000)  # the "One layer" tab is open
    wait_query(page, "layer", "1")
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "url_state_alignment.png"))
    a, b = OPENING_PAIR  # the sidebar's default pair, which the link did not name, is written in
    wait_query(page, "pair", f"{a}__{b}")
    assert urlparse(page.url).path.endswith("/alignment")
