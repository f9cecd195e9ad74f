"""Learned and dual matching in bounded memory, and what makes them converge: the MLP latent on a
candidate graph (a real permutation, the exact restricted optimum, a planted answer recovered, the
straight-through gradient at the candidate entries), the warm-up + cosine schedule, the lam sampling
modes, early stopping, and the curve the record keeps. Tiny float64 models, one-sided runs from a
fixed start (no weight matching), so every test is fast."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from ref_models import rope_pair
from scipy.optimize import linear_sum_assignment

from engine.align import learned
from engine.align.context import AlignContext
from engine.align.forward import functional_logits, task_loss
from engine.align.learned import (
    LAMBDAS,
    Settings,
    Transform,
    act_ste,
    dense_latent,
    lr_factor,
    mlp_candidates,
    optimise,
    sample_lambda,
    sparse_assignment,
)
from engine.errors import LMCError
from engine.evaluate import lm_eval_set
from engine.models.reference import RefConfig, build
from engine.symmetry import GroupElement, LayerElement, apply, identity, sample

F64 = torch.float64


@pytest.fixture(autouse=True)
def small_validation(monkeypatch):
    monkeypatch.setattr(learned, "VAL_ITEMS", {"lm": 256})  # the validation check's size is not under test


def random_graph(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cand [n, k]: a random permutation in column 0, then k - 1 other distinct columns per row."""
    first = torch.randperm(n, generator=gen)
    rest = torch.stack([torch.randperm(n, generator=gen) for _ in range(n)])  # [n, n]
    cand = torch.empty(n, k, dtype=torch.long)
    for i in range(n):
        cand[i, 0] = first[i]
        cand[i, 1:] = rest[i][rest[i] != first[i]][:k - 1]
    return cand, torch.randn(n, k, generator=gen, dtype=F64)


# ---------------------------------------------------------------------------------------------
# The candidate graph


def test_sparse_assignment_is_a_permutation_and_the_optimum_on_its_graph():
    gen = torch.Generator().manual_seed(0)
    for n, k in ((7, 3), (20, 4), (12, 12)):
        for _ in range(10):
            cand, values = random_graph(n, k, gen)
            perm = sparse_assignment(values, cand)
            assert sorted(perm.tolist()) == list(range(n))  # a real permutation
            assert bool((cand == perm[:, None]).any(1).all())  # only edges of the graph
            # the restricted optimum, by the dense Hungarian with non-edges forbidden
            dense = np.full((n, n), -1e9)
            for i in range(n):
                dense[i, cand[i].numpy()] = values[i].numpy()
            r, c = linear_sum_assignment(dense, maximize=True)
            best = float(dense[r, c].sum())
            got = float(dense[np.arange(n), perm.numpy()].sum())
            assert got == pytest.approx(best, rel=1e-12, abs=1e-12)
    # a graph without a perfect matching (nobody may take column 2) is refused in one sentence
    with pytest.raises(LMCError, match="no perfect matching"):
        sparse_assignment(torch.ones(3, 2, dtype=F64), torch.tensor([[0, 1], [0, 1], [1, 0]]))


