"""Aligners: one file each, one registry (docs/DESIGN.md section 3). Each moves model B onto model A.

    naive       no alignment (the baseline)
    weight      data-free coordinate descent on ||theta_A - g.theta_B||^2
    activation  the same assignments from activation statistics over a data batch
    learned     one-sided straight-through optimisation of the midpoint task loss
    dual        both sides learn toward the shared path

Every method can be restricted to a subset of symmetry classes (engine.classes.CLASSES); `run.align`
prepares the pair, runs a method and checks exactness; `engine.api.run_pair` turns the result into
a record. Each entry also says what a run of it needs before it starts (its scratch memory, its step
budget), from functions in the aligner's own file, so that engine.resources asks the registry instead
of reaching into an aligner, and which run options it takes (engine.options; the CLI's flags and the
app's widgets are built from them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.align import activation, dual, learned, naive, weight
from engine.align.activation import align_activations
from engine.align.context import AlignContext, AlignOutput
from engine.align.dual import align_dual
from engine.align.learned import DEFAULT_STEPS, TASK_STEPS, align_learned
from engine.align.naive import align_naive
from engine.align.options import DualOptions, LearnedOptions, WeightOptions
from engine.align.weight import align_weights
from engine.classes import CLASSES
from engine.errors import LMCError
from engine.options import Options


@dataclass(frozen=True)
class Method:
    name: str
    display_name: str
    reference: str
    fn: Callable[[AlignContext], AlignOutput]
    default_steps: int = 0  # optimisation budget when a run asks for 0 steps (0: a method without steps)
    task_steps: dict[str, int] | None = None  # per task, where it differs from default_steps
    # peak scratch memory beyond the two models, in bytes, from the config alone (engine.resources):
    # (arch, parameters of one model, parameters of one block, bytes per element of the run's dtype;
    # learned and dual also take batch=, the sequences or images per step a run sets)
    scratch: Callable[..., int] | None = None
    options: type[Options] = Options  # the run options it takes (engine.options)

    def steps(self, task: str | None) -> int:
        """The budget of a run on `task` that asks for 0 steps."""
        return (self.task_steps or {}).get(task, self.default_steps)


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("naive", "Naive (no alignment)", "Linear Mode Connectivity and the Lottery Ticket Hypothesis (ICML 2020)", align_naive,
           scratch=naive.scratch_bytes),
    Method("weight", "Weight matching", "Git Re-Basin (ICLR 2023), extended to heads, "
           "within-head maps and the residual stream (docs/MATH.md section 4.2)", align_weights,
           scratch=weight.scratch_bytes, options=WeightOptions),
    Method("activation", "Activation matching", "Git Re-Basin (ICLR 2023); Model Fusion via Optimal Transport (NeurIPS 2020)",
           align_activations, scratch=activation.scratch_bytes),
    Method("learned", "Learned matching (one-sided)", "Git Re-Basin (ICLR 2023), straight-through "
           "estimator", align_learned, DEFAULT_STEPS, TASK_STEPS, scratch=learned.scratch_bytes,
           options=LearnedOptions),
    Method("dual", "Dual learned matching", "docs/MATH.md section 4.5: both endpoints learn toward the shared path",
           align_dual, DEFAULT_STEPS, TASK_STEPS, scratch=dual.scratch_bytes, options=DualOptions),
]}


def method_entry(name: str) -> Method:
    """The registry entry of method `name`: the one place a method name is checked, in one sentence
    naming the methods there are."""
    entry = METHODS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise LMCError(f"Method {name!r} is not available; choose one of: {', '.join(METHODS)}.")
    return entry


def method_options(name: str, given: Mapping[str, object] | Options | None = None) -> Options:
    """Method `name`'s options with the fields of `given` set (a mapping, None for unset, or another
    options object), validated; an option the method does not take is refused in one sentence naming
    the methods that do."""
    entry = method_entry(name)
    if isinstance(given, Options):
        given = given.given()
    values = {k: v for k, v in (given or {}).items() if v is not None}
    for k in values:
        if k not in entry.options.specs():
            takers = {m: e.options.specs()[k] for m, e in METHODS.items() if k in e.options.specs()}
            if not takers:
                raise LMCError(f"Option {k} is not an option of any method; {name} takes "
                               f"{', '.join(entry.options.specs()) or 'none'}.")
            raise LMCError(f"Option {k} ({next(iter(takers.values())).flag}) sets {' and '.join(takers)} "
                           f"matching; method {name} does not use it.")
    return entry.options(**values)


__all__ = ["CLASSES", "METHODS", "AlignContext", "AlignOutput", "Method", "method_entry", "method_options"]
