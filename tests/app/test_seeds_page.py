"""The Seeds page under AppTest: the stored multi-model records (engine.multi) drawn as barrier heatmaps before and
after alignment and a ternary plot of the triangle, from real engine runs on tiny models in a stand-in store."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from plotly_json import chart
from streamlit.testing.v1 import AppTest
from tiny_zoo import TINY

from engine.api import multi_models
from engine.models import save_model
from engine.models.reference import build
from engine.multi import store_dir, store_file, write_record

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
PAGE = "app_pages/seeds.py"
TIMEOUT = 60


def seeds_page(params: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update(params or {})
    at.switch_page(PAGE).run()
    assert not at.exception
    assert at.title[0].value == "Seeds: more than two models"
    return at


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both records of three tiny ViTs named like seeds of one recipe, from real engine runs."""
    root = tmp_path_factory.mktemp("seeds")
    names = []
    for s in range(3):
        save_model(build(replace(TINY, task="vit", pe="learned"), seed=s), root / f"vit-tiny-s{s}")
        names.append(str(root / f"vit-tiny-s{s}"))
    return {to: multi_models(names, to, eval_items=32, per_edge=4) for to in ("reference", "barycentre")}


@pytest.fixture
def store(tiny_env, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "store"
    shutil.copytree(tiny_env[1], root)
    monkeypatch.setenv("LMC_CACHE_DIR", str(root))
    return root


def test_without_records_the_page_says_how_to_build_them(store):
    at = seeds_page()
    assert "cache build --multi" in at.info[0].value and not at.get("plotly_chart")


def test_the_stored_matrices_and_triangle_are_drawn_for_the_chosen_basis(store, runs):
    for to, rec in runs.items():
        write_record(rec, store_file(rec["models"], to, store))
    at = seeds_page()
    assert at.radio(key="seeds_basis").options == ["To the first model", "To their barycentre"]
    for to in ("reference", "barycentre"):
        rec = runs[to]
        at.radio(key="seeds_basis").set_value(to).run()
        assert not at.exception and at.query_params["basis"] == to
        fig = chart(at, "seeds_barriers")
        before, after = (t for t in fig["data"] if t["type"] == "heatmap")
        assert [list(r) for r in before["z"]] == rec["before"]["barrier"]
        assert [list(r) for r in after["z"]] == rec["after"]["barrier"]
        assert list(before["x"]) == ["seed 0", "seed 1", "seed 2"]
        assert fig["layout"]["annotations"][1]["text"].endswith("to their barycentre)" if to == "barycentre"
                                                                else "to the first model)")
        tri = chart(at, "seeds_triangle")
        grid, centroid = tri["data"]
        assert [list(w) for w in zip(grid["a"], grid["b"], grid["c"])] == rec["triangle"]["weights"]
        assert list(grid["marker"]["color"]) == rec["triangle"]["loss"] and len(grid["a"]) == 10
        assert list(centroid["marker"]["color"]) == [rec["triangle"]["centroid"]["loss"]]
        off = [rec["after"]["barrier"][i][j] for i, j in ((0, 1), (0, 2), (1, 2))]
        assert at.metric[1].value == f"{sum(off) / 3:.3f}"
        caption = " ".join(c.value for c in at.caption)
        assert ("barycentre round(s)" in caption) == (to == "barycentre") and "of its own" in caption
    assert seeds_page({"basis": "barycentre"}).radio(key="seeds_basis").value == "barycentre"
    models = [m for m in at.markdown if m.value.startswith("**Models:**")]
    assert len(models) == 1 and all(f"`{m}`" in models[0].value for m in rec["models"])  # which seeds, named
    assert any(c.value.startswith("The Seeds page shows its own set of seeds.") for c in at.sidebar.caption)


def test_an_unusable_record_is_named_and_the_others_are_still_drawn(store, runs):
    rec = runs["reference"]
    write_record(rec, store_file(rec["models"], "reference", store))
    (store_dir(store) / "broken.json").write_text('{"kind": "multi"')
    at = seeds_page()
    assert len(at.warning) == 1 and "broken.json" in at.warning[0].value
    assert at.radio(key="seeds_basis").options == ["To the first model"] and chart(at, "seeds_triangle")
