"""Exports (app.exports): every download is a file its format's own reader accepts and that holds the
record's values, checked on real engine records of the tiny stand-in zoo; then the Connectivity
page's download buttons, whose data is captured as streamlit receives it."""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs
from streamlit.testing.v1 import AppTest
from tiny_zoo import CACHED_PAIRS

from app import downloads as app_downloads
from app import exports
from app.figures import path as path_figs
from engine.api import method_names
from engine.errors import LMCError
from engine.report import symmetry_report
from engine.results import cached_record

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "app" / "streamlit_app.py")
LM, VIT = CACHED_PAIRS
# What no exported file may hold: the checkout's path, the home directory, the temporary directory.
MACHINE_PATHS = (str(REPO), os.path.expanduser("~"), "/tmp", tempfile.gettempdir())


def plots(page: str) -> list[tuple[list, dict, dict]]:
    """(data, layout, config) of every Plotly.newPlot call of an exported HTML page."""
    dec, out = json.JSONDecoder(), []
    for m in re.finditer(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*", page):
        i, parts = m.end(), []
        for _ in range(3):
            obj, i = dec.raw_decode(page, i)
            parts.append(obj)
            i = re.compile(r"\s*,?\s*").match(page, i).end()
        out.append(tuple(parts))
    return out


def axes(layout: dict) -> dict[str, dict]:
    return {k: v for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k)}


def no_machine_path(data: bytes, what: str) -> None:
    text = data.decode("utf-8", errors="replace")
    for p in MACHINE_PATHS:
        assert p not in text, f"{what} holds {p}"


@pytest.fixture
def recs(tiny_env) -> dict[str, dict]:
    _, store = tiny_env
    return {"naive": cached_record(*LM, "naive", store), "weight": cached_record(*LM, "weight", store),
            "vit": cached_record(*VIT, "naive", store)}


def test_record_json_is_the_record(recs):
    for rec in recs.values():
        assert json.loads(exports.record_json(rec)) == rec


def test_record_json_is_strict_json_with_non_finite_numbers_null(recs):
    rec = {**recs["naive"], "loss": [float("nan"), *recs["naive"]["loss"][1:-1], float("inf")]}
    text = exports.record_json(rec).decode()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in an exported record"))
    assert back["loss"][0] is None and back["loss"][-1] is None and back["loss"][1:-1] == rec["loss"][1:-1]


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
    one = exports.figures_html({"Line": go.Figure(go.Scatter(x=[0, 1], y=[2, 3]))}, "One").decode()
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
    assert json.loads(data) == naive and mime == "application/json"
    assert name == f"lm-learned-s0__lm-learned-s1__naive__{exports.run_tag(naive)}.json"
    rows = list(csv.DictReader(io.StringIO(downloads["export_curves"][0].decode())))
    assert [float(r["loss"]) for r in rows] == naive["loss"] + naive["train_loss"] + weight["loss"] + weight["train_loss"]
    page = downloads["export_figures"][0].decode()
    assert page.count("Plotly.newPlot(") == 1 and "<h2>Loss along the linear path</h2>" in page
    ((_, layout, config),) = plots(page)
    names = method_names()
    assert layout["title"]["subtitle"]["text"].startswith(
        f"lm-learned-s0 vs lm-learned-s1: {names['naive']}, {names['weight']}<br>engine commit ")
    assert downloads["export_figures"][1] == \
        f"connectivity__lm-learned-s0__lm-learned-s1__naive-weight__{exports.run_tag(weight)}__figures.html"
    assert config["toImageButtonOptions"] == {"format": "svg", "scale": 1,
                                              "filename": downloads["export_figures"][1].removesuffix(".html")}

    downloads.clear()
    at.selectbox(key="export_pick").select(1).run()  # the weight-matching record
    assert {"export_element_npz", "export_element_json"} <= set(downloads)
    with np.load(io.BytesIO(downloads["export_element_npz"][0]), allow_pickle=False) as z:
        assert z["layer0.head_perm"].tolist() == weight["alignment"]["element"]["layers"][0]["head_perm"]
    assert json.loads(downloads["export_element_json"][0])["element"] == weight["alignment"]["element"]
    assert downloads["export_element_npz"][1] == f"lm-learned-s0__lm-learned-s1__weight__{exports.run_tag(weight)}__element.npz"


