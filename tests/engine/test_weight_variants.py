"""Weight-matching settings (WeightSettings): the defaults are today's matching bit for bit, every variant
still recovers a planted element exactly, each variant computes what it says, and bad settings are refused."""

import itertools

import pytest
import torch
from ref_models import make_case, planted

from engine.align.pair import prepare_pair
from engine.align.run import align
from engine.align.weight import (
    ResidualFit,
    Terms,
    WeightSettings,
    head_cost,
    match_mlp,
    residual_axes,
    weight_match,
)
from engine.classes import default_classes
from engine.errors import LMCError
from engine.models import canonical
from engine.spec import build_spec
from engine.symmetry import invert

F64 = torch.float64
VARIANTS = {
    "head unsquared": {"head_cost": "unsquared"},
    "head normalised": {"head_cost": "normalised"},
    "mlp normalised": {"mlp_score": "normalised"},
    "block scale": {"block_scale": True},
    "seen tokens": {"seen_tokens": range(0, 256, 3)},  # every third id of the tiny models' 256 tokens
    "all together": {"head_cost": "normalised", "mlp_score": "normalised", "block_scale": True,
                     "seen_tokens": range(0, 256, 3)},
}


def unrelated(name: str):
    """A and an unrelated B of the same architecture (B = A plus noise of A's own size)."""
    a, b = make_case(name), make_case(name)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in b.module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=F64))
    return a, b


def same_element(g1, g2) -> bool:
    return torch.equal(g1.residual, g2.residual) and all(
        torch.equal(x.head_perm, y.head_perm) and torch.equal(x.mlp_perm, y.mlp_perm) and torch.equal(x.qk, y.qk)
        and torch.equal(x.vo, y.vo) and torch.equal(x.mlp_scale, y.mlp_scale) for x, y in zip(g1.layers, g2.layers))


@pytest.mark.parametrize("name", ["lm-learned", "lm-layernorm-bias-relu"])
def test_default_settings_give_the_element_of_a_call_without_settings(name):
    a, b = unrelated(name)
    plain = align(a, b, "weight")
    given = align(a, b, "weight", weight=WeightSettings())
    all_rows = align(a, b, "weight", weight=WeightSettings(seen_tokens=range(a.arch.n_out)))
    assert len(plain.out.info["sweeps"]) > 1  # a real descent, not a one-sweep fixed point
    assert same_element(plain.out.g, given.out.g) and same_element(plain.out.g, all_rows.out.g)
    for other in (given, all_rows):
        assert [(s["objective"], s["residual_change"]) for s in plain.out.info["sweeps"]] == [
            (s["objective"], s["residual_change"]) for s in other.out.info["sweeps"]]
    assert "settings" not in given.out.info
    assert all_rows.out.info["settings"]["seen_tokens"] == a.arch.n_out  # differs from the default: recorded


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["lm-learned", "lm-rope-half-gqa-swiglu", "hf_gpt2"])
def test_every_variant_recovers_a_planted_element(name, variant):
    a = make_case(name)
    b, g_star, kinds = planted(a)
    st = WeightSettings(**VARIANTS[variant])
    al = align(a, b, "weight", weight=st)
    assert al.classes == kinds and al.out.info["settings"] == st.record()
    want = invert(al.pair.arch, g_star)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
        assert (got.qk - exp.qk).abs().max() < 1e-8 and (got.vo - exp.vo).abs().max() < 1e-8
    assert (al.out.g.residual - want.residual).abs().max() < 1e-9
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params)
    assert err < 1e-10


def test_head_cost_variants_equal_the_explicit_circuit_distances():
    a, b = unrelated("lm-rope-half-gqa-swiglu")
    pa, pb, arch = canonical(a), canonical(b), a.arch
    rep = arch.n_heads // arch.n_kv_heads

    def explicit(p):  # [h, D, D] circuits, formed in full (this case has no attention biases)
        M = p["blocks.1.attn.W_Q"] @ p["blocks.1.attn.W_K"].repeat_interleave(rep, 0).mT
        return M - M.mean(-1, keepdim=True), p["blocks.1.attn.W_V"].repeat_interleave(rep, 0) @ p["blocks.1.attn.W_O"]

    def dist(X, Y):  # [h, h] Frobenius distances
        return (X[:, None] - Y[None]).square().sum((-2, -1)).sqrt()

    def unit(X):
        return X / X.square().sum((-2, -1), keepdim=True).sqrt()

    assert "blocks.1.attn.b_Q" not in pa
    (Ma, Na), (Mb, Nb) = explicit(pa), explicit(pb)
    want = {"squared": dist(Ma, Mb) ** 2 + dist(Na, Nb) ** 2, "unsquared": dist(Ma, Mb) + dist(Na, Nb),
            "normalised": dist(unit(Ma), unit(Mb)) ** 2 + dist(unit(Na), unit(Nb)) ** 2}
    for cost, w in want.items():
        assert torch.allclose(head_cost(arch, pa, pb, 1, cost), w, rtol=1e-10, atol=1e-12), cost
    assert not torch.allclose(want["unsquared"], want["squared"]) and float(want["normalised"].max()) <= 8


