"""GPT-NeoX / Pythia (engine/models/hf_neox.py): logits against HF's own module and the reference twin,
the per-head fused QKV layout, partial half-split RoPE, parallel and sequential residuals, checkpoints,
invariance and break tests, planted recovery by weight matching, and group dimensions from a config.

Tiny float64 models built in-process (2 layers, 4 heads); nothing is downloaded. Every parameter is
randomised (LayerNorm gains around 1) so that a layout mistake shows up in the logits.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ref_models import dims_only_report, random_model, rel_err, tiny
from safetensors.torch import load_file, save_file

from engine.align.forward import twin
from engine.align.pair import model_for, prepare_pair
from engine.align.run import align, endpoint_check
from engine.checks import break_tests, invariance_checks
from engine.classes import default_classes
from engine.cli import main
from engine.errors import ModelError, SpecError
from engine.evaluate import eval_set_for
from engine.interpolate import interpolate
from engine.models import canonical, family_of, hf_neox, load_model, model_logits, reference, set_canonical
from engine.models.base import Model
from engine.spec import build_spec
from engine.surgery import fold_norms, layernorm_to_rmsnorm, reference_config_from_arch
from engine.symmetry import apply, invert, sample

F64 = torch.float64
BASE = {"vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
        "rotary_emb_base": 500, "bos_token_id": 0, "eos_token_id": 0}
# D 64 with 4 heads gives d = 16, so Pythia's 25% rotates r = 4 dims: two frequency pairs, where the
# half-split and interleaved pairings differ (at r = 2 both pair (0, 1))
VARIANTS = {
    "pythia": {"hidden_size": 64, "intermediate_size": 128, "rotary_pct": 0.25},
    "half_sequential": {"hidden_size": 64, "intermediate_size": 96, "rotary_pct": 0.5,
                        "use_parallel_residual": False},
    "full_parallel_tied": {"hidden_size": 32, "intermediate_size": 64, "rotary_pct": 1.0,
                           "tie_word_embeddings": True, "hidden_act": "gelu_new"},
    "no_attention_bias": {"hidden_size": 64, "intermediate_size": 128, "rotary_pct": 0.25,
                          "use_parallel_residual": False, "attention_bias": False, "layer_norm_eps": 1e-3},
}
# the reference family has all biases or none: attention_bias=False with MLP biases has no twin
TWINNED = [v for v in VARIANTS if v != "no_attention_bias"]


def config(name: str) -> dict:
    return {**BASE, **VARIANTS[name]}


def randomise(model: Model, seed: int) -> Model:
    """Every parameter random (LayerNorm gains around 1), so biases, gains and every layout are tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            gain = name.endswith(("layernorm.weight", "final_layer_norm.weight"))
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.2 + (1.0 if gain else 0.0))
    return model


def make(name: str, seed: int = 0) -> Model:
    return randomise(hf_neox.build(config(name), seed=seed, dtype=F64), seed + 10)


def tokens(T: int = 16, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(seed))


def stock(model: Model, tmp_path: Path, dtype: torch.dtype):
    """HF's own GPTNeoXForCausalLM with the model's weights: loaded by transformers, nothing swapped."""
    from transformers import GPTNeoXForCausalLM

    hf_neox.save(model, tmp_path / "stock")
    return GPTNeoXForCausalLM.from_pretrained(str(tmp_path / "stock"), dtype=dtype, use_safetensors=True,
                                              attn_implementation="sdpa").eval()


# ---------------------------------------------------------------------------------------------
# Architecture summary and layout


def test_arch_reads_every_gpt_neox_option():
    a = make("pythia").arch
    assert (a.family, a.pe, a.rope_layout, a.d_head, a.rotary_dim) == ("hf_neox", "rope", "half", 16, 4)
    assert a.parallel_residual and not a.tied_embeddings and a.norm == "layernorm" and a.norm_bias
    assert a.attn_bias and a.out_bias and a.mlp_bias and a.mlp == "gelu" and a.rope_base == 500.0
    s = make("half_sequential").arch
    assert s.rotary_dim == 8 and not s.parallel_residual and s.d_mlp == 96
    t = make("full_parallel_tied").arch
    assert t.rotary_dim == t.d_head == 8 and t.tied_embeddings and t.mlp == "gelu_tanh"
    n = make("no_attention_bias").arch
    assert not n.attn_bias and not n.out_bias and n.mlp_bias and n.norm_eps == 1e-3


