"""The app on two GPT-2-small directories, in a real browser: a live weight-matching run with a short path.

    .venv/bin/python bench/bench_app_gpt2.py [--dir /tmp/lmc-bench] [--items 1024] [--points 21] [--method weight]

Uses the GPT-2-small pair that bench/bench_scale.py builds (`gpt2-indep`: two HF initialisations, 124M
parameters each; run `bench_scale.py --pairs gpt2-indep --tasks weight` first). Starts the app (Streamlit)
with a throwaway run history, picks "Two model directories", types both paths, picks the method, the
evaluation subset and the points on lambda, presses Run and watches the run panel until the run ends.
Prints every progress text the panel showed (sampled every 0.5 s), the wall time, the alignment's own
seconds and the barrier of the finished record (from the run history), the CPU seconds the server and the
browser used during the run, and the server process's peak resident memory (the kernel's VmHWM) as a
multiple of one model's bytes, counted from the server's resident memory before the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from bench_app import ARGS, CHROMIUM, IDLE  # the same browser and server settings

from engine.api import method_names

METHODS = method_names()  # the labels the app's method picker shows
ITEMS = (256, 1024, 8192, 32768)  # the app's evaluation subsets for directories (connectivity.ANY_ITEMS, less "whole")
POINTS = (3, 5, 11, 21, 41)  # the app's points on lambda (connectivity.POINTS)


def kib(pid: int, field: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def browser_cpu_s() -> float:
    """CPU seconds of every live Chromium process (browser, renderers, GPU/utility helpers)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and "chrom" in (d / "comm").read_text():
                total += cpu_s(int(d.name))
        except OSError:  # gone meanwhile
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/lmc-bench")
    ap.add_argument("--items", type=int, default=1024, choices=ITEMS)
    ap.add_argument("--points", type=int, default=21, choices=POINTS, help="points on lambda")
    ap.add_argument("--method", default="weight", choices=list(METHODS))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    a, b = Path(args.dir) / "gpt2-s0", Path(args.dir) / "gpt2-s1"
    for d in (a, b):
        if not (d / "config.json").exists():
            sys.exit(f"{d} is missing: run bench/bench_scale.py --pairs gpt2-indep --tasks weight first.")
    from playwright.sync_api import sync_playwright

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout's TERM still stops the server (finally)
    home = tempfile.mkdtemp(prefix="lmc-app-gpt2-")
    os.environ["LMC_EXPLORER_HOME"] = home  # the live run's record lands in a throwaway history
    import bench_app

    url, proc = bench_app.serve()
    seen: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector('h1:has-text("Connectivity")')
            page.wait_for_function(IDLE)
            side = page.locator('[data-testid="stSidebar"]')
            side.locator('[data-testid="stSelectbox"]').first.click()
            page.get_by_role("option", name="Two model directories…").click()
            page.wait_for_function(IDLE)
            for label, d in (("Model A directory", a), ("Model B directory", b)):
                box = side.get_by_label(label)
                box.fill(str(d))
                box.press("Enter")
                page.wait_for_function(IDLE)
            side.locator('[data-testid="stSelectbox"]').nth(1).click()
            page.get_by_role("option", name=METHODS[args.method], exact=True).click()
            page.wait_for_function(IDLE)
            for nth, options, value in ((0, ITEMS, args.items), (1, POINTS, args.points)):
                slider = page.get_by_role("slider").nth(nth)  # evaluation items, then points on lambda
                slider.focus()
                slider.press("Home")
                for _ in range(options.index(value)):
                    slider.press("ArrowRight")
                page.wait_for_function(IDLE)
            base = kib(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
            t0, server0, browser0 = time.monotonic(), cpu_s(proc.pid), browser_cpu_s()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_role("button", name="Stop").wait_for()
            while time.monotonic() - t0 < args.timeout:
                if page.get_by_role("button", name="Stop").count() == 0:
                    break
                for text in page.locator('[data-testid="stProgress"]').all_inner_texts():
                    text = " ".join(text.split())
                    if text and (not seen or seen[-1] != text):
                        seen.append(text)
                time.sleep(0.5)
            wall = time.monotonic() - t0
            peak = kib(proc.pid, "VmHWM")
            server_cpu, browser_cpu = cpu_s(proc.pid) - server0, browser_cpu_s() - browser0
            errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]').all_inner_texts()
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    runs = sorted(Path(home, "runs").glob("run-*.json"))
    rec = json.loads(runs[-1].read_text()) if runs else None
    one = (a / "model.safetensors").stat().st_size
    for s in seen:
        print("progress:", s)
    print(json.dumps({
        "method": args.method, "items": args.items, "points": args.points, "wall_s": round(wall, 1), "errors": errors,
        "barrier": rec and rec["barrier"], "status": rec and rec.get("run", {}).get("status"),
        "stop": rec["alignment"]["diagnostics"].get("stop") if rec and args.method == "weight" else None,
        "server_rss_before_mb": round(base / 1e6), "server_peak_mb": round(peak / 1e6),
        "peak_over_model_beyond_before": round((peak - base) / one, 2), "model_mb": round(one / 1e6),
        "align_s": round(rec["alignment"]["seconds"], 1) if rec else None,
        "server_cpu_s": round(server_cpu, 1), "browser_cpu_s": round(browser_cpu, 1),
        "load_avg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
