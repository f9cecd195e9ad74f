"""The run options of the aligners that take some (engine.options): learned and dual matching's
schedule and budget, weight matching's scores. Each turns into the settings its aligner reads
(`align_kwargs`: engine.align.learned.Settings and the time budget, engine.align.weight.WeightSettings),
so a RunConfig reaches every setting a run records."""

from __future__ import annotations

from dataclasses import dataclass

from engine.align.learned import LAMBDAS, STARTS, Settings
from engine.align.start import SUFFIX
from engine.align.weight import HEAD_COSTS, MLP_SCORES, WeightSettings
from engine.options import Options, option
from engine.results import MAX_STEPS


@dataclass(frozen=True)
class LearnedOptions(Options):
    """Learned and dual matching: the time budget and the settings a run may change (Settings)."""

    time_budget_s: float | None = option(
        "seconds", "--time-budget", "time budget (seconds)",
        "Seconds of optimisation; alone it ends the run (no step cap) and the step-size schedule follows the "
        "clock; with a step budget, whichever runs out first.")
    lambdas: str | None = option(
        "choice", "--lambda-sampling", "lambda sampling",
        "Lambda per step from U(0.4, 0.6) (narrow), U(0, 1) (uniform), 0.5 (fixed), or half U(0, 1) and half "
        "near the worst validation lambda (adaptive); by default narrow for LMs and adaptive for ViTs and for LMs "
        "aligned without a residual map.",
        choices=LAMBDAS)
    patience: int | None = option(
        "count", "--patience", "patience (checks)",
        "Stop after this many validation checks without a better midpoint loss.", most=MAX_STEPS)
    lr_perm: float | None = option(
        "rate", "--lr-perm", "permutation step size",
        "Peak Adam step size of the permutation latents.")
    lr_map: float | None = option(
        "rate", "--lr-map", "map step size",
        "Peak Adam step size of the continuous latents (the Q/K and V/O maps, the residual rotation, the MLP "
        "scales); 0.01 by default.")
    candidates: int | None = option(
        "count", "--candidates", "MLP candidates",
        "Partners per MLP neuron its permutation latent chooses among; 1 keeps the starting element's MLP "
        "permutation and learns the other classes only.", most=4096)
    keep_heads: bool | None = option(
        "flag", "--keep-heads", "keep the head permutation",
        "Keep the starting element's head permutation and learn the other classes around it (long schedules "
        "on the medium LMs otherwise reshuffle heads late and lose the path they had).")
    start: str | None = option(
        "choice_or_file", "--start", "start",
        "The element the latents start from: weight matching (the default), activation matching on one "
        "training batch, or an element file an earlier run wrote with --save-element, or kept in the app's run "
        "history (its run goes on from there with a schedule of its own).", choices=STARTS, suffix=SUFFIX)
    batch: int | None = option(
        "count", "--batch", "batch (sequences or images)",
        "Training sequences (LM) or images (ViT) per step, 16 by default; a step's time grows with its batch.",
        most=4096)

    def align_kwargs(self) -> dict:
        kw = {k: v for k, v in self.given().items() if k != "time_budget_s"}
        return ({} if self.time_budget_s is None else {"time_budget_s": self.time_budget_s}) | (
            {"learned": Settings(**kw)} if kw else {})


@dataclass(frozen=True)
class DualOptions(LearnedOptions):
    """Dual matching: learned matching's options, and whether to skip its one-sided comparison."""

    skip_comparison: bool | None = option(
        "flag", "--skip-comparison", "skip the one-sided comparison",
        "Run the dual optimisation alone: without the one-sided learned run of as many steps on the same data that "
        "a step-budget run adds for comparison (it doubles the cost); the record says it was skipped.")

    def align_kwargs(self) -> dict:
        kw = LearnedOptions(**{k: v for k, v in self.given().items() if k != "skip_comparison"}).align_kwargs()
        return kw | ({"compare_one_sided": False} if self.skip_comparison else {})


@dataclass(frozen=True)
class WeightOptions(Options):
    """Weight matching: how it scores its per-layer problems and weighs the residual fit (WeightSettings)."""

    head_cost: str | None = option(
        "choice", "--head-cost", "head cost",
        "The distance of two heads' circuits: squared (the default), unsquared, or normalised (cosines).",
        choices=HEAD_COSTS)
    mlp_score: str | None = option(
        "choice", "--mlp-score", "MLP score",
        "How two neurons are scored: inner (one product of their weights, the default) or normalised (the sum of "
        "the cosines of their incoming, outgoing and gate weights).", choices=MLP_SCORES)
    block_scale: bool | None = option(
        "flag", "--block-scale", "scale blocks by fan-in",
        "Weigh each residual parameter's term of the residual fit by 1 / its fan-in.")
    stop_tol: float | None = option(
        "fraction", "--stop-tol", "stopping tolerance",
        "A sweep lowering the objective by at most this fraction ends the descent (by default 1e-4 for float64 "
        "products, 1e-3 for float32 ones).")

    def align_kwargs(self) -> dict:
        kw = self.given()
        return {"weight": WeightSettings(**kw)} if kw else {}
