"""One Streamlit server of the app for browser tests: a free port, healthy before use, stopped (its own
process group only) on exit; and the wait for a page's script run to finish."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(env: dict[str, str], log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, process) of a server run with os.environ updated by `env`, its output appended to `log`."""
    port = free_port()
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.serve", "--server.headless", "true",  # `make run`'s server
             "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
             "--server.fileWatcherType", "none"],
            cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: we stop exactly what we started
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
        yield url, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_idle(page) -> None:
    """Until Streamlit's 'Running...' indicator is gone: the script run has finished."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
