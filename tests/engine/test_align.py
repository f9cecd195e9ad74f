"""Aligners (docs/MATH.md section 4): planted solutions per family, the exactness guard, class ablation,
learned / dual against weight matching on briefly trained models, the dual identity, the CLI.

Tiny float64 models (2 layers, D 32, 4 heads; tests/engine/ref_models.py) unless a test trains; nothing is
downloaded.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import pytest
import torch
from ref_models import CASES, byte_tiny, make_case, planted, randomise_norms

from engine.align import METHODS
from engine.align.dual import dual_identity
from engine.align.forward import functional_logits, task_loss
from engine.align.learned import Transform, act_ste, dense_latent
from engine.align.pair import prepare_pair
from engine.align.run import align, endpoint_check
from engine.align.solvers import (
    assignment,
    fit_gl,
    fit_rope,
    fit_scale,
    gqa_assignment,
    perm_matrix,
    procrustes,
    residual_perm_of,
    rope_scalars,
)
from engine.classes import default_classes, resolve_classes
from engine.cli import main
from engine.errors import ExactnessError, LMCError
from engine.evaluate import eval_set_for, evaluate, lm_eval_set
from engine.interpolate import interpolate
from engine.models import canonical, load_model, save_model
from engine.models.reference import RefConfig, build
from engine.spec import build_spec
from engine.symmetry import act, apply, invert, random_gl, rope_commutant, sample
from engine.train import TrainConfig, train

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Solvers


def test_assignment_and_gqa_assignment_recover_a_planted_permutation():
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(9, generator=g)
    S = torch.randn(9, 9, generator=g, dtype=F64)
    S[torch.arange(9), perm] += 10
    assert torch.equal(assignment(S), perm)
    hp = torch.tensor([5, 4, 1, 0, 2, 3])  # 3 KV groups of 2: group 0 <- 2, 1 <- 0, 2 <- 1
    S = torch.randn(6, 6, generator=g, dtype=F64)
    S[torch.arange(6), hp] += 10
    assert torch.equal(gqa_assignment(S, 2), hp)


def test_assignment_is_optimal_with_and_without_the_row_maximum_shortcut():
    """Random scores (row maxima collide: the solver runs) and planted ones (they form a permutation:
    the shortcut) both give the assignment of largest total, as scipy's solver finds it."""
    from scipy.optimize import linear_sum_assignment

    g = torch.Generator().manual_seed(4)
    for n, boost in ((50, 0.0), (50, 3.0), (7, 0.0)):
        S = torch.randn(n, n, generator=g, dtype=F64)
        S[torch.arange(n), torch.randperm(n, generator=g)] += boost
        _, cols = linear_sum_assignment(S.numpy(), maximize=True)
        best = float(S[torch.arange(n), torch.as_tensor(cols)].sum())
        perm = assignment(S)
        assert sorted(perm.tolist()) == list(range(n))
        assert float(S[torch.arange(n), perm].sum()) == pytest.approx(best, rel=1e-12)
    S = torch.zeros(4, 4, dtype=F64)
    S[:, 0] = 1  # every row prefers column 0: the shortcut must not apply
    assert sorted(assignment(S).tolist()) == [0, 1, 2, 3]