def test_normalised_mlp_rows_score_by_cosines_and_can_change_the_matching():
    a, b = unrelated("lm-learned")
    pa, pb, arch = canonical(a), canonical(b), a.arch
    kinds = frozenset({"mlp"})
    with torch.no_grad():  # one neuron of B much larger than the rest: the inner product prefers it
        pb["blocks.0.mlp.W_in"][:, 5] *= 50
        pb["blocks.0.mlp.W_out"][5] *= 50
    inner, _ = match_mlp(arch, pa, pb, 0, kinds)
    cos, _ = match_mlp(arch, pa, pb, 0, kinds, "normalised")
    assert not torch.equal(inner, cos)
    scaled = {k: v.clone() for k, v in pb.items()}  # cosines ignore each neuron's size
    scaled["blocks.0.mlp.W_in"] *= torch.linspace(0.5, 3, arch.d_mlp, dtype=F64)
    scaled["blocks.0.mlp.W_out"] *= torch.linspace(2, 0.1, arch.d_mlp, dtype=F64)[:, None]
    assert torch.equal(match_mlp(arch, pa, scaled, 0, kinds, "normalised")[0], cos)


def test_block_scale_weighs_by_fan_in_and_seen_rows_leave_the_others_out():
    a, b = unrelated("lm-learned")
    kinds = default_classes(a.arch)
    pair = prepare_pair(a, b, kinds)
    spec, arch = pair.spec, pair.arch
    res = residual_axes(spec, False)
    fit = ResidualFit(spec, WeightSettings(block_scale=True), res)
    D, h, d, m, V = arch.d_model, arch.n_heads, arch.d_head, arch.d_mlp, arch.n_out
    assert fit.weights["blocks.0.attn.W_Q"] == 1 / D and fit.weights["blocks.0.attn.W_O"] == 1 / (h * d)
    assert fit.weights["blocks.0.mlp.W_out"] == 1 / m and fit.weights["embed.tok"] == 1 / V
    seen = [1, 4, 9]
    terms, want = Terms(D), Terms(D)
    ResidualFit(spec, WeightSettings(seen_tokens=seen), res).add(terms, res, "embed.tok", pair.params_a["embed.tok"],
                                                                 pair.params_b["embed.tok"])
    want.add(res, "embed.tok", pair.params_a["embed.tok"][seen], pair.params_b["embed.tok"][seen])
    assert torch.equal(terms.M, want.M) and terms.sq == want.sq
    full = Terms(D)
    full.add(res, "embed.tok", pair.params_a["embed.tok"], pair.params_b["embed.tok"])
    assert not torch.allclose(full.M, terms.M)


def test_bad_settings_are_refused_with_one_sentence():
    with pytest.raises(LMCError, match="head cost 'cubed' is not available; choose one of squared"):
        WeightSettings(head_cost="cubed")
    with pytest.raises(LMCError, match="MLP score 'dot' is not available"):
        WeightSettings(mlp_score="dot")
    with pytest.raises(LMCError, match="block_scale must be True or False"):
        WeightSettings(block_scale=1)
    with pytest.raises(LMCError, match="non-empty set of non-negative integer token ids"):
        WeightSettings(seen_tokens=[])
    with pytest.raises(LMCError, match="non-empty set of non-negative integer token ids"):
        WeightSettings(seen_tokens=[3, -1])
    a, b = make_case("lm-learned"), make_case("lm-learned")
    with pytest.raises(LMCError, match=f"seen token id {a.arch.n_out} is outside the vocabulary of {a.arch.n_out} tokens"):
        align(a, b, "weight", weight=WeightSettings(seen_tokens=[0, a.arch.n_out]))
    v = make_case("vit-learned")
    with pytest.raises(LMCError, match="seen_tokens applies to language models only"):
        align(v, make_case("vit-learned"), "weight", weight=WeightSettings(seen_tokens=[0]))


@pytest.mark.parametrize("bad", [0, 1, -1e-3, 2.0, True, "1e-3"])
def test_stop_tol_is_a_number_between_0_and_1(bad):
    with pytest.raises(LMCError, match="stop_tol"):
        WeightSettings(stop_tol=bad)


def test_a_tighter_stop_runs_more_sweeps_to_a_lower_objective():
    a, b = unrelated("lm-learned")
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    runs = {tol: weight_match(prepare_pair(a, b, kinds), kinds, settings=WeightSettings(stop_tol=tol))[1]
            for tol in (1e-3, 1e-5)}
    objectives = {tol: [s["objective"] for s in r["sweeps"]] for tol, r in runs.items()}
    loose, tight = objectives[1e-3], objectives[1e-5]
    assert len(loose) < len(tight) and loose == tight[:len(loose)]  # the same descent, stopped earlier
    gains = [(u - v) / v for u, v in itertools.pairwise(loose)]  # each sweep's relative decrease
    assert gains[-1] <= 1e-3 and all(x > 1e-3 for x in gains[:-1])
    assert tight[-1] < loose[-1] and "below 0.001" in runs[1e-3]["stop"]


def test_the_default_stop_follows_the_work_dtype():
    """float64 products (a small model, sweeps in milliseconds) run to 1e-4; float32 ones (scale) stop at 1e-3."""
    from engine.align.weight import REL_TOL

    assert REL_TOL == {torch.float64: 1e-4, torch.float32: 1e-3}
    a, b = unrelated("lm-learned")
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    info = {tol: weight_match(prepare_pair(a, b, kinds), kinds, settings=WeightSettings(stop_tol=tol))[1]
            for tol in (None, 1e-4)}
    assert info[None]["work_dtype"] == "float64" and info[None]["stop_tol"] == 1e-4
    assert [s["objective"] for s in info[None]["sweeps"]] == [s["objective"] for s in info[1e-4]["sweeps"]]
    gains = [(u - v) / v for u, v in itertools.pairwise(s["objective"] for s in info[None]["sweeps"])]
    assert gains[-1] <= 1e-4 < min(gains[:-1]) and "below 0.0001" in info[None]["stop"]
