"""What a run needs, from configs alone: meta-device shapes, the memory model, the one-sentence refusal."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ref_models import tiny

from engine import resources
from engine.api import run_pair
from engine.errors import LMCError, ModelError, ResourceError
from engine.evaluate import EVAL_BUDGET_BYTES
from engine.models import hf_gpt2, hf_llama, load_model, reference, save_model, timm_vit
from engine.models.io import read_config
from engine.resources import check_fits, check_run, describe, estimate_run, model_shape
from engine.results import RunConfig

GPT2_TINY = {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 256}
LLAMA_TINY = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}
VIT_TINY = {"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 32, "depth": 2,
            "num_heads": 4, "mlp_ratio": 2.0, "global_pool": "token"}
BUILDS = {
    "reference": lambda: reference.build(tiny(vocab_size=256, pe="rope")),
    "hf_gpt2": lambda: hf_gpt2.build(GPT2_TINY),
    "hf_llama": lambda: hf_llama.build(LLAMA_TINY),
    "timm_vit": lambda: timm_vit.build(VIT_TINY),
}


def config_only(model, path):
    """A model directory holding its config.json but no weights."""
    save_model(model, path)
    (path / "model.safetensors").unlink()
    return path


@pytest.mark.parametrize("family", list(BUILDS))
def test_meta_shape_counts_the_real_modules_parameters_without_weights(family, tmp_path):
    m = BUILDS[family]()
    s = model_shape(config_only(m, tmp_path / family))
    assert s.family == family and s.arch == m.arch
    assert s.params == sum(p.numel() for p in m.module.parameters())
    blk = (m.module.blocks if family in ("reference", "timm_vit") else
           m.module.transformer.h if family == "hf_gpt2" else m.module.model.layers)[0]
    assert s.layer_params == sum(p.numel() for p in blk.parameters())


def test_gpt2_small_estimate_is_its_124m_parameters(tmp_path):
    from transformers import GPT2Config

    c = GPT2Config()
    d = tmp_path / "gpt2-small"
    d.mkdir()
    (d / "config.json").write_text(c.to_json_string())  # no weights at all
    D, L, V, n = c.n_embd, c.n_layer, c.vocab_size, c.n_positions
    params = V * D + n * D + L * (12 * D * D + 13 * D) + 2 * D  # tied head; 4 D^2 attention + 8 D^2 MLP
    est = estimate_run([d, d], "naive", eval_items=65_536)
    assert est.params == params and abs(params / 124e6 - 1) < 0.01
    assert est.parts["path model"] == pytest.approx(124e6 * 4, rel=0.10)
    assert est.parts["endpoints"] == 2 * est.parts["path model"]
    assert est.parts["evaluation"] <= EVAL_BUDGET_BYTES
    assert est.total_bytes == sum(est.parts.values())
    e64 = estimate_run([d, d], "naive", eval_items=65_536, dtype="float64")
    assert e64.parts["path model"] == 2 * est.parts["path model"]
    w = estimate_run([d, d], "weight", eval_items=65_536, classes=("heads", "mlp", "qk", "vo", "residual_perm"))
    assert "aligned B" not in w.parts and "untied heads" not in w.parts  # B is moved in place
    assert 0.5 * est.parts["path model"] < w.parts["weight matching scratch"] < 2 * est.parts["path model"]
    rw = estimate_run([d, d], "weight", eval_items=65_536)  # the default rotates: rewritten in place
    assert "aligned B" not in rw.parts and rw.parts["untied heads"] == 2 * V * D * 4
    assert rw.total_bytes == w.total_bytes + 2 * V * D * 4
    assert est.parts["untied heads"] == rw.parts["untied heads"]  # naive's second curve rewrites too
    learned, dual = (estimate_run([d, d], m, eval_items=65_536) for m in ("learned", "dual"))
    assert w.total_bytes < learned.total_bytes < dual.total_bytes


@pytest.mark.parametrize("slow_cpu", [True, False])
def test_bfloat16_on_a_cpu_without_bfloat16_products_counts_its_float32_widening(slow_cpu, tmp_path, monkeypatch):
    """engine.models.widening: the parameters outside the blocks and one block's, in float32."""
    from engine.models import widening

    monkeypatch.setattr(widening, "FORCE", slow_cpu)
    d = config_only(hf_llama.build(LLAMA_TINY), tmp_path / "llama")
    s = model_shape(d)
    est = estimate_run([d, d], "weight", eval_items=1024, dtype="bfloat16")
    outer = s.params - s.arch.n_layers * s.layer_params  # untied embedding, head, final norm
    assert outer == 2 * 256 * 32 + 32
    if slow_cpu:
        assert est.parts["float32 widening"] == 4 * (outer + s.layer_params)
        assert est.total_bytes == sum(est.parts.values())
    else:
        assert "float32 widening" not in est.parts
    assert "float32 widening" not in estimate_run([d, d], "weight", eval_items=1024).parts  # float32: nothing


