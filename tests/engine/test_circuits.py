"""The circuit path: doubled heads reproduce the interpolated QK / OV circuits, exactly, in float64."""

import hashlib
import json
import math
from dataclasses import replace

import pytest
import torch
from ref_models import byte_tiny, inputs, rel_err, tiny

from engine.align.pair import model_for
from engine.circuits import CircuitPath, half_columns
from engine.cli import main
from engine.errors import LMCError
from engine.evaluate import lm_eval_set
from engine.interpolate import LinearPath, interpolate, make_path
from engine.models import canonical, save_model
from engine.models.reference import RefConfig, apply_rope, build, rope_pairs
from engine.results import RunConfig, load_record
from engine.symmetry import apply, sample

F64 = torch.float64
TOL = 1e-10


def noisy(cfg, seed):
    """A float64 model with every parameter random (biases and norm gains too)."""
    m = build(cfg, seed=seed, dtype=F64)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in m.module.named_parameters():
            if name.endswith(".g"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=F64))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=F64))
    return m


def logits(model, x):
    with torch.no_grad():
        return model.module(x)


CONFIGS = {
    "nope": {"pe": "none"},
    "learned-bias": {"pe": "learned", "bias": True},
    "rope-interleaved": {"pe": "rope"},
    "rope-half-partial-bias": {"pe": "rope", "rope_layout": "half", "rotary_dim": 4, "bias": True},
    "rope-gqa": {"pe": "rope", "n_kv_heads": 2},
    "layernorm-gqa": {"pe": "learned", "norm": "layernorm", "bias": True, "n_kv_heads": 2},
    "vit": {"task": "vit", "pe": "learned", "bias": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_endpoints_are_the_models_themselves(name):
    cfg = tiny(vocab_size=64, **CONFIGS[name])
    a, b = noisy(cfg, 0), noisy(cfg, 1)
    path, x = CircuitPath(a, b), inputs(cfg, seed=7)
    assert path.work.arch.d_head == 2 * a.arch.d_head
    assert rel_err(logits(path.at(0.0), x), logits(a, x)) < TOL
    assert rel_err(logits(path.at(1.0), x), logits(b, x)) < TOL
    assert rel_err(logits(path.at(0.5), x), logits(a, x)) > 1e-3  # the path does move


def scores(model, layer, x, d):
    """Attention scores [B, h, T, T] of block `layer` on residual inputs x, scaled by 1/sqrt(d)."""
    p, arch = canonical(model, copy=False), model.arch
    pre = f"blocks.{layer}.attn"
    q = torch.einsum("btD,hDd->bhtd", x, p[f"{pre}.W_Q"]) + p.get(f"{pre}.b_Q", torch.zeros(1, 1, dtype=F64))[:, None]
    k = torch.einsum("btD,hDd->bhtd", x, p[f"{pre}.W_K"]) + p.get(f"{pre}.b_K", torch.zeros(1, 1, dtype=F64))[:, None]
    if arch.pe == "rope":
        T, r = x.shape[1], arch.rotary_dim
        cs = model.module.rope_cos[:T], model.module.rope_sin[:T]
        q = torch.cat([apply_rope(q[..., :r], *cs, arch.rope_layout), q[..., r:]], -1)
        k = torch.cat([apply_rope(k[..., :r], *cs, arch.rope_layout), k[..., r:]], -1)
    k = k.repeat_interleave(arch.n_heads // arch.n_kv_heads, 1)
    return q @ k.mT / math.sqrt(d)  # [B, h, T, T]


def ov(model, layer):
    """N_i = [W_V; b_V] W_O per query head on [x, 1]: [h, D + 1, D]."""
    p, arch = canonical(model, copy=False), model.arch
    pre = f"blocks.{layer}.attn"
    W = p[f"{pre}.W_V"]
    bias = p.get(f"{pre}.b_V", torch.zeros(W.shape[0], W.shape[-1], dtype=F64))
    V = torch.cat([W, bias[:, None]], 1).repeat_interleave(arch.n_heads // arch.n_kv_heads, 0)  # [h, D+1, d]
    return V @ p[f"{pre}.W_O"]


@pytest.mark.parametrize("name", ["nope", "learned-bias", "rope-interleaved", "rope-half-partial-bias", "rope-gqa"])
@pytest.mark.parametrize("lam", [0.3, 0.5, 0.85])
def test_doubled_heads_compute_the_interpolated_circuits(name, lam):
    cfg = tiny(vocab_size=64, **CONFIGS[name])
    a, b = noisy(cfg, 0), noisy(cfg, 1)
    work = CircuitPath(a, b).at(lam)
    d = a.arch.d_head
    x = torch.randn(2, cfg.n_ctx, cfg.d_model, generator=torch.Generator().manual_seed(3), dtype=F64)
    for layer in range(cfg.n_layers):
        want = (1 - lam) * scores(a, layer, x, d) + lam * scores(b, layer, x, d)
        assert rel_err(scores(work, layer, x, 2 * d), want) < TOL
        assert rel_err(ov(work, layer), (1 - lam) * ov(a, layer) + lam * ov(b, layer)) < TOL
    if cfg.pe == "rope":  # the converse: the doubled head's own RoPE frequencies would not do
        plain = build(RefConfig(**{**cfg.__dict__, "d_head": 2 * d, "rotary_dim": 2 * cfg.rot_dim}), dtype=F64)
        work.module.rope_cos, work.module.rope_sin = plain.module.rope_cos, plain.module.rope_sin
        want = (1 - lam) * scores(a, 0, x, d) + lam * scores(b, 0, x, d)
        assert rel_err(scores(work, 0, x, 2 * d), want) > 1e-3


@pytest.mark.parametrize("layout,r,d", [("interleaved", 8, 8), ("half", 8, 8), ("half", 4, 8), ("interleaved", 0, 8)])
def test_half_columns_pair_each_endpoint_with_its_own_frequencies(layout, r, d):
    ia, ib = half_columns(d, r, layout)
    assert sorted(torch.cat([ia, ib]).tolist()) == list(range(2 * d))
    if r:
        i1, i2 = rope_pairs(r, layout)
        J1, J2 = rope_pairs(2 * r, layout)
        pair_of = {int(c): j for j, c in enumerate(J1)} | {int(c): j for j, c in enumerate(J2)}
        assert [pair_of[int(c)] for c in ia[i1]] == list(range(r // 2))
        assert [pair_of[int(c)] for c in ib[i1]] == [r // 2 + j for j in range(r // 2)]
        assert [pair_of[int(c)] for c in ia[i2]] == list(range(r // 2))
    assert all(c >= 2 * r for c in torch.cat([ia[r:], ib[r:]]).tolist())


@pytest.mark.parametrize("name", ["nope", "learned-bias", "rope-half-partial-bias"])
def test_circuit_path_ignores_within_head_maps_that_move_the_weight_path(name):
    cfg = tiny(vocab_size=64, **CONFIGS[name])
    a, b = noisy(cfg, 0), noisy(cfg, 1)
    g = sample(b.arch, ("qk", "vo"), seed=5)  # GL(d) on Q/K and V/O (the RoPE commutant with RoPE)
    b2 = model_for(b, b.arch, apply(b.arch, g, canonical(b)))
    x = inputs(cfg, seed=7)
    assert rel_err(logits(b2, x), logits(b, x)) < TOL  # a symmetry of B
    assert rel_err(logits(CircuitPath(a, b2).at(0.5), x), logits(CircuitPath(a, b).at(0.5), x)) < TOL
    assert rel_err(logits(LinearPath(a, b2).at(0.5), x), logits(LinearPath(a, b).at(0.5), x)) > 1e-3


def test_interpolate_records_the_path_and_refuses_unknown_kinds():
    cfg = byte_tiny()
    a, b = build(cfg, seed=0), build(cfg, seed=1)
    es = lm_eval_set("val", 512, n_ctx=16)
    w, c = interpolate(a, b, es, points=3), interpolate(a, b, es, points=3, path="circuits")
    assert (w["path"], c["path"]) == ("weights", "circuits")
    assert c["loss"][0] == pytest.approx(w["loss"][0], rel=1e-5) and c["loss"][2] == pytest.approx(w["loss"][2], rel=1e-5)
    assert c["loss"][1] != pytest.approx(w["loss"][1], rel=1e-5)
    with pytest.raises(LMCError, match="'circuit' is not a kind of path"):
        make_path(a, b, "circuit")


def test_cli_align_on_the_circuit_path_records_it_and_keeps_old_hashes(tmp_path, capsys):
    cfg = byte_tiny(pe="rope")
    for s in (0, 1):
        save_model(build(cfg, seed=s), tmp_path / f"m{s}")
    out = tmp_path / "r.json"
    args = ["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--points", "3", "--eval-items", "512"]
    assert main([*args, "--path", "circuits", "--out", str(out)]) == 0
    rec = load_record(out)
    assert rec["path"] == rec["config"]["path"] == "circuits"
    assert "weight, circuits path" in capsys.readouterr().out
    weights = RunConfig("a", "b", "weight")
    assert weights.hash() != replace(weights, path="circuits").hash()
    assert weights.hash() == hashlib.sha256(json.dumps(  # the hash of a config from before paths had a choice
        {k: v for k, v in weights.to_dict().items() if k not in ("device", "path")}, sort_keys=True).encode()).hexdigest()[:16]
    assert main([*args, "--path", "circuits", "--save-merged", str(tmp_path / "merged")]) == 2
    assert "cannot write a model of the circuit path under RoPE" in capsys.readouterr().err
    with pytest.raises(LMCError, match="path must be one of weights, circuits, not 'circuit'"):
        RunConfig("a", "b", path="circuit")
