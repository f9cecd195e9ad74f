"""What every aligner shares: the prepared pair, twins, data, what it gets and returns, diagnostics.

An aligner moves model B onto model A: it returns a group element g with g.theta_B close to
theta_A (docs/MATH.md section 4), and the path is then theta_A -> g.theta_B. Residual rotations need the
norms out of the way (docs/MATH.md section 3), so `prepare_pair` folds RMSNorm gains into the readers, or
rewrites LayerNorm as RMSNorm, in BOTH models before any aligner runs; each endpoint still computes
its original function, but interpolation then happens in the folded coordinates (the gains
interpolate inside the readers), which is the path the rotation group acts on.

The classes a run uses are decided in engine.classes (`choose_classes`), below the aligners, so that
the memory and time estimates know them without importing an aligner; their names are re-exported
here for the aligners and tests that import them from this module.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.cancel import CancelToken
from engine.classes import (  # noqa: F401 (re-exported)
    CLASSES,
    RESIDUAL,
    ClassChoice,
    choose_classes,
    default_classes,
    resolve_classes,
    rewrite_refusal,
)
from engine.errors import SpecError
from engine.interpolate import Progress
from engine.models import FAMILIES, Model, canonical, model_logits, set_canonical
from engine.models.base import Arch, Params
from engine.spec import Spec, build_spec
from engine.surgery import fold_norms_, layernorm_to_rmsnorm_, reference_config_from_arch
from engine.symmetry import GroupElement, identity

if TYPE_CHECKING:
    from engine.align.learned import Settings
    from engine.align.weight import WeightSettings

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# The prepared pair


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
    if "residual_orth" not in classes:
        return Pair(arch, build_spec(arch, pa), pa, pb, a, b, "")
    rewrite_ = fold_norms_ if arch.norm == "rmsnorm" else layernorm_to_rmsnorm_
    name = "fold_norms" if arch.norm == "rmsnorm" else "layernorm_to_rmsnorm"
    if in_place and _own_views(a, pa) and _own_views(b, pb):
        (arch_a, pa), (arch_b, pb) = rewrite_(arch, pa), rewrite_(arch, pb)
        if arch_a == arch_b == arch:  # folded into the models themselves: no twin needed
            return Pair(arch, build_spec(arch, pa), pa, pb, a, b, name)
        share = True
    else:
        dtype = next(iter(pa.values())).dtype
        (arch_a, pa), (arch_b, pb) = (rewrite_(arch, {k: v.to(F64, copy=True) for k, v in p.items()})
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


# ---------------------------------------------------------------------------------------------
# A differentiable forward: the reference-family twin


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


def check_twin(model: Model, tw: Model, inputs: Tensor) -> None:
    """Refuse a twin whose logits differ from the family's own (it would align a different function)."""
    if tw is model:
        return
    p = next(model.module.parameters())
    with torch.no_grad():
        x = inputs.to(p.device, p.dtype) if inputs.is_floating_point() else inputs.to(p.device)
        y, yt = model_logits(model, x), model_logits(tw, x)
    err = float((y - yt).abs().max() / y.abs().max().clamp_min(1e-12))
    tol = 1e-9 if y.dtype == F64 else 1e-4
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


# ---------------------------------------------------------------------------------------------
# Data: training batches for data-driven aligners, held out from the evaluation split


LM_CTX = 128