def test_gl_and_rope_solvers_invert_planted_maps():
    g = torch.Generator().manual_seed(1)
    P_A, Q_A = torch.randn(3, 40, 8, generator=g, dtype=F64), torch.randn(3, 40, 8, generator=g, dtype=F64)
    A = random_gl(8, 3, g)
    P_B, Q_B = P_A @ torch.linalg.inv(A), Q_A @ A.mT  # so that P_B A = P_A, Q_B A^{-T} = Q_A
    assert (fit_gl(P_A, P_B, Q_A, Q_B) - A).abs().max() < 1e-10
    for layout in ("interleaved", "half"):
        z = torch.polar(torch.rand(3, 3, generator=g, dtype=F64) + 0.5, torch.rand(3, 3, generator=g, dtype=F64) * 6)
        A = rope_commutant(z, layout, 8)  # partial: 3 pairs in d = 8
        P_B, Q_B = P_A @ torch.linalg.inv(A), Q_A @ A.mT
        assert (fit_rope(P_A, P_B, Q_A, Q_B, layout, 6) - z).abs().max() < 1e-10
        assert torch.equal(rope_scalars(A, layout, 6), z)
    s = torch.rand(5, generator=g, dtype=F64) + 0.5
    a_in, a_out = torch.randn(5, 7, generator=g, dtype=F64), torch.randn(5, 9, generator=g, dtype=F64)
    assert (fit_scale(a_in, a_in / s[:, None], a_out, a_out * s[:, None], positive=True) - s).abs().max() < 1e-12
    O = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=F64))[0]
    X = torch.randn(20, 6, generator=g, dtype=F64)
    assert (procrustes((X @ O.T).T @ X) - O).abs().max() < 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_procrustes_maps_a_direction_no_data_sees_to_itself(seed):
    """Centred streams (a LayerNorm model rewritten to RMSNorm) never see the all-ones direction: of the rotations
    that fit them equally well, the one that keeps that direction (nearest the identity) is chosen, whatever signs
    the SVD returns for its null vectors; the fit on the other directions is untouched."""
    g = torch.Generator().manual_seed(seed)
    D = 8
    one = torch.full((D, 1), D**-0.5, dtype=F64)
    basis = torch.linalg.qr(torch.cat([one, torch.randn(D, D - 1, generator=g, dtype=F64)], 1))[0][:, 1:]  # [D, D-1]
    R = torch.linalg.qr(torch.randn(D - 1, D - 1, generator=g, dtype=F64))[0]
    O = basis @ R @ basis.T + one @ one.T  # a rotation of the centred subspace, the ones direction kept
    X = torch.randn(30, D, generator=g, dtype=F64)
    X = X - X.mean(1, keepdim=True)  # centred rows
    M = (X @ O.T).T @ X  # singular: the ones direction in its null space on both sides
    got = procrustes(M)
    assert (got @ got.T - torch.eye(D, dtype=F64)).abs().max() < 1e-12
    assert (got - O).abs().max() < 1e-10
    assert (got @ one - one).abs().max() < 1e-12
    assert float((got * M).sum()) == pytest.approx(float(torch.linalg.svdvals(M).sum()), rel=1e-12)  # still optimal
    generic = torch.randn(D, D, generator=g, dtype=F64)
    stacked = procrustes(torch.stack([generic, M]))  # a stack: each matrix as on its own
    assert torch.equal(stacked[0], procrustes(generic)) and (stacked[1] - O).abs().max() < 1e-10


def test_gl_solver_improves_on_its_start_for_unrelated_rows():
    g = torch.Generator().manual_seed(2)
    P_A, P_B, Q_A, Q_B = (torch.randn(2, 30, 6, generator=g, dtype=F64) for _ in range(4))
    A = fit_gl(P_A, P_B, Q_A, Q_B)
    f = lambda M: ((P_A - P_B @ M).square().sum() + (Q_A - Q_B @ torch.linalg.inv(M).mT).square().sum())
    ortho = procrustes(torch.cat([P_B, Q_B], 1).mT @ torch.cat([P_A, Q_A], 1))
    assert f(A) < f(ortho) and f(A) < f(torch.eye(6, dtype=F64).expand(2, 6, 6))


# ---------------------------------------------------------------------------------------------
# Planted solutions for every family of ref_models.CASES: theta_B = g*(theta_A)


@pytest.mark.parametrize("name", CASES)
def test_weight_matching_recovers_a_planted_element(name):
    a = make_case(name)
    b, g_star, kinds = planted(a)
    al = align(a, b, "weight")
    assert al.classes == kinds
    want = invert(al.pair.arch, g_star)  # B onto A undoes g*
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.kv_perm, exp.kv_perm)
        assert torch.equal(got.mlp_perm, exp.mlp_perm)
        assert (got.qk - exp.qk).abs().max() < 1e-8 and (got.vo - exp.vo).abs().max() < 1e-8
    if "residual_perm" in kinds:
        assert torch.equal(residual_perm_of(al.out.g.residual), residual_perm_of(want.residual))
    assert (al.out.g.residual - want.residual).abs().max() < 1e-9
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params)
    assert err < 1e-10
    es = eval_set_for(a, "val", 64 if a.arch.task == "vit" else 256)
    r = interpolate(al.model_a, al.model_b, es, points=3)
    assert abs(r["barrier"]) < 1e-6
    assert endpoint_check(b, al, es, r["endpoint_loss_b"])["rel_diff"] < 1e-9


