"""The app's server: `python -m app.serve [streamlit options]` is `streamlit run app/streamlit_app.py` with the
first script run's imports warmed while the server starts (app/warm.py; bench/RESULTS.md, "App latency")."""

from __future__ import annotations

import sys
from pathlib import Path

from streamlit.web import cli  # streamlit first, whole: its import runs plotly code that peeks at pandas

from app import warm

SCRIPT = Path(__file__).with_name("streamlit_app.py")


def main(argv: list[str] | None = None) -> None:
    warm.start()
    sys.argv = ["streamlit", "run", str(SCRIPT), *(sys.argv[1:] if argv is None else argv)]
    cli.main()


if __name__ == "__main__":
    main()
