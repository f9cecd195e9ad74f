"""OLMo (engine/models/hf_olmo.py): logits against HF's own module, LayerNorms without parameters (canonical
gains of 1, written back only as 1), invariance and break tests, the LayerNorm rewrite, planted recovery by
weight matching, and group dimensions from OLMo-1B's config.

Tiny float64 models built in-process (2 layers, 4 heads in 2 KV groups); nothing is downloaded. Every parameter
is randomised so that a layout mistake shows up in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ref_models import dims_only_report, planted, rel_err

from engine.align.run import align
from engine.checks import break_tests, invariance_checks
from engine.cli import main
from engine.errors import ModelError
from engine.evaluate import eval_set_for
from engine.interpolate import interpolate
from engine.models import canonical, family_of, hf_olmo, load_model, reference, set_canonical
from engine.models.base import Model
from engine.surgery import layernorm_to_rmsnorm, reference_config_from_arch
from engine.symmetry import apply, sample

F64 = torch.float64
CFG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "rope_theta": 500.0,
       "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
VARIANTS = {"gqa": {}, "bias_tied": {"attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4}}


def make(name: str = "gqa", seed: int = 0) -> Model:
    model = hf_olmo.build({**CFG, **VARIANTS[name]}, seed=seed, dtype=F64)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for p in model.module.parameters():  # OLMo has no norm parameters: every tensor here is a weight or bias
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.2)
    return model


def tokens(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_stock_hf_in_float32(name: str, tmp_path: Path):
    from transformers import OlmoForCausalLM

    model = make(name)
    hf_olmo.HF.save(model, tmp_path / "m")
    assert family_of(tmp_path / "m").name == "hf_olmo"
    ours = load_model(tmp_path / "m")  # float32, the adapter's classes
    stock = OlmoForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32, use_safetensors=True,
                                            attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert torch.equal(hf_olmo.logits(ours, tokens()), stock(input_ids=tokens()).logits)
        # and the float64 adapter agrees with float32 HF to float32 precision
        assert rel_err(hf_olmo.logits(make(name), tokens()).float(), stock(input_ids=tokens()).logits) < 1e-5


def test_the_norms_have_no_parameters_and_canonical_gains_of_one():
    model = make()
    a, p = model.arch, canonical(model)
    assert (a.norm, a.norm_bias, a.norm_eps, a.mlp, a.rope_layout) == ("layernorm", False, 1e-5, "swiglu", "half")
    gains = [k for k in p if k.endswith(".g")]
    assert len(gains) == 2 * a.n_layers + 1 and all(bool((p[k] == 1).all()) for k in gains)
    assert not any("norm" in n for n, _ in model.module.named_parameters())
    # a gain other than 1 cannot be written into an OLMo module: one sentence, and the module is untouched
    before = hf_olmo.logits(model, tokens())
    p["blocks.0.norm1.g"] = p["blocks.0.norm1.g"] * 2
    with pytest.raises(ModelError) as e:
        set_canonical(model, p)
    assert str(e.value) == ("The OLMo family stores no blocks.0.norm1.g: its norms have no parameters, so only a "
                            "gain of 1 can be written into this model.")
    assert torch.equal(hf_olmo.logits(model, tokens()), before)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_group_kind_leaves_the_logits_unchanged(name: str):
    model = make(name)
    rows = {r["group"]: r for r in invariance_checks(model, k=2, inputs=tokens())}
    assert {"heads", "mlp", "mlp_scale", "qk", "vo", "residual_perm", "residual_orth"} <= set(rows)
    assert rows["residual_orth"]["note"] == "after layernorm_to_rmsnorm"
    for r in rows.values():
        assert r["exact"] and r["max_rel_change"] < 1e-10, r


def test_layernorm_rewrite_is_exact_and_then_rotations_are_symmetries():
    model = make()
    a2, p2 = layernorm_to_rmsnorm(model.arch, canonical(model))
    assert a2.norm == "rmsnorm" and a2.family == "reference"
    ref = reference.build(reference_config_from_arch(a2), dtype=F64)
    reference.from_canonical(ref, p2)
    with torch.no_grad():
        y = hf_olmo.logits(model, tokens())
        assert rel_err(reference.logits(ref, tokens()), y) < 1e-12
        reference.from_canonical(ref, apply(a2, sample(a2, ["residual_orth"], seed=4), p2))
        assert rel_err(reference.logits(ref, tokens()), y) < 1e-12


def test_maps_outside_the_group_change_the_logits():
    rows = {r["group"]: r for r in break_tests(make(), inputs=tokens())}
    assert {"qk_gl", "qk_orthogonal", "residual_gl"} <= set(rows)
    for r in rows.values():
        assert r["max_rel_change"] > 1e-3, r


def test_weight_matching_rewrites_the_layernorms_and_b_stays_an_olmo_model():
    """The planted recovery itself runs for every family in test_align (ref_models.CASES has hf_olmo)."""
    a = make()
    b, _, kinds = planted(a)  # a residual permutation in OLMo's own coordinates: B is still an OLMo model
    assert b.family == "hf_olmo" and kinds == {"heads", "mlp", "mlp_scale", "qk", "vo", "residual_orth"}
    al = align(a, b, "weight")
    assert al.pair.rewrite == "layernorm_to_rmsnorm" and al.pair.arch.family == "reference"
    es = eval_set_for(a, "val", 256)
    aligned, naive = interpolate(al.model_a, al.model_b, es, points=3), interpolate(a, b, es, points=3)
    assert abs(aligned["barrier"]) < 1e-9
    assert abs(naive["loss"][1] - aligned["loss"][1]) > 1e-3  # the planted element did move B


# OLMo-1B-hf's config.json
OLMO_1B = {"architectures": ["OlmoForCausalLM"], "model_type": "olmo", "attention_bias": False, "clip_qkv": None,
           "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 2048,
           "num_attention_heads": 16, "num_hidden_layers": 16, "num_key_value_heads": 16, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "vocab_size": 50304, "pad_token_id": 1, "eos_token_id": 50279,
           "torch_dtype": "float32"}


def test_symmetry_dims_only_from_the_olmo_1b_config(tmp_path: Path, capsys):
    rep = dims_only_report(tmp_path, OLMO_1B, capsys)
    c = OLMO_1B
    L, D, h, m = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    d = D // h
    a = rep["arch"]
    assert rep["family"] == "hf_olmo" and (a["norm"], a["norm_bias"], a["tied_embeddings"]) == ("layernorm", False, True)
    by = rep["group_dim"]["by_kind"]
    assert by["qk"] == L * h * d  # one complex scalar per frequency pair: d/2 pairs x 2 real dimensions
    assert by["vo"] == L * h * d * d and by["residual_orth"] == D * (D - 1) // 2 and by["mlp_scale"] == L * m


@pytest.mark.parametrize(("change", "option"), [({"clip_qkv": 8.0}, "clip_qkv=8.0"),
                                                 ({"hidden_act": "gelu"}, "hidden_act='gelu'")])
def test_an_olmo_config_the_engine_cannot_express_is_refused_in_one_sentence(change: dict, option: str,
                                                                              tmp_path: Path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**OLMO_1B, **change}))
    assert main(["symmetry", str(tmp_path), "--dims-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and option in err and "\n" not in err
