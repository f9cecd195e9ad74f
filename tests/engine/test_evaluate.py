"""Held-out evaluation: token-budget batches, chunked float32 losses, float64 kept exact, autocast."""

import pytest
import torch
import torch.nn.functional as F
from ref_models import random_model, tiny

import engine.evaluate as ev
from engine.errors import DataError, LMCError
from engine.evaluate import EvalSet, evaluate, item_bytes, items_per_batch, lm_eval_set, vit_eval_set
from engine.models import model_logits
from engine.models.reference import apply_rope, build, rope_frequencies


def direct(model, es):
    """The definition: one forward over the whole set, float64 cross-entropy and accuracy."""
    with torch.no_grad():
        x = es.inputs.to(next(model.module.parameters()).dtype) if es.inputs.is_floating_point() else es.inputs
        logits = model_logits(model, x).double()  # [N, T, V] or [N, C]
    loss = F.cross_entropy(logits.flatten(0, -2), es.targets.flatten()).item()
    acc = (logits.argmax(-1) == es.targets).double().mean().item()
    return loss, acc


def lm_set(n_tokens=1024, n_ctx=16):
    return lm_eval_set("val", n_tokens, n_ctx=n_ctx)


@pytest.mark.parametrize("max_tokens", [None, 16, 100, 10_000])
def test_float64_model_is_exact_whatever_the_batching(max_tokens):
    m = random_model(tiny(vocab_size=256), seed=0, std=0.2)
    es = lm_set()
    loss, _ = direct(m, es)
    assert evaluate(m, es, max_tokens)["loss"] == pytest.approx(loss, rel=1e-12)


def test_float32_model_matches_float64_logits_to_float_noise():
    m = build(tiny(vocab_size=256), seed=1)  # float32
    es = lm_set(2048)
    loss, _ = direct(m, es)
    got = [evaluate(m, es, t)["loss"] for t in (None, 16, 512)]
    assert all(g == pytest.approx(loss, rel=2e-6) for g in got)
    assert got[0] != pytest.approx(loss + 1e-3, rel=1e-6)  # the tolerance can fail


def test_loss_is_taken_in_row_chunks_in_the_models_precision(monkeypatch):
    seen = []
    real = F.cross_entropy

    def spy(x, t, **kw):
        seen.append((x.dtype, x.shape[0], kw.get("reduction")))
        return real(x, t, **kw)

    monkeypatch.setattr(ev, "LOSS_CHUNK_BYTES", 7 * 4 * 256)  # 7 float32 rows of 256 logits
    monkeypatch.setattr(F, "cross_entropy", spy)
    es = lm_set(512)
    m32 = build(tiny(vocab_size=256), seed=2)
    loss32 = evaluate(m32, es)["loss"]
    assert {s[0] for s in seen} == {torch.float32} and max(s[1] for s in seen) == 7
    assert {s[2] for s in seen} == {"sum"} and sum(s[1] for s in seen) == es.size
    seen.clear()
    m64 = random_model(tiny(vocab_size=256), seed=2, std=0.2)
    loss64 = evaluate(m64, es)["loss"]
    assert {s[0] for s in seen} == {torch.float64} and max(s[1] for s in seen) == 3  # 7 * 4 bytes / 8
    monkeypatch.undo()
    assert loss32 == pytest.approx(direct(m32, es)[0], rel=2e-6)
    assert loss64 == pytest.approx(direct(m64, es)[0], rel=1e-12)


def test_batches_respect_the_token_budget_and_run_in_inference_mode(monkeypatch):
    shapes, modes = [], []
    real = ev.model_logits

    def spy(model, x):
        shapes.append(tuple(x.shape))
        modes.append(torch.is_inference_mode_enabled())
        return real(model, x)

    monkeypatch.setattr(ev, "model_logits", spy)
    m = build(tiny(vocab_size=256), seed=0)
    es = lm_set(1024)  # 64 windows of 16
    evaluate(m, es, max_tokens=100)  # 6 windows per forward
    assert all(b * t <= 100 for b, t in shapes) and sum(b for b, _ in shapes) == 64 and all(modes)
    shapes.clear()
    evaluate(m, es, max_tokens=1)  # never less than one window
    assert shapes == [(1, 16)] * 64


def test_default_batch_keeps_gpt2_small_logits_under_the_budget():
    from transformers import GPT2Config

    from engine.models import hf_gpt2

    a = hf_gpt2.arch(GPT2Config())
    n = items_per_batch(a)
    tokens = n * ev.seq_len(a)
    assert tokens * a.n_out * 4 <= ev.EVAL_BUDGET_BYTES < (n + 1) * item_bytes(a)
    assert n * item_bytes(a) <= ev.EVAL_BUDGET_BYTES
    assert items_per_batch(a, budget_bytes=1) == 1


def test_vit_accuracy_and_loss_match_the_definition():
    m = random_model(tiny("vit"), seed=3, std=0.2)
    es = vit_eval_set("test", 100)
    loss, acc = direct(m, es)
    r = evaluate(m, es, max_tokens=17 * 7)  # 7 images of 17 positions per forward
    assert r["loss"] == pytest.approx(loss, rel=1e-12) and r["accuracy"] == acc
    assert 0 < acc < 1  # a real fraction, not a constant


def test_autocast_is_ignored_off_cuda():
    m = build(tiny(vocab_size=256), seed=0)
    es = lm_set(256)
    assert evaluate(m, es, autocast=True)["loss"] == evaluate(m, es)["loss"]


def test_bad_inputs_are_one_sentence():
    m = build(tiny(vocab_size=256), seed=0)
    es = lm_set(256)
    with pytest.raises(LMCError, match="max_tokens must be a positive number"):
        evaluate(m, es, max_tokens=0)
    empty = EvalSet("lm", es.inputs[:0], es.targets[:0], "nothing")
    with pytest.raises(DataError, match=r"evaluation set \(nothing\) is empty"):
        evaluate(m, empty)


# ---------------------------------------------------------------------------------------------
# RoPE under bfloat16 autocast


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_reference_lm_runs_under_bfloat16_autocast_close_to_float32(layout):
    m = build(tiny(vocab_size=256, pe="rope", rope_layout=layout, rotary_dim=4), seed=0)  # float32, partial RoPE
    x = lm_set(256).inputs[:4]
    with torch.no_grad():
        ref = m.module(x)  # [4, 16, 256]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m.module(x)
    assert y.dtype == torch.bfloat16
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert 0 < err < 3e-2  # bfloat16 rounding, not a different function


def test_apply_rope_rounds_once_from_the_wider_dtype():
    T, d = 12, 8
    ang = torch.arange(T, dtype=torch.float64)[:, None] * rope_frequencies(d, 10000.0)  # [T, d/2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, T, d, generator=g, dtype=torch.float64)
    exact = apply_rope(x, ang.cos(), ang.sin(), "interleaved")
    xb = x.to(torch.bfloat16)
    y = apply_rope(xb, ang.cos().float(), ang.sin().float(), "interleaved")
    assert y.dtype == torch.bfloat16
    # computed in float32 from the bfloat16 inputs, rounded once: the exact rotation of xb, rounded
    want = apply_rope(xb.double(), ang.cos(), ang.sin(), "interleaved").to(torch.bfloat16)
    assert (y.double() - want.double()).abs().max() <= 2 ** -7 * want.double().abs().max()
    assert (y.double() - exact).abs().max() < 2e-2 * exact.abs().max()
