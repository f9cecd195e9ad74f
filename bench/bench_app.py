"""App latency in a real browser (Playwright + Debian's Chromium), on the committed zoo and store, against a
same-process reference.

    .venv/bin/python bench/bench_app.py [--runs 3] [--write]

What it measures, each figure the median over --runs:

- cold start: from spawning a fresh `streamlit run` server to the first Plotly curve drawn on the Connectivity
  page in a fresh browser context (the server's imports, torch's among them, included; the OS file cache is
  warm), split by when the server answered its health check and when the page asked for its script run (its
  first websocket message). Each run has its own server.
- on one warm server (one unmeasured warm-up pass, then --runs passes, each in a fresh browser context, on the
  default zoo pair): loads (the first chart after opening Connectivity; page.reload() of the Alignment view
  named by its URL query parameters pair, method, tab and layer, until that same view is drawn again) and
  interactions (the method picker on Connectivity, page switches by the navigation links, the "One layer"
  tab and the layer slider on Alignment, the pair picker on Connectivity).
- diagnostics: `import torch`, and the modules the app's first script run imports (APP_MODULES: torch, scipy
  and pandas among them), in a fresh interpreter that has imported streamlit as a server has.

Each time runs from the action until the server's ForwardMsg `script_finished` (read off the app's websocket,
so a run shorter than the 0.5 s Streamlit waits before showing "Running..." counts too) and the drawn Plotly
figures show the new view with no stale element left. The "server" column: until `script_finished` alone.

The reference: one 2048 x 2048 float32 torch matmul in this process (median of 5 after a warm-up, torch's
default threads), at the start and at the end; every time is also given in its units (seconds / the mean of
the two), as in the other benches. The load average is recorded at both ends. Servers are stopped by SIGTERM
to their process group (SIGKILL after 20 s), also when this script fails or gets SIGTERM itself.
--write replaces the "App latency" section of bench/RESULTS.md.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## App latency"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'
TRACE = CHART + " .scatterlayer .trace path"
HEATMAP = CHART + " .heatmaplayer image"
TIMEOUT_S = 120.0
COLD, FIRST_CHART, RELOAD = "cold start: spawn to first chart", "load: first chart on Connectivity", "load: reload"
HEALTH, ASKED = "cold start: spawn to health check answered", "cold start: spawn to the page asking for its script run"
# Diagnostics, each in a fresh interpreter that has imported streamlit (as a server has): row -> modules imported.
APP_MODULES = "engine.api, engine.align, pandas, plotly.graph_objects, app.sidebar, app.downloads, app.figures.path"
IMPORTS = {"import torch, fresh interpreter": "torch", "import the first run's modules, fresh interpreter": APP_MODULES}
TARGETS = {COLD: 5.0}  # the targets; every interaction (a row not starting with cold/load/import): 1 s
INTERACTION_TARGET_S = 1.0

# A signature of the drawn Plotly figures (titles; per trace its type, name, style, size and one value), and
# whether a chart matching `sel` is drawn, no element is stale and the signature differs from `before` (or
# equals `same` when that is given).
SIGNATURE = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
    const title = gd.layout && gd.layout.title ? (gd.layout.title.text || gd.layout.title) : '';
    const traces = (gd.data || []).map(t => {
        const v = t.y || t.z || [];
        return [t.type, t.name, t.line && t.line.width, t.opacity, v.length, String(v[v.length >> 1])];
    });
    return JSON.stringify([title, traces]);
}).join('|')"""
DRAWN = f"""([sel, before, same]) => {{
    if (!document.querySelector(sel) || document.querySelector('[data-stale="true"]')) return false;
    const sig = ({SIGNATURE})();
    return same === null ? sig !== before : sig === same;
}}"""

Sample = dict[str, tuple[float, float | None]]  # measure -> (seconds, seconds until the server's script run finished)


# ---------------------------------------------------------------------------------------------
# The reference and diagnostics


def matmul_seconds(repeats: int = 5) -> float:
    """One 2048 x 2048 float32 matmul in this process: the median of `repeats` after a warm-up."""
    import torch

    x = torch.randn(2048, 2048)
    x @ x
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x @ x
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def import_seconds(modules: str) -> float:
    """`import modules` in a fresh interpreter that has imported streamlit, from the repository root."""
    code = f"import streamlit, time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


# ---------------------------------------------------------------------------------------------
# A server, a page, a timed step


SERVE = ["-m", "app.serve"]  # `make run`'s server: streamlit run app/streamlit_app.py, the imports warmed meanwhile


