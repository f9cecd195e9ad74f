"""A live run the page can watch and stop: engine.api.run_pair in a worker thread.

Streamlit runs the page script once per rerun, and a rerun must not block for the minutes a dual run
takes. So the run lives in a worker thread held by the session (st.session_state[KEY]); the page
polls it (a fragment rerun every POLL_S seconds while it runs) and draws its latest progress. The
worker never touches streamlit: it writes its progress, result or error into the LiveRun under a
lock, and the page reads a Snapshot.

A run outlives its page: on the other pages the sidebar shows its progress and a Stop button, and
the Connectivity page draws its curve when the user returns. Stopping: the Stop button, a new run
(after a confirmation) and the end of the session set the run's CancelToken (engine.cancel). The engine checks it before every layer, step, evaluation batch and
grid point, so the worker ends, and the CPU falls idle, within one unit of work. A session counts
as ended once streamlit has held it disconnected for SESSION_GRACE_S (a tab closed; a brief network
drop reconnects to the same session and keeps its run).

Every run is kept in the user's run history (the Runs page) by the worker itself, so it is kept
even when nobody watches the page any more: a finished one as its record (engine.api.save_run), a
stopped or failed one with what it reached (engine.api.save_unfinished: its config, the phase it was
in, the sentence it ended with, its phase times and the points of the path it had measured), each
with its wall time.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine import api
from engine.api import PHASES, Cancelled, CancelToken, LMCError, RunConfig, Update

POLL_S = 1.0  # how often the page redraws a running run (at 0.5 s the browser's redraws took twice the CPU,
# and a GPT-2-small alignment in the app 23% longer: bench/RESULTS.md, "Scale, fifth pass")
SESSION_GRACE_S = 30.0  # a session disconnected this long stops its run
KEY = "live_run"  # where the session keeps its run

log = logging.getLogger(__name__)

Runner = Callable[..., dict]  # run_pair(cfg, progress, cancel=token[, save_element=file]) -> record


def _run_pair(cfg: RunConfig, progress, cancel: CancelToken, save_element: Path | None = None) -> dict:
    # api.run_pair is looked up per call: tests may stand in for it
    return api.run_pair(cfg, progress, cancel=cancel, save_element=save_element)


POINT = re.compile(r"lambda = [^:]+: loss (\S+?)(?:,|$)")  # engine.interpolate's tick message for one point


@dataclass(frozen=True)
class Outcome:
    """How a run ended, as the history keeps it."""

    cfg: RunConfig
    state: str  # "done" | "stopped" | "failed"
    seconds: float  # wall time
    record: dict | None = None  # a done run's
    phase: str | None = None  # the phase a stopped or failed run was in
    message: str = ""  # why it stopped or failed
    timings: dict[str, float] = field(default_factory=dict)  # seconds of every phase begun
    partial: dict | None = None  # {"lambdas", "loss"}: the points of the path measured before it ended
    run_id: str | None = None  # drawn before the run when it keeps its element (history.element_path)


def arch_dict(cfg: RunConfig) -> dict | None:
    """Model A's architecture from its config, or None when it cannot be read."""
    try:
        return api.model_info(cfg.model_a).arch.to_dict()
    except (LMCError, OSError):
        return None


def keep_in_history(out: Outcome) -> None:
    """Keep a run in the user's run history, across sessions: its record (engine.api.save_run), or what a
    stopped or failed run reached (engine.api.save_unfinished)."""
    if out.record is not None:
        kept = out.record.get("element_file") is not None and out.run_id is not None
        try:
            api.save_run(out.record, seconds=out.seconds, run_id=out.run_id if kept else None)
        except LMCError:
            if kept:  # an element without its run would be read by nothing
                api.element_path(out.run_id).unlink(missing_ok=True)
            raise
    else:
        api.save_unfinished(out.cfg.to_dict(), out.state, out.phase, out.message, out.timings, out.seconds,
                            out.partial, arch_dict(out.cfg))


@dataclass(frozen=True)
class Snapshot:
    """What the page draws of a run at one moment (copied under the run's lock)."""

    cfg: RunConfig
    state: str  # "running" | "stopping" | "done" | "stopped" | "failed"
    phases: dict[str, Update]  # latest update of every phase begun, in PHASES order
    current: Update | None
    estimates: dict[str, float | None]
    elapsed_s: float
    message: str = ""  # why it stopped or failed
    record: dict | None = None
    sources: dict[str, str] = field(default_factory=dict)  # phase -> "records" | "arithmetic" (api.estimate_run)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "stopped", "failed")


