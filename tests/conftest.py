"""Shared test setup: offline hub, deterministic float64 maths, few threads (the machine has 2 cores)."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The run history of the tests (live runs the app keeps; servers they start inherit it), never the user's.
_HOME = tempfile.TemporaryDirectory(prefix="lmc-test-home-")
os.environ["LMC_EXPLORER_HOME"] = _HOME.name

import torch

torch.set_num_threads(1)

SLOW_S = 5.0  # a test whose call takes longer carries the `slow` mark (pyproject.toml's markers)
_unmarked_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    """Name the tests that took longer than SLOW_S without the `slow` mark (a loaded machine can push a
    quick test over, so this warns rather than fails)."""
    if _unmarked_slow:
        terminalreporter.write_sep("-", f"over {SLOW_S:.0f} s without the slow mark")
        for nodeid, s in sorted(_unmarked_slow, key=lambda x: -x[1]):
            terminalreporter.write_line(f"{s:6.1f} s  {nodeid}")
