"""A live run in a real browser: start a dual run, press Stop, and the page says it stopped while the
server's CPU falls idle (its run no longer computes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.browser.server import wait_idle

pytestmark = pytest.mark.e2e

EXC = '[data-testid="stException"]'
SHOTS = Path(__file__).resolve().parents[2] / "screenshots"  # git-ignored
PANEL = '[data-testid="stColumn"]:has([data-testid="stExpander"])'  # the Recompute live column
STATUS = '[data-testid="stExpander"] summary'  # st.status draws as an expander; its label is the summary


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` and all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_stop_ends_a_live_dual_run(page, streamlit_server):
    url, proc = streamlit_server
    page.goto(url)
    page.wait_for_selector('h1:has-text("Connectivity")')
    wait_idle(page)
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').nth(1).click()
    page.get_by_role("option", name="Dual learned matching").click()
    wait_idle(page)
    page.get_by_role("button", name="Run", exact=True).click()
    stop = page.get_by_role("button", name="Stop")
    stop.wait_for()
    # the run is computing: the server burns CPU
    page.wait_for_selector('[data-testid="stProgress"] :text-matches("Aligning B onto A: (weight matching|dual)")')
    busy0 = cpu_seconds(proc.pid)
    time.sleep(1.0)
    busy = cpu_seconds(proc.pid) - busy0
    SHOTS.mkdir(exist_ok=True)
    page.locator(PANEL).last.screenshot(path=str(SHOTS / "live_run_running.png"))
    t0 = time.monotonic()
    stop.click()
    page.wait_for_selector(f'{STATUS}:has-text("Stopped after")', timeout=10_000)
    shown = time.monotonic() - t0
    assert page.locator('[data-testid="stAlertContentWarning"]').first.inner_text().startswith(
        "The run was stopped on request during")
    page.get_by_role("button", name="Stop").wait_for(state="detached", timeout=5_000)  # gone with the same rerun
    assert page.locator(EXC).count() == 0
    wait_idle(page)
    page.locator(PANEL).last.screenshot(path=str(SHOTS / "live_run_stopped.png"))
    time.sleep(0.5)  # the browser's last requests after the final redraw
    idle0 = cpu_seconds(proc.pid)
    time.sleep(2.0)
    idle = cpu_seconds(proc.pid) - idle0
    print(f"\nserver CPU: {busy:.2f} s in 1 s while running, {idle:.2f} s in 2 s after Stop "
          f"(stopped state shown {shown:.1f} s after the click)")
    assert busy > 0.5, "the run was not computing when Stop was pressed"
    assert idle < 0.5, f"the server kept computing after Stop: {idle:.2f} s of CPU in 2 s"
    assert shown < 5
    assert page.external_requests == []
