"""Symmetry specs: built from an Arch, validated against the canonical params, refusing what they cannot describe."""

from dataclasses import replace

import pytest
import torch
from ref_models import tiny

from engine.errors import SpecError
from engine.models import canonical
from engine.models.reference import build
from engine.spec import KINDS, ROLES, STRUCTURES, build_spec, norms_are_folded


def spec_of(**kw):
    m = build(tiny(**kw), dtype=torch.float64)
    return m, canonical(m), build_spec(m.arch, canonical(m))


VARIANTS = [
    {"pe": "none"}, {"pe": "learned", "bias": True, "norm": "layernorm"}, {"pe": "sinusoidal", "mlp": "relu"},
    {"pe": "rope", "rope_layout": "half", "n_kv_heads": 2, "mlp": "swiglu"},
    {"pe": "rope", "rotary_dim": 4, "tied_embeddings": True},
    {"task": "vit", "pe": "learned", "bias": True, "head_bias": True, "norm": "layernorm"},
    {"task": "vit", "pe": "rope"},
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_key_is_described_and_every_action_is_well_formed(kw):
    _, p, spec = spec_of(**kw)
    assert set(spec.params) == set(p)
    for k, ps in spec.params.items():
        assert ps.shape == tuple(p[k].shape) and len(ps.axes) == p[k].dim()
        for ax, acts in enumerate(ps.axes):
            for a in acts:
                assert a.group in spec.groups and a.role in ROLES
                if a.by_axis is not None:  # one matrix per KV group, selected along by_axis
                    g = spec.groups[a.group]
                    assert p[k].shape[a.by_axis] == g.n * a.per and p[k].shape[ax] == g.size
    assert all(g.structure in STRUCTURES for g in spec.groups.values())
    assert set(spec.kinds) <= set(KINDS)


def test_inverse_index_names_the_axes_each_group_acts_on():
    _, _, spec = spec_of(pe="rope", bias=True, n_kv_heads=2, mlp="swiglu")
    qk = {(k, ax, a.role) for k, ax, a in spec.axes_of("blocks.0.qk")}
    assert qk == {("blocks.0.attn.W_Q", 2, "right"), ("blocks.0.attn.b_Q", 1, "right"),
                  ("blocks.0.attn.W_K", 2, "right_inv_t"), ("blocks.0.attn.b_K", 1, "right_inv_t")}
    res = {(k, a.role) for k, _, a in spec.axes_of("residual")}
    assert ("embed.tok", "right") in res and ("head.W", "right_inv_t") in res
    assert ("blocks.1.mlp.W_gate", "right_inv_t") in res
    assert ("blocks.0.norm1.g", "norm") in res
    heads = {(k, a.role) for k, _, a in spec.axes_of("blocks.1.heads")}
    assert ("blocks.1.attn.W_K", "perm_kv") in heads and ("blocks.1.attn.W_O", "perm") in heads
    mlp = {k for k, _, _ in spec.axes_of("blocks.0.mlp")}
    assert {"blocks.0.mlp.W_in", "blocks.0.mlp.W_gate", "blocks.0.mlp.W_out", "blocks.0.mlp.b_in"} <= mlp
    scale = {k for k, _, _ in spec.axes_of("blocks.0.mlp_scale")}
    assert scale == {"blocks.0.mlp.W_in", "blocks.0.mlp.b_in", "blocks.0.mlp.W_out"}  # the up branch, not the gate


def test_kinds_groups_and_flags_follow_the_architecture():
    _, _, s = spec_of(pe="rope", rotary_dim=4, mlp="relu")
    assert s.kinds == KINDS
    _, _, sb = spec_of(pe="learned", head_bias=True, tied_embeddings=True)
    assert sb.params["head.b"].invariant and "head.W" not in sb.params
    g = s.groups["blocks.0.qk"]
    assert (g.structure, g.rope_layout, g.rotary_dim) == ("rope_commutant", "interleaved", 4)
    assert s.groups["blocks.0.mlp_scale"].structure == "positive_scaling"
    assert "H(4)" in s.describe("qk") and "GL(4)" in s.describe("qk")
    _, _, s = spec_of(pe="none", mlp="gelu")
    assert "mlp_scale" not in s.kinds and s.groups["blocks.1.qk"].structure == "gl"
    _, _, s = spec_of(mlp="swiglu")
    assert s.groups["blocks.0.mlp_scale"].structure == "nonzero_scaling"


def test_sinusoidal_residual_is_declared_approximate():
    _, _, s = spec_of(pe="sinusoidal")
    assert s.approximate == {"residual_perm", "residual_orth"} and not s.groups["residual"].exact
    for pe in ("none", "learned", "rope"):
        assert spec_of(pe=pe)[2].approximate == frozenset()


def test_residual_rotation_requires_folded_norms():
    m, p, s = spec_of(norm="rmsnorm")
    assert s.norms_folded and "residual_orth" not in s.requires  # fresh gains are exactly 1
    p["blocks.0.norm2.g"] = p["blocks.0.norm2.g"] * 1.5
    s = build_spec(m.arch, p)
    assert not norms_are_folded(m.arch, p) and "fold_norms" in s.requires["residual_orth"]
    _, _, s = spec_of(norm="layernorm")
    assert "layernorm_to_rmsnorm" in s.requires["residual_orth"]


def test_state_dict_mismatches_fail_with_a_sentence():
    m, p, _ = spec_of(pe="learned", bias=True)
    missing = dict(p)
    del missing["blocks.1.attn.b_K"]
    with pytest.raises(SpecError, match="expects parameter 'blocks.1.attn.b_K'"):
        build_spec(m.arch, missing)
    with pytest.raises(SpecError, match="'blocks.0.attn.alibi_slopes' is not described"):
        build_spec(m.arch, {**p, "blocks.0.attn.alibi_slopes": torch.zeros(4)})
    bad = {**p, "blocks.0.attn.W_K": torch.zeros(4, 32, 7)}
    with pytest.raises(SpecError, match=r"'blocks.0.attn.W_K' has shape \[4, 32, 7\]"):
        build_spec(m.arch, bad)
    with pytest.raises(SpecError, match="embed.pos"):
        build_spec(m.arch, {**p, "embed.pos": torch.zeros(15, 32)})


@pytest.mark.parametrize("change, why", [
    ({"pe": "alibi"}, "positional encoding 'alibi'"),
    ({"mlp": "reglu"}, "MLP activation 'reglu'"),
    ({"n_kv_heads": 3}, "do not split into 3 KV groups"),
    ({"pe": "rope", "rope_layout": "interleaved", "rotary_dim": 3}, "rotary_dim 3 must be even"),
    ({"pe": "rope", "rope_layout": "zigzag", "rotary_dim": 8}, "RoPE pairing 'zigzag'"),
    ({"rotary_dim": 4}, "rotary_dim is 4 without RoPE"),
    ({"norm": "batchnorm"}, "norm 'batchnorm'"),
])
def test_architectures_a_spec_cannot_describe_are_refused(change, why):
    m, p, _ = spec_of(pe="none")
    with pytest.raises(SpecError, match=why):
        build_spec(replace(m.arch, **change), p)


def test_specs_of_the_other_families_validate_their_canonical_params():
    from engine.models import hf_gpt2, hf_llama, timm_vit

    models = [
        hf_gpt2.build({"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 40}),
        hf_llama.build({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                        "intermediate_size": 48, "vocab_size": 40, "max_position_embeddings": 16}),
        timm_vit.build({"img_size": 8, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 4,
                        "num_classes": 5}),
    ]
    for m in models:
        s = build_spec(m.arch, canonical(m))
        assert set(s.params) == set(canonical(m))
    assert build_spec(models[1].arch, canonical(models[1])).groups["blocks.0.qk"].rope_layout == "half"
