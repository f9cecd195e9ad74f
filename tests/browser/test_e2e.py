"""The app in a real browser: the Connectivity page draws its barrier curve without an exception box."""

from pathlib import Path

import pytest

from tests.browser.server import wait_idle

pytestmark = pytest.mark.e2e

CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'
EXC = '[data-testid="stException"]'
SHOTS = Path(__file__).resolve().parents[2] / "screenshots"  # git-ignored


def test_connectivity_page_draws_the_barrier_curve(page, streamlit_url):
    page.goto(streamlit_url)
    page.wait_for_selector('h1:has-text("Connectivity")')
    # Plotly.js has drawn real SVG paths, not just an empty chart container
    page.wait_for_selector(CHART + " .scatterlayer .trace path")
    wait_idle(page)
    assert page.locator(EXC).count() == 0
    # the numbers: one table under the chart (drawn after the chart; on a loaded machine a moment later)
    page.wait_for_selector('[data-testid="stDataFrame"]')
    assert page.locator('[data-testid="stDataFrame"]').count() >= 1
    # "Loss" once the records carry train curves (drawn on the same axis), "Test loss" for older ones
    assert page.locator(CHART + " .ytitle").first.text_content().startswith(("Test loss (nats/", "Loss (nats/"))
    assert page.get_by_role("button", name="Run").is_enabled()
    assert page.external_requests == []
    SHOTS.mkdir(exist_ok=True)
    page.locator('[data-testid="stPlotlyChart"]').first.screenshot(path=str(SHOTS / "connectivity_barrier.png"))
    page.screenshot(path=str(SHOTS / "connectivity_page.png"))


def test_alignment_page_draws_the_head_permutations(page, streamlit_url):
    page.goto(streamlit_url + "/alignment")
    page.wait_for_selector('h1:has-text("Alignment")')
    # the first pair's cached record: its head permutations drawn as a real heatmap image
    page.wait_for_selector(CHART + " .heatmaplayer image")
    wait_idle(page)
    assert page.locator(EXC).count() == 0
    assert page.external_requests == []
    SHOTS.mkdir(exist_ok=True)
    page.locator('[data-testid="stPlotlyChart"]').nth(1).screenshot(path=str(SHOTS / "alignment_heads.png"))
