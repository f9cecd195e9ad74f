"""CPU vs CUDA: every aligner and the evaluator give the same answers on a GPU (float tolerance).

Skipped, with the reason, on machines without CUDA. The models are float64, so agreement is a
question of summation order only.
"""

import copy

import pytest
import torch
from ref_models import make_case, planted

from engine.align import METHODS
from engine.align.run import align
from engine.evaluate import eval_set_for, evaluate
from engine.interpolate import interpolate
from engine.models import canonical

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def on(model, device):
    m = copy.deepcopy(model)
    m.module.to(device)
    return m


@pytest.mark.parametrize("name", ["lm-rope-half-gqa-swiglu", "hf_gpt2", "vit-learned"])
def test_evaluation_agrees(name):
    a = make_case(name)
    es = eval_set_for(a, "val", 64 if a.arch.task == "vit" else 512)
    cpu, gpu = evaluate(a, es), evaluate(on(a, "cuda"), es)
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-10)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "naive"])
def test_every_aligner_agrees(method):
    a = make_case("lm-rope-half-gqa-swiglu")
    b, _, _ = planted(a)
    steps = 3 if METHODS[method].default_steps else 0
    ref = align(copy.deepcopy(a), copy.deepcopy(b), method, steps=steps, compare_one_sided=False)
    got = align(on(a, "cuda"), on(b, "cuda"), method, steps=steps, compare_one_sided=False, in_place=True)
    for el, el_ref in zip(got.out.g.layers, ref.out.g.layers):
        assert torch.equal(el.head_perm.cpu(), el_ref.head_perm) and torch.equal(el.mlp_perm.cpu(), el_ref.mlp_perm)
    moved = canonical(got.model_b)
    for k, v in ref.moved_params.items():
        assert torch.allclose(moved[k].cpu(), v, rtol=1e-8, atol=1e-10), k
    es = eval_set_for(a, "val", 256)
    r_cpu = interpolate(ref.model_a, ref.model_b, es, points=3)
    r_gpu = interpolate(got.model_a, got.model_b, es, points=3)
    assert r_gpu["loss"] == pytest.approx(r_cpu["loss"], rel=1e-8)


def test_bfloat16_autocast_evaluation_is_close():
    a = make_case("hf_llama")
    es = eval_set_for(a, "val", 512)
    m = on(a, "cuda")
    m.module.float()
    full, auto = evaluate(m, es), evaluate(m, es, autocast=True)
    assert auto["loss"] == pytest.approx(full["loss"], rel=2e-2)
