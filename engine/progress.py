"""What a run is doing and how long it has left: its phases, progress within each, remaining time.

The engine's loops report plain ticks, (done, total, message) (`Progress`).
`engine.api.run_pair` runs in five phases,

    load          both models read from disk                      ticks: models (2)
    measure B     B's held-out loss before it is moved            ticks: evaluation batches
    align         the aligner: weight-matching sweeps (a tick per layer), activation layers,
                  learned / dual optimisation steps                ticks: layers or steps
    interpolate   the path                                         ticks: grid points
    attribution   the midpoint barrier by layer and by class       ticks: evaluations (engine.attribution)

and `Phases` turns each phase's ticks into Updates for one callback, with the time the phase has
left, estimated from its rate so far. A phase may make several passes (weight matching sweeps over
every layer until nothing changes; learned matching first runs weight matching): a pass starts
whenever `done` falls back or `total` changes, and the estimate covers the current pass.

Before a run, `estimate_seconds` says about how long each phase will take from earlier result
records of the same architecture (their `timings`), scaled by the evaluation size, the grid and the
step budget: a simple rate model, good to a factor of the machine's load, not a promise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PHASES = ("load", "measure B", "align", "interpolate", "attribution")

Progress = Callable[[int, int, str], None]  # a loop's tick: (done, total, message)


@dataclass(frozen=True)
class Update:
    """One report of a run's progress: where it is and about how long the current pass has left."""

    phase: str  # one of PHASES
    done: int
    total: int  # 0 while unknown
    message: str
    elapsed_s: float  # since the phase began
    eta_s: float | None  # remaining time of the current pass at its rate so far; None before its first unit

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0


PhaseProgress = Callable[[Update], None]


class Phases:
    """Ticks of each phase -> Updates with a remaining-time estimate, for one callback (or none)."""

    def __init__(self, callback: PhaseProgress | None, clock: Callable[[], float] = time.perf_counter):
        self.callback, self.clock = callback, clock

    def phase(self, name: str, total: int = 0, message: str = "") -> Progress:
        """Announce phase `name` (an Update with nothing done) and return its tick callback."""
        if name not in PHASES:
            raise ValueError(f"Unknown phase {name!r}; the phases are {', '.join(PHASES)}.")
        t0 = self.clock()
        state = {"t_pass": t0, "t_last": t0, "done": 0, "total": total}

        def tick(done: int, total: int, message: str) -> None:
            now = self.clock()
            if done < state["done"] or total != state["total"]:  # a new pass began after the last tick
                state["t_pass"] = state["t_last"]
            state.update(done=done, total=total, t_last=now)
            eta = (now - state["t_pass"]) / done * max(0, total - done) if done > 0 else None
            if self.callback:
                self.callback(Update(name, done, total, message, now - t0, eta))

        if self.callback:
            self.callback(Update(name, 0, total, message, 0.0, None))
        return tick


# ---------------------------------------------------------------------------------------------
# Before the run


def record_items(rec: dict) -> int | None:
    """Scored tokens (LM) or images (ViT) of a record's evaluation set."""
    n = rec.get("eval_tokens", rec.get("eval_images"))
    return n if isinstance(n, int) and n > 0 else None


def record_train_items(rec: dict) -> int:
    """Scored tokens or images of a record's train curve, evaluated at every point beside the test
    set (0 for a record without one)."""
    n = rec.get("train_eval_tokens", rec.get("train_eval_images"))
    return n if isinstance(n, int) and n > 0 else 0


def same_arch(a: dict | None, b: dict) -> bool:
    """Whether a record's architecture is `b`, on the fields both know (records written before a field
    was added to Arch lack it)."""
    if not isinstance(a, dict):
        return False
    common = a.keys() & b.keys()
    return bool(common) and all(a[k] == b[k] for k in common)


def naive_paths(arch) -> int:
    """Paths a naive run walks: its own, and again in the aligned runs' coordinates when those differ
    (engine.api.naive_in_aligned_coordinates). `arch`: an Arch or its dict; 1 for a dict it cannot read."""
    from engine.classes import choose_classes
    from engine.models.base import Arch

    if isinstance(arch, dict):
        try:
            arch = Arch(**arch)
        except TypeError:
            return 1
    return 2 if "residual_orth" in choose_classes(arch, "weight").classes else 1


