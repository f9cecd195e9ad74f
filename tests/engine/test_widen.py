"""Width-heterogeneous pairs (engine/widen.py, docs/MATH.md section 8): the lift computes exactly the narrow
model's function, what makes it exact (the stream scale, not a per-model eps), what it refuses, planted
recovery across widths, and the run, the CLI and the store's build."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from ref_models import random_model, tiny

from engine.align.run import align
from engine.errors import ArchitectureMismatch, SpecError
from engine.interpolate import LinearPath
from engine.models import canonical, model_logits, save_model
from engine.models.reference import RefConfig, Transformer
from engine.results import load_record
from engine.surgery import fold_norms
from engine.symmetry import apply, invert, sample
from engine.widen import lift, lift_refusal, widen_models

F64 = torch.float64


def inputs(cfg: RefConfig, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if cfg.task == "lm":
        return torch.randint(0, cfg.vocab_size, (n, cfg.n_ctx), generator=g)
    return torch.randn(n, cfg.in_chans, cfg.image_size, cfg.image_size, generator=g, dtype=F64)


def rel_err(m0, m1, x) -> float:
    with torch.no_grad():
        y0, y1 = model_logits(m0, x), model_logits(m1, x)
    return float((y0 - y1).abs().max() / y0.abs().max())


CASES = {
    "lm, no PE": {},
    "vit, learned PE": {"task": "vit", "pe": "learned"},
    "lm, RoPE": {"pe": "rope"},
    "lm, partial RoPE, half pairs": {"pe": "rope", "rope_layout": "half", "rotary_dim": 4},
    "lm, RoPE + QK-norm": {"pe": "rope", "qk_norm": True},
    "lm, LayerNorm with biases": {"pe": "learned", "norm": "layernorm", "bias": True},
    "lm, LayerNorm, tied": {"norm": "layernorm", "bias": True, "tied_embeddings": True},
    "lm, tied": {"pe": "none", "tied_embeddings": True},
    "lm, SwiGLU, GQA": {"pe": "rope", "mlp": "swiglu", "n_kv_heads": 2},
    "vit, parallel, ReLU, biases": {"task": "vit", "pe": "learned", "parallel_residual": True, "mlp": "relu",
                                    "bias": True},
}
TARGETS = {  # from D 32, 4 heads of 8, MLP 64
    "every width doubled": {"d_model": 64, "d_head": 16, "d_mlp": 128},
    "more heads of the same width": {"d_model": 48, "n_heads": 6},
    "more and wider heads, odd MLP": {"d_model": 64, "n_heads": 8, "d_head": 16, "d_mlp": 100},
}


@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_the_lift_computes_the_same_function(kw, target):
    cfg = tiny(**kw)
    m = random_model(cfg)
    wide = lift(m, **target)
    assert wide.family == "reference" and wide.arch.norm == "rmsnorm" and wide.arch.norm_eps == m.arch.norm_eps
    assert (wide.arch.d_model, wide.arch.d_mlp) == (target["d_model"], target.get("d_mlp", 64))
    assert wide.arch.n_heads == target.get("n_heads", 4) and wide.arch.d_head == target.get("d_head", 8)
    assert rel_err(m, wide, inputs(cfg)) < 1e-12


def test_other_families_lift_through_their_reference_twin():
    from engine.models import hf_gpt2, timm_vit

    gpt2 = hf_gpt2.build({"vocab_size": 256, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4,
                          "bos_token_id": 0, "eos_token_id": 0}, seed=0, dtype=F64)  # LayerNorm, tied
    vit = timm_vit.build({"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 32,
                          "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}, seed=0, dtype=F64)
    for m, x in ((gpt2, torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))),
                 (vit, inputs(tiny(task="vit")))):
        with torch.no_grad():
            for p in m.module.parameters():  # away from the initialisation: unit gains, zero biases
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64))
        wide = lift(m, d_model=64, d_head=16, d_mlp=128)
        assert wide.family == "reference" and wide.arch.norm == "rmsnorm"
        assert rel_err(m, wide, x) < 1e-12


def test_the_padded_units_are_zero_and_the_stream_is_scaled():
    m = random_model(tiny(task="vit", pe="learned"))
    p, q = canonical(m), canonical(lift(m, d_model=64, d_head=16, d_mlp=128))
    c = math.sqrt(2)
    assert torch.allclose(q["embed.pos"][:, :32], c * p["embed.pos"], rtol=1e-15) and not q["embed.pos"][:, 32:].any()
    assert not q["blocks.0.mlp.W_in"][:, 64:].any() and not q["blocks.0.mlp.W_out"][64:].any()
    assert not q["blocks.0.attn.W_V"][..., 8:].any() and not q["blocks.0.attn.W_O"][:, 8:].any()
    assert torch.allclose(q["blocks.1.norm2.g"][:32], p["blocks.1.norm2.g"] / c, rtol=1e-15)
    assert torch.allclose(q["blocks.0.attn.W_Q"][:, :32, :8], 2 ** 0.25 * p["blocks.0.attn.W_Q"], rtol=1e-15)


WRITERS = (".attn.W_O", ".attn.b_O", ".mlp.W_out", ".mlp.b_out")  # and every embed.*


def test_eps_is_why_the_stream_is_scaled():
    """Padding without the stream scale (writers not scaled, the gains as in the lift) doubles RMSNorm's eps:
    not exact. Halving the eps of that model restores it, but then the two endpoints of a path need two eps."""
    cfg = tiny(task="vit", pe="learned", norm_eps=1e-3)  # a larger eps makes the difference plain
    m = random_model(cfg)
    wide = lift(m, d_model=64)
    c = math.sqrt(2)
    p = {k: v / c if k.startswith("embed.") or k.endswith(WRITERS) else v for k, v in canonical(wide).items()}
    for eps, ok in ((cfg.norm_eps, False), (cfg.norm_eps / 2, True)):
        w = RefConfig.from_dict({**wide.config, "norm_eps": eps})
        module = Transformer(w, init=False).to(F64)
        module.load_state_dict(p)
        unscaled = replace(wide, module=module, config=w.to_dict(), arch=w.arch())
        err = rel_err(m, unscaled, inputs(cfg))
        assert (err < 1e-12) if ok else (err > 1e-6), (eps, err)


def test_a_lift_into_a_smaller_or_equal_shape_or_across_kinds_is_refused():
    m = random_model(tiny(task="vit", pe="learned"))
    with pytest.raises(SpecError, match="residual width D is 32, more than the 16"):
        lift(m, d_model=16)
    with pytest.raises(SpecError, match="MLP width is 64, more than the 32"):
        lift(m, d_model=64, d_mlp=32)
    with pytest.raises(SpecError, match="already has the wider shape"):
        lift(m)
    with pytest.raises(SpecError, match="sinusoidal"):
        lift(random_model(tiny(pe="sinusoidal")), d_model=64)
    with pytest.raises(SpecError, match="KV groups hold 2 query heads"):
        lift(random_model(tiny(n_kv_heads=2)), n_heads=8, n_kv_heads=8)
    with pytest.raises(SpecError, match="multiple"):
        lift(random_model(tiny(pe="rope", rotary_dim=4)), d_head=12, rotary_dim=6)
    a = tiny(task="vit", pe="learned").arch()
    for b, match in ((tiny(task="vit", pe="learned", d_model=16).arch(), "more than the 16"),
                     (tiny(pe="learned", d_model=64).arch(), "differ in task"),
                     (tiny(task="vit", pe="rope", d_model=64).arch(), "differ in positional encoding"),
                     (tiny(task="vit", pe="learned", d_model=64, n_layers=3).arch(), "a lift adds width, not depth"),
                     (tiny(task="vit", pe="learned", d_model=64, norm_eps=1e-6).arch(), "differ beyond their widths")):
        why = lift_refusal(a, b)
        assert why is not None and match in why and why.count(".") <= 2, why
    # Gemma's embedding enters times sqrt(D): two widths, two scales
    gemma = (replace(tiny(pe="rope").arch(), embed_scale=32**0.5), replace(tiny(pe="rope", d_model=64).arch(),
                                                                          embed_scale=8.0))
    why = lift_refusal(*gemma)
    assert why is not None and "times 5.65685 and model B's times 8 (Gemma's sqrt(D))" in why and "\n" not in why
    assert lift_refusal(a, tiny(task="vit", pe="learned", d_model=64, d_mlp=128).arch()) is None
    wide, narrow = random_model(tiny(task="vit", pe="learned", d_model=64)), m
    with pytest.raises(ArchitectureMismatch, match="more than the 32"):
        widen_models(wide, narrow)


PLANTED = {  # (model, lifted widths, relative tolerance on the recovered parameters)
    "vit learned, D and MLP": ({"task": "vit", "pe": "learned"}, {"d_model": 64, "d_mlp": 128}, 1e-12),
    "lm rope, D and MLP": ({"pe": "rope"}, {"d_model": 64, "d_mlp": 128}, 1e-12),
    "vit learned, heads wider too": ({"task": "vit", "pe": "learned"}, {"d_model": 64, "d_head": 16, "d_mlp": 128}, 1e-5),
    "lm rope, heads wider too": ({"pe": "rope"}, {"d_model": 64, "d_head": 16, "d_mlp": 128}, 1e-5),
}


@pytest.mark.parametrize(("kw", "target", "tol"), PLANTED.values(), ids=PLANTED.keys())
def test_weight_matching_recovers_a_planted_element_of_the_wide_group(kw, target, tol):
    """B = g . lift(A) for a random g of B's width (every class; the residual rotation mixes the padding into
    the real coordinates): weight matching finds g^-1 on the real units, B comes back onto lifted A and the
    path is flat. With padded head dimensions the within-head fits are rank deficient (every map of the
    padded dimensions is optimal), so the parameters come back only to about 1e-9 to 1e-6 relative, in
    directions no logit sees, where the solver's path through the flat directions differs by CPU (the ViT:
    1.3e-6 on an AMD EPYC with AVX-512, below 1e-6 on the earlier CPUs); the path stays exact to 1e-12."""
    cfg = tiny(**kw)
    a = random_model(cfg)
    lifted = lift(a, **target)
    arch, p = fold_norms(lifted.arch, canonical(lifted))
    g = sample(arch, seed=3)
    b = replace(lifted, module=Transformer(RefConfig.from_dict(lifted.config), init=False).to(F64), name="B")
    b.module.load_state_dict(apply(arch, g, p))
    x = inputs(cfg)
    assert rel_err(a, b, x) < 1e-11  # B computes A's function in other coordinates
    al = align(lifted, b, "weight")
    want = invert(arch, g)  # B onto lifted A undoes g on every real unit
    real_d, real_m = cfg.d_model, cfg.d_mlp
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm[:real_m], exp.mlp_perm[:real_m])
    assert (al.out.g.residual[:, :real_d] - want.residual[:, :real_d]).abs().max() < 1e3 * tol
    pa, pb = canonical(al.model_a), canonical(al.model_b)
    dist = math.sqrt(sum(float((pa[k] - pb[k]).square().sum()) for k in pa))
    assert dist < tol * math.sqrt(sum(float(v.square().sum()) for v in pa.values()))
    for lam in (0.25, 0.5, 0.75):
        assert rel_err(a, LinearPath(al.model_a, al.model_b).at(lam), x) < 1e-12


def test_widen_models_lifts_a_layernorm_model_next_to_its_rewritten_wide_partner():
    a = random_model(tiny(norm="layernorm", bias=True, tied_embeddings=True))
    b = random_model(tiny(norm="layernorm", bias=True, tied_embeddings=True, d_model=64, d_mlp=128), seed=1)
    la, lb = widen_models(a, b)
    assert la.arch == lb.arch and la.arch.norm == "rmsnorm"
    x = inputs(tiny())
    assert rel_err(a, la, x) < 1e-12 and rel_err(b, lb, x) < 1e-12


def vit_pair(tmp_path, d_wide: int = 64):
    cfg = tiny(task="vit", pe="learned")
    save_model(random_model(cfg, seed=0, std=0.2), tmp_path / "narrow")
    save_model(random_model(replace(cfg, d_model=d_wide, d_mlp=2 * d_wide), seed=1, std=0.2), tmp_path / "wide")
    return str(tmp_path / "narrow"), str(tmp_path / "wide")


def test_the_cli_writes_a_record_whose_lift_and_endpoints_check(tmp_path, capsys):
    from engine.cli import main

    a, b = vit_pair(tmp_path)
    out = tmp_path / "rec.json"
    assert main(["widen", a, b, "--method", "weight", "--points", "3", "--eval-items", "16", "--dtype", "float64",
                 "--no-attribution", "--out", str(out)]) == 0, capsys.readouterr().err
    rec = load_record(out)  # a result record the app's views read
    assert rec["method"] == "weight" and (rec["model_a"], rec["model_b"]) == (a, b) and len(rec["loss"]) == 3
    lift_ = rec["lift"]
    assert lift_["widths_a"]["d_model"] == 32 and lift_["widths_b"]["d_model"] == rec["arch"]["d_model"] == 64
    assert lift_["rel_diff"] < 1e-12 and lift_["exact"] and lift_["loss_a_lifted"] == rec["endpoint_loss_a"]
    assert lift_["accuracy_a"] == lift_["accuracy_a_lifted"] == rec["accuracy"][0]
    assert rec["endpoint_check"]["rel_diff"] < 1e-12 and rec["endpoint_check"]["exact"]
    assert "residual_orth" in rec["classes"] and rec["alignment"]["diagnostics"]["converged"]
    printed = capsys.readouterr().out
    assert "lift: D 32 -> 64" in printed and "lift check" in printed and f"wrote {out}" in printed
    assert main(["widen", b, a, "--points", "3"]) == 2  # B into A: refused before anything loads
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Model wide cannot be lifted into model narrow's shape") and "\n" not in err


def test_cache_build_widen_writes_naive_and_weight_once(tmp_path, monkeypatch, capsys):
    from engine import api, builders
    from engine.cli import main

    a, b = vit_pair(tmp_path)
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setattr(builders, "widen_pairs", lambda: [(a, b)])
    monkeypatch.setattr(api, "WIDEN_METHODS", ("naive", "weight"))
    assert main(["cache", "build", "--widen", "--eval-items", "16"]) == 0, capsys.readouterr().err
    recs, skipped = api.widen_records()
    assert skipped == [] and [r["method"] for r in recs] == ["naive", "weight"]
    naive, weight = recs
    assert naive["endpoint_loss_a"] == pytest.approx(weight["endpoint_loss_a"], rel=1e-5)
    assert "barrier_folded" in naive and naive["lift"]["exact"] and weight["lift"]["exact"]
    stamp = api.widen_stamp()
    monkeypatch.setattr(builders, "widen_pair", lambda *a, **k: pytest.fail("a stored record was recomputed"))
    assert main(["cache", "build", "--widen", "--eval-items", "16"]) == 0, capsys.readouterr().err
    assert api.widen_stamp() == stamp
