"""Real-browser fixtures (recipe: docs/DESIGN.md section 10): one streamlit server per session on a free
127.0.0.1 port, and Debian's Chromium driven by Playwright (never `playwright install`)."""

import os

import pytest
import tiny_zoo

from tests.browser.server import serve

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # tests run as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # closed network: no Google lookups
    "--disable-component-update",
    "--disable-sync",
]


def _store_env(tmp_path_factory) -> dict[str, str]:
    """Serve the committed cached_results/ when they hold the pair the app opens on; otherwise (zoo still
    training, fresh clone without results) a tiny stand-in zoo and store, so the test still sees a curve."""
    from app.sidebar import OPENING_PAIR
    from engine import zoo
    from engine.results import CACHE, list_cached

    if OPENING_PAIR in {(r["model_a"], r["model_b"]) for r in list_cached(CACHE)}:
        return {"LMC_CACHE_DIR": str(CACHE), "LMC_ZOO_DIR": str(zoo.ZOO)}
    zoo_dir = tiny_zoo.build_zoo(tmp_path_factory.mktemp("zoo"))
    store = tmp_path_factory.mktemp("cached_results")
    tiny_zoo.build_store(zoo_dir, store)
    return {"LMC_CACHE_DIR": str(store), "LMC_ZOO_DIR": str(zoo_dir)}


@pytest.fixture(scope="session")
def streamlit_url(streamlit_server) -> str:
    return streamlit_server[0]


@pytest.fixture(scope="session")
def streamlit_server(tmp_path_factory):
    """(url, process) of the app served for the session."""
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    with serve(_store_env(tmp_path_factory), log_path) as (url, proc):
        yield url, proc


@pytest.fixture(scope="session")
def browser():
    pw_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: apt-get install -y chromium")
    with pw_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, streamlit_url):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    local = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")
    pg.external_requests = []  # the app must work offline: every request stays on 127.0.0.1
    pg.on("request", lambda r: None if r.url.startswith(local) else pg.external_requests.append(r.url))
    yield pg
    ctx.close()
