"""AppTest fixtures: the tiny stand-in zoo and result store (built once per session), and a clean
Streamlit cache per test (st.cache_data is process-global and outlives AppTest instances)."""

from pathlib import Path

import pytest
import streamlit as st
from tiny_zoo import build_store, build_zoo


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> Path:
    return build_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def tiny_store(tiny_zoo, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cached_results")
    build_store(tiny_zoo, root)
    return root


@pytest.fixture
def tiny_env(monkeypatch, tiny_zoo, tiny_store) -> tuple[Path, Path]:
    """Point the engine (and so the app, which runs in this process under AppTest) at the tiny zoo."""
    monkeypatch.setenv("LMC_ZOO_DIR", str(tiny_zoo))
    monkeypatch.setenv("LMC_CACHE_DIR", str(tiny_store))
    return tiny_zoo, tiny_store


@pytest.fixture(autouse=True)
def _clear_streamlit_caches():
    st.cache_data.clear()
    yield


@pytest.fixture
def downloads(monkeypatch) -> dict[str, tuple]:
    """key -> (data, file name, mime, label) of every download button drawn (deferred data resolved)."""
    from streamlit.delta_generator import DeltaGenerator

    got: dict[str, tuple] = {}
    original = DeltaGenerator.download_button

    def spy(self, label, data, file_name=None, mime=None, key=None, **kw):
        got[key] = (data() if callable(data) else data, file_name, mime, label)
        return original(self, label, data, file_name, mime, key, **kw)

    monkeypatch.setattr(DeltaGenerator, "download_button", spy)
    monkeypatch.setattr(st, "download_button", lambda *a, **kw: spy(st._main, *a, **kw))
    return got
