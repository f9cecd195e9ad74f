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

Before a run, engine.timing says about how long each phase will take; during it, `remaining_seconds`
refines that estimate from the run's pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
# During the run

PACE_MIN_S = 1.0  # finished phases estimated at less than this say too little about the run's pace


def pace(phases: dict[str, Update] | None, estimates: dict[str, float | None]) -> float:
    """How much longer than estimated the run takes: the time its finished compute phases took over
    their estimates (loading, mostly the disk's, left out), once those estimates add up to PACE_MIN_S;
    1 before. `phases`: the latest Update of every phase begun, the last of them the current one."""
    begun = [p for p in PHASES if p in (phases or {})]
    took = planned = 0.0
    for p in begun[:-1]:
        e = estimates.get(p)
        if p != "load" and e is not None and e > 0:
            took, planned = took + phases[p].elapsed_s, planned + e
    return took / planned if planned >= PACE_MIN_S else 1.0


def remaining_seconds(current: Update | None, estimates: dict[str, float | None],
                      phases: dict[str, Update] | None = None) -> float | None:
    """The run's remaining time, or None when a part is unknown: what is left of the current phase
    plus every later phase's estimate, both times the run's `pace` so far (`phases`: the latest Update
    of every phase begun). A phase of one pass (all but align) has left its pass's estimate once its
    first unit is done; align has left the larger of its current pass's estimate and its own estimate
    minus the time it has run (a phase of several passes, such as learned matching after its
    weight-matching start, is longer than its current pass)."""
    k = pace(phases, estimates)
    if current is None:
        parts = [estimates.get(p) for p in PHASES]
    else:
        now = current.eta_s
        whole = estimates.get(current.phase)
        if whole is not None and (current.phase == "align" or now is None):
            now = max(now or 0.0, whole * k - current.elapsed_s)
        later = PHASES[PHASES.index(current.phase) + 1:]
        parts = [now, *(None if estimates.get(p) is None else estimates[p] * k for p in later)]
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
