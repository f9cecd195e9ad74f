"""Symmetry diagnostics: invariance rows, break tests (the converse), group dimensions by formula and by
Jacobian nullity, config-only dimensions of GPT-2-small and Llama-2-7B, RoPE breaking, sinusoidal spectrum."""

import itertools
import json

import pytest
import torch
from ref_models import random_model, tiny

from engine.checks import break_tests, invariance_checks, jacobian_nullity, rope_breaking
from engine.groups import group_dimension, sinusoidal_spectrum
from engine.models import arch_from_config, save_model
from engine.models.reference import RefConfig
from engine.report import format_report, symmetry_report


def rows(report_rows):
    return {r["group"]: r for r in report_rows}


@pytest.mark.parametrize("kw", [
    {"pe": "rope", "rotary_dim": 4, "mlp": "relu", "n_kv_heads": 2},
    {"pe": "learned", "norm": "layernorm", "bias": True},
    {"task": "vit", "pe": "learned", "norm": "layernorm", "bias": True, "head_bias": True},
    {"pe": "none", "mlp": "swiglu", "bias": True},
], ids=["rope-partial-relu-gqa", "learned-layernorm", "vit-learned", "nope-swiglu-bias"])
def test_invariance_checks_are_exact_for_every_kind_and_translation(kw):
    m = random_model(tiny(**kw))
    checks = rows(invariance_checks(m, k=2))
    assert {"heads", "mlp", "qk", "vo", "residual_perm", "residual_orth"} <= set(checks)
    for r in checks.values():
        assert r["exact"] and r["max_rel_change"] < 1e-10, r
    if kw.get("bias"):
        assert {"value_bias_fold", "key_bias_shift"} <= set(checks)
    if kw.get("pe") == "learned":
        assert "pe_shift" in checks


@pytest.mark.parametrize("n_ctx", [8, 64], ids=["context-below-width", "context-above-width"])
def test_sinusoidal_residual_check_draws_from_the_table_fixing_rotations(n_ctx):
    """A generic rotation moves the fixed table (a break test); the check rotates only the directions the
    table does not reach (exact) or reaches below SINUSOIDAL_RTOL (approximate, a change of that order)."""
    from engine.checks import SINUSOIDAL_RTOL, table_fixing_rotation
    from engine.models.reference import sinusoidal_table

    m = random_model(tiny(pe="sinusoidal", n_ctx=n_ctx))
    D = m.arch.d_model
    checks, breaks = rows(invariance_checks(m, k=2)), rows(break_tests(m))
    O, free, barely = table_fixing_rotation(m.arch, 0)
    r = checks["residual_orth"]
    if O is None:  # the rows reach every direction: nothing to rotate, said plainly
        assert r["max_rel_change"] is None and "only the identity" in r["note"]
    else:
        P = sinusoidal_table(m.arch.n_ctx, D, torch.float64)
        assert torch.allclose(O @ O.T, torch.eye(D, dtype=torch.float64), atol=1e-12)
        assert (P @ O - P).abs().max() <= 2 * SINUSOIDAL_RTOL * torch.linalg.matrix_norm(P, 2)
        assert (O - torch.eye(D, dtype=torch.float64)).abs().max() > 0.1  # a real rotation, not the identity
        if barely == 0:
            assert r["exact"] and r["max_rel_change"] < 1e-10 and free >= D - n_ctx
        else:
            assert not r["exact"] and r["max_rel_change"] < 1e-3 and "approximate" in r["note"]
    assert checks["residual_perm"]["max_rel_change"] is None and "no coordinate permutation" in \
        checks["residual_perm"]["note"]
    for name in ("residual_orth_any", "residual_perm_any"):  # generic elements: breaks, and they break
        assert breaks[name]["max_rel_change"] > 1e-2
    assert checks["qk"]["exact"] and checks["qk"]["max_rel_change"] < 1e-10
    assert "GL(8)" in checks["qk"]["kind"]


@pytest.mark.parametrize("kw", [
    {"pe": "rope"}, {"pe": "rope", "rope_layout": "half", "rotary_dim": 4, "n_kv_heads": 2, "mlp": "swiglu"},
    {"pe": "rope", "norm": "layernorm", "bias": True, "mlp": "relu"}, {"pe": "none", "mlp": "silu"},
    {"task": "vit", "pe": "rope", "rope_layout": "half"},
    {"pe": "rope", "rope_layout": "half", "qk_norm": True, "n_kv_heads": 2, "mlp": "swiglu"},
], ids=["rope", "rope-half-partial-gqa-swiglu", "rope-layernorm-relu", "nope-silu", "vit-rope-half",
        "rope-half-qk-norm-gqa-swiglu"])