def test_a_live_and_a_cached_record_download_under_different_names(tiny_env, downloads):
    _, store = tiny_env
    naive = cached_record(*LM, "naive", store)
    live = {**naive, "created": "2026-12-03T10:00:05Z", "eval_tokens": 512}
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["live_runs"] = {LM: {"naive": live}}
    at.run()
    assert not at.exception
    cached_name = downloads["export_record"][1]
    picker = at.selectbox(key="export_pick")
    picker.set_value(next(i for i, o in enumerate(picker.options) if "live" in o)).run()
    assert downloads["export_record"][1] == "lm-learned-s0__lm-learned-s1__naive__20261203T100005Z.json" != cached_name
    assert json.loads(downloads["export_record"][0]) == live
    assert f"{method_names()['naive']}, live (512 tokens)" in plots(downloads["export_figures"][0].decode())[0][1]["title"]["subtitle"]["text"]


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


# ---------------------------------------------------------------------------------------------
# Figures a paper can use, file names, no machine paths


def test_exported_figures_have_full_axes_and_a_title_naming_pair_method_and_commit(recs):
    import streamlit  # noqa: F401  (its template, the app's default, keeps the narrow margins as given)

    prov = {"git_commit": "0123456789abcdef0123456789abcdef01234567", "engine_modified": False}
    naive, weight = ({**recs[m], "provenance": {**recs[m]["provenance"], **prov}} for m in ("naive", "weight"))
    fig = path_figs.barrier_figure([naive, weight])
    assert fig.layout.margin.l == 10  # the app's narrow margin, which clipped '3.5' to '.5' outside the app
    about = [(naive, "Naive"), (weight, "Weight matching")]
    subtitle = exports.describe(about)
    commit = "0123456"
    assert subtitle == f"lm-learned-s0 vs lm-learned-s1: Naive, Weight matching<br>engine commit {commit}"
    page = exports.figures_html({"Loss along the linear path": fig}, "LMC Explorer, Connectivity", {}, subtitle)
    ((data, layout, _),) = plots(page.decode())
    assert len(data) == len(fig.data)
    assert {"xaxis", "yaxis"} <= set(axes(layout))
    for name, ax in axes(layout).items():
        assert ax["automargin"] is True and ax["title"]["standoff"] > 0, name  # ticks and titles push the margin
    assert layout["title"]["text"] == "Loss along the linear path"
    assert layout["title"]["subtitle"]["text"] == subtitle
    assert layout["margin"]["t"] >= fig.layout.margin.t + exports.TITLE_PX and layout["margin"]["l"] >= 60
    assert layout["height"] == (fig.layout.height or 450) + exports.TITLE_PX
    assert f"<p>engine commit {commit}</p>" in page.decode()
    assert fig.layout.margin.l == 10 and not fig.layout.title.text  # the app's figure is left as it was
    # one figure alone: the same layout
    (_, one, _), = plots(exports.figures_html({"Loss": fig}, "One figure", subtitle=subtitle).decode())
    assert one["yaxis"]["automargin"] is True and one["title"]["text"] == "Loss"


def test_several_commits_are_each_named_with_their_records(recs):
    cached = {**recs["naive"], "provenance": {"git_commit": "e" * 40, "engine_modified": False}}
    live = {**recs["weight"], "provenance": {"git_commit": "f" * 40, "engine_modified": True}}
    text = exports.describe([(cached, "Naive"), (live, "Weight matching, live")])
    assert text.endswith("engine commits eeeeeee (Naive); fffffff with uncommitted engine changes "
                         "(Weight matching, live)")
    assert exports.describe([({**recs["naive"], "provenance": {}}, "Naive")]).endswith("engine commit not recorded")


