"""The Alignment page under AppTest: what it draws is the record's `alignment` field, number for number.

The store is this module's own: real engine runs (naive, weight, dual) on a tiny grouped-query RoPE pair
(4 heads in 2 KV groups), so head-permutation blocks, RoPE scalars and the dual diagnostics are all real.
"""

import copy
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tiny_zoo
from plotly_json import chart
from streamlit.testing.v1 import AppTest

from app.figures import alignment as alignment_figs
from app.figures import style
from app.sidebar import methods
from engine import zoo
from engine.api import run_pair
from engine.models import save_model
from engine.models.reference import build
from engine.results import RunConfig, cached_record, store

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
PAGE = "app_pages/alignment.py"
PAIR = ("lm-rope-s0", "lm-rope-s1")
GQA = replace(tiny_zoo.TINY, pe="rope", n_kv_heads=2)
TIMEOUT = 60  # the first run imports torch; the machine's cores may be busy


def z_of(trace: dict) -> list[list[float]]:
    return np.asarray(trace["z"], dtype=float).tolist()


@pytest.fixture(scope="module")
def align_store(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny zoo whose RoPE pair has grouped-query attention, and a store of three real runs on it."""
    zoo_root = tiny_zoo.build_zoo(tmp_path_factory.mktemp("align_zoo"))
    for name in PAIR:
        save_model(build(GQA, seed=zoo.ENTRIES[name].seed), zoo_root / name)
    root = tmp_path_factory.mktemp("align_store")
    with tiny_zoo.env(LMC_ZOO_DIR=str(zoo_root)):
        for method, steps in (("naive", 0), ("weight", 0), ("dual", 4)):
            store(run_pair(RunConfig(*PAIR, method, steps=steps, eval_items=256, points=5)), root)
    return zoo_root, root


@pytest.fixture
def env(monkeypatch, align_store) -> Path:
    zoo_root, root = align_store
    monkeypatch.setenv("LMC_ZOO_DIR", str(zoo_root))
    monkeypatch.setenv("LMC_CACHE_DIR", str(root))
    return root


def page(method: str, live_runs: dict | None = None, pair: tuple[str, str] | None = PAIR) -> AppTest:
    """The Alignment page on `pair` (None: the app's default pair) with `method` picked."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if live_runs is not None:
        at.session_state["live_runs"] = live_runs
    at.switch_page(PAGE).run()
    if pair is not None:
        at.selectbox(key="pair").select(f"{pair[0]}__{pair[1]}").run()
    at.selectbox(key="method").select(method).run()
    assert not at.exception
    return at


def open_tab(at: AppTest, label: str) -> None:
    """Only the open tab runs: open another one, as a click on it would."""
    at.session_state["align_tab"] = label
    at.run()
    assert not at.exception


def test_weight_matching_is_drawn_layer_by_layer_from_the_record(env):
    rec = cached_record(*PAIR, "weight", env)
    al, layers = rec["alignment"], rec["alignment"]["element"]["layers"]
    at = page("weight")
    assert at.title[0].value == "Alignment"
    # every layer's head permutation, with its 2 KV groups outlined
    over = chart(at, "heads_overview")
    heat = [t for t in over["data"] if t["type"] == "heatmap"]
    assert [z_of(t) for t in heat] == [alignment_figs.permutation_matrix(L["head_perm"]) for L in layers]
    rects = [s for s in over["layout"]["shapes"] if s["type"] == "rect"]
    assert len(rects) == 2 * len(layers)
    # the outlined block of A's group c spans the columns of the B group it takes (kv_perm)
    first = [s for s in rects if s["xref"] == "x"]
    assert sorted((round(s["y0"] + 0.5) // 2, round(s["x0"] + 0.5) // 2) for s in first) == \
        sorted(enumerate(layers[0]["kv_perm"]))
    # matching cost: the record's numbers, before then after, per layer and the outer part
    cost = chart(at, "cost_chart")
    before, after = cost["data"]
    parts = [f"blocks.{i}" for i in range(len(layers))] + ["outer"]
    assert list(before["y"]) == [al["matching_cost"]["before"][p] for p in parts]
    assert list(after["y"]) == [al["matching_cost"]["after"][p] for p in parts]
    assert after["marker"]["color"] == style.method_colour("weight")
    # MLP: the median similarity of matched neurons against same-index ones, per layer
    same, matched = chart(at, "mlp_similarity")["data"]
    assert list(matched["y"]) == [L["mlp_similarity"]["matched"][50] for L in layers]
    assert list(same["y"]) == [L["mlp_similarity"]["same_index"][50] for L in layers]
    # the residual rotation: how much each A coordinate takes from its largest B coordinate
    O = np.abs(np.array(al["element"]["residual"]["matrix"]))
    assert list(chart(at, "residual_map")["data"][0]["y"]) == pytest.approx(sorted(O.max(0), reverse=True))
    # classes: every class the run used, with its group
    text = "\n".join(m.value for m in at.markdown)
    for c in al["classes"]:
        assert f"`{c}` | {al['groups'][c]}" in text
    assert f"`mlp_scale` | *not used: {rec['classes_left_out']['mlp_scale']}*" in text  # the engine's reasons
    assert "`residual_perm` | *not used: contained in residual_orth (every permutation is a rotation)*" in text
    # the sweep history
    open_tab(at, "Method diagnostics")
    sweeps = chart(at, "sweeps_chart")["data"][0]
    assert list(sweeps["y"]) == [s["objective"] for s in al["diagnostics"]["sweeps"]]


def test_one_layer_in_detail_follows_the_slider(env):
    rec = cached_record(*PAIR, "weight", env)
    layers = rec["alignment"]["element"]["layers"]
    at = page("weight")
    open_tab(at, "One layer")
    for i in (0, 1):
        at.select_slider(key="align_layer").set_value(i).run()
        assert not at.exception
        L = layers[i]
        heat, chosen = chart(at, "head_cost")["data"]  # the cost the matching saw, the permutation on it
        assert z_of(heat) == L["head_cost"] and list(chosen["x"]) == L["head_perm"]
        same, matched = chart(at, "mlp_similarity_layer")["data"]
        assert list(matched["y"]) == L["mlp_similarity"]["matched"]
        assert list(same["y"]) == L["mlp_similarity"]["same_index"]
        polar = chart(at, "rope_scalars")["data"]
        assert len(polar) == GQA.n_kv_heads  # one trace per KV group
        for c, t in enumerate(polar):
            assert list(t["r"]) == L["rope_scalars"]["abs"][c]
            assert list(t["theta"]) == pytest.approx([math.degrees(p) for p in L["rope_scalars"]["angle"][c]])
        sv = chart(at, "singular_values")
        assert [list(t["y"]) for t in sv["data"]] == L["vo_singular_values"]
        assert sv["layout"]["yaxis"]["tickformat"] == "~g"  # '0.8', '2' on the log axis, not bare digits


def test_only_the_open_tab_is_drawn_and_the_layer_is_kept_while_another_is_open(env):
    layers = cached_record(*PAIR, "weight", env)["alignment"]["element"]["layers"]
    at = page("weight")
    assert chart(at, "heads_overview")
    for key in ("head_cost", "sweeps_chart", "ablation_chart"):  # closed tabs: nothing built or sent
        with pytest.raises(KeyError):
            at.get_by_key(key)
    open_tab(at, "One layer")
    at.select_slider(key="align_layer").set_value(1).run()
    with pytest.raises(KeyError):
        at.get_by_key("heads_overview")
    open_tab(at, "All layers")
    open_tab(at, "One layer")
    assert at.select_slider(key="align_layer").value == 1
    assert list(chart(at, "head_cost")["data"][1]["x"]) == layers[1]["head_perm"]


def test_dual_shows_history_identity_and_either_side(env):
    rec = cached_record(*PAIR, "dual", env)
    al, d = rec["alignment"], rec["alignment"]["diagnostics"]
    at = page("dual")
    open_tab(at, "Method diagnostics")
    hist = chart(at, "history_chart")["data"]
    assert list(hist[0]["y"]) == d["history"]["val_barrier"]
    one_sided = [t for t in hist if t.get("line", {}).get("dash") == "dash"]
    one = d["one_sided_same_budget"]
    assert list(one_sided[0]["y"]) == one["history"]["val_barrier"]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Loss, max relative gap"] == f"{d['identity']['max_relative_error']:.1e}"
    assert metrics["Dual − one-sided"] == f"{one['dual_minus_one_sided_barrier']:+.4f}"
    (table,) = [t.value for t in at.dataframe if "one-sided" in t.value.columns]
    assert table["dual"].tolist() == d["identity"]["loss_dual"]
    assert table["one-sided"].tolist() == d["identity"]["loss_one_sided"]
    # the relative transform first (what the path uses), A's own on request
    open_tab(at, "All layers")

    def heat():
        return [z_of(t) for t in chart(at, "heads_overview")["data"]]

    assert heat() == [alignment_figs.permutation_matrix(L["head_perm"]) for L in al["element"]["layers"]]
    at.radio(key="align_side").set_value("a").run()
    assert not at.exception
    assert heat() == [alignment_figs.permutation_matrix(L["head_perm"]) for L in al["element_a"]["layers"]]


def test_the_optimisation_says_its_steps_and_the_batch_a_run_chose(env):
    rec = cached_record(*PAIR, "dual", env)
    steps = rec["alignment"]["diagnostics"]["steps"]

    def said(at) -> str:
        open_tab(at, "Method diagnostics")
        return next(m.value for m in at.markdown if m.value.startswith("**Optimisation**"))

    assert said(page("dual")).startswith(f"**Optimisation** ({steps:,} steps, Adam")  # the default batch: unsaid
    live = copy.deepcopy(rec)
    live["alignment"]["diagnostics"]["settings"]["batch"] = 64
    assert said(page("dual", live_runs={PAIR: {"dual": live}})).startswith(
        f"**Optimisation** ({steps:,} steps of 64 sequences, Adam")
    live["alignment"]["diagnostics"]["settings"]["candidates"] = 1
    assert said(page("dual", live_runs={PAIR: {"dual": live}})).endswith(
        "The MLP permutation (one candidate per neuron) is the start's; the other classes are learned.")
    live["alignment"]["diagnostics"]["settings"]["keep_heads"] = True
    assert said(page("dual", live_runs={PAIR: {"dual": live}})).endswith(
        "The head permutation and the MLP permutation (one candidate per neuron) are the start's; the other "
        "classes are learned.")
    live["alignment"]["diagnostics"]["settings"]["keep_heads"] = False
    live["alignment"]["diagnostics"]["settings"]["candidates"] = 16
    assert said(page("dual", live_runs={PAIR: {"dual": live}})).endswith(
        "Each MLP neuron chooses among 16 candidate partners.")


def test_the_optimisation_says_where_its_comparison_came_from_and_when_it_resumed(env):
    rec = cached_record(*PAIR, "dual", env)

    def captions(at) -> str:
        open_tab(at, "Method diagnostics")
        return " ".join(c.value for c in at.caption)

    live = copy.deepcopy(rec)
    d = live["alignment"]["diagnostics"]
    d["one_sided_same_budget"]["from_learned_record"], d["resumed_at"] = False, []
    said = captions(page("dual", live_runs={PAIR: {"dual": live}}))
    assert "stored learned record" not in said and "resumed" not in said
    d["one_sided_same_budget"]["from_learned_record"], d["resumed_at"] = True, [40, 1200]
    said = captions(page("dual", live_runs={PAIR: {"dual": live}}))
    assert "The dashed one-sided run is the stored learned record's" in said
    assert "resumed from its saved state at steps 40, 1,200;" in said
    assert "Started from" not in said
    d["start_element"] = {"file": "d1600.safetensors", "sha256": "0" * 64, "method": "dual", "model_a": PAIR[0],
                          "model_b": PAIR[1], "steps": 1600, "barrier": 0.1234}
    said = captions(page("dual", live_runs={PAIR: {"dual": live}}))
    assert ("Started from d1600.safetensors, the element a dual run of 1,600 steps saved (barrier 0.1234 "
            "nats/byte), not from weight matching") in said
    del d["start_element"]
    # a run given a time budget spent it on dual matching: no comparison, and the page says why
    del d["one_sided_same_budget"]
    d["one_sided_skipped"] = "the 900 s time budget went to the dual optimisation"
    at = page("dual", live_runs={PAIR: {"dual": live}})
    assert "No one-sided comparison: the 900 s time budget went to the dual optimisation." in captions(at)
    assert "Dual − one-sided" not in {m.label for m in at.metric}
    assert not [t for t in chart(at, "history_chart")["data"] if t.get("line", {}).get("dash") == "dash"]


def test_a_live_run_from_the_connectivity_page_is_offered_first(env):
    cached = cached_record(*PAIR, "weight", env)
    live = copy.deepcopy(cached)
    layers = live["alignment"]["element"]["layers"]
    layers[0]["head_perm"], layers[0]["kv_perm"] = [2, 3, 0, 1], [1, 0]  # a different, valid GQA permutation
    at = page("weight", live_runs={PAIR: {"weight": live}})
    open_tab(at, "One layer")
    assert at.radio(key="align_source").value == "live"
    assert list(chart(at, "head_cost")["data"][1]["x"]) == [2, 3, 0, 1]
    at.radio(key="align_source").set_value("cached").run()
    assert not at.exception
    assert list(chart(at, "head_cost")["data"][1]["x"]) == cached["alignment"]["element"]["layers"][0]["head_perm"]


def test_naive_says_no_class_was_used(env):
    rec = cached_record(*PAIR, "naive", env)
    at = page("naive")
    assert any("Classes used: none" in m.value for m in at.markdown)
    n = GQA.n_heads
    assert all(z_of(t) == alignment_figs.permutation_matrix(list(range(n))) for t in chart(at, "heads_overview")["data"])
    assert rec["alignment"]["element"]["residual"]["kind"] == "identity"
    with pytest.raises(KeyError):
        at.get_by_key("residual_map")  # nothing to draw for the identity
    assert any("matches nothing" in c.value for c in at.caption)
    open_tab(at, "One layer")
    assert z_of(chart(at, "head_perm")["data"][0]) == alignment_figs.permutation_matrix(list(range(n)))
    assert not any("predates the matching view" in c.value for c in at.caption)  # naive matched nothing
    assert any("matches nothing" in c.value for c in at.caption)


def test_a_method_without_a_record_says_how_to_get_one(env):
    at = page("activation")
    assert f"No record of {methods()['activation']}" in at.info[0].value
    assert not at.get("plotly_chart")


def test_a_corrupt_record_is_an_error_not_a_traceback(env, monkeypatch, tmp_path):
    broken = tmp_path / "store"
    shutil.copytree(env, broken)
    (broken / f"{PAIR[0]}__{PAIR[1]}__weight.json").write_text("{not json")
    monkeypatch.setenv("LMC_CACHE_DIR", str(broken))
    at = page("weight")
    assert "is not valid JSON" in at.error[0].value
    assert not at.get("plotly_chart")


def test_class_ablation_tab_draws_each_class_alone_and_all(env, monkeypatch, tmp_path):
    from engine.api import ablation_file
    from engine.models.io import write_json_atomic

    at = page("weight")
    open_tab(at, "Class ablation")
    assert any("No class ablation is stored" in c.value for c in at.caption)
    store_dir = tmp_path / "store"
    shutil.copytree(env, store_dir)
    monkeypatch.setenv("LMC_CACHE_DIR", str(store_dir))
    runs = [{"label": label, "classes": classes, "barrier": b, "eval_set": "austen/test, 256 tokens"}
            for label, classes, b in (("all", ["heads", "mlp"], 0.2), ("mlp", ["mlp"], 0.5),
                                      ("none", [], 1.5), ("heads", ["heads"], 1.2))]
    f = ablation_file(*PAIR)
    f.parent.mkdir()
    write_json_atomic(f, {"model_a": PAIR[0], "model_b": PAIR[1], "points": 11, "runs": runs})
    at = page("weight")
    open_tab(at, "Class ablation")
    bars = chart(at, "ablation_chart")["data"][0]
    assert list(bars["y"]) == ["none (naive)", "heads alone", "mlp alone", "all classes"]
    assert list(bars["x"]) == [1.5, 1.2, 0.5, 0.2]
    assert any("austen/test, 256 tokens, 11 points" in c.value for c in at.caption)


# ---------------------------------------------------------------------------------------------
# Where the barrier lives: the tiny zoo's cached records (run_pair writes their `attribution`)


def main_pane(at: AppTest) -> list:
    """The main pane's elements top to bottom, columns read left to right (blocks themselves left out)."""
    out = []

    def walk(node):
        if not getattr(node, "children", None) or node.type in ("tab_container", "expander"):
            out.append(node)
        for c in getattr(node, "children", {}).values():
            walk(c)

    walk(at.main)
    return out


def first_chart_comes_first(at: AppTest, chart_key: str) -> str:
    """Assert that under the page's head (title, caption, pair, description) come a sentence, then the chart
    `chart_key`, before any number, table, tab or expander; return the sentence."""
    kinds = [(n.type, getattr(n, "value", None) if n.type == "markdown" else None) for n in main_pane(at)]
    assert [k for k, _ in kinds[:6]] == ["title", "caption", "subheader", "caption", "markdown", "plotly_chart"], kinds
    assert chart_key in at.get("plotly_chart")[0].proto.id  # the figure asked for comes first
    later = [k for k, _ in kinds[6:]]
    for kind in ("metric", "tab_container", "expander"):
        assert kind in later  # all there, all after the chart
    return kinds[4][1]


def test_where_the_barrier_lives_is_drawn_first_from_the_records_attribution(tiny_env, downloads):
    _, root = tiny_env
    rec = cached_record(*tiny_zoo.CACHED_PAIRS[0], "weight", root)
    att = rec["attribution"]
    at = page("weight", pair=None)
    sentence = first_chart_comes_first(at, "attribution_blocks")  # above the fold: the numbers come after it
    # the sentence names the block whose whole excess is largest, with the record's midpoint barrier
    wholes = [b for b in att["blocks"] if b["part"] == "all"]
    top = max(wholes, key=lambda b: b["excess"])
    assert sentence == alignment_figs.attribution_sentence(rec)
    name = top["block"] if top["layer"] is not None else f"the {top['block']}"
    d = alignment_figs.decimals(top["excess"], att["midpoint_barrier"])
    assert sentence.startswith(f"Interpolated alone, {name} raises the loss most: by {top['excess']:.{d}f} nats/byte")
    assert f"against the {att['midpoint_barrier']:.{d}f} midpoint barrier that alignment left" in sentence
    # the bars are the record's excesses, block by block in path order, and the line its midpoint barrier
    fig = chart(at, "attribution_blocks")
    whole, attention, mlp, line = fig["data"]
    assert list(whole["y"]) == [b["excess"] for b in wholes]
    assert list(attention["y"]) == [b["excess"] for b in att["blocks"] if b["part"] == "attention"]
    assert list(mlp["y"]) == [b["excess"] for b in att["blocks"] if b["part"] == "mlp"]
    assert list(fig["layout"]["xaxis"]["ticktext"]) == ["embedding", "layer 0", "layer 1", "head"]
    assert list(line["y"]) == [att["midpoint_barrier"]] * 2
    # what each class buys, in reading order under the reader's names
    bars = chart(at, "attribution_classes")["data"][0]
    rise = {c["class"]: c["rise"] for c in att["classes"]}
    order = [c for c in alignment_figs.CLASS_ORDER if c in rise]
    assert list(bars["x"]) == [rise[c] for c in order] and len(order) == len(att["classes"]) > 1
    assert list(bars["y"]) == [alignment_figs.class_label(c, rec["alignment"]["classes"]) for c in order]
    assert "residual rotation" in bars["y"]
    # both join the page's figure export under their titles
    page_html = downloads["align_figures"][0].decode()
    assert "<h2>Where the barrier lives: each block alone</h2>" in page_html
    assert "<h2>What each symmetry class buys</h2>" in page_html


def test_naive_draws_the_blocks_and_says_why_there_are_no_classes(tiny_env):
    _, root = tiny_env
    rec = cached_record(*tiny_zoo.CACHED_PAIRS[0], "naive", root)
    at = page("naive", pair=None)
    assert list(chart(at, "attribution_blocks")["data"][0]["y"]) == \
        [b["excess"] for b in rec["attribution"]["blocks"] if b["part"] == "all"]
    with pytest.raises(KeyError):
        at.get_by_key("attribution_classes")
    assert any("naive interpolation uses no symmetry class" in c.value for c in at.caption)
    assert not any("without the" in m.value for m in at.markdown)


def test_a_record_from_before_the_attribution_says_how_to_get_it(tiny_env):
    _, root = tiny_env
    pair = tiny_zoo.CACHED_PAIRS[0]
    old = copy.deepcopy(cached_record(*pair, "weight", root))
    del old["attribution"]
    at = page("weight", live_runs={pair: {"weight": old}}, pair=None)
    assert at.radio(key="align_source").value == "live"
    (info,) = at.info
    assert "predates the barrier attribution" in info.value
    assert f"cache build --only {pair[0]} --methods weight --force" in info.value
    for key in ("attribution_blocks", "attribution_classes"):
        with pytest.raises(KeyError):
            at.get_by_key(key)
    # the worst-aligned layer still comes first, told from the matching cost, its chart under it
    cost = old["alignment"]["matching_cost"]
    layers = {p: v for p, v in cost["after"].items() if p.startswith("blocks.")}
    worst = max(layers, key=layers.get)
    md = [m.value for m in at.markdown]
    sentence = next(m for m in md if " is aligned worst: " in m)
    assert sentence == alignment_figs.matching_sentence(old, methods()["weight"])
    assert sentence.startswith(f"Layer {worst.split('.')[1]} is aligned worst: its weights stay {layers[worst]:.3f}")
    after = chart(at, "cost_chart")["data"][1]
    assert list(after["y"])[:len(layers)] == list(layers.values())
    assert at.get("plotly_chart")[0].proto.id.endswith("cost_chart")  # first, and once: not again in the tab
    assert chart(at, "heads_overview")  # the rest of the page as before