def test_fused_qkv_rows_run_per_head():
    """query_key_value output rows are [h, 3, d]: q, k, v of head 0, then of head 1, ..."""
    m = hf_neox.build(config("pythia"), dtype=F64)
    a = m.arch
    h, d, D = a.n_heads, a.d_head, a.d_model
    at = m.module.gpt_neox.layers[0].attention
    with torch.no_grad():
        at.query_key_value.weight.copy_(torch.arange(3 * D, dtype=F64)[:, None].expand(3 * D, D))  # row index
        at.query_key_value.bias.copy_(torch.arange(3 * D, dtype=F64))
    p = canonical(m)  # a copy: the adapter's own views would be zeroed below with the module
    row = (torch.arange(h)[:, None] * 3 * d + torch.arange(d)).to(F64)  # [h, d]: row of (head i, dim j) in q
    for r, role in enumerate("QKV"):
        want = row + r * d  # k and v rows follow q's d rows within each head
        assert torch.equal(p[f"blocks.0.attn.W_{role}"], want[:, None, :].expand(h, D, d)), role
        assert torch.equal(p[f"blocks.0.attn.b_{role}"], want), role
    # and back: from_canonical rebuilds the fused tensor exactly
    before = at.query_key_value.weight.clone()
    with torch.no_grad():
        at.query_key_value.weight.zero_()
    hf_neox.from_canonical(m, p)
    assert torch.equal(at.query_key_value.weight, before)