@dataclass
class LiveRun:
    """One run_pair call in a daemon thread, with its token, latest progress and outcome."""

    cfg: RunConfig
    estimates: dict[str, float | None] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # where each estimate came from (api.estimate_run)
    run: Runner = _run_pair
    alive: Callable[[], bool] | None = None  # is the owning session still connected?
    keep: Callable[[Outcome], None] | None = None  # where the run is kept when it ends (keep_in_history)
    clock: Callable[[], float] = time.monotonic
    run_id: str | None = None  # the history id of a run that keeps its element there (element_run_id)

    def __post_init__(self) -> None:
        self.token = CancelToken()
        self.collected = False  # the page has stored the finished run's record
        self._lock = threading.Lock()
        self._phases: dict[str, Update] = {}
        self._current: Update | None = None
        self._points: dict[int, float] = {}  # grid index -> test loss, from the path's ticks
        self._state, self._message, self._record = "running", "", None
        self._t0, self._t_end = self.clock(), None
        self._gone_since: float | None = None
        self._thread = threading.Thread(target=self._work, name="lmc-live-run", daemon=True)

    def start(self) -> LiveRun:
        self._t0 = self.clock()
        self._thread.start()
        return self

    def stop(self, reason: str = "stopped on request") -> None:
        """Ask the run to stop (from any thread); it ends within one unit of the engine's work."""
        self.token.cancel(reason)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker; True once it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> Snapshot:
        with self._lock:
            state = self._state
            if state == "running" and self.token.cancelled:
                state = "stopping"
            end = self._t_end if self._t_end is not None else self.clock()
            phases = {p: self._phases[p] for p in PHASES if p in self._phases}
            return Snapshot(self.cfg, state, phases, self._current, dict(self.estimates), end - self._t0,
                            self._message, self._record, dict(self.sources))

    # the worker thread

    def _progress(self, u: Update) -> None:
        m = POINT.match(u.message) if u.phase == "interpolate" else None
        with self._lock:
            self._phases[u.phase] = u
            self._current = u
            if m and 0 < u.done <= self.cfg.points:  # naive's second path (its ticks go on) is not kept
                self._points[u.done - 1] = float(m.group(1))
        if self.alive is not None:  # the owning session's tab may be gone: then nobody waits for this run
            now = self.clock()
            if self.alive():
                self._gone_since = None
            elif self._gone_since is None:
                self._gone_since = now
            elif now - self._gone_since >= SESSION_GRACE_S:
                self.token.cancel("stopped because its session ended")

    def outcome(self, state: str, message: str, record: dict | None) -> Outcome:
        """How the run ended, with what it reached (the phases it began and the path points it measured)."""
        with self._lock:
            seconds = self.clock() - self._t0
            timings = {p: u.elapsed_s for p, u in self._phases.items()}
            phase = self._current.phase if self._current else None
            n = self.cfg.points - 1
            points = sorted(self._points.items())
        partial = {"lambdas": [i / n for i, _ in points], "loss": [v for _, v in points]} if points else None
        return Outcome(self.cfg, state, seconds, record, phase, message, timings, partial, self.run_id)

    def _work(self) -> None:
        state, message, record = "failed", "", None
        try:
            keep = {} if self.run_id is None else {"save_element": api.element_path(self.run_id)}
            record = self.run(self.cfg, self._progress, cancel=self.token, **keep)
            state = "done"
        except Cancelled as e:
            state, message = "stopped", str(e)
        except LMCError as e:
            message = str(e)
        except Exception as e:  # a bug, not a user error: keep the traceback in the server log
            log.exception("live run failed")
            message = f"The run failed unexpectedly ({type(e).__name__}: {e})."
        finally:
            if self.keep is not None:  # done, stopped or failed: the history keeps every run
                try:
                    self.keep(self.outcome(state, message, record))
                except LMCError as e:
                    message = f"{message} It could not be kept in the run history: {e}" if message else \
                        f"The run finished but could not be kept in the run history: {e}"
            with self._lock:
                self._state, self._message, self._record = state, message, record
                self._t_end = self.clock()