@contextmanager
def server() -> Iterator[tuple[str, float]]:
    """A fresh server of the app (SERVE) on a free port: yields (url, the perf_counter time of the spawn) once
    its health check answers; on leaving, its process group gets SIGTERM, then SIGKILL after 20 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawned = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *SERVE, "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port",
         str(port), "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode} before answering")
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("streamlit did not answer within 60 s") from None
                time.sleep(0.02)
        yield url, spawned
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Page:
    """A page in a fresh browser context that notes when the server says a script run finished (ForwardMsg
    `script_finished`, FINISHED_SUCCESSFULLY) on any of its websockets, across reloads."""

    def __init__(self, browser):
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        self._parse, self._ok = ForwardMsg.FromString, ForwardMsg.FINISHED_SUCCESSFULLY
        self.ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(TIMEOUT_S * 1000)
        self.finished: list[float] = []  # perf_counter times
        self.sent: list[float] = []  # perf_counter times of the page's messages to the server (BackMsg)
        self.page.on("websocket", self._websocket)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.ctx.close()

    def _websocket(self, ws) -> None:
        ws.on("framereceived", self._frame)
        ws.on("framesent", lambda _: self.sent.append(time.perf_counter()))

    def _frame(self, payload) -> None:
        if isinstance(payload, bytes):
            msg = self._parse(payload)
            if msg.WhichOneof("type") == "script_finished" and msg.script_finished == self._ok:
                self.finished.append(time.perf_counter())

    def signature(self) -> str:
        return self.page.evaluate(SIGNATURE)

    def timed(self, action: Callable[[], object], sel: str = CHART, same: str | None = None,
              t0: float | None = None) -> tuple[float, float]:
        """(seconds, seconds until the script run finished) from `action` (or from `t0`) until a script run has
        finished and the figures are redrawn: a chart matching `sel`, no stale element, and the figures'
        signature changed (or equal to `same`)."""
        before, runs = self.signature(), len(self.finished)
        t0 = time.perf_counter() if t0 is None else t0
        action()
        deadline = time.monotonic() + TIMEOUT_S
        while len(self.finished) == runs:
            if time.monotonic() > deadline:
                raise TimeoutError("no script run finished")
            self.page.wait_for_timeout(5)  # lets Playwright deliver the websocket frames
        self.page.wait_for_function(DRAWN, arg=[sel, before, same], polling="raf")
        return time.perf_counter() - t0, self.finished[runs] - t0


# ---------------------------------------------------------------------------------------------
# The measures


def cold_start(browser) -> Sample:
    """A fresh server to the first curve on Connectivity."""
    with server() as (url, spawned):
        up = time.perf_counter() - spawned
        with Page(browser) as p:
            chart = p.timed(lambda: p.page.goto(url), TRACE, t0=spawned)
            asked = p.sent[0] - spawned  # the page's first message: the request for the script run
    return {COLD: chart, HEALTH: (up, None), ASKED: (asked, None)}


def warm_pass(browser, url: str) -> Sample:
    """Loads and interactions on the default zoo pair, in a fresh browser context."""
    with Page(browser) as p:
        page, sidebar = p.page, p.page.locator('[data-testid="stSidebar"]')

        def pick(label: str, index: int) -> Callable[[], None]:
            def action() -> None:
                sidebar.get_by_role("combobox", name=label).click()
                page.get_by_role("option").nth(index).click()
            return action

        def nav(name: str) -> Callable[[], None]:
            return lambda: page.get_by_role("link", name=name).click()

        def next_layer() -> None:
            page.locator('[data-testid="stSlider"] input[type="range"]').first.focus()
            page.keyboard.press("ArrowRight")

        out: Sample = {FIRST_CHART: p.timed(lambda: page.goto(url), TRACE)}
        out["method picker on Connectivity, naive to weight matching"] = p.timed(pick("Alignment method", 1), TRACE)
        if "method=weight" not in page.url:
            raise RuntimeError(f"the second method is not weight matching: {page.url}")
        out["page switch Connectivity to Alignment"] = p.timed(nav("Alignment"), HEATMAP)
        out["Alignment: the One layer tab"] = p.timed(lambda: page.get_by_role("tab", name="One layer").click())
        out["Alignment: layer slider, next layer"] = p.timed(next_layer)
        if "tab=One+layer" not in page.url or "layer=1" not in page.url:
            raise RuntimeError(f"the URL does not name the view: {page.url}")
        out[RELOAD + " of /alignment?pair&method&tab&layer"] = p.timed(page.reload, HEATMAP, same=p.signature())
        out["page switch Alignment to Connectivity"] = p.timed(nav("Connectivity"), TRACE)
        out["pair picker on Connectivity, second zoo pair"] = p.timed(pick("Pair", 1), TRACE)
        out["page switch Connectivity to Symmetry"] = p.timed(nav("Symmetry"))
    return out


def on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through server()'s and Page's clean-up


# ---------------------------------------------------------------------------------------------
# Report


def target(name: str) -> float | None:
    if name in TARGETS:
        return TARGETS[name]
    return None if name.startswith(("cold start", "load", "import")) else INTERACTION_TARGET_S


def medians(samples: list[Sample]) -> Sample:
    keys = list(dict.fromkeys(k for s in samples for k in s))
    out: Sample = {}
    for k in keys:
        pairs = [s[k] for s in samples if k in s]
        server = [b for _, b in pairs if b is not None]
        out[k] = (statistics.median(a for a, _ in pairs), statistics.median(server) if server else None)
    return out


def table(rows: Sample, unit: float) -> str:
    lines = ["| measure | seconds | matmul units | server (s) | target | met |", "|---|---|---|---|---|---|"]
    for name, (s, server) in rows.items():
        goal = target(name)
        met = "-" if goal is None else "met" if s <= goal else "**missed**"
        lines.append(f"| {name} | {s:.2f} | {s / unit:.1f} | {'-' if server is None else f'{server:.2f}'} | "
                     f"{'-' if goal is None else f'{goal:.0f} s'} | {met} |")
    return "\n".join(lines)


def findings(rows: Sample) -> str:
    """Where the time of each missed target goes, from the measured figures."""
    out = []
    for name, (s, server) in rows.items():
        goal = target(name)
        if goal is None or s <= goal or server is None:
            continue
        if name == COLD:
            up, asked = rows[HEALTH][0], rows[ASKED][0]
            torch_s, app_s = (rows[k][0] for k in IMPORTS)
            out.append(f"The cold start misses {goal:.0f} s: the server answers after {up:.2f} s, the page (a fresh "
                       f"browser context loading the frontend) asks for its script run at {asked:.2f} s, the run "
                       f"finishes at {server:.2f} s and the browser draws the chart in the last {s - server:.2f} s. "
                       f"The first script run ({server - asked:.2f} s) dominates; the modules it imports take "
                       f"{app_s:.2f} s on their own in a fresh interpreter, {torch_s:.2f} s of it `import torch`.")
        else:
            out.append(f"{name} misses {goal:.0f} s: {server:.2f} s until the script run finished, {s - server:.2f} s "
                       "drawing in the browser.")
    return " ".join(out)


def write(text: str) -> None:
    old = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION not in old:
        RESULTS.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    head, rest = old.split(SECTION, 1)
    tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
    RESULTS.write_text(head + text.rstrip("\n") + "\n" + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="record the figures in bench/RESULTS.md")
    ap.add_argument("--note", default="", help="what else ran on the machine, for the record")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    import torch
    from playwright.sync_api import sync_playwright

    load0, unit0 = os.getloadavg(), matmul_seconds()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            cold = [cold_start(browser) for _ in range(args.runs)]
            with server() as (url, _):
                warm_pass(browser, url)  # warm-up: the server's imports and caches
                warm = [warm_pass(browser, url) for _ in range(args.runs)]
        finally:
            browser.close()
    imports: list[Sample] = [{row: (import_seconds(m), None) for row, m in IMPORTS.items()} for _ in range(args.runs)]
    unit1, load1 = matmul_seconds(), os.getloadavg()
    unit = (unit0 + unit1) / 2

    rows = medians(cold + warm + imports)
    loads = [", ".join(f"{x:.2f}" for x in la) for la in (load0, load1)]
    ref = (f"reference: a 2048 x 2048 float32 matmul took {unit0 * 1e3:.0f} ms at the start and {unit1 * 1e3:.0f} ms "
           f"at the end ({torch.get_num_threads()} torch threads; unit {unit * 1e3:.0f} ms); load average (1, 5, "
           f"15 min) {loads[0]} at the start, {loads[1]} at the end, on {os.cpu_count()} cores"
           + (f"; {args.note}" if args.note else ""))
    print(table(rows, unit))
    print(ref)
    print(findings(rows))
    if args.write:
        write(f"{SECTION}\n\n`bench/bench_app.py --runs {args.runs}` (its docstring says what each time covers): "
              f"headless Chromium at 1400 x 1000, median of {args.runs}; {ref}. The targets: the first "
              f"chart within {TARGETS[COLD]:.0f} s of a cold start, any interaction on a zoo pair within "
              f"{INTERACTION_TARGET_S:.0f} s. *server*: until the server's script run finished (the rest is the "
              f"browser drawing).\n\n{table(rows, unit)}\n\n{findings(rows)}\n")


if __name__ == "__main__":
    main()