@pytest.mark.parametrize("name", CASES)
def test_moving_b_in_place_keeps_its_function(name):
    """A run moves B in its own tensors (align(in_place=True), as every CLI and app run does): B's function stays,
    whatever views the family's adapter hands out (Phi's one norm is two canonical tensors: had both been views of
    it, the move would have applied itself twice)."""
    from engine.models import model_logits

    a = make_case(name)
    b, _, kinds = planted(a)
    if a.arch.norm == "layernorm" or a.arch.tied_embeddings:  # the rotation would rewrite B out of its family
        kinds = kinds - {"residual_orth"} | {"residual_perm"}
    x = eval_set_for(a, "val", 64 if a.arch.task == "vit" else 256).inputs[:2]
    with torch.no_grad():
        y0 = model_logits(b, x)
        al = align(a, b, "weight", kinds, in_place=True)
        y1 = model_logits(al.model_b, x)
    assert al.model_b is b or "residual_orth" in kinds  # moved in its own tensors (folding norms may copy it)
    assert float((y1 - y0).norm() / y0.norm()) < 1e-10


@pytest.mark.parametrize("name", ["lm-rope-half-gqa-swiglu", "vit-learned", "hf_llama", "hf_llama_llama3", "hf_qwen2",
                                  "hf_olmo"])
def test_activation_matching_recovers_a_planted_element(name):
    """Through the reference-family twin (engine.align.forward.twin), Llama 3's scaled RoPE frequencies and OLMo's
    LayerNorm rewrite included."""
    a = make_case(name)
    b, g_star, _ = planted(a)
    al = align(a, b, "activation")
    want = invert(al.pair.arch, g_star)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params)
    assert err < 1e-8


@pytest.mark.parametrize("pe", ["none", "rope"])
def test_activation_matching_recovers_wide_heads_the_batch_cannot_determine(pe):
    """One head of 64 dims (RoPE on 16 of them): the first block's queries and keys span only the embeddings of the
    tokens in the batch, fewer than 64 directions, so the activations alone leave the head's GL map undetermined;
    the weights' rows stacked under them (activation.weight_rows) settle it, and the planted element comes back."""
    from engine.align.activation import ACT_BATCH
    from engine.align.batches import train_batches

    cfg = byte_tiny(pe=pe, d_model=64, n_heads=1, **({"rotary_dim": 16} if pe == "rope" else {}))
    a = randomise_norms(build(cfg, seed=0, dtype=F64), 5)
    x, _ = next(train_batches(a.arch, ACT_BATCH["lm"], 0))
    assert x.unique().numel() < a.arch.d_head - a.arch.rotary_dim  # fewer inputs than unrotated dims at layer 0
    b, g_star, _ = planted(a)
    al = align(a, b, "activation")
    want = invert(al.pair.arch, g_star)
    assert max(float((got.qk - exp.qk).abs().max()) for got, exp in zip(al.out.g.layers, want.layers)) < 1e-8
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params)
    assert err < 1e-8


# ---------------------------------------------------------------------------------------------
# RoPE: the aligner stays in the commutant; a GL aligner is caught by the guard


def test_rope_aligner_stays_in_the_rope_group_and_gl_is_caught():
    a = build(byte_tiny(pe="rope", rotary_dim=6), seed=0, dtype=F64)
    b = build(byte_tiny(pe="rope", rotary_dim=6), seed=1, dtype=F64)
    es = lm_eval_set("val", 256, n_ctx=16)
    al = align(a, b, "weight", classes=("heads", "qk"))
    apply(al.pair.arch, al.out.g, al.pair.params_b, strict=True)  # raises outside H(r) x GL(d - r)
    x = es.inputs[:4]
    assert (al.model_b.module(x) - b.module(x)).abs().max() < 1e-10  # exactly the same function
    assert endpoint_check(b, al, es, evaluate(al.model_b, es)["loss"])["rel_diff"] < 1e-12
    wrong = align(a, b, "weight", classes=("heads", "qk"), qk_structure="gl")
    with pytest.raises(ExactnessError, match="not a symmetry"):
        endpoint_check(b, wrong, es, evaluate(wrong.model_b, es)["loss"])


def test_sinusoidal_residual_is_reported_as_approximate_not_raised():
    a = build(byte_tiny(pe="sinusoidal"), seed=0, dtype=F64)
    b = build(byte_tiny(pe="sinusoidal"), seed=1, dtype=F64)
    es = lm_eval_set("val", 256, n_ctx=16)
    al = align(a, b, "weight", classes=("heads", "mlp", "residual_orth"))
    chk = endpoint_check(b, al, es, evaluate(al.model_b, es)["loss"])
    assert chk["approximate_classes"] == ["residual_orth"] and not chk["exact"]
    assert chk["rel_diff"] > 1e-6 and chk["exact_part"]["rel_diff"] < 1e-12
    assert "residual_orth" not in align(a, b, "weight").classes  # left out by default


