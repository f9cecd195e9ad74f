"""QK-norm (Qwen3): the Q/K group that survives a per-head RMSNorm before RoPE (docs/MATH.md section 1, QK-norm).

What the derivation claims, each checked in float64 on tiny models with random gains: the group's elements
(gain moduli per pair, quarter turns with the pair's gains swapped, a sign per pair and KV group) keep the
function and move the weights; the sign flip of one coordinate with its gain keeps it too (exact, not
offered); everything around them breaks it (GL(d), the plain RoPE commutant's phases or moduli on W_Q /
W_K, gain scales unequal within a pair, a quarter turn in one KV group only) and is refused by strict
apply; the dimension is d/2 per layer; the solver inverts planted elements; and every aligner runs on an
HF Qwen3 pair.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ref_models import inputs, random_model, rel, tiny

from engine.align.pair import model_for, prepare_pair
from engine.align.run import align
from engine.align.solvers import fit_qk_norm
from engine.classes import default_classes
from engine.errors import LMCError, ModelError, SpecError
from engine.evaluate import eval_set_for
from engine.groups import group_dimension
from engine.interpolate import interpolate
from engine.models import arch_from_config, canonical, hf_qwen3, set_canonical
from engine.models.reference import rope_pairs
from engine.spec import build_spec, check_arch, is_qk_gain, norms_are_folded
from engine.surgery import fold_norms, layernorm_to_rmsnorm, reference_config_from_arch
from engine.symmetry import GroupElement, LayerElement, apply, identity, invert, random_gl, rope_commutant, sample

F64 = torch.float64
QWEN3 = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 16,
         "bos_token_id": 0, "eos_token_id": 0, "rope_theta": 500.0, "rms_norm_eps": 1e-5}
CASES = {"interleaved": {"pe": "rope", "qk_norm": True},
         "half-gqa-swiglu-qkv-bias": {"pe": "rope", "rope_layout": "half", "qk_norm": True, "n_kv_heads": 2,
                                      "mlp": "swiglu", "qkv_bias": True}}


def with_qk(arch, qk) -> GroupElement:
    """The identity but for the Q/K map of every layer."""
    e = identity(arch)
    return GroupElement(tuple(LayerElement(el.head_perm, qk, el.vo, el.mlp_perm, el.mlp_scale) for el in e.layers),
                        e.residual)


def logits_of(model, params, x) -> torch.Tensor:
    m = random_model(model.module.cfg)
    set_canonical(m, params)
    with torch.no_grad():
        return m.module(x)


@pytest.fixture(params=list(CASES))
def case(request):
    cfg = tiny(**CASES[request.param])
    m = random_model(cfg)  # gains 1 + 0.3 N(0, 1): generic, the two entries of every pair differ
    x = inputs(cfg)
    with torch.no_grad():
        y0 = m.module(x)
    return m, x, y0


def turn_of_pair0(arch, groups: list[int], k: int = 1) -> torch.Tensor:
    """i^k on RoPE pair 0 in the given KV groups, identity elsewhere: [h_kv, d, d] with exact 0 / +-1 entries."""
    z = torch.ones(arch.n_kv_heads, arch.d_head // 2, dtype=torch.complex128)
    z[groups, 0] = 1j ** k
    return rope_commutant(z, arch.rope_layout, arch.d_head)


# ---------------------------------------------------------------------------------------------
# The group: its elements keep the function


def test_every_element_keeps_the_function_and_moves_the_weights(case):
    m, x, y0 = case
    arch, theta = m.arch, canonical(m)
    assert build_spec(arch, theta).groups["blocks.0.qk"].structure == "rope_qk_norm"
    for seed in range(4):
        g = sample(arch, ["qk"], seed)
        moved = apply(arch, g, theta)
        assert rel(logits_of(m, moved, x), y0) < 1e-10
        assert float((moved["blocks.0.attn.q_norm.g"] - theta["blocks.0.attn.q_norm.g"]).abs().max()) > 1e-3
        assert max(float((apply(arch, invert(arch, g), moved)[k] - theta[k]).abs().max()) for k in theta) < 1e-12


def test_quarter_turn_swaps_the_pairs_gains_and_is_exact(case):
    """The 90-degree turn of a pair in every KV group with the pair's q and k gains swapped: exact."""
    m, x, y0 = case
    arch, theta = m.arch, canonical(m)
    A = turn_of_pair0(arch, list(range(arch.n_kv_heads)))
    moved = apply(arch, with_qk(arch, A), theta)
    i1, i2 = (0, 1) if arch.rope_layout == "interleaved" else (0, arch.d_head // 2)
    for n in ("q_norm", "k_norm"):
        g, g2 = theta[f"blocks.0.attn.{n}.g"], moved[f"blocks.0.attn.{n}.g"]
        assert g2[i1] == g[i2] and g2[i2] == g[i1]  # swapped, signs kept
    assert rel(logits_of(m, moved, x), y0) < 1e-10


def test_half_turn_in_one_kv_group_and_gain_sign_flips_are_exact(case):
    """A sign per pair and KV group is in the group (gains untouched); flipping one coordinate of W_Q in every
    head together with its gain entry leaves q itself unchanged (exact, not offered)."""
    m, x, y0 = case
    arch, theta = m.arch, canonical(m)
    moved = apply(arch, with_qk(arch, turn_of_pair0(arch, [0], k=2)), theta)
    assert torch.equal(moved["blocks.0.attn.q_norm.g"], theta["blocks.0.attn.q_norm.g"])
    assert rel(logits_of(m, moved, x), y0) < 1e-10
    flipped = dict(theta)
    for key in ("W_Q", "b_Q", "q_norm.g"):
        k = f"blocks.1.attn.{key}"
        if k in theta:
            flipped[k] = theta[k].clone()
            flipped[k][..., 3] *= -1
    assert rel(logits_of(m, flipped, x), y0) < 1e-10


def test_head_permutations_leave_the_shared_gains_in_place(case):
    m, x, y0 = case
    arch, theta = m.arch, canonical(m)
    moved = apply(arch, sample(arch, ["heads"], 3), theta)
    for l in range(arch.n_layers):
        for n in ("q_norm", "k_norm"):
            assert torch.equal(moved[f"blocks.{l}.attn.{n}.g"], theta[f"blocks.{l}.attn.{n}.g"])
    assert rel(logits_of(m, moved, x), y0) < 1e-10


def test_norm_folding_leaves_the_qk_gains_alone(case):
    """The residual norms fold into the readers; the QK-norm gains act in head space and stay (section 3)."""
    m, x, y0 = case
    for rewrite in (fold_norms, layernorm_to_rmsnorm):
        arch, theta = m.arch, canonical(m)
        if rewrite is layernorm_to_rmsnorm:  # the same model with LayerNorm: the rewrite keeps the gains too
            ln = random_model(replace(m.module.cfg, norm="layernorm", bias=True, mlp="gelu"))
            arch, theta, m = ln.arch, canonical(ln), ln
            with torch.no_grad():
                y0 = ln.module(x)
        arch2, p2 = rewrite(arch, theta)
        assert arch2.qk_norm and norms_are_folded(arch2, p2)
        for k in theta:
            if is_qk_gain(k):
                assert torch.equal(p2[k], theta[k]) and not bool((p2[k] == 1).all())
        moved = apply(arch2, sample(arch2, ["residual_orth", "qk"], 2), p2)
        assert rel(logits_of(random_model(reference_config_from_arch(arch2)), moved, x), y0) < 1e-10


# ---------------------------------------------------------------------------------------------
# The converse: refused when strict, and breaking the function


def plain_qk(arch, theta, A: torch.Tensor) -> dict:
    """A [h_kv, d, d] on W_Q / W_K as on a model without QK-norm (W_Q A, W_K A^{-T}), gains left."""
    rep, p = arch.n_heads // arch.n_kv_heads, dict(theta)
    for l in range(arch.n_layers):
        b = f"blocks.{l}.attn"
        p[f"{b}.W_Q"] = theta[f"{b}.W_Q"] @ A.repeat_interleave(rep, 0)
        p[f"{b}.W_K"] = theta[f"{b}.W_K"] @ torch.linalg.inv(A).mT
        for key, M in (("b_Q", A.repeat_interleave(rep, 0)), ("b_K", torch.linalg.inv(A).mT)):
            if f"{b}.{key}" in theta:
                p[f"{b}.{key}"] = (theta[f"{b}.{key}"][:, None] @ M).squeeze(1)
    return p


def test_what_the_group_does_not_hold_breaks_the_function_and_is_refused(case):
    m, x, y0 = case
    arch, theta = m.arch, canonical(m)
    hkv, d, n = arch.n_kv_heads, arch.d_head, arch.d_head // 2
    gen = torch.Generator().manual_seed(1)
    phase = rope_commutant(torch.polar(torch.ones(hkv, n, dtype=F64), torch.full((hkv, n), 0.7, dtype=F64)),
                           arch.rope_layout, d)  # the plain RoPE commutant: orthogonal, a generic phase
    modulus = rope_commutant(torch.complex(torch.linspace(0.6, 1.5, hkv * n, dtype=F64).reshape(hkv, n),
                                           torch.zeros(hkv, n, dtype=F64)), arch.rope_layout, d)  # per KV group
    gl = random_gl(d, hkv, gen)
    for A in (phase, modulus, gl):
        with pytest.raises(SpecError, match="QK-norm|does not commute"):
            apply(arch, with_qk(arch, A), theta)
        assert rel(logits_of(m, plain_qk(arch, theta, A), x), y0) > 1e-3
    # the moduli differ between KV groups: refused (the gains are shared), however it would be applied
    with pytest.raises(SpecError, match="same modulus"):
        apply(arch, with_qk(arch, modulus), theta)
    # gain scales unequal within a pair: q gains times c, k gains over c
    c = torch.linspace(0.7, 1.4, d, dtype=F64)
    scaled = dict(theta)
    for l in range(arch.n_layers):
        scaled[f"blocks.{l}.attn.q_norm.g"] = theta[f"blocks.{l}.attn.q_norm.g"] * c
        scaled[f"blocks.{l}.attn.k_norm.g"] = theta[f"blocks.{l}.attn.k_norm.g"] / c
    assert rel(logits_of(m, scaled, x), y0) > 1e-3
    # the same scales, constant on every pair: the group's own element
    i1, i2 = rope_pairs(d, arch.rope_layout)
    c = torch.empty(d, dtype=F64)
    c[i1] = c[i2] = torch.linspace(0.7, 1.4, n, dtype=F64)
    for l in range(arch.n_layers):
        scaled[f"blocks.{l}.attn.q_norm.g"] = theta[f"blocks.{l}.attn.q_norm.g"] * c
        scaled[f"blocks.{l}.attn.k_norm.g"] = theta[f"blocks.{l}.attn.k_norm.g"] / c
    assert rel(logits_of(m, scaled, x), y0) < 1e-10
    if hkv > 1:  # a quarter turn in one KV group only: refused, and as applied (gains follow group 0) it breaks
        A = turn_of_pair0(arch, [0])
        with pytest.raises(SpecError, match="same modulus and quarter turn"):
            apply(arch, with_qk(arch, A), theta)
        assert rel(logits_of(m, apply(arch, with_qk(arch, A), theta, strict=False), x), y0) > 1e-3


def test_break_tests_of_a_qk_norm_model_all_break(case):
    from engine.checks import break_tests, invariance_checks

    m = case[0]
    breaks = {r["group"]: r["max_rel_change"] for r in break_tests(m)}
    want = {"qk_gl", "qk_orthogonal", "qk_rope_phase", "qk_rope_modulus", "qk_gain_within_pair"}
    want |= {"qk_turn_one_kv_group"} if m.arch.n_kv_heads > 1 else set()
    assert want <= set(breaks) and all(v > 1e-3 for v in breaks.values()), breaks
    checks = {r["group"]: r for r in invariance_checks(m, k=2)}
    assert "key_bias_shift" not in checks  # the norm sees a shifted key
    assert all(r["exact"] and r["max_rel_change"] < 1e-10 for r in checks.values()), checks


# ---------------------------------------------------------------------------------------------
# Dimension, solver, refusals


def test_dimension_is_half_a_head_per_layer():
    qwen3_8b = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "max_position_embeddings": 40960, "vocab_size": 151936, "attention_bias": True}
    arch = arch_from_config(qwen3_8b)
    assert arch.qk_norm and arch.family == "hf_qwen3" and (arch.attn_bias, arch.out_bias, arch.mlp_bias) == (
        True, True, False)
    layer = group_dimension(arch)["per_layer"][0]
    assert layer["qk"] == 64 and layer["key_bias"] == 0  # d/2, not h_kv d = 1,024; no key-bias shift
    assert layer["value_bias"] == 8 * 128 and layer["vo"] == 8 * 128 ** 2


