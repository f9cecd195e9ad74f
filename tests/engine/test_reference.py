"""The reference family: every PE / norm / MLP variant, save-load bit identity, PE behaviour."""

import itertools
import math

import pytest
import torch
from ref_models import byte_tiny, inputs

from engine.errors import ModelError
from engine.models import family_of, load_model, save_model
from engine.models.reference import RefConfig, apply_rope, build, rope_frequencies, sinusoidal_table

PES = ["none", "learned", "sinusoidal", "rope"]


VARIANTS = [
    dict(task=t, pe=pe, **extra)
    for t, pe in itertools.product(["lm", "vit"], PES)
    for extra in [{}, {"norm": "layernorm", "bias": True, "mlp": "relu"}]
] + [
    {"pe": "rope", "rope_layout": "half", "mlp": "swiglu", "n_kv_heads": 2},
    {"pe": "rope", "rotary_dim": 4, "tied_embeddings": True, "head_bias": True},
    {"pe": "learned", "mlp": "gelu_tanh", "norm": "layernorm", "bias": True, "tied_embeddings": True},
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_save_load_is_bit_identical(tmp_path, kw):
    cfg = byte_tiny(**kw)
    m = build(cfg, seed=7, dtype=torch.float64)
    save_model(m, tmp_path / "m")
    assert family_of(tmp_path / "m").name == "reference"
    r = load_model(tmp_path / "m", dtype=torch.float64)
    assert r.arch == m.arch
    sa, sb = m.module.state_dict(), r.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = inputs(cfg)
    assert torch.equal(m.module(x), r.module(x))


def test_variants_differ_only_in_the_chosen_option():
    keys = {pe: set(build(byte_tiny(pe=pe)).module.state_dict()) for pe in PES}
    assert keys["none"] == keys["sinusoidal"] == keys["rope"]
    assert keys["learned"] - keys["none"] == {"embed.pos"}
    # same seed, same shapes: every shared tensor starts identical across PEs
    a, b = build(byte_tiny(pe="none"), seed=3).module.state_dict(), build(byte_tiny(pe="rope"), seed=3).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nope_vit_is_permutation_invariant_in_patches_and_learned_pe_is_not():
    for pe, invariant in [("none", True), ("learned", False), ("sinusoidal", False), ("rope", False)]:
        cfg = byte_tiny("vit", pe=pe)
        m = build(cfg, seed=1, dtype=torch.float64).module
        with torch.no_grad():
            if pe == "learned":
                m.embed.pos.normal_()
        x = inputs(cfg)
        p = cfg.patch_size
        # swap two patches: (row 0, col 0) <-> (row 3, col 2)
        y = x.clone()
        y[..., 0:p, 0:p], y[..., 6:8, 4:6] = x[..., 6:8, 4:6], x[..., 0:p, 0:p]
        change = (m(x) - m(y)).abs().max().item()
        assert (change < 1e-12) == invariant, (pe, change)


def test_nope_lm_without_positions_sees_a_multiset_in_layer_one():
    # one layer, causal, no PE: the last position attends over a set of earlier tokens
    cfg = byte_tiny(pe="none", n_layers=1)
    m = build(cfg, seed=2, dtype=torch.float64).module
    x = inputs(cfg, batch=1)
    y = x.clone()
    y[0, :-1] = x[0, :-1].flip(0)
    assert torch.allclose(m(x)[0, -1], m(y)[0, -1], rtol=0, atol=1e-12)
    cfg = byte_tiny(pe="rope", n_layers=1)
    m = build(cfg, seed=2, dtype=torch.float64).module
    assert (m(x)[0, -1] - m(y)[0, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_scores_depend_only_on_relative_offset(layout):
    d, T = 8, 40
    w = rope_frequencies(d, 10000.0)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * w  # [T, d/2]
    cos, sin = ang.cos(), ang.sin()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64).expand(1, 1, T, d)
    k = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64).expand(1, 1, T, d)
    qr, kr = apply_rope(q, cos, sin, layout)[0, 0], apply_rope(k, cos, sin, layout)[0, 0]  # [T, d]
    S = qr @ kr.T  # [T, T]: S[m, n] = <R_m q, R_n k>
    for off in (-5, 0, 3, 17):
        diag = torch.diagonal(S, off)
        assert (diag - diag[0]).abs().max() < 1e-12
    assert (S[0, 1] - S[0, 2]).abs() > 1e-3  # but it does depend on the offset
    # rotations preserve norms
    assert torch.allclose(qr.norm(dim=-1), q[0, 0].norm(dim=-1))


def test_rope_layouts_are_different_functions():
    x = inputs(byte_tiny(pe="rope"))
    a = build(byte_tiny(pe="rope", rope_layout="interleaved"), seed=4, dtype=torch.float64).module
    b = build(byte_tiny(pe="rope", rope_layout="half"), seed=4, dtype=torch.float64).module
    assert (a(x) - b(x)).abs().max() > 1e-4


def test_sinusoidal_table_matches_the_formula():
    P = sinusoidal_table(50, 16, torch.float64)
    t, i = 7, 3
    assert P[t, 2 * i].item() == pytest.approx(math.sin(t / 10000 ** (2 * i / 16)), abs=1e-15)
    assert P[t, 2 * i + 1].item() == pytest.approx(math.cos(t / 10000 ** (2 * i / 16)), abs=1e-15)


def test_bad_configs_and_checkpoints_get_one_sentence(tmp_path):
    with pytest.raises(ModelError, match="pe must be one of"):
        RefConfig(pe="alibi")
    with pytest.raises(ModelError, match="not divisible by n_heads"):
        RefConfig(d_model=30, n_heads=4)
    m = build(byte_tiny())
    save_model(m, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        load_model(tmp_path / "m")
    save_model(m, tmp_path / "n")
    with torch.no_grad():
        m.module.blocks[0].attn.W_Q[0, 0, 0] = float("nan")
    save_model(m, tmp_path / "n")
    with pytest.raises(ModelError, match="NaN"):
        load_model(tmp_path / "n")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text('{"family": "reference"}')
    (tmp_path / "p" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="pickled"):
        load_model(tmp_path / "p")
    with pytest.raises(ModelError, match="not a supported family"):
        family_of(tmp_path)


def test_too_long_input_is_refused():
    cfg = byte_tiny()
    m = build(cfg).module
    with pytest.raises(ModelError, match="exceeds the model's context"):
        m(torch.zeros(1, cfg.n_ctx + 1, dtype=torch.long))
