"""LMC Explorer: `streamlit run app/streamlit_app.py`.

The entry script runs on every rerun: page config, the shared sidebar, then the chosen page.
Pages live in app/app_pages/, not app/pages/, because Streamlit would auto-discover the latter as
a legacy multipage app alongside st.navigation.
"""

import sys
from pathlib import Path

import streamlit as st

# `streamlit run` puts only app/ on sys.path; the pages import the `app` and `engine` packages.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app import warm

warm.wait()  # a cold server's warmed imports (app/serve.py) are complete before this run uses them

from app import sidebar, url_state
from engine.api import return_freed_memory

return_freed_memory()  # large freed tensors go back to the OS: live runs do not ratchet memory up

st.set_page_config(page_title="LMC Explorer", page_icon="📈", layout="wide")

connectivity = st.Page("app_pages/connectivity.py", title="Connectivity", icon=":material/show_chart:", default=True)
page = st.navigation([
    connectivity,
    st.Page("app_pages/alignment.py", title="Alignment", icon=":material/compare_arrows:"),
    st.Page("app_pages/symmetry.py", title="Symmetry", icon=":material/change_circle:"),
    st.Page("app_pages/seeds.py", title="Seeds", icon=":material/hub:"),
    st.Page("app_pages/runs.py", title="Runs", icon=":material/history:"),
])
url_state.begin()
sidebar.render(page.url_path)
if page.url_path != connectivity.url_path:  # a live run goes on while the user looks elsewhere
    sidebar.live_run_panel()
page.run()
url_state.publish()  # the view in the URL: a reload or a pasted link opens it again (app/url_state.py)