def test_qk_norm_needs_rope_on_the_whole_head():
    for kw in ({"pe": "learned"}, {"pe": "rope", "rotary_dim": 4}):
        with pytest.raises(ModelError, match="qk_norm needs RoPE on the whole head"):
            tiny(qk_norm=True, **kw)
    with pytest.raises(SpecError, match="QK-norm is described with RoPE on the whole head"):
        check_arch(replace(tiny(pe="rope", rotary_dim=4).arch(), qk_norm=True))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_fit_qk_norm_inverts_planted_elements_on_weights_and_activations(layout):
    g = torch.Generator().manual_seed(2)
    hkv, d, N = 3, 8, 40
    arch = tiny(pe="rope", rope_layout=layout, qk_norm=True, n_kv_heads=hkv, n_heads=3, d_model=24).arch()
    A = sample(arch, ["qk"], 5).layers[0].qk  # [h_kv, d, d]
    P_A, Q_A = torch.randn(hkv, N, d, generator=g, dtype=F64), torch.randn(hkv, N, d, generator=g, dtype=F64)
    # activations move by the whole map: P_B A = P_A, Q_B A^{-T} = Q_A
    z = fit_qk_norm(P_A, P_A @ torch.linalg.inv(A), Q_A, Q_A @ A.mT, layout, d)
    assert (rope_commutant(z, layout, d) - A).abs().max() < 1e-10
    # weights move by sign(A) alone and the gains by |A| and |A^{-T}|
    S, M, Mi = A.sign(), A[0].abs(), torch.linalg.inv(A[0]).mT.abs()
    gq, gk = 1 + 0.3 * torch.randn(d, generator=g, dtype=F64), 1 + 0.3 * torch.randn(d, generator=g, dtype=F64)
    gains = (gq, gq @ torch.linalg.inv(M), gk, gk @ torch.linalg.inv(Mi))
    z = fit_qk_norm(P_A, P_A @ S.mT, Q_A, Q_A @ S.mT, layout, d, gains)
    assert (rope_commutant(z, layout, d) - A).abs().max() < 1e-10