@pytest.mark.parametrize("rotary_pct", [0.25, 0.5, 1.0])
def test_hf_rotary_is_the_reference_half_split_rope(rotary_pct: float):
    """HF's apply_rotary_pos_emb with the adapter's float64 tables == reference.apply_rope on the first
    r dims with layout "half" (pairs (j, j + r/2)), the rest passed through; exactly."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    m = hf_neox.build({**config("pythia"), "rotary_pct": rotary_pct}, dtype=F64)
    a = m.arch
    r, T = a.rotary_dim, 16
    q, k = torch.randn(2, 2, a.n_heads, T, a.d_head, generator=torch.Generator().manual_seed(3), dtype=F64)
    cos, sin = m.module.gpt_neox.rotary_emb(q, torch.arange(T)[None])  # [1, T, r]
    assert cos.dtype == F64 and cos.shape[-1] == r
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    ang = torch.arange(T, dtype=F64)[:, None] * reference.rope_frequencies(r, a.rope_base)  # [T, r/2]
    for x, hx in ((q, hq), (k, hk)):
        ours = torch.cat([reference.apply_rope(x[..., :r], ang.cos(), ang.sin(), "half"), x[..., r:]], -1)
        assert (ours - hx).abs().max() < 1e-14
    # the other pairing is a different map (r >= 4: two or more pairs)
    if r >= 4:
        wrong = reference.apply_rope(q[..., :r], ang.cos(), ang.sin(), "interleaved")
        assert rel_err(wrong, hq[..., :r]) > 1e-2


# ---------------------------------------------------------------------------------------------
# Logits: HF's own module and the reference twin


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_stock_hf(name: str, tmp_path: Path):
    """The adapter IS HF's module with float64 RoPE tables: float32 is bit-identical to stock HF; in
    float64 stock HF is exact where its float32 tables are (position 0: cos 1, sin 0), and elsewhere
    only float32-accurate (why the adapter swaps the rotary embedding)."""
    model = make(name)
    with torch.no_grad():
        hf64 = stock(model, tmp_path, F64)
        for T in (1, 16):
            x = tokens(T)
            err = rel_err(hf_neox.logits(model, x), hf64(input_ids=x, use_cache=False).logits)
            assert err < 1e-13 if T == 1 else 1e-10 < err < 1e-5, (T, err)
        hf32, ours32 = stock(model, tmp_path, torch.float32), load_model(tmp_path / "stock", torch.float32)
        x = tokens()
        assert torch.equal(hf_neox.logits(ours32, x), hf32(input_ids=x, use_cache=False).logits)


@pytest.mark.parametrize("name", TWINNED)
def test_reference_twin_computes_the_same_logits(name: str):
    model = make(name)
    tw = twin(model)
    assert tw.family == "reference" and tw.module.cfg.parallel_residual == model.arch.parallel_residual
    assert tw.arch == replace(model.arch, family="reference")
    x = tokens()
    with torch.no_grad():
        assert rel_err(reference.logits(tw, x), hf_neox.logits(model, x)) < 1e-12
        # the residual form matters: the twin with the other form is a different function
        other = reference.build(replace(tw.module.cfg, parallel_residual=not tw.module.cfg.parallel_residual), dtype=F64)
        reference.from_canonical(other, canonical(model))
        assert rel_err(reference.logits(other, x), hf_neox.logits(model, x)) > 1e-2


def test_twin_is_refused_when_the_reference_family_cannot_express_the_biases():
    with pytest.raises(SpecError, match="mixes them"):
        twin(make("no_attention_bias"))


# ---------------------------------------------------------------------------------------------
# Checkpoints


@pytest.mark.parametrize("name", ["pythia", "half_sequential"])
def test_canonical_round_trip_into_another_module(name: str):
    a, b = make(name, 0), make(name, 1)
    x = tokens()
    with torch.no_grad():
        la = hf_neox.logits(a, x)
        assert rel_err(hf_neox.logits(b, x), la) > 1e-2
        set_canonical(b, canonical(a))
        assert torch.equal(hf_neox.logits(b, x), la)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["pythia", "no_attention_bias", "full_parallel_tied"])
def test_save_detect_load_round_trip(name: str, tmp_path: Path):
    model = make(name)
    hf_neox.save(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "gpt_neox"
    assert hf_neox.detect(tmp_path / "m") and family_of(tmp_path / "m").name == "hf_neox"
    back = load_model(tmp_path / "m", dtype=F64)
    assert back.family == "hf_neox" and back.arch == model.arch
    sa, sb = model.module.state_dict(), back.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        assert torch.equal(hf_neox.logits(back, tokens()), hf_neox.logits(model, tokens()))


def test_hub_layout_with_embed_out_old_buffers_and_rotary_pct_loads(tmp_path: Path):
    """Pythia on the hub: `embed_out.weight` for the unembedding, per-layer causal-mask and rotary buffers
    that the current module no longer has, rotary_pct / rotary_emb_base in config.json."""
    model = make("pythia")
    path = tmp_path / "hub"
    hf_neox.save(model, path)
    state = load_file(str(path / "model.safetensors"))
    assert "embed_out.weight" in state and "lm_head.weight" not in state  # HF writes the hub name
    r, T = model.arch.rotary_dim, model.arch.n_ctx
    for i in range(model.arch.n_layers):
        pre = f"gpt_neox.layers.{i}.attention."
        state[pre + "bias"] = torch.ones(1, 1, T, T, dtype=torch.bool).tril()
        state[pre + "masked_bias"] = torch.tensor(-1e9)
        state[pre + "rotary_emb.inv_freq"] = reference.rope_frequencies(r, model.arch.rope_base).float()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps({**cfg, "rotary_pct": 0.25, "rotary_emb_base": 500}))
    back = load_model(path, dtype=F64)
    assert back.arch == model.arch
    with torch.no_grad():
        assert torch.equal(hf_neox.logits(back, tokens()), hf_neox.logits(model, tokens()))


def test_detect_ignores_other_directories(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    assert not hf_neox.detect(tmp_path / "empty")
    ref = tmp_path / "ref"
    reference.save(random_model(tiny()), ref)
    assert not hf_neox.detect(ref) and family_of(ref).name == "reference"


@pytest.mark.parametrize(("change", "option"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "rope_type"),
    ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor"),  # int(16 * 0.1) = 1 rotated dim: no frequency pair
    ({"hidden_size": 66}, "not a valid GPT-NeoX config"),  # 66 is not divisible by 4 heads
])
def test_unsupported_or_invalid_configs_are_refused_in_one_sentence(change: dict, option: str, tmp_path: Path):
    path = tmp_path / "ckpt"
    hf_neox.save(hf_neox.build(config("pythia")), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelError) as e:
        load_model(path)
    msg = str(e.value)
    assert option in msg and str(path) in msg and "\n" not in msg, msg
    with pytest.raises(ModelError, match=option.split("=")[0]):
        hf_neox.build({**config("pythia"), **change})


# ---------------------------------------------------------------------------------------------
# Symmetries: invariance, the LayerNorm rewrite of a parallel block, break tests


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_group_kind_leaves_the_logits_unchanged(name: str):
    model = make(name)
    rows = {r["group"]: r for r in invariance_checks(model, k=2, inputs=tokens())}
    assert {"heads", "mlp", "qk", "vo", "residual_perm", "residual_orth"} <= set(rows)
    assert rows["residual_orth"]["note"] == "after layernorm_to_rmsnorm"
    assert ("key_bias_shift" in rows) == (model.arch.attn_bias and model.arch.rotary_dim < model.arch.d_head)
    assert ("value_bias_fold" in rows) == model.arch.attn_bias
    for r in rows.values():
        assert r["exact"] and r["max_rel_change"] < 1e-10, r


@pytest.mark.parametrize("name", list(VARIANTS))
def test_layernorm_to_rmsnorm_is_exact_for_the_parallel_and_sequential_blocks(name: str):
    """Both norms of a parallel block read the same residual x, so centring the writers and folding the
    gains and biases into the readers keeps the function, as in the sequential block."""
    model = make(name)
    a2, p2 = layernorm_to_rmsnorm(model.arch, canonical(model))
    assert a2.norm == "rmsnorm" and a2.parallel_residual == model.arch.parallel_residual
    ref = reference.build(reference_config_from_arch(a2), dtype=F64)
    reference.from_canonical(ref, p2)
    x = tokens()
    with torch.no_grad():
        y = hf_neox.logits(model, x)
        assert rel_err(reference.logits(ref, x), y) < 1e-12
        g = sample(a2, ["residual_orth"], seed=4)
        reference.from_canonical(ref, apply(a2, g, p2))
        assert rel_err(reference.logits(ref, x), y) < 1e-12


def test_fold_norms_is_exact_for_a_parallel_rmsnorm_block():
    m = random_model(tiny(pe="rope", rope_layout="half", rotary_dim=4, norm="rmsnorm", parallel_residual=True))
    x = tokens(seed=2) % m.arch.n_out
    with torch.no_grad():
        y = model_logits(m, x)
        a2, p2 = fold_norms(m.arch, canonical(m))
        folded = model_for(m, a2, p2)
        assert rel_err(model_logits(folded, x), y) < 1e-12
        rotated = model_for(m, a2, apply(a2, sample(a2, ["residual_orth", "heads", "qk"], seed=1), p2))
        assert rel_err(model_logits(rotated, x), y) < 1e-12
        sequential = reference.build(replace(m.module.cfg, parallel_residual=False), dtype=F64)
        reference.from_canonical(sequential, canonical(m))
        assert rel_err(model_logits(sequential, x), y) > 1e-2


@pytest.mark.parametrize("name", ["pythia", "half_sequential"])
def test_maps_outside_the_group_change_the_logits(name: str):
    rows = {r["group"]: r for r in break_tests(make(name), inputs=tokens())}
    assert {"qk_gl", "qk_other_layout", "qk_orthogonal", "residual_gl", "mlp_scale_nonhomogeneous"} <= set(rows)
    assert rows["qk_other_layout"]["kind"] == "RoPE commutant of the interleaved pairing"
    for r in rows.values():
        assert r["max_rel_change"] > 1e-3, r


# ---------------------------------------------------------------------------------------------
# Planted recovery: weight matching finds g* when B = g*(A)


@pytest.mark.parametrize("name", ["pythia", "half_sequential"])
def test_weight_matching_recovers_a_planted_element(name: str):
    a = make(name)
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    assert kinds == {"heads", "mlp", "qk", "vo", "residual_orth"}  # rotated after the LayerNorm rewrite
    plant = kinds - {"residual_orth"} | {"residual_perm"}  # in NeoX's own coordinates: B stays a NeoX model
    pair = prepare_pair(a, a, plant)
    g_star = sample(pair.arch, plant, seed=3)
    b = model_for(pair.model_a, pair.arch, apply(pair.arch, g_star, pair.params_a))
    assert b.family == "hf_neox"
    al = align(a, b, "weight")
    assert al.pair.rewrite == "layernorm_to_rmsnorm"
    want = invert(al.pair.arch, g_star)  # B onto A undoes g*
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
        assert (got.qk - exp.qk).abs().max() < 1e-8 and (got.vo - exp.vo).abs().max() < 1e-8
    assert (al.out.g.residual - want.residual).abs().max() < 1e-9  # the rotation found is the permutation
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max() / al.pair.params_a[k].abs().max())
              for k in al.moved_params)
    assert err < 1e-8
    es = eval_set_for(a, "val", 256)
    r = interpolate(al.model_a, al.model_b, es, points=3)
    assert abs(r["barrier"]) < 1e-9
    assert endpoint_check(b, al, es, r["endpoint_loss_b"])["rel_diff"] < 1e-9
    naive = interpolate(a, b, es, points=3)  # random models: the unaligned midpoint is nearer uniform, not worse
    assert abs(naive["loss"][1] - r["loss"][1]) > 1e-2  # the planted element was not a no-op


def test_activation_matching_recovers_a_planted_element_through_the_parallel_twin():
    a = make("pythia")
    plant = default_classes(build_spec(a.arch, canonical(a))) - {"residual_orth"} | {"residual_perm"}  # B stays NeoX
    pair = prepare_pair(a, a, plant)
    g_star = sample(pair.arch, plant, seed=5)
    b = model_for(pair.model_a, pair.arch, apply(pair.arch, g_star, pair.params_a))
    # the planted classes: with the default rotation the LayerNorm rewrite centres the stream, the rotation is
    # then free along the ones vector, and which one the SVD returns depends on the LAPACK build
    al = align(a, b, "activation", classes=tuple(plant))  # statistics from the reference twin's hooks (parallel block)
    want = invert(al.pair.arch, g_star)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
    err = max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max() / al.pair.params_a[k].abs().max())
              for k in al.moved_params)
    assert err < 1e-8


# ---------------------------------------------------------------------------------------------
# Group dimensions from a config.json alone (Pythia-160m's shape)


PYTHIA_160M = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 768,
               "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 50304,
               "rotary_pct": 0.25, "rotary_emb_base": 10000, "max_position_embeddings": 2048, "hidden_act": "gelu",
               "layer_norm_eps": 1e-5, "use_parallel_residual": True, "tie_word_embeddings": False,
               "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float16"}


def test_symmetry_dims_only_from_a_pythia_config(tmp_path: Path, capsys):
    rep = dims_only_report(tmp_path, PYTHIA_160M, capsys)
    c = PYTHIA_160M
    L, D, h, m = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    d = D // h
    r = int(d * c["rotary_pct"])
    a = rep["arch"]
    assert rep["family"] == "hf_neox" and rep["dims_only"]
    assert (a["d_head"], a["rotary_dim"], a["rope_layout"], a["d_mlp"], a["n_out"]) == (d, r, "half", m, c["vocab_size"])
    assert a["parallel_residual"] and a["norm"] == "layernorm" and not a["tied_embeddings"]
    by = rep["group_dim"]["by_kind"]
    assert by["qk"] == L * h * (r + (d - r) ** 2)  # H(r) x GL(d - r) per head (docs/MATH.md section 1)
    assert by["vo"] == L * h * d * d and by["residual_orth"] == D * (D - 1) // 2
    assert by["key_bias"] == L * h * (d - r) and by["value_bias"] == L * h * d
    assert len(rep["rope"]) == r // 2
    assert main(["symmetry", str(tmp_path), "--dims-only"]) == 0
    text = capsys.readouterr().out
    assert f"(half, rotary {r})" in text and "dimensions from the config only" in text


def test_symmetry_dims_only_refuses_a_bad_pythia_config(tmp_path: Path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**PYTHIA_160M, "hidden_act": "gelu_fast"}))
    assert main(["symmetry", str(tmp_path), "--dims-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "hidden_act='gelu_fast'" in err and "\n" not in err