def test_candidates_recover_a_planted_mlp_permutation_from_the_wrong_start():
    """B = A with its MLP neurons permuted; from the identity start the planted partner is among every
    neuron's candidates, the sparse matching of the candidate scores is the planted permutation, and the
    element it gives moves B exactly onto A (float64)."""
    pair, _ = rope_pair(seed_b=0)
    arch, spec = pair.arch, pair.spec
    gen = torch.Generator().manual_seed(3)
    planted = [torch.randperm(arch.d_mlp, generator=gen) for _ in range(arch.n_layers)]
    start = identity(arch)
    g = GroupElement(tuple(LayerElement(el.head_perm, el.qk, el.vo, p, el.mlp_scale)
                           for el, p in zip(start.layers, planted)), start.residual)
    pb = apply(arch, g, pair.params_a)  # B's neuron i is A's neuron planted[i]
    inv = [torch.argsort(p) for p in planted]  # B's neuron inv[i] is A's neuron i: the answer
    cands = mlp_candidates(spec, pair.params_a, pb, start, k=4)
    assert [c.shape for c in cands] == [(arch.d_mlp, 4)] * arch.n_layers
    for cand, want in zip(cands, inv):
        assert torch.equal(cand[:, 0], torch.arange(arch.d_mlp))  # the start's partner comes first
        assert bool((cand == want[:, None]).any(1).all())
    T = Transform(arch, spec, frozenset({"mlp"}), start, F64, cands)
    with torch.no_grad():  # latents = the weight-matching scores at the candidate entries
        for layer, (Z, cand) in enumerate(zip(T.Z_mlp, cands)):
            feats_a = [pair.params_a[k].movedim(ax, 0).reshape(arch.d_mlp, -1)
                       for k, ax, a in spec.axes_of(f"blocks.{layer}.mlp") if a.role == "perm"]
            feats_b = [pb[k].movedim(ax, 0).reshape(arch.d_mlp, -1)
                       for k, ax, a in spec.axes_of(f"blocks.{layer}.mlp") if a.role == "perm"]
            S = sum(fa @ fb.T for fa, fb in zip(feats_a, feats_b))  # [m, m]
            Z.copy_(S.gather(1, cand))
    counts = T.solve()
    assert counts["flips_mlp"] > 0
    assert all(torch.equal(p, w) for p, w in zip(T.mlp_perms, inv))
    moved = apply(arch, T.element(), pb)  # strict: a member of the group
    assert max(float((moved[k] - pair.params_a[k]).abs().max()) for k in moved) < 1e-12
    wrong = apply(arch, start, pb)  # the converse: the start leaves B where it was
    assert max(float((wrong[k] - pair.params_a[k]).abs().max()) for k in wrong) > 1e-2


def test_the_sparse_gradient_is_the_dense_straight_through_gradient_at_the_candidates():
    pair, kinds = rope_pair()
    arch, spec = pair.arch, pair.spec
    g = sample(arch, kinds, seed=4)
    cands = mlp_candidates(spec, pair.params_a, pair.params_b, g, k=5)
    sparse, full = Transform(arch, spec, kinds, g, F64, cands), Transform(arch, spec, kinds, g, F64)
    es = lm_eval_set("val", 8, n_ctx=16)
    grads = []
    for T in (sparse, full):
        moved = act_ste(spec, T.maps(), pair.params_b)
        mid = {k: 0.5 * pair.params_a[k] + 0.5 * moved[k] for k in moved}
        task_loss(functional_logits(pair.model_a, mid, es.inputs[:4]), es.targets[:4]).backward()
        grads.append([Z.grad for Z in T.Z_mlp])
    for gs, gf, cand in zip(*grads, cands):
        assert gs.shape == cand.shape and gf.shape == (arch.d_mlp, arch.d_mlp)
        assert gf.abs().max() > 0
        assert torch.allclose(gs, gf.gather(1, cand), rtol=1e-10, atol=1e-12 * float(gf.abs().max()))
        assert torch.equal(dense_latent(gs, cand).gather(1, cand), gs)


def test_candidates_must_hold_the_start():
    pair, kinds = rope_pair()
    g = identity(pair.arch)
    cands = mlp_candidates(pair.spec, pair.params_a, pair.params_b, g, k=3)
    bad = [c.clone() for c in cands]
    bad[0][0] = torch.tensor([5, 6, 7])  # neuron 0's row lacks its starting partner, neuron 0
    with pytest.raises(LMCError, match="starting partner"):
        Transform(pair.arch, pair.spec, kinds, g, F64, bad)


# ---------------------------------------------------------------------------------------------
# Schedule, lam sampling, settings


def test_warmup_then_cosine():
    steps, warm = 100, 0.1
    f = [lr_factor(s, steps, warm) for s in range(1, steps + 1)]
    assert f[:10] == pytest.approx([s / 10 for s in range(1, 11)], rel=1e-15)  # linear warm-up to the peak
    assert all(a > b for a, b in itertools.pairwise(f[9:]))  # strictly decreasing after the peak
    assert 0 < f[-1] < 1e-3 and f[54] == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 91)), rel=1e-15)
    assert lr_factor(1, 1, 0.0) == 1.0 and lr_factor(3, 5, 0.0) < 1.0  # warm-up of at least one step


