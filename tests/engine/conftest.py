"""Engine test fixtures: the tiny stand-in zoo (tests/app/tiny_zoo.py) with an empty result store, per test."""

from pathlib import Path

import pytest
from tiny_zoo import build_zoo


@pytest.fixture
def tiny_dirs(monkeypatch, tmp_path) -> Path:
    """tmp_path holding zoo/ (the tiny zoo, LMC_ZOO_DIR) and store/ (an empty result store, LMC_CACHE_DIR)."""
    monkeypatch.setenv("LMC_ZOO_DIR", str(build_zoo(tmp_path / "zoo")))
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    return tmp_path
