"""The prepared pair: two models in the coordinates the chosen classes act on, and writing into them.

An aligner moves model B onto model A: it returns a group element g with g.theta_B close to
theta_A (docs/MATH.md section 4), and the path is then theta_A -> g.theta_B. Residual rotations need the
norms out of the way (docs/MATH.md section 3), so `prepare_pair` folds RMSNorm gains into the readers, or
rewrites LayerNorm as RMSNorm, in BOTH models before any aligner runs; each endpoint still computes
its original function, but interpolation then happens in the folded coordinates (the gains
interpolate inside the readers), which is the path the rotation group acts on. The classes a run uses
are decided in engine.classes (`choose_classes`), from the Arch alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.models import Model, canonical, set_canonical
from engine.models.base import Arch, Params
from engine.spec import Spec, build_spec
from engine.surgery import fold_norms_, layernorm_to_rmsnorm_, reference_config_from_arch


@dataclass
class Pair:
    """Two same-architecture models in the coordinates the chosen classes act on.

    params_a / params_b are views of model_a's / model_b's own tensors (engine.models.canonical with
    copy=False): a pair costs no memory beyond its models, and aligners must not modify them.
    """

    arch: Arch
    spec: Spec
    params_a: Params
    params_b: Params
    model_a: Model  # computes params_a: the original model, or a folded copy / reference twin
    model_b: Model
    rewrite: str  # "", "fold_norms" or "layernorm_to_rmsnorm"


def _patch_dim(params: Params) -> int | None:
    return params["embed.patch.W"].shape[0] if "embed.patch.W" in params else None


def model_for(template: Model, arch: Arch, params: Params, share: bool = False) -> Model:
    """A model computing `params`: a copy of `template` when the arch is unchanged, else a
    reference-family twin (fold_norms may untie embeddings; layernorm_to_rmsnorm always changes family).

    share=True (a twin only): the twin's parameters ARE the tensors of `params` (views of another
    model's storage, say), so the twin costs no memory; it must then be used read-only.
    """
    from engine.models.reference import Transformer, module_from_params

    if arch == template.arch:
        m = copy.deepcopy(template)
    else:
        cfg = reference_config_from_arch(arch, patch_dim=_patch_dim(params))
        if share:
            module = module_from_params(cfg, params)
            return Model("reference", cfg.arch(), module, cfg.to_dict(), name=template.name, path=None)
        p = next(template.module.parameters())
        module = Transformer(cfg, init=False).to(dtype=p.dtype, device=p.device)
        m = Model("reference", cfg.arch(), module, cfg.to_dict(), name=template.name, path=None)
    set_canonical(m, params)
    return m


def rewrite_for(arch: Arch, classes: frozenset[str]) -> str:
    """The coordinates prepare_pair puts a pair of `arch` in for `classes` (Pair.rewrite), known before any
    model loads: the residual rotation needs the norm gains folded, or LayerNorm rewritten as RMSNorm."""
    if "residual_orth" not in classes:
        return ""
    return "fold_norms" if arch.norm == "rmsnorm" else "layernorm_to_rmsnorm"


def prepare_pair(a: Model, b: Model, classes: frozenset[str], in_place: bool = False) -> Pair:
    """Canonical params of both models, norm-folded (or LayerNorm-rewritten) if residual_orth is used.

    in_place=True consumes both models: the norms are folded (or rewritten) into their own tensors,
    one tensor at a time. When the family is kept (RMSNorm, nothing to untie) each model still
    computes the same function in folded coordinates; otherwise the pair's models are reference-family
    twins whose parameters are those same tensors (plus the few the rewrite adds: unit gains, zero
    biases, an untied head), and the original modules must not be used again. Without in_place (or
    when an adapter's views are reshaped copies) the rewrite works on float64 copies.
    """
    pa, pb = canonical(a, copy=False), canonical(b, copy=False)  # views: aligners only read them
    arch = a.arch
    name = rewrite_for(arch, classes)
    if not name:
        return Pair(arch, build_spec(arch, pa), pa, pb, a, b, "")
    rewrite_ = fold_norms_ if name == "fold_norms" else layernorm_to_rmsnorm_
    if in_place and _own_views(a, pa) and _own_views(b, pb):
        (arch_a, pa), (arch_b, pb) = rewrite_(arch, pa), rewrite_(arch, pb)
        if arch_a == arch_b == arch:  # folded into the models themselves: no twin needed
            return Pair(arch, build_spec(arch, pa), pa, pb, a, b, name)
        share = True
    else:
        dtype = next(iter(pa.values())).dtype
        (arch_a, pa), (arch_b, pb) = (rewrite_(arch, {k: v.to(torch.float64, copy=True) for k, v in p.items()})
                                      for p in (pa, pb))
        pa, pb = ({k: v.to(dtype) for k, v in p.items()} for p in (pa, pb))
        share = False
    if arch_a != arch_b:  # e.g. one tied model keeps its tie and the other does not
        arch_a = arch_b = replace(arch_a, tied_embeddings=False, family="reference")
        for p in (pa, pb):
            if "head.W" not in p:
                p["head.W"] = p["embed.tok"].T.clone()  # [D, V]: its final gain is 1, it reads centred vectors
    ma, mb = model_for(a, arch_a, pa, share=share), model_for(b, arch_b, pb, share=share)
    return Pair(arch_a, build_spec(arch_a, pa), canonical(ma, copy=False), canonical(mb, copy=False), ma, mb, name)


def storages(model: Model) -> set[int]:
    """The storages of the model's own tensors: a canonical tensor in one of them is a view the adapter
    handed out (writing into it writes into the model), anything else a reshaped copy."""
    return {t.untyped_storage().data_ptr() for t in model.module.state_dict().values()}


@torch.no_grad()
def write_params(model: Model, views: Params, new: Iterable[tuple[str, Tensor]]) -> bool:
    """Write each (key, tensor) of `new`, as it comes, into the model's canonical parameter `views[key]`:
    straight into a view the adapter handed out, or, for a reshaped copy, through the family's
    from_canonical once at the end. Returns whether that last write was needed (the views are then stale)."""
    own, pending = storages(model), {}
    for key, t in new:
        v = views[key]
        if v.untyped_storage().data_ptr() in own:
            v.copy_(t)
        else:
            pending[key] = t
    if pending:
        set_canonical(model, views | pending)
    return bool(pending)


def _own_views(model: Model, views: Params) -> bool:
    """Every canonical tensor is a view of the model's own storage: writing into it reaches the model."""
    own = storages(model)
    return all(v.untyped_storage().data_ptr() in own for v in views.values())