def test_lambda_sampling_modes():
    for mode, (lo, hi) in LAMBDAS.items():
        rng = random.Random(0)
        xs = [sample_lambda(rng, mode) for _ in range(400)]
        assert all(lo <= x <= hi for x in xs)
        if mode == "fixed":
            assert set(xs) == {0.5}
        else:  # the band is really covered
            assert min(xs) < lo + 0.05 * (hi - lo) and max(xs) > hi - 0.05 * (hi - lo)
    assert LAMBDAS["narrow"] == (0.4, 0.6) and LAMBDAS["uniform"] == (0.0, 1.0)
    rng = random.Random(1)  # adaptive: half uniform, half within the band around the worst lam
    xs = [sample_lambda(rng, "adaptive", worst=0.9) for _ in range(2000)]
    near = sum(abs(x - 0.9) <= learned.ADAPTIVE_BAND for x in xs) / len(xs)
    assert 0.5 + 0.5 * 0.2 - 0.05 < near < 0.5 + 0.5 * 0.2 + 0.05  # 0.6: the band's own draws and a fifth of U(0, 1)
    assert max(xs) <= 1.0 and min(xs) < 0.05
    for bad in ({"lambdas": "wide"}, {"lr_perm": -1.0}, {"warmup": 1.0}, {"patience": 0}, {"candidates": 0},
                {"eval_every": 2.5}):
        with pytest.raises(LMCError):
            Settings(**bad)


# ---------------------------------------------------------------------------------------------
# The optimisation: early stopping, the record


def test_patience_stops_a_run_that_cannot_improve_once_its_step_size_has_halved():
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    frozen = Settings(lr_perm=0.0, lr_map=0.0, patience=2, eval_every=1)  # nothing moves: no improvement
    res = optimise(AlignContext(pair, kinds, steps=10), g0, dual=False, steps=10, settings=frozen)
    # warm-up 1 step, then the cosine falls to half its peak at step 6: checks 6 and 7 count, 7 stops it
    assert [s for s in range(1, 11) if lr_factor(s, 10, frozen.warmup) <= 0.5][:2] == [6, 7]
    assert res["stopped"] == "patience" and res["steps_done"] == 7 and res["best_step"] == 0
    assert res["history"]["step"] == list(range(8)) and res["resolves"]["flips_mlp"] == [0] * 7
    free = Settings(lr_perm=0.0, lr_map=0.0, eval_every=1, patience=None)  # without patience: the whole budget
    res = optimise(AlignContext(pair, kinds, steps=4), g0, dual=False, steps=4, settings=free)
    assert res["stopped"] == "steps" and res["steps_done"] == 4
    assert Settings().patience == learned.PATIENCE == 8 and Settings().min_improvement == learned.MIN_IMPROVEMENT


def test_the_record_keeps_the_curve_the_settings_and_the_flips():
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    st = Settings(lr_perm=2.0, lambdas="uniform", eval_every=2, candidates=4)  # big steps: permutations flip
    seen = []
    res = optimise(AlignContext(pair, kinds, steps=6), g0, dual=False, steps=6, settings=st,
                   on_check=lambda step, g_a, g_b: seen.append((step, g_a, g_b)))
    curve, hist, rs = res["curve"], res["history"], res["resolves"]
    assert curve["step"] == list(range(1, 7)) and len(curve["train_loss"]) == 6
    assert curve["lr_factor"] == [lr_factor(s, 6, st.warmup) for s in range(1, 7)]
    assert all(0.0 <= lam <= 1.0 for lam in curve["lambda"]) and len(set(curve["lambda"])) == 6
    assert hist["step"] == [0, 2, 4, 6] and all(math.isfinite(v) for v in hist["val_midpoint_loss"])
    assert [s for s, _, _ in seen] == hist["step"] and all(g_a is None for _, g_a, _ in seen)
    assert rs["step"] == sorted(rs["step"]) and sum(rs["flips_mlp"]) + sum(rs["flips_heads"]) > 0
    assert sum(rs["hungarian"]) == res["permutation_solves"]["hungarian"]
    assert res["settings"]["lambdas"] == "uniform" and res["settings"]["candidates"] == 4
    assert res["memory"]["latent_bytes"] > 0 and res["memory"]["candidate_bytes"] == 2 * pair.arch.d_mlp * 4 * 8
    kept = res["g_b"]  # the best element is a real group element
    for el in kept.layers:
        assert sorted(el.mlp_perm.tolist()) == list(range(pair.arch.d_mlp))
    apply(pair.arch, kept, pair.params_b)  # strict membership check


