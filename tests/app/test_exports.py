"""Exports (app.exports): every download is a file its format's own reader accepts and that holds the
record's values, checked on real engine records of the tiny stand-in zoo; then the Connectivity
page's download buttons, whose data is captured as streamlit receives it."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS

from app import exports
from app.figures import path as path_figs
from engine.errors import LMCError
from engine.results import cached_record

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
LM, VIT = CACHED_PAIRS


@pytest.fixture
def recs(tiny_env) -> dict[str, dict]:
    _, store = tiny_env
    return {"naive": cached_record(*LM, "naive", store), "weight": cached_record(*LM, "weight", store),
            "vit": cached_record(*VIT, "naive", store)}


def test_record_json_is_the_record(recs):
    for rec in recs.values():
        assert json.loads(exports.record_json(rec)) == rec


def test_record_json_keeps_nan_as_the_engine_writes_it(recs):
    rec = {**recs["naive"], "loss": [float("nan"), *recs["naive"]["loss"][1:]]}
    back = json.loads(exports.record_json(rec))
    assert math.isnan(back["loss"][0]) and back["loss"][1:] == rec["loss"][1:]


def test_curves_csv_has_a_row_per_point_of_every_curve(recs):
    curves = [(recs["naive"], "Naive", "cached"), (recs["weight"], "Weight matching, live", "live"),
              (recs["vit"], "Naive ViT", "cached")]
    rows = list(csv.DictReader(io.StringIO(exports.curves_csv(curves).decode())))
    assert tuple(rows[0]) == exports.CSV_COLUMNS
    assert all("train_loss" in r for r, _, _ in curves)  # engine records carry their train curve
    assert len(rows) == 2 * sum(len(r["lambdas"]) for r, _, _ in curves)  # test rows, then train rows
    i = 0
    for rec, name, source in curves:
        for split, prefix in (("test", ""), ("train", "train_")):
            acc = rec[f"{prefix}accuracy"]
            for j, (lam, loss) in enumerate(zip(rec["lambdas"], rec[f"{prefix}loss"])):
                row = rows[i]
                assert (row["method"], row["curve"], row["source"], row["split"], row["eval_set"]) == \
                    (rec["method"], name, source, split, rec[f"{prefix}eval_set"])
                assert (float(row["lambda"]), float(row["loss"])) == (lam, loss)  # exact: repr round-trips
                assert row["accuracy"] == ("" if acc is None else repr(acc[j]))
                i += 1
    old = {k: v for k, v in recs["naive"].items() if not k.startswith("train_")}  # from before train curves
    rows = list(csv.DictReader(io.StringIO(exports.curves_csv([(old, "Naive", "cached")]).decode())))
    assert [r["split"] for r in rows] == ["test"] * len(old["lambdas"])


def test_element_npz_holds_the_permutations_and_maps(recs):
    rec = recs["weight"]
    el = rec["alignment"]["element"]
    with np.load(io.BytesIO(exports.element_npz(rec)), allow_pickle=False) as z:
        for i, layer in enumerate(el["layers"]):
            assert z[f"layer{i}.head_perm"].tolist() == layer["head_perm"]
            assert z[f"layer{i}.mlp_perm"].tolist() == layer["mlp_perm"]
            assert np.array_equal(z[f"layer{i}.qk_singular_values"], np.asarray(layer["qk_singular_values"]))
        assert str(z["residual.kind"]) == el["residual"]["kind"]
        res = "residual.perm" if "perm" in el["residual"] else "residual.matrix"
        assert np.array_equal(z[res], np.asarray(el["residual"][res.split(".")[1]]))
        assert sorted(z.files) == sorted(  # nested fields (rope_scalars, mlp_similarity) one array per part
            [f"layer{i}.{k}" + (f".{part}" if isinstance(v, dict) else "") for i, layer in enumerate(el["layers"])
             for k, v in layer.items() for part in (v if isinstance(v, dict) else [None])]
            + [f"residual.{k}" for k in el["residual"]])
    back = json.loads(exports.element_json(rec))
    assert back["element"] == el and back["method"] == "weight" and back["classes"] == rec["alignment"]["classes"]


def test_element_npz_of_a_dual_run_keeps_both_sides():
    layer = {"head_perm": [1, 0], "kv_perm": [1, 0], "mlp_perm": [2, 0, 1],
             "rope_scalars": {"abs": [[1.0, 0.5]], "angle": [[0.1, -0.2]]}}
    rec = {"method": "dual", "model_a": "x/a", "model_b": "x/b", "alignment": {
        "classes": ["heads"], "element": {"layers": [layer], "residual": {"kind": "identity"}},
        "element_a": {"layers": [{**layer, "head_perm": [0, 1]}], "residual": {"kind": "identity"}}}}
    with np.load(io.BytesIO(exports.element_npz(rec)), allow_pickle=False) as z:
        assert z["layer0.head_perm"].tolist() == [1, 0] and z["a.layer0.head_perm"].tolist() == [0, 1]
        assert z["layer0.rope_scalars.angle"].tolist() == [[0.1, -0.2]]
    assert exports.stem(rec) == "a__b__dual"


def test_a_naive_record_has_no_element(recs):
    with pytest.raises(LMCError, match="holds no group element"):
        exports.element_npz(recs["naive"])


def test_stems_are_file_safe():
    assert exports.stem({"model_a": "/data/my models/a:1", "model_b": "lm-rope-s1", "method": "weight"}) == \
        "a_1__lm-rope-s1__weight"


def test_figures_page_holds_every_figure_and_plotly_once(recs):
    figs = {"Loss <path>": path_figs.barrier_figure([recs["naive"], recs["weight"]]),
            "Accuracy": path_figs.accuracy_figure([recs["vit"]])}
    page = exports.figures_html(figs, "LMC Explorer: test").decode()
    assert page.count("Plotly.newPlot(") == 2  # one call per figure
    assert page.count(get_plotlyjs()) == 1  # the library once, for both
    assert "<h2>Loss &lt;path&gt;</h2>" in page and "<h2>Accuracy</h2>" in page
    one = exports.figure_html(go.Figure(go.Scatter(x=[0, 1], y=[2, 3]))).decode()
    assert one.lower().startswith("<!doctype html>") and one.count("Plotly.newPlot(") == 1
    assert one.count(get_plotlyjs()) == 1  # self-contained: opens offline


# ---------------------------------------------------------------------------------------------
# The page's download buttons


def test_connectivity_page_downloads_are_valid_files(tiny_env, downloads):
    _, store = tiny_env
    naive, weight = (cached_record(*LM, m, store) for m in ("naive", "weight"))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert set(downloads) == {"export_record", "export_curves", "export_figures"}  # naive: no element
    data, name, mime, _ = downloads["export_record"]
    assert json.loads(data) == naive and name == "lm-none-s0__lm-none-s1__naive.json" and mime == "application/json"
    rows = list(csv.DictReader(io.StringIO(downloads["export_curves"][0].decode())))
    assert [float(r["loss"]) for r in rows] == naive["loss"] + naive["train_loss"] + weight["loss"] + weight["train_loss"]
    page = downloads["export_figures"][0].decode()
    assert page.count("Plotly.newPlot(") == 1 and "Loss along the linear path" in page

    downloads.clear()
    at.selectbox(key="export_pick").select(1).run()  # the weight-matching record
    assert {"export_element_npz", "export_element_json"} <= set(downloads)
    with np.load(io.BytesIO(downloads["export_element_npz"][0]), allow_pickle=False) as z:
        assert z["layer0.head_perm"].tolist() == weight["alignment"]["element"]["layers"][0]["head_perm"]
    assert json.loads(downloads["export_element_json"][0])["element"] == weight["alignment"]["element"]
    assert downloads["export_element_npz"][1] == "lm-none-s0__lm-none-s1__weight__element.npz"


def test_every_chart_saves_as_svg(tiny_env):
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="pair").select(f"{VIT[0]}__{VIT[1]}").run()
    charts = at.get("plotly_chart")
    assert len(charts) == 2
    for c in charts:
        assert json.loads(c.proto.config)["toImageButtonOptions"]["format"] == "svg"


def test_alignment_page_offers_its_record_element_and_every_figure(tiny_env, downloads):
    _, store = tiny_env
    weight = cached_record(*LM, "weight", store)
    at = AppTest.from_file(APP, default_timeout=60)
    at.switch_page("app_pages/alignment.py").run()
    at.selectbox(key="method").select("weight").run()
    assert not at.exception
    assert {"align_export_record", "align_export_element_npz", "align_export_element_json",
            "align_figures"} <= set(downloads)
    assert json.loads(downloads["align_export_record"][0]) == weight
    with np.load(io.BytesIO(downloads["align_export_element_npz"][0]), allow_pickle=False) as z:
        assert z["layer1.mlp_perm"].tolist() == weight["alignment"]["element"]["layers"][1]["mlp_perm"]
    page = downloads["align_figures"][0].decode()
    assert page.count("Plotly.newPlot(") == len(at.get("plotly_chart")) > 3  # every chart the page drew
