"""The imports of a first script run, warmed in a background thread while a cold server starts and the browser
loads the frontend (about a second in which the server is otherwise idle; app/serve.py starts it). The entry
script waits for them before it runs (`wait`), so a first run never meets a half-imported module (plotly's
validators look pandas up in sys.modules); in a server that did not start them, `wait` returns at once."""

from __future__ import annotations

import threading

_done = threading.Event()
_started = False


def _imports() -> None:
    try:
        import pandas  # noqa: F401  (st.dataframe's)

        import app.downloads
        import app.exports
        import app.figures.alignment
        import app.figures.path
        import app.live_run
        import app.sidebar  # noqa: F401
        from engine import api

        api.method_names()  # the aligners' registry and scipy's solvers, which the sidebar lists
    except Exception:  # noqa: BLE001, S110  (the page's own import raises it where the user sees it)
        pass
    finally:
        _done.set()


def start() -> None:
    """Start warming (once; streamlit must be imported already: its import runs plotly code)."""
    global _started
    if not _started:
        _started = True
        threading.Thread(target=_imports, name="warm-imports", daemon=True).start()


def wait() -> None:
    if _started:
        _done.wait()
