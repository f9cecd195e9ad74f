"""The symmetry classes a run uses: one decision, from the architecture alone (docs/MATH.md section 3).

Classes a user may restrict an aligner to are the spec's KINDS; the default (`choose_classes`, the
one place it is decided) is every kind the architecture has that is an exact symmetry, with the
residual stream as a rotation: RMSNorm gains are folded, LayerNorm is rewritten as RMSNorm (the pair
then runs as reference-family twins, and a merged model is saved in that family;
engine.align.pair.prepare_pair).

Below the aligners and above nothing but the spec: the memory estimate (engine.resources) and the
time estimate (engine.progress) know a run's classes before any model is loaded, without importing
an aligner.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import LMCError
from engine.models.base import Arch
from engine.spec import KINDS, Spec, approximate_kinds, arch_kinds

CLASSES = KINDS  # what a user may restrict an aligner to (engine/spec.py)
RESIDUAL = ("residual_perm", "residual_orth")


@dataclass(frozen=True)
class ClassChoice:
    """The symmetry classes a run uses, and why each other kind of KINDS is left out."""

    classes: frozenset[str]
    left_out: dict[str, str]  # kind -> one sentence


def rewrite_refusal(arch: Arch) -> str | None:
    """Why the residual stream of `arch` cannot be made rotation-ready (fold_norms or layernorm_to_rmsnorm),
    or None. Judged from the Arch alone, so a run's classes (and its memory) are known before loading."""
    if arch.post_norm:
        return "a post-LayerNorm stream is normalised after every add, where only permutations are exact (docs/MATH.md section 9)"
    if arch.norm == "layernorm" and arch.pe == "sinusoidal":
        return "a LayerNorm model with a fixed sinusoidal table cannot be rewritten as RMSNorm (the table is not centred)"
    if arch.norm == "layernorm" and arch.gated and arch.norm_bias:
        return "a gated-MLP model with LayerNorm biases cannot be rewritten as RMSNorm (the gate has no bias to absorb them)"
    return None


def _absent(arch: Arch, kind: str) -> str:
    if kind == "mlp_scale":
        return f"not a symmetry of a {arch.mlp} MLP (only ReLU and SwiGLU neurons can be rescaled)"
    return f"not a symmetry of this {arch.mlp} / {arch.pe} model"


def choose_classes(arch: Arch, method: str, asked: tuple[str, ...] | list[str] | None = ()) -> ClassChoice:
    """The classes a run of `method` on `arch` uses: exactly those `asked`, or by default (() or None) the
    one default of the engine, with a reason for every kind left out.

    The default: every exact kind of the architecture, the residual stream as a rotation (O(D) contains
    the permutations) after folding RMSNorm gains or rewriting LayerNorm as RMSNorm (prepare_pair),
    which every aligner supports. Where no rewrite is possible the residual stream is permuted instead.
    Under a fixed sinusoidal PE no residual map is exact (docs/MATH.md section 3), and both are left out:
    measured on the sinusoidal zoo LM pair, either map lowers the barrier over the chord only because
    it ruins the moved B (its loss rises 3-4 fold, bench/RESULTS.md), so the path no longer ends at the
    model B. The naive baseline uses no class.
    """
    kinds, approx = arch_kinds(arch), approximate_kinds(arch)
    absent = {k: _absent(arch, k) for k in KINDS if k not in kinds}
    if asked:
        chosen = frozenset(asked)
        unknown = sorted(chosen - set(CLASSES))
        if unknown:
            raise LMCError(f"Unknown symmetry class {unknown[0]!r}; choose from {', '.join(CLASSES)}.")
        if set(RESIDUAL) <= chosen:
            raise LMCError("Choose one residual class, residual_perm or residual_orth (the rotations contain the "
                           "permutations).")
        bad = sorted(chosen & set(absent))
        if bad:
            raise LMCError(f"Symmetry class {bad[0]!r} is not a symmetry of this {arch.mlp} / {arch.pe} "
                           f"model (its classes: {', '.join(kinds)}).")
        return ClassChoice(chosen, absent | {k: "not asked for (--classes)" for k in kinds if k not in chosen})
    if method == "naive":
        return ClassChoice(frozenset(), absent | {k: "the naive baseline applies no symmetry" for k in kinds})
    left = dict(absent)
    for k in sorted(approx):
        left[k] = ("not exact: the fixed sinusoidal table is a residual writer that no rotation or permutation "
                   "preserves; on the sinusoidal zoo pair either map raises B's own loss 3-4 fold (bench/RESULTS.md)")
    refused = rewrite_refusal(arch)
    if "residual_orth" not in approx:
        if refused is None:
            left["residual_perm"] = "contained in residual_orth (every permutation is a rotation)"
        else:
            left["residual_orth"] = f"not rotation-ready: {refused}"
    chosen = frozenset(k for k in kinds if k not in left)
    return ClassChoice(chosen, {k: left[k] for k in KINDS if k in left})


def default_classes(spec: Spec | Arch, method: str = "weight") -> frozenset[str]:
    """The classes `method` uses by default on this architecture (choose_classes)."""
    return choose_classes(spec.arch if isinstance(spec, Spec) else spec, method).classes


def resolve_classes(spec: Spec, classes: tuple[str, ...] | list[str] | None, method: str = "weight") -> frozenset[str]:
    """The classes an aligner will use: the default for () or None, else exactly those asked for."""
    return choose_classes(spec.arch, method, classes).classes