def test_weights_are_never_read(tmp_path):
    m = reference.build(tiny(vocab_size=256, pe="learned"), dtype=torch.float64)
    save_model(m, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError):
        load_model(tmp_path / "m")
    est = estimate_run([tmp_path / "m", tmp_path / "m"], "naive", dtype="float64", eval_items=1024)
    assert est.parts["path model"] == 8 * sum(p.numel() for p in m.module.parameters())
    assert read_config(tmp_path / "m")  # the config is what was read


def test_check_fits_refuses_in_one_sentence_naming_need_and_availability(tmp_path):
    d = config_only(BUILDS["hf_gpt2"](), tmp_path / "g")
    est = estimate_run([d, d], "weight", eval_items=1024)
    with pytest.raises(ResourceError) as e:
        check_fits(est, available=1500)
    msg = str(e.value)
    assert re.fullmatch(r"This run needs about [\d.]+ [kMG]B \(endpoints [\d.]+ [kMG]?B, path model .*, weight matching "
                        r"scratch .*\) but only 1\.5 kB are available on cpu\.", msg), msg
    assert resources.fmt_bytes(est.total_bytes) in msg and "\n" not in msg
    check_fits(est, available=est.total_bytes)  # exactly enough fits
    with pytest.raises(ResourceError, match="available on cuda"):
        check_fits(est, "cuda", available=lambda dev: 10)
    assert describe(est).startswith(f"needs about {resources.fmt_bytes(est.total_bytes)}: endpoints ")
    assert describe(est).endswith("(cpu, float32)")


def test_run_pair_refuses_before_loading(tmp_path, monkeypatch):
    from engine import pipeline

    for s in (0, 1):
        save_model(reference.build(tiny(vocab_size=256), seed=s), tmp_path / f"m{s}")
    cfg = RunConfig(str(tmp_path / "m0"), str(tmp_path / "m1"), points=3, eval_items=1024)
    assert check_run(cfg).total_bytes > 0

    def never(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pipeline, "load_both", never)
    with monkeypatch.context() as m:
        m.setattr(resources, "available_bytes", lambda device: 1000)
        with pytest.raises(ResourceError, match=r"but only 1\.0 kB are available on cpu\."):
            run_pair(cfg)
    (tmp_path / "m1" / "model.safetensors").write_bytes(b"corrupt")  # its header does not parse
    with pytest.raises(ModelError, match=r"^Model B directory .* cannot be used: .* is not a readable safetensors"):
        run_pair(cfg)


def test_a_run_that_fits_only_in_bfloat16_is_refused_with_the_bfloat16_figure(tmp_path):
    for s in (0, 1):
        save_model(hf_llama.build(LLAMA_TINY, seed=s), tmp_path / f"m{s}")
    cfg = RunConfig(str(tmp_path / "m0"), str(tmp_path / "m1"), points=3, eval_items=1024)
    f32, bf16 = check_run(cfg), check_run(replace(cfg, dtype="bfloat16"))
    assert bf16.total_bytes < f32.total_bytes
    between = (bf16.total_bytes + f32.total_bytes) // 2
    with pytest.raises(ResourceError, match=r"In bfloat16 \(--dtype bfloat16\) it would need about"):
        check_run(cfg, available=between)
    with pytest.raises(ResourceError) as e:  # fitting in neither: no advice
        check_run(cfg, available=bf16.total_bytes - 1)
    assert "bfloat16" not in str(e.value).split("(cpu")[0] and "would need" not in str(e.value)
    assert check_run(replace(cfg, dtype="bfloat16"), available=between).dtype == "bfloat16"


def test_available_memory_is_measured():
    free = resources.available_bytes("cpu")
    lines = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemTotal:"))
    assert 0 < free <= total
    assert resources.available_bytes("meta") is None


def test_bad_requests_are_one_sentence(tmp_path):
    d = config_only(BUILDS["reference"](), tmp_path / "r")
    with pytest.raises(LMCError, match="Method 'best' is not available; choose one of: naive, weight"):
        estimate_run([d, d], "best")
    with pytest.raises(LMCError, match="Method 'best' is not available; choose one of: naive, weight"):
        resources.method_scratch(model_shape(d), "best", 4)
    with pytest.raises(LMCError, match="compares two models; got 1"):
        estimate_run([d], "naive")
    with pytest.raises(LMCError, match="Unknown dtype 'float8'"):
        estimate_run([d, d], "naive", dtype="float8")
    with pytest.raises(ModelError, match="is not a supported family"):
        estimate_run([d, tmp_path], "naive")