def test_every_break_transform_changes_the_output(kw):
    m = random_model(tiny(**kw))
    breaks = rows(break_tests(m))
    if m.arch.pe == "rope":
        assert {"qk_gl", "qk_other_layout", "qk_orthogonal"} <= set(breaks)
    if m.arch.qk_norm:
        assert {"qk_rope_phase", "qk_rope_modulus", "qk_gain_within_pair", "qk_turn_one_kv_group"} <= set(breaks)
    if m.arch.n_kv_heads < m.arch.n_heads:
        assert "heads_across_kv_groups" in breaks
    assert "residual_gl" in breaks and len(breaks) >= 2
    for r in breaks.values():
        assert r["exact"] is False and r["max_rel_change"] >= 1e-3, r


def test_the_other_pairing_is_no_break_when_it_pairs_the_same_coordinates():
    m = random_model(tiny(pe="rope", rotary_dim=2))  # one pair: (0, 1) in both layouts
    assert "qk_other_layout" not in rows(break_tests(m))


JACOBIAN = [
    {"pe": "none"}, {"pe": "learned"}, {"pe": "rope"}, {"pe": "rope", "rotary_dim": 2, "rope_layout": "half"},
    {"pe": "none", "mlp": "relu"}, {"pe": "rope", "n_kv_heads": 1},
    {"pe": "learned", "mlp": "swiglu", "bias": True}, {"pe": "sinusoidal", "n_ctx": 4},
    {"pe": "learned", "norm": "layernorm", "bias": True, "tied_embeddings": True},
    # QK-norm: d/2 per layer, gains free (random: generic), no key-bias shift
    {"pe": "rope", "qk_norm": True}, {"pe": "rope", "qk_norm": True, "rope_layout": "half", "n_kv_heads": 1},
    {"pe": "rope", "qk_norm": True, "mlp": "swiglu", "bias": True},
]


@pytest.mark.parametrize("kw", JACOBIAN, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_jacobian_nullity_equals_the_formula(kw):
    base = {"n_layers": 1, "d_model": 8, "n_heads": 2, "d_mlp": 8, "vocab_size": 20, "n_ctx": 6, "norm_eps": 1e-2}
    m = random_model(RefConfig(**{**base, **kw}), std=0.5)
    r = jacobian_nullity(m)
    assert r["nullity"] == r["formula"], r
    assert r["gap"] > 1e6  # a clean spectral gap, not a tolerance accident


def test_dimension_formulas_for_gpt2_small_and_llama2_7b_from_config_dicts():
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
            "vocab_size": 50257, "activation_function": "gelu_new"}
    d = group_dimension(arch_from_config(gpt2))
    assert d["per_layer"][0]["attention"] == 99_840  # 12 (64^2 + 64^2) + key bias 768 + value bias 768
    assert d["by_kind"]["residual_orth"] == 768 * 767 // 2 and d["by_kind"]["mlp_scale"] == 0
    llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
             "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096, "hidden_act": "silu"}
    d = group_dimension(arch_from_config(llama))
    assert d["per_layer"][0]["attention"] == 528_384  # 32 (128 + 128^2)
    assert d["per_layer"][0]["mlp"] == 11008  # SwiGLU up-branch scaling
    assert d["total"] == 32 * (528_384 + 11008) + 4096 * 4095 // 2
    gqa = group_dimension(arch_from_config({**llama, "num_key_value_heads": 8}))
    assert gqa["per_layer"][0]["attention"] == 8 * (128 + 128**2)


