"""Align one pair end to end: choose the classes, prepare the pair, run a method, check exactness.

The exactness guard (docs/MATH.md section 5, endpoint check): B moved onto A must compute the function
B computed, so its held-out loss must equal B's up to float error. A violation raises
ExactnessError; it is never a warning. The one exception is a class the spec marks approximate
(residual maps under a fixed sinusoidal PE, docs/MATH.md section 3): there the change is measured and
reported, the rest of the transform is still checked strictly, and the user can leave the class out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.align import METHODS, method_entry
from engine.align.context import F64, AlignContext, AlignOutput, tick
from engine.align.diagnostics import describe_element, matching_costs, rounded
from engine.align.learned import Settings, step_budget
from engine.align.pair import Pair, model_for, prepare_pair, write_params
from engine.align.resume import Checkpoint
from engine.align.solvers import single_thread
from engine.align.weight import SMALL_MODEL, WeightSettings, head_cost, neurons
from engine.cancel import CancelToken
from engine.classes import RESIDUAL, ClassChoice, choose_classes
from engine.errors import ExactnessError, LMCError
from engine.evaluate import EvalSet, evaluate
from engine.interpolate import Progress, check_same_architecture
from engine.models import Model, canonical
from engine.models.base import Params
from engine.spec import build_spec
from engine.symmetry import GroupElement, LayerElement, act, apply, element_maps

# relative loss change allowed as float error: a bfloat16 B moved in place is rounded to bfloat16 again
# (2^-8 relative per weight), which moved a zoo LM's loss by 1.0e-4 and a planted 1.1B Llama's by 3.3e-4
# (bench/RESULTS.md); a transform outside the group moves a trained model's by far more (160% on lm-rope)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2**-8}


@dataclass
class Aligned:
    """A pair after alignment: the path runs from model_a to model_b (B moved onto A)."""

    method: str
    classes: frozenset[str]
    pair: Pair
    out: AlignOutput
    model_a: Model
    model_b: Model
    moved_params: dict
    seconds: float
    costs_before: dict  # matching_costs of the pair before alignment
    left_out: dict[str, str]  # every other kind of KINDS -> why the run does not use it (choose_classes)
    in_place: bool = False  # model_b is pair.model_b itself, moved (its original weights are gone)


def align(a: Model, b: Model, method: str = "weight", classes: tuple[str, ...] | list[str] | None = (),
          steps: int = 0, seed: int = 0, progress: Progress | None = None, qk_structure: str | None = None,
          compare_one_sided: bool = True, in_place: bool = False, cancel: CancelToken | None = None,
          time_budget_s: float | None = None, learned: Settings | None = None,
          weight: WeightSettings | None = None, one_sided: dict | None = None,
          checkpoint: Checkpoint | None = None) -> Aligned:
    """Move B onto A with `method`, restricted to `classes` (() = the method's default for the model,
    engine.classes.choose_classes).

    in_place=True writes g.theta_B into B's own tensors (pair.model_b: `b` itself unless the norms were
    rewritten into a twin) instead of a copy, so a run holds no model beyond A, B and the path; the
    caller must have measured what it needs of the original B first (endpoint_check's `loss_b`).
    Approximate classes keep the copy: their exactness check needs the original B. `progress` hears of
    every layer or step of the method, and `cancel` (engine.cancel) stops it with Cancelled between
    two; B is moved only after the method has finished, so a cancelled run leaves B computing what it
    computed (its norms possibly folded). `time_budget_s` and `learned` (engine.align.learned.Settings:
    schedule, lam sampling, patience) apply to learned and dual matching; `weight`
    (engine.align.weight.WeightSettings: head cost, MLP score, residual weighting) to weight matching.
    `one_sided` is dual's comparison run where it was already made (AlignContext.one_sided); `checkpoint`
    where learned and dual matching keep their resumable state (engine.align.resume).
    """
    t = tick()
    check_same_architecture(a, b)
    entry = method_entry(method)
    build_spec(a.arch, canonical(a, copy=False))  # the architecture has a spec (a clear SpecError otherwise)
    choice: ClassChoice = choose_classes(a.arch, method, () if method == "naive" else classes)
    kinds = choice.classes
    pair = prepare_pair(a, b, kinds, in_place)
    costs_before = matching_costs(pair.params_a, pair.params_b)
    steps = step_budget(steps, time_budget_s, entry.steps(a.arch.task))
    ctx = AlignContext(pair, kinds, steps, seed, progress=progress, qk_structure=qk_structure,
                       compare_one_sided=compare_one_sided, cancel=cancel, time_budget_s=time_budget_s, learned=learned,
                       weight=weight, one_sided=one_sided, checkpoint=checkpoint)
    out = entry.fn(ctx)
    if method == "naive":
        return Aligned(method, kinds, pair, out, pair.model_a, pair.model_b, pair.params_b, t(), costs_before,
                       choice.left_out)
    if in_place and not kinds & pair.spec.approximate:
        move_in_place(pair, out.g)
        return Aligned(method, kinds, pair, out, pair.model_a, pair.model_b, pair.params_b, t(), costs_before,
                       choice.left_out, True)
    # strict=False: group membership is judged by its effect, by the exactness guard below
    moved = apply(pair.arch, out.g, pair.params_b, strict=False)
    return Aligned(method, kinds, pair, out, pair.model_a, model_for(pair.model_b, pair.arch, moved), moved, t(),
                   costs_before, choice.left_out)


@torch.no_grad()
def move_in_place(pair: Pair, g: GroupElement) -> None:
    """Write g.theta_B into pair.model_b's own tensors, one parameter at a time.

    pair.params_b are views of the module (prepare_pair), so each moved parameter is copied straight
    back into its view; a parameter the adapter could only hand out as a copy (a fused layout it had
    to reshape) is collected and written through the family's from_canonical at the end. Like weight
    matching's products (weight.work_dtype), a small model moves in float64 and a large one in its
    own dtype, where a permutation is exact and a rotation costs a rounding of its products (no float64
    transient: on GPT-2-small that halves the move's time); a half-precision one in float32, rounded once
    (bfloat16 products would round every partial sum, and on a CPU without bfloat16 kernels they run
    270 times slower than float32's: bench/RESULTS.md, "bfloat16 on a CPU without bfloat16 products").
    """
    model, spec, views = pair.model_b, pair.spec, pair.params_b
    with single_thread():
        maps = element_maps(g)  # inverses of d x d maps
    small = sum(v.numel() for v in views.values()) <= SMALL_MODEL

    def moved():  # one parameter at a time, so that no more than one moved copy is alive
        for key, ps in spec.params.items():
            v = views[key]
            exact = all(maps.get(a.group) is None or "index" in maps[a.group] or a.role in ("perm", "perm_kv")
                        for acts in ps.axes for a in acts)  # only indexing: exact in any dtype
            work = torch.float64 if small else torch.promote_types(v.dtype, torch.float32)
            wide = v if exact else v.to(work)
            yield key, act(ps, maps, wide).to(v.dtype)

    if write_params(model, views, moved()):
        pair.params_b.update(canonical(model, copy=False))


def restrict(g: GroupElement, kinds: frozenset[str]) -> GroupElement:
    """g with every class outside `kinds` replaced by the identity."""
    layers = []
    for el in g.layers:
        h, hkv, d, m = len(el.head_perm), el.qk.shape[0], el.qk.shape[-1], len(el.mlp_perm)
        eye = torch.eye(d, dtype=el.qk.dtype).repeat(hkv, 1, 1)  # [h_kv, d, d]
        layers.append(LayerElement(
            el.head_perm if "heads" in kinds else torch.arange(h),
            el.qk if "qk" in kinds else eye, el.vo if "vo" in kinds else eye,
            el.mlp_perm if "mlp" in kinds else torch.arange(m),
            el.mlp_scale if "mlp_scale" in kinds else torch.ones(m, dtype=el.mlp_scale.dtype),
        ))
    O = g.residual if set(RESIDUAL) & kinds else torch.eye(g.residual.shape[0], dtype=g.residual.dtype)
    return GroupElement(tuple(layers), O)


def _relative(u: float, v: float) -> float:
    return abs(u - v) / max(abs(v), 1e-30)


def endpoint_check(b: Model, al: Aligned, es: EvalSet, loss_moved: float, loss_b: float | None = None) -> dict:
    """Compare the moved model's loss with the original B's on `es`; raise ExactnessError on a violation.

    `loss_moved` is the path's endpoint at lam = 1 (already evaluated); `loss_b` the original B's loss,
    required when B was moved in place (it is evaluated here otherwise). With approximate classes
    the transform without them is evaluated as well and must be exact.
    """
    dtype = next(b.module.parameters()).dtype
    tol = TOLERANCE.get(dtype, 1e-4)
    rec = {"loss_b": loss_moved, "loss_b_moved": loss_moved, "abs_diff": 0.0, "rel_diff": 0.0, "tolerance": tol,
           "exact": True, "approximate_classes": [], "rewrite": al.pair.rewrite}
    if al.method == "naive":
        return rec
    if loss_b is None:
        if al.in_place and al.model_b is b:
            raise LMCError("B was moved in place: pass its loss before alignment to the endpoint check.")
        loss_b = evaluate(b, es)["loss"]
    rel = _relative(loss_moved, loss_b)
    approx = sorted(al.classes & al.pair.spec.approximate)
    rec |= {"loss_b": loss_b, "abs_diff": abs(loss_moved - loss_b), "rel_diff": rel, "approximate_classes": approx}
    name = b.name or "B"
    if approx:
        exact_kinds = al.classes - set(approx)
        moved = apply(al.pair.arch, restrict(al.out.g, exact_kinds), al.pair.params_b, strict=False)
        loss_exact = evaluate(model_for(al.pair.model_b, al.pair.arch, moved), es)["loss"]
        rel_exact = _relative(loss_exact, loss_b)
        rec |= {"exact": False, "exact_part": {"classes": sorted(exact_kinds), "loss": loss_exact,
                                               "rel_diff": rel_exact}}
        if rel_exact > tol:
            raise ExactnessError(f"Aligning {name} with {al.method} changed its loss from {loss_b:.6g} to "
                                 f"{loss_exact:.6g} (relative {rel_exact:.1e} > {tol:.0e}) even without the "
                                 f"approximate classes {', '.join(approx)}: the transform is not a symmetry of the model.")
    elif rel > tol:
        raise ExactnessError(f"Aligning {name} with {al.method} changed its loss from {loss_b:.6g} to "
                             f"{loss_moved:.6g} (relative {rel:.1e} > {tol:.0e}): the transform is not a symmetry "
                             "of the model.")
    return rec


def alignment_record(al: Aligned) -> dict:
    """The record's `alignment` field: classes, the group element(s), costs, method diagnostics."""
    pair, g = al.pair, al.out.g
    view = matching_view(pair, al.moved_params, g) if al.method != "naive" else None
    rec = {
        "method": al.method,
        "display_name": METHODS[al.method].display_name,
        "classes": sorted(al.classes),
        "classes_left_out": al.left_out,
        "groups": {k: pair.spec.describe(k) for k in sorted(al.classes)},
        "rewrite": pair.rewrite,
        "element": describe_element(pair, g, al.classes, view),
        "matching_cost": {"before": al.costs_before, "after": matching_costs(pair.params_a, al.moved_params)},
        "diagnostics": al.out.info,
        "seconds": al.seconds,
    }
    if al.out.g_a is not None:
        rec["element_a"] = describe_element(pair, al.out.g_a, al.classes)
    return rec


# ---------------------------------------------------------------------------------------------
# What a matching saw, for the record


QUANTILES = 101  # sorted per-neuron similarities are kept as percentiles: a curve, not m numbers


def _sig(t: Tensor, digits: int = 4) -> list:
    """Values to `digits` significant figures (costs span orders of magnitude across models)."""
    return [[float(f"{v:.{digits}g}") for v in row] for row in t.tolist()]


def _neuron_rows(arch, p: Params, layer: int) -> Tensor:
    """[m, *]: every weight of each hidden neuron (incoming, gate, outgoing) as one row."""
    inc, out, gate = neurons(arch, p, layer)
    return torch.cat([inc, out] + ([gate] if gate is not None else []), 1)  # [m, *]


def _cosine_rows(X: Tensor, Y: Tensor) -> Tensor:
    return (X * Y).sum(1) / (X.norm(dim=1) * Y.norm(dim=1)).clamp_min(1e-30)  # [m]


def matching_view(pair: Pair, moved: Params, g: GroupElement) -> list[dict]:
    """Per layer, what a matching sees once B is aligned (B moved onto A, in A's residual frame):

    - head_cost [h_A][h_B]: the weight-matching head cost (engine.align.weight.head_cost: the distance
      of the heads' invariant Q/K and V/O circuits) between A's head i and B's head j as trained, so
      the chosen head permutation is the cells (i, head_perm[i]);
    - mlp_similarity: percentiles (QUANTILES, ascending) of the cosine between each A neuron's weights
      and its matched B neuron's ("matched"), and with B's neuron of the same index ("same_index"),
      both after every other part of the alignment.
    Float64 on the CPU, one layer at a time.
    """
    arch, pa = pair.arch, pair.params_a
    q = torch.linspace(0, 1, QUANTILES, dtype=F64)
    out = []
    for layer, el in enumerate(g.layers):
        pre = f"blocks.{layer}."
        la = {k: v.detach().to("cpu", F64) for k, v in pa.items() if k.startswith(pre)}
        lb = {k: v.detach().to("cpu", F64) for k, v in moved.items() if k.startswith(pre)}
        C = torch.empty(arch.n_heads, arch.n_heads, dtype=F64)
        C[:, el.head_perm] = head_cost(arch, la, lb, layer)  # moved B's head j is B's head perm[j]
        na, nb = _neuron_rows(arch, la, layer), _neuron_rows(arch, lb, layer)  # [m, *]
        inv = torch.argsort(el.mlp_perm)  # B's neuron i sits at inv[i] in the moved model
        out.append({"head_cost": _sig(C), "mlp_similarity": {
            "matched": rounded(torch.quantile(_cosine_rows(na, nb), q), 4),
            "same_index": rounded(torch.quantile(_cosine_rows(na, nb[inv]), q), 4)}})
    return out