def train_batches(arch: Arch, batch: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (inputs, targets) from the training split (never the evaluation split)."""
    from engine.data import default_splits, digits_splits, image_batches, lm_batches

    if arch.task == "vit":
        return image_batches(digits_splits()["train"], batch, seed)
    n_ctx = min(arch.n_ctx, LM_CTX)
    if not arch.causal:  # a masked LM (docs/MATH.md section 9): bytes, the last id the mask
        from engine.data import BYTE_VOCAB, mlm_batches

        return mlm_batches(default_splits().train, batch, n_ctx, seed, arch.n_out - 1, BYTE_VOCAB)
    return ((w[:, :-1], w[:, 1:]) for w in lm_batches(default_splits().train, batch, n_ctx, seed))


def val_batch(arch: Arch, items: int) -> tuple[Tensor, Tensor]:
    """A fixed batch of the validation split: model selection inside an aligner, never reported as test."""
    from engine.evaluate import lm_eval_set, vit_eval_set

    if arch.task == "vit":
        es = vit_eval_set("val", items)
    elif not arch.causal:  # a masked LM: `items` positions, about 15% of them scored
        from engine.evaluate import mlm_eval_set

        es = mlm_eval_set("val", items, n_ctx=min(arch.n_ctx, LM_CTX), vocab=arch.n_out)
    else:
        n_ctx = min(arch.n_ctx, LM_CTX)
        es = lm_eval_set("val", items, n_ctx=n_ctx)
    return es.inputs, es.targets


# ---------------------------------------------------------------------------------------------
# What an aligner gets and returns


@dataclass
class AlignContext:
    pair: Pair
    classes: frozenset[str]
    steps: int = 0  # optimisation budget (learned, dual); 0 = the method's default
    seed: int = 0
    batch: int = 16  # sequences / images per training batch
    progress: Progress | None = None
    qk_structure: str | None = None  # override the spec's Q/K group ("gl"): only to test the guard
    compare_one_sided: bool = True  # dual: also run one-sided learning at the same step budget
    time_budget_s: float | None = None  # learned, dual: also stop when this many seconds of optimisation are spent
    cancel: CancelToken | None = None  # checked before every layer / step (engine.cancel): Cancelled when set
    learned: Settings | None = None  # learned, dual: schedule, lam sampling, patience (None: the defaults)
    weight: WeightSettings | None = None  # weight: head cost, MLP score, residual weighting (None: the defaults)


@dataclass
class AlignOutput:
    g: GroupElement  # moves B onto A: the path is theta_A -> g.theta_B
    info: dict = field(default_factory=dict)  # method-specific diagnostics (JSON-ready)
    g_a: GroupElement | None = None  # dual: A's own transform (the path is reported in A's frame)


def identity_like(pair: Pair) -> GroupElement:
    dtype = next(iter(pair.params_a.values())).dtype
    return identity(pair.arch, F64 if dtype != F64 else dtype)


def tick() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


class F64View(Mapping[str, Tensor]):
    """Params read as float64 CPU tensors one key at a time: the solvers' working precision and place
    (scipy, small matrices) without a float64 copy of the whole model."""

    def __init__(self, p: Params):
        self.p = p

    def __getitem__(self, k: str) -> Tensor:
        return self.p[k].detach().to("cpu", F64)

    def __iter__(self) -> Iterator[str]:
        return iter(self.p)

    def __len__(self) -> int:
        return len(self.p)


# ---------------------------------------------------------------------------------------------
# Diagnostics shared by every method


SLICE = 1 << 20  # elements per slice of a big tensor in elementwise reductions


def slices(x: Tensor) -> list[Tensor]:
    """x cut along its first axis into views of about SLICE elements: temporaries stay small."""
    if x.dim() == 0 or x.numel() <= SLICE:
        return [x]
    return list(x.split(max(1, SLICE * x.shape[0] // x.numel())))


def layer_of(key: str) -> str:
    """'blocks.3.attn.W_Q' -> 'blocks.3'; embeddings, final norm and head -> 'outer'."""
    parts = key.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "outer"


def matching_costs(pa: Params, pb: Params) -> dict[str, float]:
    """||theta_A - theta_B||^2 per layer ('outer' = embeddings, final norm, head), the weight-matching
    objective; divided by ||theta_A||^2 + ||theta_B||^2 so 1 means unrelated and 0 identical."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for k in pa:  # in slices of the parameters' own dtype: no copy of an embedding matrix
        L = layer_of(k)
        a, b = pa[k].detach(), pb[k].detach()
        num[L] = num.get(L, 0.0) + sum(float(torch.linalg.vector_norm(x - y)) ** 2 for x, y in zip(slices(a), slices(b)))
        den[L] = den.get(L, 0.0) + float(torch.linalg.vector_norm(a)) ** 2 + float(torch.linalg.vector_norm(b)) ** 2
    return {L: num[L] / den[L] if den[L] > 0 else 0.0 for L in num}


def rounded(t: Tensor, digits: int = 5) -> list:
    return torch.round(t.detach().to(F64), decimals=digits).tolist()


def describe_element(pair: Pair, g: GroupElement, classes: frozenset[str], view: list[dict] | None = None) -> dict:
    """The JSON view of a group element: permutations as index lists, RoPE complex scalars per head,
    Q/K and V/O maps by their singular values, the residual map (index list or matrix); `view`
    (matching_view) adds each layer's head cost matrix and matched-neuron similarities."""
    from engine.align.solvers import residual_perm_of, rope_scalars

    a = pair.arch
    layers = []
    for el in g.layers:
        d: dict = {
            "head_perm": el.head_perm.tolist(),
            "kv_perm": el.kv_perm.tolist(),
            "mlp_perm": el.mlp_perm.tolist(),
        }
        if "mlp_scale" in classes:
            d["mlp_scale"] = rounded(el.mlp_scale)
        if "qk" in classes:
            d["qk_singular_values"] = rounded(torch.linalg.svdvals(el.qk.to(F64)))
            if a.pe == "rope":
                z = rope_scalars(el.qk.to(F64), a.rope_layout, a.rotary_dim)  # [h_kv, r/2]
                d["rope_scalars"] = {"abs": rounded(z.abs()), "angle": rounded(z.angle())}
        if "vo" in classes:
            d["vo_singular_values"] = rounded(torch.linalg.svdvals(el.vo.to(F64)))
        layers.append(d | (view[len(layers)] if view else {}))
    O = g.residual.to(F64)
    perm = residual_perm_of(O)
    residual: dict = {"kind": "identity" if torch.equal(O, torch.eye(a.d_model, dtype=F64)) else
                      ("permutation" if perm is not None else "orthogonal")}
    if perm is not None:
        residual["perm"] = perm.tolist()
    else:
        residual["matrix"] = rounded(O, 4)
        residual["distance_from_identity"] = float(torch.linalg.matrix_norm(O - torch.eye(a.d_model, dtype=F64)))
    return {"layers": layers, "residual": residual}