def test_an_lm_run_keeps_its_start_s_mlp_permutation_unless_it_names_more_candidates():
    """learned.DEFAULT_CANDIDATES: one candidate per MLP neuron on LMs (the start's partner), so even steps
    that flip every other permutation leave the MLP's; a run naming more learns it."""
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    assert learned.DEFAULT_CANDIDATES == {"lm": 1, "vit": learned.CANDIDATES} and Settings().candidates is None
    big = Settings(lr_perm=2.0, lambdas="uniform", eval_every=2)
    res = optimise(AlignContext(pair, kinds, steps=6), g0, dual=True, steps=6, settings=big)
    assert res["settings"]["candidates"] == 1 and sum(res["resolves"]["flips_mlp"]) == 0
    assert res["memory"]["candidate_bytes"] == 2 * 2 * pair.arch.d_mlp * 1 * 8  # two sides, two layers, k = 1
    for side in (res["g_a"], res["g_b"]):
        assert all(torch.equal(el.mlp_perm, torch.arange(pair.arch.d_mlp)) for el in side.layers)
    res = optimise(AlignContext(pair, kinds, steps=6), g0, dual=True, steps=6, settings=replace(big, candidates=4))
    assert sum(res["resolves"]["flips_mlp"]) > 0


def test_keep_heads_holds_the_start_s_head_permutation_through_steps_that_flip_it():
    """Settings.keep_heads: the start's head permutation is a constant of both sides (no latent, never
    re-solved) while the other classes still learn; the same steps without it reshuffle heads."""
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    big = Settings(lr_perm=2.0, lr_map=0.05, lambdas="uniform", eval_every=2, patience=None)
    free = optimise(AlignContext(pair, kinds, steps=6), g0, dual=True, steps=6, settings=big)
    assert sum(free["resolves"]["flips_heads"]) > 0
    kept = optimise(AlignContext(pair, kinds, steps=6), g0, dual=True, steps=6, settings=replace(big, keep_heads=True))
    assert sum(kept["resolves"]["flips_heads"]) == 0 and kept["settings"]["keep_heads"] is True
    assert kept["memory"]["latent_bytes"] < free["memory"]["latent_bytes"]
    for side in (kept["g_a"], kept["g_b"]):
        assert all(torch.equal(el.head_perm, torch.arange(pair.arch.n_heads)) for el in side.layers)
    assert any(not torch.allclose(el.vo, torch.eye(pair.arch.d_head, dtype=el.vo.dtype)) for el in kept["g_b"].layers)
    with pytest.raises(LMCError, match="keep_heads"):
        Settings(keep_heads=1)


def test_a_run_without_a_sampling_mode_takes_its_task_s_and_records_it():
    pair, kinds = rope_pair()
    assert Settings().lambdas is None and learned.DEFAULT_LAMBDAS == {"lm": "narrow", "vit": "adaptive"}
    res = optimise(AlignContext(pair, kinds, steps=3), identity(pair.arch), dual=False, steps=3,
                   settings=Settings(eval_every=1))
    assert res["settings"]["lambdas"] == "narrow" and all(0.4 <= lam <= 0.6 for lam in res["curve"]["lambda"])
    res = optimise(AlignContext(pair, kinds, steps=3), identity(pair.arch), dual=False, steps=3,
                   settings=Settings(eval_every=1, lambdas="fixed"))
    assert res["settings"]["lambdas"] == "fixed"


