"""The run history in a real browser: a live run finished on Connectivity is still listed on the Runs
page after the server restarts (a new process, the same user store)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_zoo

from engine import history
from tests.browser.server import serve, wait_idle

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXC = '[data-testid="stException"]'
SHOTS = ROOT / "screenshots"  # git-ignored


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory) -> dict[str, str]:
    """The tiny stand-in zoo (tests/app/tiny_zoo.py), where a live run takes a second or two, and an
    empty result store: only live runs are drawn."""
    zoo_dir = tiny_zoo.build_zoo(tmp_path_factory.mktemp("zoo"))
    return {"LMC_ZOO_DIR": str(zoo_dir), "LMC_CACHE_DIR": str(tmp_path_factory.mktemp("cached_results"))}


@pytest.mark.slow
def test_a_finished_live_run_survives_a_server_restart(browser, tiny_env, tmp_path):
    env = {**tiny_env, "LMC_EXPLORER_HOME": str(tmp_path / "home")}
    store = tmp_path / "home" / "runs"
    log = tmp_path / "server.log"
    ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    try:
        with serve(env, log) as (url, _):
            page.goto(url)
            page.wait_for_selector('h1:has-text("Connectivity")')
            wait_idle(page)
            page.get_by_role("button", name="Run", exact=True).click()
            page.wait_for_selector('[data-testid="stExpander"] summary:has-text("Done in")', timeout=120_000)
            wait_idle(page)
            assert page.locator(EXC).count() == 0
        runs = history.list_runs(store)
        assert len(runs) == 1 and runs[0]["run"]["status"] == "done"
        run = runs[0]
        with serve(env, log) as (url, _):  # a new server process: nothing of the first survives but the store
            page.goto(url + "/runs")
            page.wait_for_selector('h1:has-text("Runs")')
            wait_idle(page)
            page.wait_for_selector('[data-testid="stCaptionContainer"]:has-text("1 of 1 run(s).")')
            page.wait_for_selector(f'[data-testid="stCaptionContainer"]:has-text("Run {run["run"]["id"]}, done, took")')
            barrier = page.locator('[data-testid="stMetric"]:has-text("Midpoint barrier")').inner_text()
            assert f"{run['midpoint_barrier']:.4f}" in barrier
            page.wait_for_selector('[data-testid="stPlotlyChart"] .js-plotly-plot .scatterlayer .trace path')
            assert page.locator(EXC).count() == 0
            SHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SHOTS / "runs_page.png"))
    finally:
        ctx.close()