# ---------------------------------------------------------------------------------------------
# Class ablation


def test_classes_restrict_the_element_and_bad_requests_fail_clearly():
    a = build(byte_tiny(pe="rope"), seed=0, dtype=F64)
    b = build(byte_tiny(pe="rope"), seed=1, dtype=F64)
    al = align(a, b, "weight", classes=("mlp",))
    assert al.pair.rewrite == "" and al.classes == {"mlp"}
    for el in al.out.g.layers:
        assert torch.equal(el.head_perm, torch.arange(4)) and torch.equal(el.qk, torch.eye(8, dtype=F64).repeat(4, 1, 1))
    assert torch.equal(al.out.g.residual, torch.eye(32, dtype=F64))
    spec = build_spec(a.arch, canonical(a))
    with pytest.raises(LMCError, match="Unknown symmetry class 'rotation'"):
        resolve_classes(spec, ("rotation",))
    with pytest.raises(LMCError, match="Choose one residual class"):
        resolve_classes(spec, ("residual_perm", "residual_orth"))
    with pytest.raises(LMCError, match="'mlp_scale' is not a symmetry of this gelu"):
        resolve_classes(spec, ("mlp_scale",))
    with pytest.raises(LMCError, match="Method 'magic' is not available"):
        align(a, b, "magic")


# ---------------------------------------------------------------------------------------------
# The differentiable action and the dual identity


ACTION_CASES = [{"pe": "rope", "rope_layout": "half", "n_kv_heads": 2, "mlp": "swiglu", "rotary_dim": 6},
                {"pe": "rope", "rope_layout": "half", "n_kv_heads": 2, "mlp": "swiglu", "qk_norm": True},
                {"pe": "learned", "norm": "layernorm", "bias": True, "mlp": "relu"}]


def action_case(kw: dict, seed: int = 4, residual: str = "residual_orth"):
    a = randomise_norms(build(byte_tiny(**kw), seed=0, dtype=F64), 1)
    kinds = (default_classes(build_spec(a.arch, canonical(a))) - {"residual_orth"}) | {residual}
    pair = prepare_pair(a, a, kinds)
    g = sample(pair.arch, kinds, seed=seed)
    return pair, kinds, g, Transform(pair.arch, pair.spec, kinds, g)


@pytest.mark.parametrize("kw", ACTION_CASES)
def test_gather_action_equals_apply_for_hard_elements(kw):
    pair, kinds, g, T = action_case(kw)
    moved = act_ste(pair.spec, T.maps(), pair.params_a)
    ref = apply(pair.arch, g, pair.params_a)
    # bitwise, but for the Newton-Schulz polar factor of an already orthogonal residual map
    tol = 1e-12 if "residual_orth" in kinds else 0.0
    assert max(float((moved[k] - ref[k]).detach().abs().max()) for k in ref) <= tol
    e = T.element()
    assert all(torch.equal(x.head_perm, y.head_perm) and torch.equal(x.mlp_perm, y.mlp_perm)
               and (x.qk - y.qk).abs().max() < 1e-12 for x, y in zip(e.layers, g.layers))
    assert (e.residual - g.residual).abs().max() < 1e-12


def dense_permute(x: torch.Tensor, axis: int, entry: tuple) -> torch.Tensor:
    """The gradient oracle's permutation step for symmetry.act: a straight-through permutation MATRIX
    (value the hard P, gradient Z's) multiplying the weights, x <- P x along `axis`."""
    hard, Z, cand = entry
    Z = Z if cand is None else dense_latent(Z, cand)  # the MLP's candidate graph as a dense [n, n] latent
    P = perm_matrix(hard, Z.dtype) + (Z - Z.detach())
    return (x.movedim(axis, -1) @ P.T).movedim(-1, axis)


def dense_action(T: Transform, params: dict) -> dict:
    """T's action with every permutation a dense straight-through matrix product (`dense_permute`)."""
    maps = T.maps()
    return {key: act(ps, maps, params[key], dense_permute) for key, ps in T.spec.params.items()}


