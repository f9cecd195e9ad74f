"""Run options (engine.options): each method's typed, validated options, recorded as RunConfig's `extra`
pairs, so that every stored record's config reads back to itself, hash included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.align import METHODS, method_options
from engine.align.learned import Settings
from engine.align.options import DualOptions, LearnedOptions, WeightOptions
from engine.align.weight import WeightSettings
from engine.errors import LMCError
from engine.options import Options
from engine.pipeline import run_config
from engine.results import CACHE, RunConfig


def stored_configs() -> list[tuple[Path, dict]]:
    """Every record of the committed store holding a config: the pairs' records and the widen/ ones."""
    out = []
    for f in sorted(CACHE.glob("*__*__*.json")) + sorted((CACHE / "widen").glob("*__*__*.json")):
        rec = json.loads(f.read_text())
        out.append((f, rec))
    return out


def test_every_stored_record_config_reads_back_to_the_same_dict_and_hash():
    recs = stored_configs()
    assert len(recs) >= 40  # the 8 zoo pairs x 5 methods, and the widen records
    for f, rec in recs:
        cfg = run_config(rec["config"])
        assert json.dumps(cfg.to_dict()) == json.dumps(rec["config"]), f.name  # same keys, order and values
        assert cfg.hash() == rec["config_hash"], f.name


def test_options_record_as_text_pairs_in_declaration_order_and_hash_as_before():
    opts = LearnedOptions(patience=2, lambdas="fixed", time_budget_s=600)
    cfg = RunConfig("vit-learned-s0", "vit-learned-s1", "learned", steps=4, points=3, eval_items=64, device="cpu",
                    data_sha256="8d18975e181b9760afe33669d9c7210cf686f3bc4ce2d21632ac72e2d04e66f8", options=opts)
    assert cfg.to_dict()["extra"] == (("time_budget_s", "600.0"), ("lambdas", "fixed"), ("patience", "2"))
    assert list(cfg.to_dict())[-2:] == ["path", "extra"]
    assert cfg.hash() == "5db9f691435efde2"  # the hash `align --time-budget 600 --lambda-sampling fixed --patience 2` records
    assert RunConfig("a", "b").to_dict()["extra"] == () and RunConfig("a", "b").options == Options()
    assert run_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.hash() == RunConfig(**{**cfg.__dict__, "options": LearnedOptions(
        time_budget_s=600.0, lambdas="fixed", patience=2)}).hash()  # 600 and 600.0 seconds are one option


def test_each_method_declares_its_options_type():
    assert {m: e.options for m, e in METHODS.items()} == {
        "naive": Options, "weight": WeightOptions, "activation": Options, "learned": LearnedOptions,
        "dual": DualOptions}
    assert list(LearnedOptions.specs()) == ["time_budget_s", "lambdas", "patience", "lr_perm", "lr_map", "candidates",
                                            "keep_heads", "start", "batch"]
    assert list(DualOptions.specs()) == [*LearnedOptions.specs(), "skip_comparison"]
    assert LearnedOptions.specs()["patience"].flag == "--patience"


def test_options_turn_into_the_settings_their_aligner_reads():
    assert LearnedOptions().align_kwargs() == {} and WeightOptions().align_kwargs() == {}
    assert LearnedOptions(time_budget_s=30, lr_perm=0.1).align_kwargs() == {
        "time_budget_s": 30.0, "learned": Settings(lr_perm=0.1)}
    assert LearnedOptions(lr_map=0.0025).align_kwargs() == {"learned": Settings(lr_map=0.0025)}
    assert WeightOptions(head_cost="normalised", block_scale=True, stop_tol=1e-5).align_kwargs() == {
        "weight": WeightSettings(head_cost="normalised", block_scale=True, stop_tol=1e-5)}
    assert WeightOptions.from_pairs((("block_scale", "True"), ("mlp_score", "normalised"))) == WeightOptions(
        mlp_score="normalised", block_scale=True)


@pytest.mark.parametrize("method, given, message", [
    ("weight", {"patience": 2}, ("Option patience (--patience) sets learned and dual matching; method weight does not "
                                 "use it.")),
    ("naive", {"head_cost": "squared"}, "Option head_cost (--head-cost) sets weight matching; method naive does not"),
    ("activation", {"speed": 1}, "Option speed is not an option of any method; activation takes none."),
    ("learned", {"patience": 0}, "Option patience (--patience) must be a whole number from 1 to 100,000, not 0."),
    ("learned", {"patience": True}, "Option patience (--patience) must be a whole number"),
    ("dual", {"time_budget_s": float("inf")}, ("Option time_budget_s (--time-budget) must be a positive number of "
                                               "seconds, not inf.")),
    ("learned", {"lambdas": "wide"}, ("Option lambdas (--lambda-sampling) must be one of narrow, uniform, fixed, "
                                      "adaptive, not 'wide'.")),
    ("weight", {"stop_tol": 1.0}, "Option stop_tol (--stop-tol) must be a number between 0 and 1, not 1.0."),
    ("weight", {"block_scale": "yes"}, "Option block_scale (--block-scale) must be True or False, not 'yes'."),
    ("best", {}, "Method 'best' is not available; choose one of: naive, weight"),
])
def test_a_bad_option_is_one_sentence(method, given, message):
    with pytest.raises(LMCError) as e:
        method_options(method, given)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_record_config_that_cannot_be_read_back_is_refused():
    good = RunConfig("a", "b", "learned", options=LearnedOptions(patience=3)).to_dict()
    for bad, message in ((good | {"extra": [["patience", "three"]]}, "Run option patience is 'three'"),
                         (good | {"extra": [["speed", "1"]]}, "Run option 'speed' is not known"),
                         (good | {"colour": "red"}, "Run config field 'colour' is not known"),
                         (good | {"method": "best"}, "Method 'best' is not available"),
                         (good | {"points": 1}, "Run config: points must be an integer from 2")):
        with pytest.raises(LMCError, match=message):
            run_config(bad)
    with pytest.raises(LMCError, match="options must be a method's options"):
        RunConfig("a", "b", options=(("patience", "2"),))
