"""The run history in a real browser: a live run finished on Connectivity is still listed on the Runs
page after the server restarts (a new process, the same user store)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine import history

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app" / "streamlit_app.py"
EXC = '[data-testid="stException"]'
SHOTS = ROOT / "screenshots"  # git-ignored


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(env: dict[str, str], log: Path):
    """A streamlit server on a free port with `env`, stopped (its process group only) on exit."""
    port = _free_port()
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
             "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
             "--server.fileWatcherType", "none"],
            cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited early:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit not healthy in 60 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory) -> dict[str, str]:
    """The tiny stand-in zoo (tests/app/tiny_zoo.py), where a live run takes a second or two, and an
    empty result store: only live runs are drawn."""
    spec = importlib.util.spec_from_file_location("tiny_zoo", ROOT / "tests" / "app" / "tiny_zoo.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    zoo_dir = tiny.build_zoo(tmp_path_factory.mktemp("zoo"))
    return {"LMC_ZOO_DIR": str(zoo_dir), "LMC_CACHE_DIR": str(tmp_path_factory.mktemp("cached_results"))}


def wait_idle(page):
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")


def test_a_finished_live_run_survives_a_server_restart(browser, tiny_env, tmp_path):
    env = {**tiny_env, "LMC_EXPLORER_HOME": str(tmp_path / "home")}
    store = tmp_path / "home" / "runs"
    log = tmp_path / "server.log"
    ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    try:
        with serve(env, log) as url:
            page.goto(url)
            page.wait_for_selector('h1:has-text("Connectivity")')
            wait_idle(page)
            page.get_by_role("button", name="Run", exact=True).click()
            page.wait_for_selector('[data-testid="stExpander"] summary:has-text("Done in")', timeout=60_000)
            wait_idle(page)
            assert page.locator(EXC).count() == 0
        runs = history.list_runs(store)
        assert len(runs) == 1 and runs[0]["run"]["status"] == "done"
        run = runs[0]
        with serve(env, log) as url:  # a new server process: nothing of the first survives but the store
            page.goto(url + "/runs")
            page.wait_for_selector('h1:has-text("Runs")')
            wait_idle(page)
            page.wait_for_selector('[data-testid="stCaptionContainer"]:has-text("1 of 1 run(s).")')
            page.wait_for_selector(f'[data-testid="stCaptionContainer"]:has-text("Run {run["run"]["id"]}, done.")')
            barrier = page.locator('[data-testid="stMetric"]:has-text("Midpoint barrier")').inner_text()
            assert f"{run['midpoint_barrier']:.4f}" in barrier
            page.wait_for_selector('[data-testid="stPlotlyChart"] .js-plotly-plot .scatterlayer .trace path')
            assert page.locator(EXC).count() == 0
            SHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SHOTS / "runs_page.png"))
    finally:
        ctx.close()