def test_circuit_path_is_refused_for_qk_norm():
    from engine.circuits import CircuitPath

    a = random_model(tiny(pe="rope", qk_norm=True))
    with pytest.raises(LMCError, match="circuit path is not defined.*QK-norm"):
        CircuitPath(a, a)


# ---------------------------------------------------------------------------------------------
# HF Qwen3: every aligner on a planted pair


def qwen3_pair():
    a = hf_qwen3.build(QWEN3, seed=0, dtype=F64)
    g = torch.Generator().manual_seed(5)
    p = canonical(a)
    set_canonical(a, {k: 1 + 0.2 * torch.randn(v.shape, generator=g, dtype=F64) if k.endswith(".g") else v
                      for k, v in p.items()})
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    pair = prepare_pair(a, a, kinds)
    g_star = sample(pair.arch, kinds, seed=3)
    return a, model_for(pair.model_a, pair.arch, apply(pair.arch, g_star, pair.params_a)), g_star, kinds


@pytest.mark.parametrize("method", ["activation", "learned", "dual"])
def test_every_aligner_runs_on_a_qwen3_pair_and_recovers_a_planted_element(method):
    a, b, g_star, kinds = qwen3_pair()
    assert "qk" in kinds and a.arch.qk_norm
    al = align(a, b, method, steps=2 if method in ("learned", "dual") else 0)
    assert al.classes == kinds
    apply(al.pair.arch, al.out.g, al.pair.params_b, strict=True)  # in the QK-norm group
    want = invert(al.pair.arch, g_star)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert (got.qk - exp.qk).abs().max() < 1e-8
    assert max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params) < 1e-8
    r = interpolate(al.model_a, al.model_b, eval_set_for(a, "val", 256), points=3)
    assert abs(r["barrier"]) < 1e-6
