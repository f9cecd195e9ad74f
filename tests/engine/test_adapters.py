"""Model-family adapters: checkpoint round trips, canonical round trips, and the canonical layout
proved against the reference family (docs/MATH.md notation, engine/models/base.py layout).

All float64, tiny in-process models (2 layers, D 32, 4 heads); nothing is downloaded. Every
parameter, biases and norm gains included, is randomised so that a layout mistake shows up in
the logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ref_models import rel_err
from safetensors.torch import load_file, save_file

from engine.errors import ModelError
from engine.models import (
    FAMILIES,
    canonical,
    family_of,
    hf_bert,
    hf_gemma,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_neox,
    hf_olmo,
    hf_phi,
    hf_qwen2,
    hf_qwen3,
    hf_roberta,
    load_model,
    reference,
    timm_vit,
)
from engine.models.base import Model
from engine.models.reference import RefConfig

F64 = torch.float64
VIT_ARGS = {"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 32, "depth": 2,
            "num_heads": 4, "mlp_ratio": 2.0}
GPT2_CFG = {"vocab_size": 256, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4, "bos_token_id": 0,
            "eos_token_id": 0}
LLAMA_CFG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "bos_token_id": 0,
             "eos_token_id": 0, "rope_theta": 500.0, "rms_norm_eps": 1e-5}
# Qwen2 and Mistral take Llama's keys; Qwen2's sliding layers (from max_window_layers on) with a window as
# long as the context are full causal attention, and Mistral's default window (4096) exceeds the context
QWEN2_CFG = {**LLAMA_CFG, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
MISTRAL_CFG = {**LLAMA_CFG, "head_dim": 12, "tie_word_embeddings": True}
QWEN3_CFG = {**LLAMA_CFG, "head_dim": 12}
# Gemma: multi-query attention as gemma-2b, heads wider than D / h, GeGLU, tied (its default)
GEMMA_CFG = {**LLAMA_CFG, "num_key_value_heads": 1, "head_dim": 12, "hidden_act": "gelu_pytorch_tanh"}
BERT_CFG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 16, "layer_norm_eps": 1e-5}
# RoBERTa numbers positions from pad_token_id + 1 (1 here): 18 rows hold a context of 16
ROBERTA_CFG = {**BERT_CFG, "max_position_embeddings": 18, "type_vocab_size": 1}
# Llama 3's RoPE frequency scaling, with an original context short enough (8) that the tiny model's four
# frequencies fall in all three of its regimes (divided by the factor, blended, kept)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
LLAMA3_CFG = {**{k: v for k, v in LLAMA_CFG.items() if k != "rope_theta"}, "rope_parameters": LLAMA3_ROPE}
# OLMo: Llama's sizes, LayerNorms without parameters (its config has no rms_norm_eps)
OLMO_CFG = {k: v for k, v in LLAMA_CFG.items() if k != "rms_norm_eps"} | {"pad_token_id": 0}
# Phi: one LayerNorm for both parallel branches, RoPE on half of each head, biases everywhere (the head's too)
PHI_CFG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}
NEOX_CFG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 16, "rotary_pct": 0.5, "rotary_emb_base": 500,
            "bos_token_id": 0, "eos_token_id": 0}


def randomise(model: Model, seed: int) -> Model:
    """Every parameter random (norm gains around 1), so biases and gains are tested too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            gain = name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "ln_1.weight", "ln_2.weight",
                                  "ln_f.weight", "layernorm.weight", ".g"))
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.2 + (1.0 if gain else 0.0))
    return model


@dataclass(frozen=True)
class Case:
    family: str
    build: Callable[[int], Model]  # seed -> float64 model of the case's config
    ref: RefConfig | None  # the reference architecture expressing this model exactly
    task: str = "lm"


