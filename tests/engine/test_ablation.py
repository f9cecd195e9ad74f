"""`cache build --ablation`: weight matching with each symmetry class alone and all together, beside
naive, per zoo pair, into cached_results/ablation/; resumable run by run."""

import pytest
from tiny_zoo import CACHED_PAIRS

from engine import api, builders

PAIR = CACHED_PAIRS[0]


@pytest.fixture(autouse=True)
def few_eval_items(monkeypatch):
    monkeypatch.setattr(builders, "ABLATION_EVAL_ITEMS", 256)


def test_each_class_alone_and_all_together_then_resumed_without_work(tiny_dirs, monkeypatch):
    logged = []
    (abl,) = api.build_ablation(only=[PAIR], log=logged.append)
    labels = [r["label"] for r in abl["runs"]]
    full = next(r for r in abl["runs"] if r["label"] == "all")
    assert labels == ["none", "all", *full["classes"]] and "heads" in labels and "residual_orth" in labels
    for r in abl["runs"]:
        assert len(r["lambdas"]) == len(r["loss"]) == api.ABLATION_POINTS
        assert r["classes"] == ([] if r["label"] in ("none",) else full["classes"] if r["label"] == "all"
                                else [r["label"]])
        assert "256 tokens" in r["eval_set"]
    assert api.ablation_record(*PAIR) == abl
    assert (tiny_dirs / "store" / "ablation" / f"{PAIR[0]}__{PAIR[1]}.json").is_file()
    assert len(logged) == len(labels)

    def no_work(*a, **k):
        raise AssertionError("an up-to-date run was recomputed")

    monkeypatch.setattr(builders, "run_pair", no_work)
    assert api.build_ablation(only=[PAIR]) == [abl]


def test_a_pair_outside_the_zoo_is_refused(tiny_dirs):
    with pytest.raises(api.LMCError, match="is not a pair of the zoo"):
        api.build_ablation(only=[("lm-none-s0", "vit-learned-s1")])