# ---------------------------------------------------------------------------------------------
# The session's run


def session_alive() -> Callable[[], bool] | None:
    """Whether the current streamlit session is still connected, as a function any thread may call;
    None outside a served app (AppTest, bare scripts)."""
    try:
        from streamlit.runtime import Runtime
        from streamlit.runtime.scriptrunner import get_script_run_ctx
    except ImportError:
        return None
    ctx = get_script_run_ctx()
    if ctx is None or not Runtime.exists():
        return None
    runtime, session = Runtime.instance(), ctx.session_id
    return lambda: runtime.is_active_session(session)


def current(state: MutableMapping) -> LiveRun | None:
    return state.get(KEY)


def start(state: MutableMapping, cfg: RunConfig, estimates: dict[str, float | None] | None = None,
          run: Runner = _run_pair, keep: Callable[[Outcome], None] | None = keep_in_history,
          sources: dict[str, str] | None = None) -> LiveRun:
    """Start `cfg` as the session's run (its time `estimates` and their `sources`, as estimates_for
    gives them); a run still going is stopped first (one run per session). When it ends, done,
    stopped or failed, `keep` keeps it (the user's run history)."""
    stop(state, "stopped because a new run started")
    live = LiveRun(cfg, dict(estimates or {}), dict(sources or {}), run, alive=session_alive(), keep=keep,
                   run_id=element_run_id(cfg) if keep is keep_in_history else None)
    state[KEY] = live.start()
    return live


def element_run_id(cfg: RunConfig) -> str | None:
    """A learned or dual run keeps the element it finds in the run history, named after an id drawn now
    (a later run may start from it: the Method options' start); None for other methods, or when the history
    cannot be written (its own error says so when the run is kept)."""
    if cfg.method not in ("learned", "dual"):
        return None
    run_id = api.new_run_id()
    try:
        api.element_path(run_id)
    except LMCError:
        return None
    return run_id


def stop(state: MutableMapping, reason: str = "stopped on request") -> bool:
    """Stop the session's run if one is going; True if there was one."""
    live = current(state)
    if live is None or not live.running:
        return False
    live.stop(reason)
    return True


# ---------------------------------------------------------------------------------------------
# What the page says about a run (pure: snapshot -> text)


PHASE_LABELS = {"load": "Loading the models", "measure B": "Measuring B before it moves",
                "align": "Aligning B onto A", "interpolate": "Walking the path",
                "attribution": "Finding where the barrier lives"}


def phases_of(method: str) -> tuple[str, ...]:
    """The phases a run of `method` goes through (naive measures nothing before the path)."""
    return tuple(p for p in PHASES if not (p == "measure B" and method == "naive"))


def span(s: float) -> str:
    """A time, as fmt_seconds says it, but never '0 s': a part of a second is 'under 1 s'."""
    return "under 1 s" if s < 0.5 else api.fmt_seconds(s)


def about(s: float) -> str:
    """A time to come: 'about 40 s', or 'under 1 s' (never 'about under 1 s')."""
    return "under 1 s" if s < 0.5 else f"about {api.fmt_seconds(s)}"


def phase_rows(snap: Snapshot) -> list[tuple[str, float, str]]:
    """(phase, fraction done, line of text) for every phase of the run, begun or not; a phase to come
    says its estimate at the run's pace so far (api.pace)."""
    rows = []
    now = snap.current.phase if snap.current else None
    k = api.pace(snap.phases, snap.estimates)
    for p in phases_of(snap.cfg.method):
        label, u, est = PHASE_LABELS[p], snap.phases.get(p), snap.estimates.get(p)
        if u is None:
            rows.append((p, 0.0, f"{label}: {about(est * k)}" if est is not None else f"{label}: to come"))
        elif p != now or snap.state == "done":
            rows.append((p, 1.0, f"{label}: done in {api.fmt_seconds(u.elapsed_s)}"))
        elif snap.finished:
            rows.append((p, u.fraction, f"{label}: {snap.state} at {u.message or 'its start'}"))
        else:
            left = f" · {about(u.eta_s)} left" + (" in this sweep" if "sweep" in u.message else "") \
                if u.eta_s is not None else ""
            rows.append((p, u.fraction, f"{label}: {u.message or 'starting'}{left}"))
    return rows