@pytest.mark.parametrize("residual", ["residual_orth", "residual_perm"])
@pytest.mark.parametrize("kw", ACTION_CASES)
def test_gather_gradient_equals_the_dense_straight_through_gradient(kw, residual):
    pair, _, _, T = action_case(kw, residual=residual)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # latents away from the start, so every class has a nontrivial map
        for name, p in T.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=F64) * (0.3 if name.startswith("Z_") else 0.05))
    T.solve()
    es = lm_eval_set("val", 64, n_ctx=16)
    grads = []
    for action in (lambda p: act_ste(pair.spec, T.maps(), p), lambda p: dense_action(T, p)):
        T.zero_grad(set_to_none=True)
        moved = action(pair.params_a)
        mid = {k: 0.5 * pair.params_b[k] + 0.5 * moved[k] for k in moved}
        task_loss(functional_logits(pair.model_a, mid, es.inputs[:4]), es.targets[:4]).backward()
        grads.append({n: p.grad.clone() for n, p in T.named_parameters()})
    new, old = grads
    assert set(new) == set(old) and any(n.startswith("Z_mlp") for n in new)
    for n in new:
        assert old[n].abs().max() > 0, n  # every latent gets a gradient
        assert torch.allclose(new[n], old[n], rtol=1e-10, atol=1e-10 * float(old[n].abs().max())), n


def test_dual_identity_holds_for_random_elements():
    a = randomise_norms(build(byte_tiny(pe="rope"), seed=0, dtype=F64), 2)
    b = randomise_norms(build(byte_tiny(pe="rope"), seed=1, dtype=F64), 3)
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    pair = prepare_pair(a, b, kinds)
    out = dual_identity(pair, sample(pair.arch, kinds, seed=5), sample(pair.arch, kinds, seed=6))
    assert out["max_relative_error"] < 1e-10 and 0 < out["max_logit_relative_error"] < 1e-10
    assert out["loss_dual"][0] != out["loss_dual"][1]  # the lambdas really differ


# ---------------------------------------------------------------------------------------------
# Learned and dual beat weight matching on briefly trained models


@pytest.fixture(scope="module")
def trained_pair():
    cfg = RefConfig(task="lm", n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=32, pe="rope")
    tc = TrainConfig(steps=120, batch=16, lr=3e-3, warmup=10, eval_every=10**9, eval_items=512)
    return [train(cfg, s, tc, progress=False)[0] for s in (0, 1)]


@pytest.mark.slow
def test_learned_and_dual_reduce_the_barrier_below_weight_matching(trained_pair):
    a, b = trained_pair
    es = lm_eval_set("test", 2048, n_ctx=32)
    barrier = {}
    runs = {}
    for m in ("naive", "weight", "learned", "dual"):
        runs[m] = align(a, b, m, steps=20)
        barrier[m] = interpolate(runs[m].model_a, runs[m].model_b, es, points=5)["barrier"]
        endpoint_check(b, runs[m], es, evaluate(runs[m].model_b, es)["loss"])  # float32: within 1e-4
    assert barrier["weight"] < 0.5 * barrier["naive"]
    assert barrier["learned"] < barrier["weight"] and barrier["dual"] < barrier["weight"]
    info = runs["dual"].out.info
    assert info["identity"]["max_relative_error"] < 1e-6 and info["identity"]["max_logit_relative_error"] < 1e-6
    same = info["one_sided_same_budget"]
    assert same["steps"] == info["steps"] == 20 and len(same["history"]["step"]) == len(info["history"]["step"])


# ---------------------------------------------------------------------------------------------
# CLI, records, the merged model, build_cache


