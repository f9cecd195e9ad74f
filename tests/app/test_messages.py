"""One message per cause, the same on every page: an empty directory as model A on Connectivity and
Alignment gives the engine's one sentence under its input in the sidebar, and as the model on Symmetry
the same sentence, before any work."""

from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
TIMEOUT = 60


def test_an_empty_directory_gets_one_message_on_every_page(tiny_env, tmp_path):
    zoo_dir, _ = tiny_env
    empty = tmp_path / "empty"
    empty.mkdir()
    expected = f"Model A directory {empty} is empty: a model directory holds config.json and the weights."
    seen = {}
    for page in ("app_pages/connectivity.py", "app_pages/alignment.py"):
        at = AppTest.from_file(APP, default_timeout=TIMEOUT)
        at.session_state["pair"] = "custom"
        at.session_state["model_a_dir"] = str(empty)
        at.session_state["model_b_dir"] = str(zoo_dir / "lm-rope-s1")
        at.switch_page(page).run()
        assert not at.exception and not at.status
        seen[page] = [e.value for e in at.sidebar.error]
        assert at.error[0].icon == ":material/error:" and not at.main.error
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state["sym_source"] = "dir"
    at.session_state["sym_dir"] = str(empty)
    at.switch_page("app_pages/symmetry.py").run()
    assert not at.exception and not at.status
    seen["symmetry"] = [e.value.replace("Model directory", "Model A directory") for e in at.error]
    assert at.error[0].value == f"Model directory {empty} is empty: a model directory holds config.json and the weights."
    assert all(v == [expected] for v in seen.values()), seen