def test_an_lm_path_without_a_residual_map_samples_lambda_adaptively():
    """learned.default_lambdas: an LM aligned with a residual map samples U(0.4, 0.6), one aligned without
    (the sinusoidal pair's default classes) adaptively, as ViTs do; a run names what it sampled."""
    from engine.classes import RESIDUAL

    assert learned.default_lambdas("lm", {"heads", "mlp", "residual_orth"}) == "narrow"
    assert learned.default_lambdas("lm", {"heads", "mlp", "residual_perm"}) == "narrow"
    assert learned.default_lambdas("lm", {"heads", "mlp", "qk", "vo"}) == "adaptive"
    assert learned.default_lambdas("vit", {"heads", "residual_orth"}) == "adaptive"
    pair, kinds = rope_pair()
    assert set(RESIDUAL) & kinds
    without = kinds - set(RESIDUAL)
    res = optimise(AlignContext(pair, without, steps=12), identity(pair.arch), dual=False, steps=12,
                   settings=Settings(eval_every=4))
    assert res["settings"]["lambdas"] == "adaptive"
    assert any(not 0.4 <= lam <= 0.6 for lam in res["curve"]["lambda"])  # narrow never leaves [0.4, 0.6]


def test_a_record_s_config_names_the_sampling_when_it_is_not_its_task_s():
    """pipeline.final_config: the zoo's sinusoidal LM pair (no residual map by default) and any LM run whose
    classes leave the residual map out record `adaptive`, so their hash differs from a record of the task's
    narrow sampling; every other run's config is as before (lambdas unnamed)."""
    from engine.align import method_options
    from engine.pipeline import final_config
    from engine.results import RunConfig
    from engine.zoo import ENTRIES

    def lam(a: str, method: str = "dual", classes: tuple[str, ...] = ()) -> str | None:
        cfg = RunConfig(a, a.replace("-s0", "-s1"), method, classes=classes)
        return final_config(cfg, ENTRIES[a].config().arch()).options.lambdas

    assert lam("lm-sinusoidal-s0") == "adaptive" and lam("lm-sinusoidal-s0", "learned") == "adaptive"
    assert lam("lm-learned-s0") is None and lam("lm-rope-s0") is None and lam("vit-sinusoidal-s0") is None
    assert lam("lm-learned-s0", classes=("heads", "mlp", "qk", "vo")) == "adaptive"
    assert lam("lm-learned-s0", classes=("heads", "mlp", "residual_orth")) is None
    named = RunConfig("lm-learned-s0", "lm-learned-s1", "dual", classes=("heads", "mlp", "qk", "vo"))
    arch = ENTRIES["lm-learned-s0"].config().arch()
    explicit = replace(named, options=method_options("dual", {"lambdas": "adaptive"}))
    assert final_config(named, arch).hash() == final_config(explicit, arch).hash()


def test_the_kept_element_has_the_lowest_validation_barrier_on_the_path():
    """Validation measures the path at VAL_LAMBDAS; the kept element is the check with the smallest
    largest excess over the chord, and the history says where each check's worst point lay."""
    pair, kinds = rope_pair()
    st = Settings(lr_perm=2.0, lambdas="adaptive", eval_every=1, patience=None)
    res = optimise(AlignContext(pair, kinds, steps=5), identity(pair.arch), dual=False, steps=5, settings=st)
    hist = res["history"]
    assert hist["step"] == list(range(6)) and all(lam in learned.VAL_LAMBDAS for lam in hist["val_worst_lambda"])
    i = min(range(6), key=hist["val_barrier"].__getitem__)
    assert res["best_step"] == hist["step"][i] and res["best_val_barrier"] == hist["val_barrier"][i]
    assert res["best_val_midpoint_loss"] == hist["val_midpoint_loss"][i]
    # the barrier is measured against the chord: recompute it for the kept element
    xv, yv = learned.val_batch(pair.arch, learned.VAL_ITEMS["lm"])
    tw = learned.twin(pair.model_a)
    moved = apply(pair.arch, res["g_b"], pair.params_b)

    def loss(p):
        return float(task_loss(functional_logits(tw, p, xv), yv))

    ends = loss(pair.params_a), loss(moved)
    ex = [loss({k: (1 - t) * pair.params_a[k] + t * moved[k] for k in moved}) - ((1 - t) * ends[0] + t * ends[1])
          for t in learned.VAL_LAMBDAS]
    assert max(ex) == pytest.approx(res["best_val_barrier"], rel=1e-9, abs=1e-12)


