"""The Connectivity page's "Across widths" section under AppTest: the stored width-heterogeneous curves (a
narrow model lifted into a wider one's shape, engine.widen) drawn with the path figure, on the tiny stand-in
zoo and store (tiny_zoo.py)."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from plotly_json import chart
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS, TINY

from app.sidebar import methods
from engine.api import widen_file, widen_pair
from engine.models import save_model
from engine.models.reference import build
from engine.results import RunConfig, write_record

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
TITLE = "Across widths: a narrow model lifted into a wider one"


def vit_page(store: Path) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="pair").select(f"{CACHED_PAIRS[1][0]}__{CACHED_PAIRS[1][1]}").run()
    assert not at.exception
    return at


def test_the_stored_width_heterogeneous_curves_are_drawn(tiny_env, monkeypatch, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny_env[1], store)
    monkeypatch.setenv("LMC_CACHE_DIR", str(store))
    at = vit_page(store)
    assert [e.label for e in at.expander].count(TITLE) == 1
    assert "No width-heterogeneous run is stored" in " ".join(c.value for c in at.caption)

    cfg = replace(TINY, task="vit", pe="learned")
    save_model(build(cfg, seed=0), tmp_path / "narrow")
    save_model(build(replace(cfg, d_model=64, d_mlp=128), seed=1), tmp_path / "wide")
    a, b = str(tmp_path / "narrow"), str(tmp_path / "wide")
    recs = {}
    for m in ("naive", "weight"):
        recs[m] = widen_pair(RunConfig(a, b, m, points=5, eval_items=32), attribution=False, train_curve=False)
        f = widen_file(a, b, m, root=store)
        f.parent.mkdir(exist_ok=True)
        write_record(recs[m], f)
    at = vit_page(store)
    fig = chart(at, "widen_chart")
    names = methods()
    drawn = {t["name"]: list(t["y"]) for t in fig["data"] if t.get("showlegend", True) and t.get("legendgroup") != "key"}
    assert drawn == {names[m]: pytest.approx(recs[m]["loss"], abs=0) for m in recs}
    assert fig["layout"]["title"]["text"] == "Loss along the path in width 64"
    tables = [{r["curve"]: r["barrier"] for r in d.value.to_dict("records")} for d in at.dataframe
              if "curve" in d.value.columns]  # the pair's summary, then this section's
    assert tables[-1] == {names[m]: recs[m]["barrier"] for m in recs}
    caption = " ".join(c.value for c in at.caption)
    assert "lifted into the shape of `wide` (D = 64" in caption and f"{recs['weight']['lift']['loss_a']:.4f}" in caption

    at.selectbox(key="pair").select(f"{CACHED_PAIRS[0][0]}__{CACHED_PAIRS[0][1]}").run()  # an LM pair: no ViT widths
    assert not at.exception and TITLE not in [e.label for e in at.expander]
