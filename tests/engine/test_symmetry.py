"""Group actions: every group kind of every reference variant leaves the function unchanged (float64, 1e-10).

Also: invert and compose are the group operations, the RoPE commutant commutes with the reference RoPE,
apply refuses non-members when strict, and norm folding / the LayerNorm rewrite preserve the function.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ref_models import inputs, random_model, rel, tiny

from engine.errors import SpecError
from engine.models import canonical, set_canonical
from engine.models.base import GATED_MLPS, MLP_KINDS, NORM_KINDS, PE_KINDS, ROPE_LAYOUTS
from engine.models.reference import RefConfig, apply_rope, build, rope_frequencies
from engine.spec import build_spec
from engine.surgery import fold_norms, layernorm_to_rmsnorm, reference_config_from_arch
from engine.symmetry import (
    KINDS,
    GroupElement,
    LayerElement,
    apply,
    compose,
    identity,
    invert,
    random_gl,
    rope_commutant,
    sample,
)

TOL = 1e-10


def logits(cfg: RefConfig, arch, params, x) -> torch.Tensor:
    """Evaluate canonical params of `arch` (possibly rewritten) in a reference module."""
    m = build(reference_config_from_arch(arch, in_chans=cfg.in_chans, patch_size=cfg.patch_size), dtype=torch.float64)
    set_canonical(m, params)
    with torch.no_grad():
        return m.module(x)


def max_diff(p, q) -> float:
    return max(float((p[k] - q[k]).abs().max() / q[k].abs().max().clamp_min(1e-30)) for k in q)


def ready(arch, params, kind):
    """The model in a form the kind may act on: residual rotations need folded norms (docs/MATH.md section 3)."""
    if kind != "residual_orth":
        return arch, params
    return layernorm_to_rmsnorm(arch, params) if arch.norm == "layernorm" else fold_norms(arch, params)


LM_VARIANTS = [
    {"pe": "none"}, {"pe": "learned"}, {"pe": "sinusoidal"}, {"pe": "rope"},
    {"pe": "rope", "rope_layout": "half"}, {"pe": "rope", "rotary_dim": 4},
    {"pe": "rope", "rope_layout": "half", "rotary_dim": 2},
    {"pe": "learned", "norm": "layernorm", "bias": True},
    {"pe": "rope", "norm": "layernorm", "bias": True, "rotary_dim": 4},
    {"pe": "none", "norm": "layernorm", "bias": False, "mlp": "relu"},
    {"pe": "learned", "mlp": "relu", "bias": True},
    {"pe": "rope", "mlp": "swiglu", "n_kv_heads": 2, "rope_layout": "half"},
    {"pe": "none", "mlp": "silu", "n_kv_heads": 1}, {"pe": "learned", "mlp": "gelu_tanh", "tied_embeddings": True},
    {"pe": "learned", "norm": "layernorm", "bias": True, "tied_embeddings": True, "head_bias": True},
    {"pe": "rope", "mlp": "swiglu", "bias": True, "head_bias": True},
    {"pe": "rope", "mlp": "swiglu", "n_kv_heads": 2, "rope_layout": "half", "qkv_bias": True},  # Qwen2's biases
    {"pe": "rope", "qk_norm": True}, {"pe": "rope", "rope_layout": "half", "qk_norm": True, "n_kv_heads": 2,
                                      "mlp": "swiglu", "qkv_bias": True},  # Qwen3's QK-norm
    {"pe": "rope", "qk_norm": True, "norm": "layernorm", "bias": True, "tied_embeddings": True},
]
VIT_VARIANTS = [
    dict(task="vit", pe=pe, **extra) for pe in PE_KINDS
    for extra in [{}, {"norm": "layernorm", "bias": True, "head_bias": True, "mlp": "relu"}]
]


@pytest.mark.parametrize("kw", LM_VARIANTS + VIT_VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_group_kind_is_an_exact_symmetry(kw):
    cfg = tiny(**kw)
    m = random_model(cfg)
    theta, x = canonical(m), inputs(cfg)
    with torch.no_grad():
        y0 = m.module(x)
    spec = build_spec(m.arch, theta)
    for kind in spec.kinds:
        if kind in spec.approximate:  # sinusoidal residual maps: measured in test_diagnostics
            continue
        arch, p = ready(m.arch, theta, kind)
        g = sample(arch, [kind], seed=1)
        moved = apply(arch, g, p)
        assert rel(logits(cfg, arch, moved, x), y0) < TOL, kind
        assert max_diff(moved, p) > 1e-3 or kind == "heads" and cfg.n_heads == 1, f"{kind} did not move the weights"
        assert max_diff(apply(arch, invert(arch, g), moved), p) < 1e-12, kind


@st.composite
def configs(draw):
    task = draw(st.sampled_from(["lm", "vit"]))
    D, h = draw(st.sampled_from([(16, 2), (32, 4), (24, 3)]))
    pe = draw(st.sampled_from(PE_KINDS))
    d = D // h
    rotary = draw(st.sampled_from([0, 2, d - d % 2]))
    whole = pe == "rope" and (rotary or d) == d  # QK-norm needs RoPE on the whole head
    return tiny(task=task, n_layers=draw(st.integers(1, 2)), d_model=D, n_heads=h,
                n_kv_heads=draw(st.sampled_from([0, 1])), d_mlp=draw(st.sampled_from([8, 24])), pe=pe,
                rope_layout=draw(st.sampled_from(ROPE_LAYOUTS)), rotary_dim=rotary,
                qk_norm=whole and draw(st.booleans()),
                norm=draw(st.sampled_from(NORM_KINDS)), mlp=draw(st.sampled_from(MLP_KINDS)), bias=draw(st.booleans()),
                head_bias=draw(st.booleans()), tied_embeddings=draw(st.booleans()), n_ctx=8, vocab_size=24,
                embed_scale=draw(st.sampled_from([1.0, 2.5])) if task == "lm" else 1.0)  # Gemma's scaled embedding


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**31 - 1))
def test_random_configs_and_elements_of_the_whole_group(cfg, seed):
    """All kinds at once on random tiny configs; inverse and composition laws."""
    m = random_model(cfg, seed % 1000)
    theta, x = canonical(m), inputs(cfg, seed=seed % 7)
    with torch.no_grad():
        y0 = m.module(x)
    exact = tuple(k for k in KINDS if not (cfg.pe == "sinusoidal" and k.startswith("residual")))
    arch, p = m.arch, theta
    if "residual_orth" in exact:
        try:
            arch, p = ready(arch, theta, "residual_orth")
        except SpecError as e:  # a gated MLP with a LayerNorm bias: no gate bias to absorb beta
            assert cfg.mlp in GATED_MLPS and cfg.bias and "gate" in str(e)
            exact = tuple(k for k in exact if k != "residual_orth")
    g, h = sample(arch, exact, seed), sample(arch, exact, seed + 1)
    moved = apply(arch, g, p)
    assert rel(logits(cfg, arch, moved, x), y0) < TOL
    assert max_diff(apply(arch, invert(arch, g), moved), p) < 1e-11
    assert max_diff(apply(arch, compose(arch, g, h), p), apply(arch, g, apply(arch, h, p))) < 1e-11
    assert max_diff(apply(arch, compose(arch, invert(arch, g), g), p), p) < 1e-11


def test_compose_and_invert_are_the_group_operations():
    cfg = tiny(pe="rope", rotary_dim=4, n_kv_heads=2, mlp="swiglu")
    arch, p = fold_norms(random_model(cfg).arch, canonical(random_model(cfg)))
    g, h, k = (sample(arch, KINDS, s) for s in (3, 4, 5))
    lhs = apply(arch, compose(arch, compose(arch, g, h), k), p)
    rhs = apply(arch, compose(arch, g, compose(arch, h, k)), p)
    assert max_diff(lhs, rhs) < 1e-11  # associativity, as actions
    e = compose(arch, g, invert(arch, g))
    assert max_diff(apply(arch, e, p), p) < 1e-11
    for el in e.layers:
        assert torch.equal(el.head_perm, torch.arange(4)) and torch.equal(el.mlp_perm, torch.arange(64))
        assert torch.allclose(el.qk, torch.eye(8, dtype=torch.float64).expand(2, 8, 8), atol=1e-12)
    assert max_diff(apply(arch, identity(arch), p), p) == 0


def test_sample_is_seeded_and_restricted_to_its_kinds():
    arch = tiny(pe="rope", n_kv_heads=2, mlp="relu").arch()
    a, b = sample(arch, ["heads", "qk"], 7), sample(arch, ["heads", "qk"], 7)
    assert all(torch.equal(x.qk, y.qk) and torch.equal(x.head_perm, y.head_perm) for x, y in zip(a.layers, b.layers))
    e = identity(arch)
    for el, el0 in zip(a.layers, e.layers):
        assert torch.equal(el.vo, el0.vo) and torch.equal(el.mlp_perm, el0.mlp_perm)
        assert torch.equal(el.mlp_scale, el0.mlp_scale)
        assert torch.equal(el.head_perm // 2, el.kv_perm.repeat_interleave(2))  # KV groups to KV groups
    assert torch.equal(a.residual, e.residual)
    s = sample(arch, ["mlp_scale"], 0).layers[0].mlp_scale
    assert bool((s > 0).all()) and not torch.allclose(s, torch.ones_like(s))
    assert bool((sample(tiny(mlp="swiglu").arch(), ["mlp_scale"], 0).layers[0].mlp_scale < 0).any())
    with pytest.raises(SpecError, match="Unknown symmetry kind"):
        sample(arch, ["rotations"], 0)


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
@pytest.mark.parametrize("r", [4, 8])
def test_rope_commutant_commutes_with_the_reference_rope(layout, r):
    d, T = 8, 12
    g = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(r // 2, generator=g, dtype=torch.float64),
                      torch.randn(r // 2, generator=g, dtype=torch.float64))
    A = rope_commutant(z, layout, d)
    A[r:, r:] = random_gl(d - r, 1, g)[0] if r < d else A[r:, r:]
    ang = torch.arange(T, dtype=torch.float64)[:, None] * rope_frequencies(r, 10000.0)  # [T, r/2]

    def rope(x):  # the reference module's partial rotary: the first r dims rotate
        return torch.cat([apply_rope(x[..., :r], ang.cos(), ang.sin(), layout), x[..., r:]], -1)

    q, k = torch.randn(2, 1, 1, T, d, generator=g, dtype=torch.float64)
    scores = rope(q) @ rope(k).mT
    assert torch.allclose(rope(q @ A) @ rope(k @ torch.linalg.inv(A).mT).mT, scores, rtol=0, atol=1e-12)
    other = "half" if layout == "interleaved" else "interleaved"
    B = rope_commutant(z, other, d)
    wrong = rope(q @ B) @ rope(k @ torch.linalg.inv(B).mT).mT
    assert rel(wrong, scores) > 1e-2  # the other pairing's commutant does not commute


def test_strict_apply_refuses_what_is_not_in_the_group():
    cfg = tiny(pe="rope", rotary_dim=4, n_kv_heads=2, mlp="relu")
    m = random_model(cfg)
    arch, p = m.arch, canonical(m)
    e = identity(arch)
    gen = torch.Generator().manual_seed(0)

    def with_layer0(**kw):
        el = e.layers[0]
        parts = {"head_perm": el.head_perm, "qk": el.qk, "vo": el.vo, "mlp_perm": el.mlp_perm,
                 "mlp_scale": el.mlp_scale} | kw
        return GroupElement((LayerElement(**parts),) + e.layers[1:], e.residual)

    with pytest.raises(SpecError, match="does not commute with the interleaved RoPE"):
        apply(arch, with_layer0(qk=random_gl(8, 2, gen)), p)
    apply(arch, with_layer0(qk=random_gl(8, 2, gen)), p, strict=False)  # break tests may
    with pytest.raises(SpecError, match="positive scales"):
        apply(arch, with_layer0(mlp_scale=-torch.ones(64, dtype=torch.float64)), p)
    with pytest.raises(SpecError, match="moves query heads between KV groups"):
        with_layer0(head_perm=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(SpecError, match="not a permutation"):
        apply(arch, with_layer0(mlp_perm=torch.zeros(64, dtype=torch.long)), p)
    with pytest.raises(SpecError, match="fold_norms"):
        apply(arch, sample(arch, ["residual_orth"], 0), p)  # gains are random, not folded
    with pytest.raises(SpecError, match="not orthogonal"):
        apply(*fold_norms(arch, p)[:1], GroupElement(e.layers, 2 * e.residual), fold_norms(arch, p)[1])
    with pytest.raises(SpecError, match="3 layers but the model has 2"):
        apply(arch, GroupElement(e.layers + e.layers[:1], e.residual), p)
    gelu = tiny(mlp="gelu").arch()
    el = identity(gelu).layers[0]
    scaled = LayerElement(el.head_perm, el.qk, el.vo, el.mlp_perm, 2 * el.mlp_scale)
    with pytest.raises(SpecError, match="no neuron scaling symmetry"):
        apply(gelu, GroupElement((scaled, el), identity(gelu).residual), canonical(build(tiny(mlp="gelu"))))
    ln = random_model(tiny(norm="layernorm", bias=True))
    with pytest.raises(SpecError, match="layernorm_to_rmsnorm"):
        apply(ln.arch, sample(ln.arch, ["residual_orth"], 0), canonical(ln))


def test_norm_folding_and_layernorm_rewrite_preserve_the_function():
    for kw, tied_after in [({"norm": "layernorm", "bias": True, "tied_embeddings": True}, False),
                           ({"norm": "rmsnorm", "tied_embeddings": True}, False),
                           ({"norm": "layernorm", "bias": True, "pe": "rope"}, False),
                           ({"task": "vit", "norm": "layernorm", "bias": True, "pe": "learned"}, False)]:
        cfg = tiny(**kw)
        m = random_model(cfg)
        x = inputs(cfg)
        with torch.no_grad():
            y0 = m.module(x)
        arch, p = (layernorm_to_rmsnorm if cfg.norm == "layernorm" else fold_norms)(m.arch, canonical(m))
        assert arch.norm == "rmsnorm" and arch.tied_embeddings == tied_after and arch.family == "reference"
        assert all(bool((v == 1).all()) for k, v in p.items() if k.endswith(".g"))
        assert rel(logits(cfg, arch, p, x), y0) < TOL
    # a tied model whose final gain is 1 stays tied and keeps its family
    m = build(tiny(tied_embeddings=True), dtype=torch.float64)
    arch, p = fold_norms(m.arch, canonical(m))
    assert arch == m.arch and "head.W" not in p
    m = build(tiny(tied_embeddings=True, norm="layernorm", bias=True), dtype=torch.float64)
    with torch.no_grad():
        m.module.norm_f.b.normal_()
        y0 = m.module(inputs(m.module.cfg))
    arch, p = layernorm_to_rmsnorm(m.arch, canonical(m))
    assert arch.tied_embeddings and arch.head_bias  # beta E^T went into a head bias
    assert rel(logits(m.module.cfg, arch, p, inputs(m.module.cfg)), y0) < TOL


def test_norm_rewrites_refuse_what_they_cannot_do():
    sin = random_model(tiny(pe="sinusoidal", norm="layernorm", bias=True))
    with pytest.raises(SpecError, match="sinusoidal"):
        layernorm_to_rmsnorm(sin.arch, canonical(sin))
    with pytest.raises(SpecError, match="call layernorm_to_rmsnorm instead"):
        fold_norms(sin.arch, canonical(sin))
    rms = build(tiny())
    with pytest.raises(SpecError, match="call fold_norms instead"):
        layernorm_to_rmsnorm(rms.arch, canonical(rms))


@pytest.mark.parametrize("kw", LM_VARIANTS + VIT_VARIANTS[:4], 
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_reference_config_from_arch_round_trips(kw):
    cfg = tiny(**kw)
    back = reference_config_from_arch(cfg.arch(), in_chans=cfg.in_chans, patch_size=cfg.patch_size)
    assert back.arch() == cfg.arch()
    if cfg.task == "vit":  # geometry inferred from the patch dimension alone
        inferred = reference_config_from_arch(cfg.arch(), patch_dim=cfg.in_chans * cfg.patch_size ** 2)
        assert (inferred.image_size, inferred.patch_size) == (cfg.image_size, cfg.patch_size)


def test_a_scaled_embedding_keeps_every_group_and_its_pe_shift_moves_s_c():
    """With the embedding scaled as it enters (Gemma's sqrt(D), here 2.5) every class stays exact; the learned-PE
    shift moves the position table by s c for c on the embedding (docs/MATH.md section 3)."""
    from engine.checks import invariance_checks

    cfg = tiny(pe="learned", embed_scale=2.5)
    m, x = random_model(cfg), inputs(cfg, seed=1)
    rows = {r["group"]: r for r in invariance_checks(m, k=2, inputs=x)}
    assert {"heads", "mlp", "qk", "vo", "residual_orth", "pe_shift"} <= set(rows)
    assert all(r["exact"] and r["max_rel_change"] < 1e-12 for r in rows.values()), rows
