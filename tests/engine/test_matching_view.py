"""The record's view of what a matching saw (engine.align.run.matching_view): each layer's head
cost matrix, on which the chosen permutation is the cheapest, and the matched neurons' similarities."""

from itertools import permutations

import torch

from engine.align.pair import model_for, prepare_pair
from engine.align.run import QUANTILES, align, alignment_record
from engine.classes import default_classes
from engine.models import canonical
from engine.models.reference import RefConfig, build
from engine.spec import build_spec
from engine.symmetry import apply, sample

TINY = RefConfig(n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, pe="none")


def test_the_chosen_head_permutation_is_the_cheapest_on_the_recorded_cost():
    a, b = build(TINY, seed=0, dtype=torch.float64), build(TINY, seed=1, dtype=torch.float64)
    rec = alignment_record(align(a, b, "weight", classes=("heads", "mlp")))  # no residual map: one sweep
    for layer in rec["element"]["layers"]:
        C, perm = layer["head_cost"], layer["head_perm"]
        assert len(C) == len(C[0]) == TINY.n_heads
        cost = {p: sum(C[i][p[i]] for i in range(len(p))) for p in permutations(range(TINY.n_heads))}
        assert cost[tuple(perm)] == min(cost.values())
        assert len(set(cost.values())) > 1  # unrelated models: the choice is not a tie
        sim = layer["mlp_similarity"]
        assert len(sim["matched"]) == len(sim["same_index"]) == QUANTILES
        assert sim["matched"] == sorted(sim["matched"]) and -1 <= sim["matched"][0] <= sim["matched"][-1] <= 1
        # matching pairs neurons by their weights: the matched ones are more alike than same-index ones
        assert sum(sim["matched"]) > sum(sim["same_index"])


def test_a_planted_element_is_found_at_zero_cost_and_identical_neurons():
    a = build(TINY, seed=0, dtype=torch.float64)
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    pair = prepare_pair(a, a, kinds)
    b = model_for(pair.model_a, pair.arch, apply(pair.arch, sample(pair.arch, kinds, seed=3), pair.params_a))
    rec = alignment_record(align(a, b, "weight"))
    for layer in rec["element"]["layers"]:
        C, perm = layer["head_cost"], layer["head_perm"]
        chosen = [C[i][perm[i]] for i in range(TINY.n_heads)]
        others = [C[i][j] for i in range(TINY.n_heads) for j in range(TINY.n_heads) if j != perm[i]]
        assert max(abs(c) for c in chosen) < 1e-8 * min(others)
        assert min(layer["mlp_similarity"]["matched"]) > 1 - 1e-9
        assert min(layer["mlp_similarity"]["same_index"]) < 0.9  # B's neurons were shuffled


def test_naive_records_carry_no_view():
    a, b = build(TINY, seed=0), build(TINY, seed=1)
    rec = alignment_record(align(a, b, "naive"))
    assert all("head_cost" not in layer for layer in rec["element"]["layers"])