def test_report_from_a_config_path_alone(tmp_path):
    cfg = tiny(pe="learned", mlp="relu", bias=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    rep = symmetry_report(tmp_path, dims_only=True)
    assert rep["dims_only"] and rep["checks"] == [] and rep["breaks"] == []
    assert rep["group_dim"] == symmetry_report(tmp_path / "config.json")["group_dim"]
    D, h, d = 32, 4, 8
    assert rep["group_dim"]["per_layer"][0]["attention"] == 2 * h * d * d + 2 * h * d
    assert rep["group_dim"]["by_kind"]["pe_shift"] == D and "mlp_scale" in rep["kinds"]
    assert "dimensions from the config only" in format_report(rep)


def test_report_of_a_saved_model_is_json_with_checks_breaks_and_dims(tmp_path):
    m = random_model(tiny(pe="rope", rotary_dim=4, norm="layernorm", bias=True))
    save_model(m, tmp_path / "m")
    rep = json.loads(json.dumps(symmetry_report(tmp_path / "m", k=1)))
    assert not rep["dims_only"] and rep["kinds"][0] == "heads"
    for r in rep["checks"]:
        assert set(r) >= {"group", "kind", "max_rel_change", "exact"} and r["max_rel_change"] < 1e-10
    assert all(r["max_rel_change"] >= 1e-3 for r in rep["breaks"])
    assert rep["group_dim"]["total"] == sum(rep["group_dim"]["by_kind"].values())
    assert len(rep["rope"]) == 2
    text = format_report(rep)
    assert "invariance check" in text and "break test" in text and "qk_other_layout" in text


def qk_gains(m):
    """Random QK-norm gains: HF initialises them to 1, where every RoPE phase is a symmetry too (docs/MATH.md
    section 1, QK-norm: the group is counted for gains that differ within a pair)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in m.module.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    return m


def test_other_families_pass_the_same_checks():
    from engine.models import hf_gpt2, hf_llama, hf_mistral, hf_qwen2, hf_qwen3, timm_vit

    llama = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "intermediate_size": 48, "vocab_size": 40, "max_position_embeddings": 16}
    models = [
        hf_gpt2.build({"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 40}, seed=1),
        hf_llama.build(llama, seed=1),
        hf_qwen2.build(llama, seed=1),  # Q/K/V biases, tested nonzero in test_adapters.py
        hf_mistral.build({**llama, "head_dim": 12}, seed=1),
        qk_gains(hf_qwen3.build({**llama, "head_dim": 8, "attention_bias": True}, seed=1)),  # QK-norm, 4 biases
        timm_vit.build({"img_size": 8, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 4,
                        "num_classes": 5}, seed=1),
    ]
    for m in models:
        checks = rows(invariance_checks(m, k=1))
        assert "residual_orth" in checks, m.family
        for r in checks.values():
            assert r["max_rel_change"] < 1e-10, (m.family, r)
        assert all(r["max_rel_change"] > 0 for r in break_tests(m)), m.family


def test_rope_breaking_grows_with_omega_times_context():
    arch = tiny(pe="rope", d_model=64, n_heads=2, n_ctx=64).arch()
    r = rope_breaking(arch)
    assert len(r) == 16 and r[0]["strength"] > 0.99
    s = [x["strength"] for x in r if x["omega"] * 63 <= torch.pi / 2]
    assert len(s) > 4 and all(a > b for a, b in itertools.pairwise(s))  # below a quarter turn, slower pairs break less
    slow = r[-1]
    assert slow["omega_ctx"] < 0.1 and abs(slow["strength"] - slow["omega"] * 63) < 1e-3  # ~ omega (T - 1)
    m = random_model(tiny(pe="rope", n_ctx=16))
    measured = [x["measured"] for x in rope_breaking(m.arch, model=m)]
    assert all(v > 0 for v in measured)
    assert rope_breaking(tiny(pe="learned").arch()) == []


def test_sinusoidal_table_is_badly_conditioned():
    sp = sinusoidal_spectrum(128, 128)
    assert sp["n_below_rtol"] > 0 and sp["numerical_rank"] < 128 and sp["condition"] > 1e6
    assert sp["singular_values"] == sorted(sp["singular_values"], reverse=True)


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama", "timm_vit"])
def test_symmetry_cli_on_real_ecosystem_directories(tmp_path, capsys, family):
    from engine.cli import main
    from engine.models import hf_gpt2, hf_llama, save_model, timm_vit

    build = {
        "hf_gpt2": lambda: hf_gpt2.build({"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16,
                                          "vocab_size": 40}, seed=2),
        "hf_llama": lambda: hf_llama.build({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                                            "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 40,
                                            "max_position_embeddings": 16}, seed=2),
        "timm_vit": lambda: timm_vit.build({"img_size": 8, "patch_size": 2, "in_chans": 1, "embed_dim": 32,
                                            "depth": 2, "num_heads": 4, "num_classes": 10}, seed=2),
    }[family]
    save_model(build(), tmp_path / family)
    assert main(["symmetry", str(tmp_path / family), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["checks"] and all(r["max_rel_change"] <= 1e-10 and r["exact"] for r in rep["checks"])
    assert {"heads", "qk", "vo", "mlp", "residual_orth"} <= {r["group"] for r in rep["checks"]}
    assert rep["group_dim"]["total"] == sum(rep["group_dim"]["by_kind"].values()) > 0
    assert main(["symmetry", str(tmp_path / family), "--dims-only", "--json"]) == 0
    dims = json.loads(capsys.readouterr().out)["group_dim"]
    assert dims["per_layer"] == rep["group_dim"]["per_layer"]