def test_align_cli_writes_a_record_and_a_merged_model_that_loads_back(tmp_path, capsys):
    for s in (0, 1):
        save_model(build(byte_tiny(pe="rope"), seed=s), tmp_path / f"m{s}")
    out, merged = tmp_path / "r.json", tmp_path / "merged"
    rc = main(["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--method", "weight", "--points", "3",
               "--eval-items", "256", "--out", str(out), "--save-merged", str(merged), "--alpha", "0.5"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["method"] == "weight" and rec["endpoint_check"]["rel_diff"] < 1e-4
    al = rec["alignment"]
    assert al["classes"] == ["heads", "mlp", "qk", "residual_orth", "vo"] and al["rewrite"] == "fold_norms"
    assert len(al["element"]["layers"][0]["head_perm"]) == 4 and "rope_scalars" in al["element"]["layers"][0]
    assert al["element"]["residual"]["kind"] == "orthogonal"
    assert set(al["matching_cost"]["after"]) == {"blocks.0", "blocks.1", "outer"}
    m = load_model(merged)
    es = lm_eval_set("test", 256, n_ctx=16)
    assert evaluate(m, es)["loss"] == pytest.approx(rec["loss"][1], rel=1e-6)
    assert "endpoint check" in capsys.readouterr().out
    rc = main(["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--classes", "mlp_scale"])
    assert rc == 2 and "not a symmetry" in capsys.readouterr().err


def test_build_cache_accepts_every_method(tmp_path, monkeypatch):
    import engine.align as registry
    from engine import builders
    from engine.align import run
    from engine.api import build_cache

    for s in (0, 1):
        save_model(build(byte_tiny(pe="rope", n_ctx=32), seed=s), tmp_path / "zoo" / f"lm-rope-s{s}")
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    short = {k: replace(v, default_steps=2 if v.default_steps else 0, task_steps=None) for k, v in METHODS.items()}
    monkeypatch.setattr(registry, "METHODS", short)
    monkeypatch.setattr(run, "METHODS", short)
    monkeypatch.setattr(builders, "CONVERGED", {})  # the methods' (shortened) defaults, not the stored budget
    recs = build_cache(methods=list(METHODS), eval_items=256, only=[("lm-rope-s0", "lm-rope-s1")])
    assert [r["method"] for r in recs] == list(METHODS)
    assert all("alignment" in r and "endpoint_check" in r for r in recs)
    assert recs[-1]["alignment"]["diagnostics"]["steps"] == 2
    assert len(json.loads((tmp_path / "cache" / "manifest.json").read_text())["records"]) == len(METHODS)
    # dual's one-sided comparison is the learned record's run, taken from it: the same run as computing it anew
    learned, dual = recs[-2]["alignment"]["diagnostics"], recs[-1]["alignment"]["diagnostics"]
    taken = dual["one_sided_same_budget"]
    assert taken["from_learned_record"] and taken["history"] == learned["history"]
    (tmp_path / "cache" / "lm-rope-s0__lm-rope-s1__learned.json").unlink()
    anew = build_cache(methods=["dual"], eval_items=256, only=[("lm-rope-s0", "lm-rope-s1")], force=True)
    ran = anew[0]["alignment"]["diagnostics"]["one_sided_same_budget"]
    assert not ran["from_learned_record"]
    assert {k: v for k, v in ran["history"].items() if k != "seconds"} == {
        k: v for k, v in taken["history"].items() if k != "seconds"}
    assert ran["best_val_barrier"] == taken["best_val_barrier"] and anew[0]["barrier"] == recs[-1]["barrier"]


def test_stored_records_use_each_tiers_converged_budget():
    from engine.builders import cache_config
    from engine.results import RunConfig

    for pair, steps in ((("lm-learned-s0", "lm-learned-s1"), 6400), (("vit-rope-s0", "vit-rope-s1"), 3200),
                        (("lm-rope-medium-s0", "lm-rope-medium-s1"), 3200)):
        dual = cache_config(*pair, "dual")
        assert (dual.steps, dual.options.batch, dual.eval_items) == (steps, None, 65_536)  # the default batch
        assert cache_config(*pair, "learned").options.given() == {}
    for a, b, m in [("lm-learned-s0", "lm-learned-s1", "weight"), ("vit-rope-s0", "vit-rope-s1", "activation"),
                    ("lm-learned-medium-s0", "lm-learned-medium-s1", "naive")]:
        assert cache_config(a, b, m) == RunConfig(a, b, m, eval_items=65_536)  # the methods' defaults


def test_naive_keeps_the_original_models():
    a = build(byte_tiny(), seed=0)
    al = align(a, copy.deepcopy(a), "naive")
    assert al.model_a is a and al.classes == frozenset()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LMC_SLOW"), reason="zoo-sized alignment takes minutes; set LMC_SLOW=1")
def test_zoo_learned_and_dual_beat_weight_matching():
    from engine.api import run_pair
    from engine.results import RunConfig
    from engine.zoo import ENTRIES

    a, b = "lm-rope-s0", "lm-rope-s1"
    if not all((ENTRIES[n].path / "model.safetensors").is_file() for n in (a, b)):
        pytest.skip("the zoo's lm-rope pair is not built")
    barrier = {m: run_pair(RunConfig(a, b, m, points=11, eval_items=16384))["barrier"]
               for m in ("naive", "weight", "learned", "dual")}
    assert barrier["weight"] < barrier["naive"]
    assert barrier["learned"] < barrier["weight"] and barrier["dual"] < barrier["weight"]
