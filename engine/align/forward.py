"""A differentiable forward for the data-driven aligners (activation, learned, dual): the reference-family
twin of a model, checked against the family's own logits, its logits as a function of the parameters,
and the task loss."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.align.pair import model_for
from engine.errors import SpecError
from engine.models import FAMILIES, Model, canonical, model_logits
from engine.models.base import Params


def twin(model: Model) -> Model:
    """A reference-family model computing the same function from the same canonical params.

    For the reference family canonical keys ARE the module's parameter names, so the model is its
    own twin. Other families are expressed in the reference family (surgery.reference_config_from_arch);
    families it cannot express (mixed bias flags) are refused. Data-driven aligners (activation,
    learned, dual) run their forward passes, hooks and torch.func.functional_call on the twin.
    """
    if model.family == "reference":
        return model
    own = FAMILIES[model.family].twin
    if own is not None:  # a family with its own twin (hf_bert: post-norm blocks)
        return own(model)
    params = canonical(model, copy=False)
    try:  # sharing the model's own tensors: a twin costs no memory (aligners only read it)
        return model_for(model, replace(model.arch, family="reference"), params, share=True)
    except SpecError as e:
        raise SpecError(f"Data-driven alignment needs the model expressed in the reference family: {e}") from None


# relative logit error allowed between a model and its twin: float error only. In bfloat16 the two forwards round
# differently (9e-3 on a 2-layer Llama; tests/engine/test_bfloat16.py); a twin computing another function is off
# by order one.
TWIN_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}


def check_twin(model: Model, tw: Model, inputs: Tensor) -> None:
    """Refuse a twin whose logits differ from the family's own (it would align a different function)."""
    if tw is model:
        return
    p = next(model.module.parameters())
    with torch.no_grad():
        x = inputs.to(p.device, p.dtype) if inputs.is_floating_point() else inputs.to(p.device)
        y, yt = model_logits(model, x), model_logits(tw, x)
    err = float((y - yt).abs().max() / y.abs().max().clamp_min(1e-12))
    tol = TWIN_TOLERANCE.get(y.dtype, TWIN_TOLERANCE[torch.float32])
    if err > tol:
        raise SpecError(f"The reference-family twin of {model.name or model.family} differs from it "
                        f"(relative logit error {err:.1e}); data-driven alignment is not available for it.")


def functional_logits(tw: Model, params: Params, inputs: Tensor) -> Tensor:
    """Logits of the twin's module with `params` (canonical = parameter names), differentiable."""
    p = next(tw.module.parameters())
    x = inputs.to(p.device, p.dtype) if inputs.is_floating_point() else inputs.to(p.device)
    return torch.func.functional_call(tw.module, params, (x,), strict=False)


def task_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy per scored token / image, in nats, in the logits' dtype (a float64 copy of
    float32 logits would be a gigabyte per batch at GPT-2's vocabulary; float64 models stay float64)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.to(logits.device).flatten())  # [N, V], [N]