def test_dual_reads_its_settings_from_the_context():
    from engine.align.dual import align_dual

    pair, kinds = rope_pair()
    st = Settings(lambdas="fixed", candidates=3)
    info = align_dual(AlignContext(pair, kinds, steps=2, compare_one_sided=False, learned=st)).info
    assert info["settings"]["lambdas"] == "fixed" and info["curve"]["lambda"] == [0.5, 0.5]
    assert info["memory"]["candidate_bytes"] == 2 * 2 * pair.arch.d_mlp * 3 * 8  # two sides
    assert info["identity"]["holds"]
    assert learned.RECORD[-3:] == ("curve", "resolves", "settings")


# ---------------------------------------------------------------------------------------------
# The options from the command line


def test_run_options_parse_and_refuse():
    from engine.align.options import LearnedOptions

    assert LearnedOptions.from_pairs(()).align_kwargs() == {}
    got = LearnedOptions.from_pairs((("time_budget_s", "30"), ("lambdas", "uniform"), ("patience", "3")))
    assert got.align_kwargs() == {"time_budget_s": 30.0, "learned": Settings(lambdas="uniform", patience=3)}
    assert LearnedOptions.from_pairs((("start", "activation"),)).align_kwargs() == {
        "learned": Settings(start="activation")}
    for bad in ((("time_budget_s", "-1"),), (("patience", "x"),), (("lambdas", "wide"),), (("speed", "1"),),
                (("start", "naive"),)):
        with pytest.raises(LMCError):
            LearnedOptions.from_pairs(bad)


def test_cli_flags_reach_the_record(tmp_path, capsys):
    import json

    from engine.cli import main
    from engine.models import save_model

    cfg = RefConfig(task="lm", n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, pe="rope")
    for s in (0, 1):
        save_model(build(cfg, seed=s), tmp_path / f"m{s}")
    out = tmp_path / "r.json"
    args = ["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--points", "3", "--eval-items", "256",
            "--steps", "3", "--out", str(out)]
    assert main(args + ["--method", "learned", "--lambda-sampling", "fixed", "--patience", "2",
                        "--time-budget", "600", "--start", "activation", "--candidates", "3"]) == 0
    rec = json.loads(out.read_text())
    d = rec["alignment"]["diagnostics"]
    assert d["settings"]["lambdas"] == "fixed" and d["settings"]["patience"] == 2 and d["time_budget_s"] == 600.0
    assert d["settings"]["start"] == "activation" and d["settings"]["candidates"] == 3
    assert d["curve"]["lambda"] == [0.5] * d["steps_done"]
    assert dict(map(tuple, rec["config"]["extra"])) == {"time_budget_s": "600.0", "lambdas": "fixed", "patience": "2",
                                                         "candidates": "3", "start": "activation"}
    assert main(args + ["--method", "dual"]) == 0
    rec = json.loads(out.read_text())  # no --candidates: the LM default, named in the config and the settings
    assert dict(map(tuple, rec["config"]["extra"])) == {"candidates": "1"}
    assert rec["alignment"]["diagnostics"]["settings"]["candidates"] == 1
    capsys.readouterr()
    assert main(args[:-4] + ["--out", str(out), "--method", "weight", "--patience", "2"]) == 2  # no --steps
    assert "--patience" in capsys.readouterr().err


