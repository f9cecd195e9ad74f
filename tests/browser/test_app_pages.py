"""The pages in a real browser: every download is a file its format can read, the side-by-side symmetry
mode, and each error message; first-chart, switch and symmetry-open times are printed and recorded by
bench/bench_app.py (no timed assertions)."""

import csv
import io
import json

import numpy as np
import pytest

from tests.browser.server import wait_idle

pytestmark = pytest.mark.e2e

CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'
EXC = '[data-testid="stException"]'
ERROR = '[data-testid="stAlertContentError"]'


def error_text(page) -> str:
    """The error box's sentence (its icon's ligature name comes first in the text)."""
    return page.inner_text(ERROR).strip().split("\n")[-1]


def download(page, label: str) -> bytes:
    """Click a download button and return the file the browser saved."""
    with page.expect_download() as info:
        page.get_by_role("button", name=label).click()
    return open(info.value.path(), "rb").read()


@pytest.mark.slow
def test_every_download_on_connectivity_and_symmetry_is_a_valid_file(page, streamlit_url):
    page.goto(streamlit_url)
    page.wait_for_selector(CHART + " .scatterlayer .trace path")
    wait_idle(page)
    page.get_by_text("Export", exact=True).click()
    rec = json.loads(download(page, "Result record (JSON)"))
    assert {"lambdas", "loss", "barrier", "method"} <= set(rec)
    rows = list(csv.DictReader(io.StringIO(download(page, "Every curve (CSV)").decode())))
    assert rows and {"method", "loss"} <= set(rows[0]) and float(rows[0]["loss"]) > 0
    html = download(page, "Every figure on this page (HTML)").decode()
    assert html.lstrip().lower().startswith("<!doctype html") or "<html" in html[:500].lower()
    assert "plotly" in html.lower()
    # an aligned record also hands out its group element
    page.locator('[data-testid="stExpander"] [data-testid="stSelectbox"]').click()
    page.get_by_role("option").nth(1).click()
    wait_idle(page)
    npz = np.load(io.BytesIO(download(page, "Group element (npz)")))
    assert any(k.endswith("head_perm") for k in npz.files)
    element = json.loads(download(page, "Group element (JSON)"))
    assert element and isinstance(element, dict)

    page.goto(streamlit_url + "/symmetry")
    page.wait_for_selector('h1:has-text("Symmetry")')
    page.wait_for_selector(CHART, timeout=120_000)
    wait_idle(page)
    rep = json.loads(download(page, "Symmetry report (JSON)"))
    assert {"checks", "breaks", "group_dim", "arch"} <= set(rep)
    md = download(page, "Symmetry report (Markdown)").decode()
    assert md.startswith("# Symmetry report: ") and "group dimension (continuous)" in md
    assert page.locator(EXC).count() == 0 and page.external_requests == []


def test_side_by_side_symmetry_mode(page, streamlit_url):
    page.goto(streamlit_url + "/symmetry")
    page.wait_for_selector('h1:has-text("Symmetry")')
    page.get_by_text("Side by side", exact=True).click()
    page.wait_for_function(f"() => document.querySelectorAll('{CHART}').length >= 2", timeout=120_000)
    wait_idle(page)
    assert page.locator(EXC).count() == 0
    # one model or shape per column, each with its own picker and group-dimension chart (log scale)
    assert page.locator('[data-testid="stSelectbox"]').count() >= 2
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .ytitle')]"
                           ".filter(e => e.textContent.includes('log scale')).length >= 2")


@pytest.mark.slow
def test_each_error_is_one_sentence_next_to_its_input(page, streamlit_url, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    page.goto(streamlit_url)
    page.wait_for_selector('h1:has-text("Connectivity")')
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').first.click()
    page.get_by_role("option", name="Two model directories…").click()
    page.get_by_label("Model A directory").fill(str(empty))
    page.get_by_label("Model A directory").press("Enter")
    page.get_by_label("Model B directory").fill("/nonexistent/model")
    page.get_by_label("Model B directory").press("Enter")
    sidebar = page.locator('[data-testid="stSidebar"]')
    page.wait_for_function(f"() => document.querySelectorAll('[data-testid=\"stSidebar\"] {ERROR}').length == 2")
    wait_idle(page)
    # both directories are bad: both sentences, each right under its own input, none in the main pane
    texts = [t.strip().split("\n")[-1] for t in sidebar.locator(ERROR).all_inner_texts()]
    assert texts == [f"Model A directory {empty} is empty: a model directory holds config.json and the weights.",
                     "Model B /nonexistent/model is neither a zoo model nor an existing directory."]
    a_box, b_box = (page.get_by_label(f"Model {m} directory").bounding_box() for m in "AB")
    error_a, error_b = (e.bounding_box() for e in sidebar.locator(ERROR).all())
    assert a_box["y"] < error_a["y"] < b_box["y"] < error_b["y"]
    assert page.locator(f'[data-testid="stMainBlockContainer"] {ERROR}').count() == 0
    assert page.get_by_role("button", name="Run").is_disabled()
    # the same directory on the Symmetry page: the same sentence, for "the model"
    page.goto(streamlit_url + "/symmetry")
    page.wait_for_selector('h1:has-text("Symmetry")')
    page.get_by_text("Model directory", exact=True).click()
    field = page.get_by_role("textbox", name="Model directory")
    field.fill(str(empty))
    field.press("Enter")
    page.wait_for_selector(ERROR)
    assert error_text(page) == f"Model directory {empty} is empty: a model directory holds config.json and " \
                                     "the weights."
    assert page.locator(EXC).count() == 0