REF_LM = {"task": "lm", "n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 256, "n_ctx": 16}
REF_VIT = {"task": "vit", "n_layers": 2, "d_model": 32, "n_heads": 4, "d_mlp": 64, "pe": "learned",
           "norm": "layernorm", "norm_eps": 1e-6, "mlp": "gelu", "bias": True, "head_bias": True, "image_size": 8,
           "patch_size": 2, "in_chans": 1, "n_classes": 10}
CASES = {
    "reference": Case("reference", lambda s: reference.build(
        RefConfig(**REF_LM, d_mlp=64, pe="rope", rope_layout="half", n_kv_heads=2, mlp="swiglu"), seed=s, dtype=F64),
        None),
    "hf_gpt2": Case("hf_gpt2", lambda s: hf_gpt2.build(GPT2_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, d_mlp=128, pe="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu_tanh", bias=True,
        tied_embeddings=True)),
    "hf_gpt2_untied": Case("hf_gpt2", lambda s: hf_gpt2.build(
        {**GPT2_CFG, "tie_word_embeddings": False, "activation_function": "relu", "n_inner": 48,
         "layer_norm_epsilon": 1e-3}, seed=s, dtype=F64),
        RefConfig(**REF_LM, d_mlp=48, pe="learned", norm="layernorm", norm_eps=1e-3, mlp="relu", bias=True)),
    "hf_llama": Case("hf_llama", lambda s: hf_llama.build(LLAMA_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="rmsnorm",
        norm_eps=1e-5, mlp="swiglu")),
    # tied, wider heads than D / h, and every bias HF offers (the gate bias is zeroed in the
    # reference comparison: the reference family has none)
    "hf_llama_bias_tied": Case("hf_llama", lambda s: hf_llama.build(
        {**LLAMA_CFG, "tie_word_embeddings": True, "head_dim": 12, "attention_bias": True, "mlp_bias": True},
        seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_head=12, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0,
        norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", bias=True, tied_embeddings=True)),
    # Llama 3's frequency scaling (the reference family computes it too), and linear scaling on a Qwen2
    "hf_llama_llama3": Case("hf_llama", lambda s: hf_llama.build(LLAMA3_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="rmsnorm",
        norm_eps=1e-5, mlp="swiglu", rope_scaling=reference.rope_scaling(LLAMA3_ROPE))),
    "hf_qwen2_linear_rope": Case("hf_qwen2", lambda s: hf_qwen2.build(
        {**LLAMA3_CFG, "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}}, seed=s,
        dtype=F64), RefConfig(**REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0,
                              norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", qkv_bias=True,
                              rope_scaling='{"factor": 4.0, "rope_type": "linear"}')),
    # Qwen2: biases on Q, K and V only (the reference family's qkv_bias); untied with a sliding layer whose window
    # is the whole context, and tied as the small Qwen2.5 models
    "hf_qwen2": Case("hf_qwen2", lambda s: hf_qwen2.build(QWEN2_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="rmsnorm",
        norm_eps=1e-5, mlp="swiglu", qkv_bias=True)),
    "hf_qwen2_tied": Case("hf_qwen2", lambda s: hf_qwen2.build(
        {**LLAMA_CFG, "tie_word_embeddings": True}, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="rmsnorm",
        norm_eps=1e-5, mlp="swiglu", qkv_bias=True, tied_embeddings=True)),
    # Qwen3: QK-norm (q_norm / k_norm gains [d], randomised with the other gains), wider heads than D / h; and
    # tied with attention_bias (all four projections: no reference twin, whose biases are all or Q/K/V alone)
    "hf_qwen3": Case("hf_qwen3", lambda s: hf_qwen3.build(QWEN3_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_head=12, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0,
        norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", qk_norm=True)),
    "hf_qwen3_bias_tied": Case("hf_qwen3", lambda s: hf_qwen3.build(
        {**QWEN3_CFG, "tie_word_embeddings": True, "attention_bias": True}, seed=s, dtype=F64), None),
    # Mistral: no biases, wider heads than D / h, tied
    "hf_mistral": Case("hf_mistral", lambda s: hf_mistral.build(MISTRAL_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_head=12, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0,
        norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", tied_embeddings=True)),
    # OLMo: LayerNorms without gain or bias (canonically gains of 1), GQA; and tied with biases on all four
    # attention projections (no reference twin: its biases are all or Q/K/V alone)
    "hf_olmo": Case("hf_olmo", lambda s: hf_olmo.build(OLMO_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="layernorm",
        norm_eps=1e-5, mlp="swiglu")),
    "hf_olmo_bias_tied": Case("hf_olmo", lambda s: hf_olmo.build(
        {**OLMO_CFG, "tie_word_embeddings": True, "attention_bias": True}, seed=s, dtype=F64), None),
    # Gemma: gains stored as offsets from 1 (randomised around 1 natively: canonical gains around 2), the embedding
    # scaled by sqrt(D) as it enters, GeGLU, MQA; and untied with biases on all four attention projections (no
    # reference twin: its biases are all or Q/K/V alone)
    "hf_gemma": Case("hf_gemma", lambda s: hf_gemma.build(GEMMA_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=1, d_head=12, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0,
        norm="rmsnorm", norm_eps=1e-5, mlp="geglu", tied_embeddings=True, embed_scale=hf_gemma.embed_scale(32))),
    "hf_gemma_bias_untied": Case("hf_gemma", lambda s: hf_gemma.build(
        {**GEMMA_CFG, "tie_word_embeddings": False, "attention_bias": True}, seed=s, dtype=F64), None),
    # Phi: the parallel block under one shared LayerNorm (canonically two equal norms), partial RoPE, a head bias;
    # and tied with grouped-query attention
    "hf_phi": Case("hf_phi", lambda s: hf_phi.build(PHI_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, d_mlp=64, pe="rope", rope_layout="half", rotary_dim=4, rope_base=500.0, norm="layernorm",
        norm_eps=1e-5, mlp="gelu_tanh", bias=True, head_bias=True, parallel_residual=True)),
    "hf_phi_gqa_tied": Case("hf_phi", lambda s: hf_phi.build(
        {**PHI_CFG, "num_key_value_heads": 2, "tie_word_embeddings": True}, seed=s, dtype=F64), RefConfig(
        **REF_LM, n_kv_heads=2, d_mlp=64, pe="rope", rope_layout="half", rotary_dim=4, rope_base=500.0,
        norm="layernorm", norm_eps=1e-5, mlp="gelu_tanh", bias=True, head_bias=True, parallel_residual=True,
        tied_embeddings=True)),
    # Pythia layout: partial RoPE, parallel residual, untied; and the sequential, tied variant
    "hf_neox": Case("hf_neox", lambda s: hf_neox.build(NEOX_CFG, seed=s, dtype=F64), RefConfig(
        **REF_LM, d_mlp=64, pe="rope", rope_layout="half", rotary_dim=4, rope_base=500.0, norm="layernorm",
        norm_eps=1e-5, mlp="gelu", bias=True, parallel_residual=True)),
    "hf_neox_sequential_tied": Case("hf_neox", lambda s: hf_neox.build(
        {**NEOX_CFG, "use_parallel_residual": False, "tie_word_embeddings": True, "rotary_pct": 1.0,
         "hidden_act": "gelu_new"}, seed=s, dtype=F64), RefConfig(
        **REF_LM, d_mlp=64, pe="rope", rope_layout="half", rope_base=500.0, norm="layernorm", norm_eps=1e-5,
        mlp="gelu_tanh", bias=True, tied_embeddings=True)),
    "timm_vit": Case("timm_vit", lambda s: timm_vit.build(VIT_ARGS, seed=s, dtype=F64), RefConfig(**REF_VIT),
                     task="vit"),
    # BERT: post-LayerNorm, no reference twin (its blocks are pre-norm); erf GELU, and ReLU with three token types
    "hf_bert": Case("hf_bert", lambda s: hf_bert.build(BERT_CFG, seed=s, dtype=F64), None),
    "hf_bert_relu": Case("hf_bert", lambda s: hf_bert.build(
        {**BERT_CFG, "hidden_act": "relu", "type_vocab_size": 3}, seed=s, dtype=F64), None),
    # RoBERTa and XLM-RoBERTa: BERT's encoder, other keys, positions after the padding id
    "hf_roberta": Case("hf_roberta", lambda s: hf_roberta.build(ROBERTA_CFG, seed=s, dtype=F64), None),
    "hf_xlm_roberta": Case("hf_xlm_roberta", lambda s: hf_roberta.build_xlm(ROBERTA_CFG, seed=s, dtype=F64), None),
}


def inputs(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if case.task == "vit":
        return torch.randn(3, 1, 8, 8, generator=g, dtype=F64)
    return torch.randint(0, 256, (2, 16), generator=g)


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]


def test_every_family_has_a_case():
    assert {c.family for c in CASES.values()} == set(FAMILIES)


# ---------------------------------------------------------------------------------------------
# (a) save -> load


def test_save_load_round_trip_is_bit_identical(case: Case, tmp_path: Path):
    fam = FAMILIES[case.family]
    model = randomise(case.build(0), 1)
    fam.save(model, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert family_of(tmp_path / "m").name == case.family
    back = load_model(tmp_path / "m", dtype=F64)
    assert back.family == case.family and back.arch == model.arch
    sa, sb = model.module.state_dict(), back.module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sb[k].dtype == F64 and torch.equal(sa[k], sb[k]), k
    x = inputs(case)
    with torch.no_grad():
        assert torch.equal(fam.logits(model, x), fam.logits(back, x))


def test_save_load_save_writes_the_same_tensors_and_config(case: Case, tmp_path: Path):
    """A saved model, loaded and saved again, is the same checkpoint: every stored tensor bit for bit (same
    names, dtypes and values) and the same config.json."""
    fam = FAMILIES[case.family]
    fam.save(randomise(case.build(0), 1), tmp_path / "first")
    fam.save(load_model(tmp_path / "first", dtype=F64), tmp_path / "second")
    first, second = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("first", "second"))
    assert first.keys() == second.keys() and len(first) > 10
    for k in first:
        assert first[k].dtype == second[k].dtype == F64 and torch.equal(first[k], second[k]), k
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("first", "second")]
    assert configs[0] == configs[1]


# ---------------------------------------------------------------------------------------------
# (b) canonical -> native in place


def test_canonical_round_trip_into_another_module(case: Case):
    fam = FAMILIES[case.family]
    a, b = randomise(case.build(0), 1), randomise(case.build(1), 2)
    x = inputs(case)
    with torch.no_grad():
        la, lb = fam.logits(a, x), fam.logits(b, x)
        assert rel_err(lb, la) > 1e-2  # genuinely different models to begin with
        params = canonical(a)  # the registry's copy, not the adapter's views
        ptrs = {k: p.data_ptr() for k, p in b.module.named_parameters()}
        fam.from_canonical(b, params)
        assert {k: p.data_ptr() for k, p in b.module.named_parameters()} == ptrs  # written in place
        assert torch.equal(fam.logits(b, x), la)
        # fresh tensors: editing the canonical dict leaves the model alone
        for v in params.values():
            v.zero_()
        assert torch.equal(fam.logits(a, x), la)


def test_canonical_shapes_follow_the_arch(case: Case):
    model = case.build(0)
    a, p = model.arch, canonical(model)
    D, h, hkv, d, m = a.d_model, a.n_heads, a.n_kv_heads, a.d_head, a.d_mlp
    for l in range(a.n_layers):
        assert p[f"blocks.{l}.attn.W_Q"].shape == (h, D, d)
        assert p[f"blocks.{l}.attn.W_K"].shape == p[f"blocks.{l}.attn.W_V"].shape == (hkv, D, d)
        assert p[f"blocks.{l}.attn.W_O"].shape == (h, d, D)
        assert p[f"blocks.{l}.mlp.W_in"].shape == (D, m) and p[f"blocks.{l}.mlp.W_out"].shape == (m, D)
        assert (f"blocks.{l}.attn.b_Q" in p) == a.attn_bias and (f"blocks.{l}.norm1.b" in p) == a.norm_bias
        assert (f"blocks.{l}.mlp.W_gate" in p) == a.gated
    assert ("head.W" in p) == (not a.tied_embeddings)
    assert ("embed.pos" in p) == (a.pe == "learned")
    if a.pe == "learned":  # RoBERTa's table starts with the rows up to its padding id
        first = model.config["pad_token_id"] + 1 if case.family in (hf_roberta.FAMILY, hf_roberta.XLM_FAMILY) else 0
        assert p["embed.pos"].shape == (first + a.n_ctx, D)
    assert all(v.is_contiguous() for v in p.values())


# ---------------------------------------------------------------------------------------------
# (c) the canonical layout, proved: a reference Transformer with these params is the same function


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.ref is not None])
def test_canonical_params_run_in_the_reference_family(name: str):
    case = CASES[name]
    fam = FAMILIES[case.family]
    model = randomise(case.build(0), 3)
    if name == "hf_llama_bias_tied":
        with torch.no_grad():
            for layer in model.module.model.layers:
                layer.mlp.gate_proj.bias.zero_()
    params = fam.to_canonical(model)
    ref = reference.build(case.ref, dtype=F64)
    ref_keys = dict(ref.module.state_dict())
    if name == "hf_llama_bias_tied":
        params = {k: v for k, v in params.items() if not k.endswith("mlp.b_gate")}
    assert params.keys() == ref_keys.keys()
    assert all(params[k].shape == v.shape for k, v in ref_keys.items())
    reference.from_canonical(ref, params)
    x = inputs(case)
    with torch.no_grad():
        native, via_ref = fam.logits(model, x), reference.logits(ref, x)
    assert native.shape == via_ref.shape == ((3, 10) if case.task == "vit" else (2, 16, 256))
    assert rel_err(via_ref, native) < 1e-10
    # and the adapter's Arch is the reference's Arch, field by field
    diff = {k for k in model.arch.to_dict() if getattr(model.arch, k) != getattr(ref.arch, k)}
    assert diff <= {"family", "rope_base"} and ("rope_base" not in diff or model.arch.pe != "rope")


@pytest.mark.parametrize(("name", "adapter", "prefix", "norm"), [
    ("hf_llama", hf_llama, "Llama", "RMSNorm"), ("hf_llama_llama3", hf_llama, "Llama", "RMSNorm"),
    ("hf_qwen2", hf_qwen2, "Qwen2", "RMSNorm"), ("hf_qwen2_linear_rope", hf_qwen2, "Qwen2", "RMSNorm"),
    ("hf_qwen3", hf_qwen3, "Qwen3", "RMSNorm"), ("hf_mistral", hf_mistral, "Mistral", "RMSNorm"),
    ("hf_olmo", hf_olmo, "Olmo", "LayerNorm"), ("hf_gemma", hf_gemma, "Gemma", "RMSNorm")], ids=lambda a: a if isinstance(a, str) else "")
def test_stock_hf_llama_is_only_float32_accurate_in_float64(name: str, adapter, prefix: str, norm: str):
    """Why the Llama-layout adapters swap in float64-faithful norms and RoPE (engine/models/hf_decoder.py,
    hf_olmo.py); with a frequency scaling, also that the reference family's scaled frequencies are
    transformers' own (to float32 rounding; unscaled ones would be off by order one)."""
    from engine.models.hf_decoder import hf_class

    RMSNorm, Rotary = (hf_class(adapter.MODEL_TYPE, f"{prefix}{n}") for n in (norm, "RotaryEmbedding"))
    case = CASES[name]
    model = randomise(case.build(0), 3)
    ref = reference.build(case.ref, dtype=F64)
    reference.from_canonical(ref, adapter.to_canonical(model))
    x = inputs(case)
    for m in model.module.modules():
        if isinstance(m, RMSNorm):
            m.__class__ = RMSNorm
        elif isinstance(m, Rotary):
            m.__class__ = Rotary
    with torch.no_grad():
        assert 1e-9 < rel_err(adapter.logits(model, x), reference.logits(ref, x)) < 1e-5


@pytest.mark.parametrize(("adapter", "change", "option"), [
    (hf_qwen2, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding_window=8"),
    (hf_qwen2, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (hf_qwen3, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding_window=8"),
    (hf_mistral, {"sliding_window": 15}, "sliding_window=15"),
    (hf_mistral, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}, "rope_type"),
    (hf_olmo, {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    (hf_olmo, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (hf_gemma, {"hidden_act": "silu"}, "hidden_act='silu'"),
    (hf_phi, {"qk_layernorm": True}, "qk_layernorm=True"),
    (hf_phi, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor=0.1"),
    (hf_gemma, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}, "rope_type"),
])
def test_unsupported_configs_are_refused_before_building(adapter, change: dict, option: str):
    base = {hf_olmo: OLMO_CFG, hf_gemma: GEMMA_CFG, hf_phi: PHI_CFG}.get(adapter, LLAMA_CFG)
    with pytest.raises(ModelError) as e:
        adapter.build({**base, **change})
    msg = str(e.value)
    assert option in msg and "\n" not in msg and msg.startswith(f"{adapter.HF.config_name} config uses"), msg


def test_a_sliding_window_as_long_as_the_context_is_full_attention():
    """Accepted windows: Qwen2 without use_sliding_window, or whose sliding layers start after the last layer;
    Mistral without a window or with one at least max_position_embeddings long. Each is the same function."""
    x = inputs(CASES["hf_qwen2"])
    for adapter, cfgs in ((hf_qwen2, [{"use_sliding_window": False, "sliding_window": 8},
                                      {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                                      {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}]),
                          (hf_mistral, [{"sliding_window": None}, {"sliding_window": 16}])):
        full = randomise(adapter.build(LLAMA_CFG, dtype=F64), 1)
        for cfg in cfgs:
            model = adapter.build({**LLAMA_CFG, **cfg}, dtype=F64)
            adapter.from_canonical(model, canonical(full))
            with torch.no_grad():
                assert torch.equal(adapter.logits(model, x), adapter.logits(full, x)), cfg


def test_qwen2_biases_move_with_their_maps_and_keep_the_function():
    """b_Q and b_K move with the Q/K map A (RoPE commutant), b_V with the V/O map B, per KV group; a head
    permutation permutes all three. Checked entry by entry against the maps, and on the logits."""
    from engine.checks import break_tests, invariance_checks
    from engine.spec import build_spec
    from engine.symmetry import apply, sample

    model = randomise(CASES["hf_qwen2_tied"].build(0), 4)
    a, p = model.arch, canonical(model)
    assert (a.attn_bias, a.out_bias, a.mlp_bias) == (True, False, False)
    assert {"blocks.0.attn.b_Q", "blocks.0.attn.b_K", "blocks.0.attn.b_V"} <= set(p) and "blocks.0.attn.b_O" not in p
    build_spec(a, p)
    g = sample(a, ["heads", "qk", "vo"], seed=2)
    moved = apply(a, g, p)
    rep = a.n_heads // a.n_kv_heads
    for l, el in enumerate(g.layers):
        b = f"blocks.{l}.attn"
        A, B, sigma, tau = el.qk, el.vo, el.head_perm, el.kv_perm  # [h_kv, d, d] x 2, [h], [h_kv]
        assert not torch.equal(sigma, torch.arange(a.n_heads))
        for i in range(a.n_heads):  # query head i reads KV group i // rep
            assert torch.allclose(moved[f"{b}.b_Q"][i], p[f"{b}.b_Q"][sigma[i]] @ A[i // rep], rtol=0, atol=1e-12)
        for c in range(a.n_kv_heads):
            assert torch.allclose(moved[f"{b}.b_K"][c], p[f"{b}.b_K"][tau[c]] @ torch.linalg.inv(A[c]).T, rtol=0,
                                  atol=1e-12)
            assert torch.allclose(moved[f"{b}.b_V"][c], p[f"{b}.b_V"][tau[c]] @ B[c], rtol=0, atol=1e-12)
    x = inputs(CASES["hf_qwen2"])
    with torch.no_grad():
        y = hf_qwen2.logits(model, x)
        twin = hf_qwen2.build({**LLAMA_CFG, "tie_word_embeddings": True}, dtype=F64)
        hf_qwen2.from_canonical(twin, moved)
        assert rel_err(hf_qwen2.logits(twin, x), y) < 1e-10
        hf_qwen2.from_canonical(twin, {**moved, **{k: p[k] for k in p if k.endswith("b_K")}})  # b_K left behind
        assert rel_err(hf_qwen2.logits(twin, x), y) > 1e-3
    # every kind, residual rotations included (the tied head is untied into a reference twin with qkv_bias)
    rows = {r["group"]: r for r in invariance_checks(model, k=1, inputs=x)}
    assert {"heads", "qk", "vo", "mlp", "mlp_scale", "residual_orth"} <= set(rows)
    assert "value_bias_fold" not in rows  # without b_O nothing absorbs a value-bias shift
    assert all(r["exact"] and r["max_rel_change"] < 1e-10 for r in rows.values()), rows
    assert all(r["max_rel_change"] > 1e-3 for r in break_tests(model, inputs=x)), "a break test kept the function"


def test_timm_hub_layout_loads(tmp_path: Path):
    import timm
    from timm.models._hub import save_for_hf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        native = timm.create_model("vit_tiny_patch16_224", pretrained=False, **VIT_ARGS).to(F64).eval()
    save_for_hf(native, str(tmp_path / "hub"), safe_serialization=True)
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["architecture"] == "vit_tiny_patch16_224"
    assert family_of(tmp_path / "hub").name == "timm_vit"
    model = load_model(tmp_path / "hub", dtype=F64)
    x = inputs(CASES["timm_vit"])
    with torch.no_grad():
        assert torch.equal(timm_vit.logits(model, x), native(x))
    timm_vit.save(model, tmp_path / "ours")  # re-saved in the engine's format, same function
    again = load_model(tmp_path / "ours", dtype=F64)
    with torch.no_grad():
        assert torch.equal(timm_vit.logits(again, x), native(x))


# ---------------------------------------------------------------------------------------------
# (d) bad input: one ModelError sentence that names the directory


BAD_CASES = ["hf_gpt2", "hf_llama", "hf_qwen2", "hf_qwen3", "hf_mistral", "hf_olmo", "hf_gemma", "hf_phi", "hf_neox", "timm_vit"]


@pytest.fixture
def saved(request, tmp_path: Path) -> tuple[Case, Path]:
    case = CASES[request.param]
    path = tmp_path / "ckpt"
    FAMILIES[case.family].save(case.build(0), path)
    return case, path


def _raises_naming(path: Path, fn: Callable[[], object], *words: str) -> None:
    with pytest.raises(ModelError) as e:
        fn()
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("saved", BAD_CASES, indirect=True)
def test_pickled_only_directory_is_refused(saved):
    case, path = saved
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded: pickles can run code")
    _raises_naming(path, lambda: FAMILIES[case.family].load(path, dtype=F64), "pytorch_model.bin", "pickle")


@pytest.mark.parametrize("saved", BAD_CASES, indirect=True)
def test_corrupt_safetensors_is_refused(saved):
    case, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    _raises_naming(path, lambda: FAMILIES[case.family].load(path, dtype=F64))


@pytest.mark.parametrize("saved", BAD_CASES, indirect=True)
def test_nan_weights_are_refused(saved):
    case, path = saved
    f = path / "model.safetensors"
    state = load_file(str(f))
    k = max(state)
    state[k] = state[k].clone()
    state[k].view(-1)[0] = float("nan")
    save_file(state, str(f), metadata={"format": "pt"})
    _raises_naming(path, lambda: FAMILIES[case.family].load(path, dtype=F64), "NaN")


@pytest.mark.parametrize("saved", ["hf_gpt2", "hf_llama", "hf_qwen2", "hf_mistral", "hf_neox"], indirect=True)
def test_unsupported_model_type_is_refused(saved):
    case, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (path / "config.json").write_text(json.dumps(cfg))
    _raises_naming(path, lambda: load_model(path), "not a supported family")
    _raises_naming(path, lambda: FAMILIES[case.family].load(path), "mamba")


@pytest.mark.parametrize(("saved", "change", "option"), [
    ("hf_gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("hf_gpt2", {"activation_function": "gelu_fast"}, "gelu_fast"),
    ("hf_llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}, "rope_type"),
    ("hf_llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("hf_llama", {"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}},
     "not a valid Llama config (Missing required keys in `rope_parameters` for 'rope_type'='llama3': {'low_freq_factor'})"),
    ("hf_llama", {"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": -4}}, "high_freq_factor must be a positive"),
    ("hf_qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0}}, "rope_type"),
    ("hf_qwen2", {"use_sliding_window": True, "sliding_window": 8,
                  "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window=8"),
    ("hf_qwen2", {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]},
     "layer_types"),  # sliding layers without a window: transformers cannot run them
    ("hf_mistral", {"sliding_window": 8}, "sliding_window=8"),
    ("hf_mistral", {"hidden_act": "gelu"}, "hidden_act"),
], indirect=["saved"])
def test_unsupported_hf_options_are_refused(saved, change: dict, option: str):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    _raises_naming(path, lambda: load_model(path), option)


@pytest.mark.parametrize(("saved", "change", "option"), [
    ("hf_gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("hf_llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("hf_qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, "sliding_window=8"),
    ("hf_qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}, "rope_type='dynamic'"),
    ("hf_mistral", {"sliding_window": 8}, "sliding_window=8"),
    ("hf_neox", {"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
    ("hf_olmo", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("hf_gemma", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("hf_phi", {"qk_layernorm": True}, "qk_layernorm=True"),
    ("hf_bert", {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ("hf_bert", {"hidden_size": 30}, "hidden_size=30 with 4 heads"),
    ("hf_roberta", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("hf_xlm_roberta", {"pad_token_id": None}, "pad_token_id=None"),
], indirect=["saved"])
def test_an_hf_config_is_refused_before_any_weight_is_read(saved, change: dict, option: str):
    """The option is named even when the weights are unreadable: the config is checked first (a changed size
    or an untied head would otherwise surface as weights that do not match)."""
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    _raises_naming(path, lambda: load_model(path), f"{path} uses {option}, which the engine does not support")


@pytest.mark.parametrize(("change", "option"), [
    ({"class_token": False}, "class_token"),
    ({"global_pool": "avg"}, "global_pool"),
    ({"init_values": 1e-5}, "init_values"),
    ({"reg_tokens": 4}, "reg_tokens"),
    ({"qk_norm": True}, "qk_norm"),
])
def test_unsupported_timm_options_are_refused(tmp_path: Path, change: dict, option: str):
    path = tmp_path / "ckpt"
    timm_vit.save(timm_vit.build(VIT_ARGS), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_args"] |= change
    (path / "config.json").write_text(json.dumps(cfg))
    _raises_naming(path, lambda: load_model(path), option)
    with pytest.raises(ModelError, match=option):
        timm_vit.build({**VIT_ARGS, **change})


def test_unsupported_timm_architecture_defaults_are_refused(tmp_path: Path):
    """A registered architecture sets options the kwargs never mention: checked on the module."""
    path = tmp_path / "hub"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_patch14_reg4_dinov2", "num_classes": 10, "model_args": VIT_ARGS}))
    save_file({}, str(path / "model.safetensors"))
    assert family_of(path).name == "timm_vit"
    _raises_naming(path, lambda: load_model(path), "reg_tokens=4")


def test_adapter_views_alias_the_module_and_canonical_copies_do_not(case: Case):
    """The adapters hand out views (alignment streams over them without copying the model);
    engine.models.canonical copies unless asked for views."""
    model = case.build(0)
    storages = {p.untyped_storage().data_ptr() for p in model.module.state_dict().values()}
    views, copies = FAMILIES[case.family].to_canonical(model), canonical(model)
    assert views.keys() == copies.keys()
    shared = [k for k, v in views.items() if v.untyped_storage().data_ptr() in storages]
    # OLMo stores no norm gains, Gemma stores them less 1: their canonical gains are tensors of their own; Phi's
    # one norm per block is a view as norm1 and a copy as norm2 (two views of one tensor would be moved twice)
    own = {hf_olmo.FAMILY: hf_olmo.NORMS, hf_gemma.FAMILY: hf_gemma.NORMS,
           hf_phi.FAMILY: ("norm2.g", "norm2.b")}.get(case.family)
    unstored = [k for k in views if own and k.endswith(own)]
    n = {hf_phi.FAMILY: 2 * model.arch.n_layers}.get(case.family, 2 * model.arch.n_layers + 1)
    assert len(unstored) == (n if own else 0)
    assert len(shared) + len(unstored) >= len(views) - 2  # at most a couple of reshaped copies (e.g. a fused layout)
    assert not any(v.untyped_storage().data_ptr() in storages for v in copies.values())
    assert all(torch.equal(views[k], copies[k]) for k in views)


def test_arch_from_config_alone_is_the_loaded_models_arch(case: Case, tmp_path: Path):
    from engine.models import arch_from_config

    model = case.build(0)
    FAMILIES[case.family].save(model, tmp_path / "m")
    assert arch_from_config(json.loads((tmp_path / "m" / "config.json").read_text())) == model.arch


# published configs (their config.json as on the hub), read without weights
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "max_position_embeddings": 32768, "max_window_layers": 24, "use_sliding_window": False,
              "sliding_window": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
              "tie_word_embeddings": True, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643,
              "torch_dtype": "bfloat16"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 32768, "sliding_window": None, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
              "hidden_act": "silu", "tie_word_embeddings": False, "vocab_size": 32768, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "bfloat16"}  # v0.3; v0.1 had a 4096-token sliding window


def test_published_qwen2_and_mistral_configs_and_their_group_dimensions():
    from engine.groups import group_dimension
    from engine.models import arch_from_config

    q = arch_from_config(QWEN25_05B)
    assert (q.family, q.n_heads, q.n_kv_heads, q.d_head, q.rope_layout, q.rotary_dim) == ("hf_qwen2", 14, 2, 64, "half", 64)
    assert (q.attn_bias, q.out_bias, q.mlp_bias, q.tied_embeddings) == (True, False, False, True)
    by = group_dimension(q)["by_kind"]
    L, hkv, d = 24, 2, 64
    assert by["qk"] == L * hkv * d and by["vo"] == L * hkv * d * d  # RoPE commutant H(d) per KV group, GL(d)
    assert by["key_bias"] == 0 and by["value_bias"] == 0  # RoPE rotates every dim; no b_O absorbs a b_V shift
    m = arch_from_config(MISTRAL_7B)
    assert (m.family, m.n_kv_heads, m.d_head, m.attn_bias, m.out_bias, m.mlp_bias) == ("hf_mistral", 8, 128, False,
                                                                                     False, False)
    with pytest.raises(ModelError, match="sliding_window=4096") as e:
        arch_from_config({**MISTRAL_7B, "sliding_window": 4096}, "Mistral-7B-v0.1's config.json")
    assert str(e.value).startswith("Mistral-7B-v0.1's config.json uses sliding_window=4096") and "\n" not in str(e.value)


# gemma-2b's config.json (its legacy hidden_act "gelu" is read by transformers as gelu_pytorch_tanh)
GEMMA_2B = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "head_dim": 256, "hidden_act": "gelu",
            "hidden_size": 2048, "intermediate_size": 16384, "max_position_embeddings": 8192,
            "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0, "vocab_size": 256000, "torch_dtype": "bfloat16"}


def test_gemma_its_published_config_and_its_group_exactly():
    """gemma-2b's config read without weights (GeGLU, multi-query, heads of 256, the embedding scaled by sqrt(2048)
    at float32); on a small Gemma every default class keeps the function to float64 rounding, gains stored less 1
    included, and the transforms outside the group (the GeGLU gate scaled among them) change it."""
    from engine.checks import break_tests, invariance_checks
    from engine.groups import group_dimension
    from engine.models import arch_from_config

    a = arch_from_config(GEMMA_2B)
    assert (a.family, a.mlp, a.n_heads, a.n_kv_heads, a.d_head, a.tied_embeddings) == ("hf_gemma", "geglu", 8, 1, 256,
                                                                                       True)
    assert a.embed_scale == float(torch.tensor(2048**0.5, dtype=torch.float32)) != 2048**0.5
    assert group_dimension(a)["by_kind"]["mlp_scale"] == 18 * 16384  # the up branch scales, as SwiGLU's
    model = randomise(CASES["hf_gemma"].build(0), 3)
    p = canonical(model)
    assert torch.equal(p["norm_f.g"], model.module.model.norm.weight.detach() + 1)  # the gain is 1 + the stored weight
    x = inputs(CASES["hf_gemma"])
    rows = {r["group"]: r for r in invariance_checks(model, k=2, inputs=x)}
    assert {"heads", "mlp", "mlp_scale", "qk", "vo", "residual_orth"} <= set(rows)
    assert all(r["exact"] and r["max_rel_change"] < 1e-10 for r in rows.values()), rows
    broken = {r["group"]: r["max_rel_change"] for r in break_tests(model, inputs=x)}
    assert "geglu_gate_scale" in broken and all(v > 1e-3 for v in broken.values()), broken


# phi-2's config.json (its legacy top-level rope_theta and partial_rotary_factor, as on the hub)
PHI_2 = {"architectures": ["PhiForCausalLM"], "model_type": "phi", "attention_dropout": 0.0, "bos_token_id": 50256,
         "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560,
         "initializer_range": 0.02, "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
         "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4,
         "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True, "vocab_size": 51200}


def test_phi_2_s_published_config_and_its_group_dimensions():
    from engine.groups import group_dimension
    from engine.models import arch_from_config

    a = arch_from_config(PHI_2)
    assert (a.family, a.d_head, a.rotary_dim, a.mlp, a.parallel_residual, a.head_bias) == ("hf_phi", 80, 32, "gelu_tanh",
                                                                                         True, True)
    by = group_dimension(a)["by_kind"]
    L, h, d, r = 32, 32, 80, 32
    assert by["qk"] == L * h * ((d - r) ** 2 + r)  # GL on the 48 unrotated dims, a complex scalar per rotated pair
    assert by["mlp_scale"] == 0  # gelu: no neuron scaling


def test_phi_one_layernorm_for_both_branches_and_its_group_exactly():
    """Phi's one LayerNorm is canonically two equal norms: both are the native tensor, unequal ones are refused
    rather than averaged, and every default class keeps the function to float64 rounding (the LayerNorm rewritten
    as RMSNorm for the residual rotation, as GPT-NeoX's)."""
    from engine.checks import break_tests, invariance_checks

    model = randomise(CASES["hf_phi"].build(0), 3)
    p = canonical(model)
    for l in range(model.arch.n_layers):
        assert torch.equal(p[f"blocks.{l}.norm1.g"], p[f"blocks.{l}.norm2.g"])
        assert torch.equal(p[f"blocks.{l}.norm1.b"], model.module.model.layers[l].input_layernorm.bias.detach())
    bad = dict(p) | {"blocks.0.norm2.g": p["blocks.0.norm2.g"] * 1.5}
    with pytest.raises(ModelError, match="one LayerNorm for both branches"):
        hf_phi.from_canonical(model, bad)
    x = inputs(CASES["hf_phi"])
    rows = {r["group"]: r for r in invariance_checks(model, k=2, inputs=x)}
    assert {"heads", "mlp", "qk", "vo", "residual_orth"} <= set(rows)
    assert all(r["exact"] and r["max_rel_change"] < 1e-10 for r in rows.values()), rows
    assert all(r["max_rel_change"] > 1e-3 for r in break_tests(model, inputs=x))


# ---------------------------------------------------------------------------------------------
# RoPE frequency scaling (Llama 3): the same group, another function


def test_llama3_frequency_scaling_keeps_the_rope_group_and_changes_the_function():
    from engine.checks import break_tests, invariance_checks

    model = randomise(CASES["hf_llama_llama3"].build(0), 3)
    assert json.loads(model.arch.rope_scaling) == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    x = inputs(CASES["hf_llama_llama3"])
    rows = {r["group"]: r for r in invariance_checks(model, k=2, inputs=x)}
    assert {"heads", "mlp", "qk", "vo", "residual_orth"} <= set(rows)
    assert all(r["exact"] and r["max_rel_change"] < 1e-10 for r in rows.values()), rows
    assert all(r["max_rel_change"] > 1e-3 for r in break_tests(model, inputs=x))
    # the same weights with standard frequencies are another function
    plain = hf_llama.build(LLAMA_CFG, dtype=F64)
    hf_llama.from_canonical(plain, canonical(model))
    with torch.no_grad():
        assert rel_err(hf_llama.logits(plain, x), hf_llama.logits(model, x)) > 1e-2


def test_llamas_with_other_rope_scalings_are_not_one_architecture(tmp_path: Path):
    from engine.errors import ArchitectureMismatch
    from engine.pipeline import check_pair

    hf_llama.HF.save(CASES["hf_llama_llama3"].build(0), tmp_path / "a")
    hf_llama.HF.save(CASES["hf_llama"].build(1), tmp_path / "b")
    with pytest.raises(ArchitectureMismatch) as e:
        check_pair(str(tmp_path / "a"), str(tmp_path / "b"))
    msg = str(e.value)
    assert "rope_scaling is '{" in msg and "llama3" in msg and "\n" not in msg


# Llama-3.2-1B's config.json
LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
                "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
                "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
                "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                         "low_freq_factor": 1.0,
                                                         "original_max_position_embeddings": 8192,
                                                         "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                "vocab_size": 128256}


def test_the_llama_3_2_1b_config_reads_with_its_frequency_scaling(tmp_path: Path, capsys):
    from ref_models import dims_only_report

    rep = dims_only_report(tmp_path, LLAMA_3_2_1B, capsys)
    a, by = rep["arch"], rep["group_dim"]["by_kind"]
    assert rep["family"] == "hf_llama" and a["tied_embeddings"] and a["n_kv_heads"] == 8
    assert json.loads(a["rope_scaling"]) == {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert by["qk"] == 16 * 8 * 64  # one complex scalar per frequency pair and KV group, as without the scaling