@pytest.mark.parametrize("start", ["weight", "activation"])
def test_the_start_is_that_aligner_s_element(start):
    from engine.align.activation import ACT_BATCH, activation_match
    from engine.align.batches import train_batches
    from engine.align.learned import starting_point
    from engine.align.weight import weight_match

    pair, kinds = rope_pair()
    ctx = AlignContext(pair, kinds, seed=3, learned=Settings(start=start))
    s = starting_point(ctx)
    assert s.g_a is None and s.file is None  # an aligner's start: A at the identity, no file to name
    got = s.g_b
    if start == "weight":
        want = weight_match(pair, kinds)[0]
    else:
        want = activation_match(pair, kinds, next(train_batches(pair.arch, ACT_BATCH["lm"], 3))[0])[0]
    for el_got, el_want in zip(got.layers, want.layers):
        assert torch.equal(el_got.mlp_perm, el_want.mlp_perm) and torch.equal(el_got.head_perm, el_want.head_perm)
        assert torch.allclose(el_got.qk, el_want.qk, rtol=0, atol=1e-12)
    assert torch.allclose(got.residual, want.residual, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Budgets in steps and seconds


def test_only_a_time_budget_lifts_the_step_default():
    from engine.align.learned import step_budget
    from engine.results import MAX_STEPS

    assert step_budget(0, None, 100) == 100  # nothing asked: the method's default
    assert step_budget(0, 30.0, 100) == MAX_STEPS  # only a time budget: the clock ends the run
    assert step_budget(50, 30.0, 100) == 50  # both: whichever runs out first
    assert step_budget(0, 30.0, 0) == 0  # a method without steps has none, whatever the budget


def test_the_schedule_follows_the_budget_that_runs_out_first():
    from engine.align.learned import budget_fraction, fraction_factor

    assert budget_fraction(10, 100, 5.0, None) == 0.1
    assert budget_fraction(10, 100, 5.0, 10.0) == 0.5  # the clock is ahead of the steps
    assert budget_fraction(90, 100, 5.0, 10.0) == 0.9
    assert fraction_factor(0.05, 0.1) == pytest.approx(0.5)  # half way up the warm-up
    assert fraction_factor(0.1, 0.1) == 1.0
    assert fraction_factor(0.55, 0.1) == pytest.approx(0.5)  # half way down the cosine
    assert fraction_factor(1.0, 0.1) == 0.0 and fraction_factor(2.0, 0.1) == 0.0
    # the step schedule is the same curve sampled at its steps: warm-up and decay land where the fraction says
    f = [fraction_factor(s / 100, 0.1) for s in range(1, 101)]
    assert f[:10] == pytest.approx([lr_factor(s, 100, 0.1) for s in range(1, 11)], rel=1e-12)
    assert all(a > b for a, b in itertools.pairwise(f[9:]))


def test_a_run_given_only_seconds_uses_them_and_decays_its_step_size_on_the_clock(monkeypatch):
    from engine.results import MAX_STEPS

    clock = [0.0]

    def tick():  # a fake clock: every call to it is a second later, whatever the machine does
        def now():
            clock[0] += 1.0
            return clock[0]
        return now

    monkeypatch.setattr(learned, "tick", tick)
    pair, kinds = rope_pair()
    res = optimise(AlignContext(pair, kinds, steps=MAX_STEPS), identity(pair.arch), dual=False, steps=MAX_STEPS,
                   time_budget_s=60.0, settings=Settings(lr_perm=0.0))
    curve = res["curve"]
    assert res["stopped"] == "time_budget" and 5 < res["steps_done"] < 60  # the clock ended it, not the steps
    f = curve["lr_factor"]
    assert max(f) > 0.9 and f[-1] < 0.1  # warmed up, then decayed to near zero by the end of the budget
    peak = f.index(max(f))
    assert all(a >= b for a, b in itertools.pairwise(f[peak:]))
    assert len(res["history"]["step"]) >= 8  # checks at every tenth of the budget, not every MAX_STEPS // 10 steps


def test_the_batch_setting_sizes_every_training_batch_and_is_recorded(monkeypatch):
    pair, kinds = rope_pair()
    sizes = []
    real = learned.train_batches

    def spy(arch, batch, seed):
        sizes.append(batch)
        return real(arch, batch, seed)

    monkeypatch.setattr(learned, "train_batches", spy)
    res = optimise(AlignContext(pair, kinds, steps=2), identity(pair.arch), dual=False, steps=2,
                   settings=Settings(eval_every=1, batch=3))
    assert sizes == [3] and res["settings"]["batch"] == 3
    optimise(AlignContext(pair, kinds, steps=1), identity(pair.arch), dual=False, steps=1, settings=Settings(eval_every=1))
    assert AlignContext(pair, kinds, steps=1).batch == 16 and sizes == [3, 16]  # none given: the context's
    with pytest.raises(LMCError, match="batch must be a positive integer"):
        Settings(batch=0)