def headline(snap: Snapshot) -> str:
    """The run's one-line state: 'Running … about 40 s left', 'Done in 12 s', 'Stopped after 3 s'."""
    took = api.fmt_seconds(snap.elapsed_s)
    if snap.state == "running":
        rest = api.remaining_seconds(snap.current, snap.estimates, snap.phases)
        return f"Running for {took}" + (f", {about(rest)} left" if rest is not None else "")
    return {"stopping": "Stopping…", "done": f"Done in {took}", "stopped": f"Stopped after {took}",
            "failed": "Run failed"}[snap.state]


def estimated(snap: Snapshot) -> str | None:
    """'Estimated before the start: about 57 s, from the run's arithmetic …' while a run goes, beside
    its pace; None when a phase had no estimate."""
    said = before_run(snap.estimates, snap.cfg.method, snap.sources)
    if said is None:
        return None
    total, basis = said.split(" (", 1)[0], said.rsplit("), ", 1)[1]
    return f"Estimated before the start: {total[0].lower()}{total[1:]}, {basis}"


SOURCES = {"records": "at the pace of earlier runs of this architecture",
           "arithmetic": "from the run's arithmetic at this machine's measured speed"}


def before_run(estimates: dict[str, float | None], method: str, sources: dict[str, str] | None = None) -> str | None:
    """'About 1 min 5 s (…), at the pace of earlier runs of this architecture.' for a run not started
    yet, saying where the numbers come from (`sources`: phase -> "records" | "arithmetic", as
    api.estimate_run gives; none: records), or None when a phase is unknown."""
    parts = {p: estimates.get(p) for p in phases_of(method)}
    if any(v is None for v in parts.values()):
        return None
    total = sum(parts.values())
    detail = ", ".join(f"{PHASE_LABELS[p][0].lower()}{PHASE_LABELS[p][1:]} {span(v)}"
                       for p, v in parts.items() if v > 0)  # naive aligns nothing: no "0 s" for it
    kinds = {p: (sources or {}).get(p, "records") for p in parts if parts[p] > 0}
    if len(set(kinds.values())) <= 1:
        basis = SOURCES[next(iter(kinds.values()), "records")]
    else:  # say which phase came from where
        basis = "; ".join(f"{', '.join(PHASE_LABELS[p][0].lower() + PHASE_LABELS[p][1:] for p in kinds if kinds[p] == k)} "
                          f"{SOURCES[k]}" for k in SOURCES if k in kinds.values())
    return f"{about(total).capitalize()} ({detail}), {basis}."


# ---------------------------------------------------------------------------------------------
# Estimates before a run


@functools.lru_cache(maxsize=64)
def _arch(path: str, stamp: int) -> api.Arch:
    return api.model_info(path).arch


@functools.lru_cache(maxsize=64)
def eval_size(task: str, n_ctx: int, eval_items: int | None) -> int:
    """Scored tokens (LM, byte-level windows of the test split) or images (ViT) of a live run."""
    return api.eval_size(task, n_ctx, eval_items)


def estimates_for(cfg: RunConfig, refs: Sequence[dict]) -> tuple[dict[str, float | None], dict[str, str]]:
    """About how long each phase of `cfg` takes and where each number comes from (api.estimate_run):
    earlier records `refs` (best first) of the same architecture, scaled to the machine's speed now
    (api.reference_gflops, measured once per process and again by every run), else the run's own
    arithmetic; every phase None when the models cannot be read."""
    try:
        path = api.resolve(cfg.model_a)
        arch = _arch(str(path), (path / "config.json").stat().st_mtime_ns)
        size = eval_size(arch.task, arch.n_ctx, cfg.eval_items)
        rate = api.reference_gflops(api.resolve_device(cfg.device))
    except (LMCError, OSError):
        return dict.fromkeys(PHASES), {}
    steps = api.final_config(cfg, arch).steps  # the cap it runs under: none under a time budget alone
    return api.estimate_run(cfg.method, arch.to_dict(), size, cfg.points, steps, refs, rate,
                            train_size=api.train_items(arch.task, size),
                            attribution_size=0 if api.attribution_skipped(cfg.method, arch.to_dict(), size, cfg.points)
                            else api.attribution_items(arch.task, size),
                            batch=getattr(cfg.options, "batch", None),
                            time_budget_s=getattr(cfg.options, "time_budget_s", None))