def test_file_names_name_the_pair_method_and_run(recs):
    cached = {**recs["naive"], "created": "2026-12-01T09:00:00Z"}  # fixed dates: the newest run names the file
    weight = {**recs["weight"], "created": "2026-12-01T09:00:01Z"}
    live = {**cached, "created": "2026-12-03T10:00:05Z"}
    kept = {**live, "run": {"id": "20261203T100006Z-0a1b2c", "status": "done"}}
    assert exports.file_stem(live) == "lm-learned-s0__lm-learned-s1__naive__20261203T100005Z"
    assert exports.file_stem(kept) == "lm-learned-s0__lm-learned-s1__naive__20261203T100006Z-0a1b2c"
    assert len({exports.file_stem(r) for r in (cached, live, kept)}) == 3  # never one name for two runs
    assert exports.figures_file_name("Connectivity", [(cached, "Naive"), (weight, "W"), (live, "N, live")]) \
        == "connectivity__lm-learned-s0__lm-learned-s1__naive-weight__20261203T100005Z__figures.html"  # the newest run
    assert exports.figures_file_name("Symmetry", subject="GPT-2 small") == "symmetry__GPT-2_small__figures.html"


def test_every_chart_key_of_the_app_has_a_heading_in_words():
    keys = []
    for f in (REPO / "app" / "app_pages").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "show":
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("key"), ast.Constant) and "name" not in kw:
                    keys.append(kw["key"].value)
    assert len(keys) > 20
    assert sorted(k for k in keys if k not in app_downloads.HEADINGS) == []
    assert all("_" not in h for h in app_downloads.HEADINGS.values())


def test_no_export_holds_a_machine_path(tiny_env, recs):
    zoo, _ = tiny_env
    a, b = str(zoo / LM[0]), str(zoo / LM[1])
    assert a.startswith(tempfile.gettempdir())  # the tiny zoo lies in the temporary directory
    rec = {**recs["weight"], "model_a": a, "model_b": b,
           "config": {**recs["weight"]["config"], "model_a": a, "model_b": b},
           "eval_set": f"{a}/data/test, 1,024 tokens (bytes)"}
    no_machine_path(exports.record_json(rec), "record JSON")
    assert json.loads(exports.record_json(rec))["model_a"] == LM[0]
    no_machine_path(exports.curves_csv([(rec, f"Weight matching ({a})", "live")]), "curves CSV")
    no_machine_path(exports.element_json(rec), "element JSON")
    with np.load(io.BytesIO(exports.element_npz(rec)), allow_pickle=False) as z:
        no_machine_path(" ".join(str(z[k]) for k in z.files if z[k].dtype.kind == "U").encode(), "element npz")
    fig = path_figs.barrier_figure([rec], title=f"Loss of {a}", method_names={"weight": f"weight {b}"})
    subtitle = exports.describe([(rec, f"Weight matching on {a}")])
    no_machine_path(exports.figures_html({f"Loss {a}": fig}, f"LMC Explorer: {a}", {}, subtitle), "figures HTML")
    rep = symmetry_report(a)
    assert rep["model"] == a  # the engine names a directory by its path; the exports do not
    no_machine_path(exports.symmetry_json(rep), "symmetry JSON")
    md = exports.symmetry_markdown(rep, "Exact.")
    no_machine_path(md, "symmetry Markdown")
    assert md.decode().startswith(f"# Symmetry report: {LM[0]}") and f"\n{LM[0]} (reference)" in md.decode()


def test_the_pages_downloads_hold_no_machine_path(tiny_env, downloads):
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("app_pages/alignment.py").run()
    at.selectbox(key="method").select("weight").run()
    at.session_state["sym_source"] = "zoo"
    at.switch_page("app_pages/symmetry.py").run()
    assert not at.exception
    assert {"export_record", "align_export_record", "align_figures", "symmetry_export_md",
            "symmetry_export_json", "symmetry_figures"} <= set(downloads)
    for key, (data, name, _, _) in downloads.items():
        no_machine_path(data, key)
        assert "/" not in name and "\\" not in name
    assert downloads["symmetry_figures"][1] == f"symmetry__{LM[0]}__figures.html"
