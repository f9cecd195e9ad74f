"""App latency in a real browser (Playwright + Debian's Chromium), on the committed zoo and store:
first chart after opening Connectivity, a page switch, a pair switch, and a zoo model's Symmetry page.

    .venv/bin/python bench/bench_app.py [--runs 3] [--write]

Each figure is the median over --runs fresh page loads on one warm server (the first load, which warms
the server's caches, is not counted). --write replaces the "App latency" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'
TRACE = CHART + " .scatterlayer .trace path"
IDLE = "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
SECTION = "## App latency"


def serve() -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "streamlit_app.py"), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=1):
                return url, proc
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("streamlit did not start within 60 s")


def timed(page, action, selector: str, timeout: float = 120_000) -> float:
    t0 = time.perf_counter()
    action()
    page.wait_for_selector(selector, timeout=timeout)
    page.wait_for_function(IDLE, timeout=timeout)
    return time.perf_counter() - t0


def measure(browser, url: str) -> dict[str, float]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    out = {"first chart after opening Connectivity": timed(page, lambda: page.goto(url), TRACE)}
    out["page switch: Connectivity to Alignment"] = timed(
        page, lambda: page.get_by_role("link", name="Alignment").click(), CHART + " .heatmaplayer image")
    page.get_by_role("link", name="Connectivity").click()
    page.wait_for_selector(TRACE)
    page.wait_for_function(IDLE)

    before = page.locator("h3").first.inner_text()

    def switch_pair():
        page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').first.click()
        page.get_by_role("option").nth(1).click()
        page.wait_for_function("t => document.querySelector('h3').innerText !== t", arg=before)

    out["pair switch (Connectivity)"] = timed(page, switch_pair, TRACE)
    out["zoo model's Symmetry page"] = timed(page, lambda: page.goto(url + "/symmetry"), CHART)
    ctx.close()
    return out


def write(rows: dict[str, float], runs: int) -> None:
    table = "\n".join(f"| {k} | {v:.2f} s |" for k, v in rows.items())
    text = (f"{SECTION}\n\n`bench/bench_app.py`: a warm server on this machine (2 cores, shared), headless Chromium "
            f"at 1400 x 1000, median of {runs} fresh page loads after one warm-up; each time runs until the chart "
            "is drawn and the script run has finished. Targets: first chart 5 s, switches 2 s, a zoo model's "
            f"Symmetry page 2 s.\n\n| step | time |\n|---|---|\n{table}\n")
    old = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION in old:
        head, rest = old.split(SECTION, 1)
        tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
        new = head + text + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="record the figures in bench/RESULTS.md")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    url, proc = serve()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            measure(browser, url)  # warm-up: imports, caches, Plotly's bundle
            samples = [measure(browser, url) for _ in range(args.runs)]
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    rows = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    for k, v in rows.items():
        print(f"{k:<45} {v:6.2f} s")
    if args.write:
        write(rows, args.runs)


if __name__ == "__main__":
    main()