def estimate_seconds(method: str, arch: dict, eval_size: int, points: int, steps: int,
                     refs: Iterable[dict], train_size: int = 0, attribution_size: int = 0) -> dict[str, float | None]:
    """About how long each phase of a run will take, from earlier records `refs` (best first).

    The first record of the same architecture (`same_arch`) gives the evaluation rate (its path's seconds per
    point per scored item) and the loading time; the first of the same architecture and method gives
    the alignment time, scaled by the step budget for learned and dual matching. `steps` is the
    run's budget (0 for methods without one); `train_size` the items of its train curve
    (engine.evaluate.train_items; 0 without one), scored at every point of the path like a record's
    own train items; `attribution_size` the items the barrier attribution scores at each of its
    evaluations (engine.attribution.items; 0 without one). A phase no record can tell is None.
    """
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    same = [r for r in refs if same_arch(r.get("arch"), arch) and isinstance(r.get("timings"), dict)]
    for r in same:
        t, n, k = r["timings"], record_items(r), len(r.get("lambdas") or ())
        if n and k and isinstance(t.get("interpolate"), (int, float)):
            per_item_point = t["interpolate"] / ((n + record_train_items(r)) * k)
            paths = naive_paths(arch) if method == "naive" else 1  # naive's second path: test split only
            out["interpolate"] = per_item_point * points * (eval_size * paths + train_size)
            out["measure B"] = 0.0 if method == "naive" else per_item_point * eval_size
            out["load"] = float(t.get("load", 0.0))
            out["attribution"] = per_item_point * attribution_size * attribution_evaluations(method, arch)
            break
    if method == "naive":
        out["align"] = 0.0
    else:
        for r in same:
            t = r["timings"]
            if r.get("method") != method or not isinstance(t.get("align"), (int, float)):
                continue
            ref_steps = (r.get("config") or {}).get("steps") or 0
            scale = steps / ref_steps if steps and ref_steps else 1.0
            out["align"] = t["align"] * scale
            break
    return out


def attribution_evaluations(method: str, arch: dict) -> int:
    """Evaluations the attribution makes at most: both endpoints and the midpoint, two per block
    (embedding, head, and each layer whole, its attention and its MLP), one per dropped class (six)."""
    layers = arch.get("n_layers") if isinstance(arch.get("n_layers"), int) else 0
    return 3 + 2 * (2 + 3 * layers) + (0 if method == "naive" else 6)


def remaining_seconds(current: Update | None, estimates: dict[str, float | None]) -> float | None:
    """The run's remaining time, or None when a part is unknown: what is left of the current phase
    plus every later phase's estimate. The current phase has left the larger of its current pass's
    estimate and its own estimate minus the time it has run (a phase of several passes, such as
    learned matching after its weight-matching start, is longer than its current pass)."""
    if current is None:
        parts = [estimates.get(p) for p in PHASES]
    else:
        now = current.eta_s
        whole = estimates.get(current.phase)
        if whole is not None:
            now = max(now or 0.0, whole - current.elapsed_s)
        later = PHASES[PHASES.index(current.phase) + 1:]
        parts = [now, *(estimates.get(p) for p in later)]
    return None if any(p is None for p in parts) else float(sum(parts))


def fmt_seconds(s: float) -> str:
    """'8 s', '2 min 5 s', '1 h 3 min': a remaining time, rounded to what matters."""
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s < 600 and s % 60 else f"{round(s / 60)} min"
    m = round(s / 60)
    return f"{m // 60} h {m % 60} min"


def relabel(progress: Progress | None, prefix: str = "", offset: int = 0, total: int | None = None) -> Progress | None:
    """`progress` with every tick moved `offset` units on, out of `total` (default: the tick's own),
    and its message prefixed: one loop reported as a stretch of a longer phase."""
    if progress is None:
        return None
    return lambda done, tot, message: progress(offset + done, tot if total is None else total, prefix + message)
