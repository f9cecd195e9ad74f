"""bfloat16 weights computed in float32 where the CPU has no bfloat16 products (engine.models.widening).

For every family's adapter case: a bfloat16 model's logits under widening are those of a float32 model holding
the same (bfloat16-rounded) weights, and the model ends with its own bfloat16 tensors, untouched; activation
matching's capture, which stops its forward with an exception, restores them too."""

from __future__ import annotations

import copy

import pytest
import torch
from test_adapters import CASES, inputs, randomise

from engine.align.activation import capture
from engine.align.forward import twin
from engine.models import model_logits, widening
from engine.models.widening import fast_half, widened, widens

BF16 = torch.bfloat16


@pytest.fixture
def force(monkeypatch):
    def set_(value: bool | None) -> None:
        monkeypatch.setattr(widening, "FORCE", value)
    return set_


def _bf16(case_name: str):
    case = CASES[case_name]
    m = randomise(case.build(0), 0)
    m.module.to(BF16)
    wide = copy.deepcopy(m)
    wide.module.float()  # the same bfloat16 values, held in float32
    return case, m, wide


def _state(m) -> list[tuple[str, torch.dtype, int]]:
    return [(n, p.dtype, p.data_ptr()) for n, p in m.module.named_parameters()]


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_widened_logits_are_the_float32_models_and_the_weights_stay_bfloat16(name, force):
    case, m, wide = _bf16(name)
    x = inputs(case)
    before = _state(m)
    force(True)
    y = model_logits(m, x)
    ref = model_logits(wide, x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), name
    assert _state(m) == before  # every parameter back in bfloat16, in its own storage
    force(False)
    native = model_logits(m, x).float()  # bfloat16 arithmetic: further from the float32 function
    assert float((native - ref).abs().max()) > 10 * float((y - ref).abs().max())


def test_capture_restores_the_weights_after_its_early_stop_and_keeps_the_models_dtype(force):
    case, m, wide = _bf16("hf_gpt2")  # learned positions: no RoPE tables, which a bfloat16 twin holds rounded
    tw, tw32 = twin(m), twin(wide)
    x = inputs(case)
    before = _state(tw)
    force(True)
    got = capture(tw, x)  # stopped by an exception before the unembedding
    assert _state(tw) == before
    ref = capture(tw32, x)
    for key in ("resid", "x_attn", "x_mlp"):
        assert all(t.dtype == BF16 for t in got[key])
        for g, r in zip(got[key], ref[key], strict=True):  # float32 activations, rounded once to bfloat16
            assert torch.equal(g, r.to(BF16))


def test_only_half_precision_weights_on_a_slow_device_widen(force):
    _, m, wide = _bf16("reference")
    force(None)
    assert not widens(wide.module)  # float32: nothing to widen
    assert widens(m.module) == (not fast_half(BF16, torch.device("cpu")))
    assert fast_half(BF16, torch.device("meta"))  # any accelerator device: its own half-precision kernels
    with widened(wide.module) as w:
        assert w is False
