"""Stopping a run (engine.cancel) and reporting its phases (engine.progress).

Each long loop is stopped from its own progress callback after its first unit of work: the loop must
raise Cancelled before doing a second one, so a stopped run frees its CPU within one unit."""

from __future__ import annotations

import pytest
import torch
from ref_models import random_model, tiny

from engine.align.activation import activation_match
from engine.align.batches import train_batches
from engine.align.context import AlignContext
from engine.align.dual import align_dual
from engine.align.learned import align_learned
from engine.align.pair import prepare_pair
from engine.align.weight import weight_match
from engine.api import run_pair
from engine.cancel import CancelToken
from engine.classes import default_classes
from engine.errors import Cancelled, LMCError
from engine.evaluate import evaluate, lm_eval_set
from engine.interpolate import interpolate
from engine.models import canonical, save_model
from engine.progress import PHASES, Phases, Update, fmt_seconds, relabel, remaining_seconds
from engine.results import RunConfig
from engine.spec import build_spec
from engine.timing import estimate_seconds

FAST = frozenset({"heads", "mlp"})  # no residual map: weight matching takes one sweep


def pair(kinds: frozenset[str] | None = None):
    """Two random tiny LMs prepared for `kinds` (default: every default class, residual rotation included)."""
    cfg = tiny(n_ctx=16, vocab_size=256)  # byte-level training text
    a, b = random_model(cfg, 0), random_model(cfg, 1)
    kinds = kinds or default_classes(build_spec(a.arch, canonical(a)))
    return prepare_pair(a, b, kinds), kinds


class StopAfter:
    """A progress callback that sets the token once `first` ticks matched, and counts every tick."""

    def __init__(self, token: CancelToken, first: int = 1, match: str = ""):
        self.token, self.first, self.match = token, first, match
        self.ticks: list[tuple[int, int, str]] = []
        self.after = 0  # ticks matching `match` seen once the token was set

    def __call__(self, done: int, total: int, message: str) -> None:
        if self.match not in message:
            return
        if self.token.cancelled:
            self.after += 1
        self.ticks.append((done, total, message))
        if len(self.ticks) == self.first:
            self.token.cancel()


def test_a_token_is_a_one_way_switch_and_names_where_the_run_stopped():
    t = CancelToken()
    t.check("anything")  # not set: nothing happens
    t.cancel("stopped because a new run started")
    t.cancel("stopped on request")  # the first reason stays
    assert t.cancelled
    with pytest.raises(Cancelled, match=r"^The run was stopped because a new run started during step 3\.$"):
        t.check("step 3")
    assert issubclass(Cancelled, LMCError)  # the CLI and the app show it as one sentence


def test_cancelled_weight_matching_stops_before_the_next_layer():
    p, kinds = pair()
    token = CancelToken()
    stop = StopAfter(token, match="sweep")
    with pytest.raises(Cancelled, match=r"weight matching, sweep 1, layer 2/2"):
        weight_match(p, kinds, progress=stop, cancel=token)
    assert stop.ticks == [(1, 2, "sweep 1: layer 1/2")] and stop.after == 0


def test_cancelled_weight_matching_in_a_later_sweep():
    p, kinds = pair()  # the residual map makes it sweep again (a single sweep would return, not raise)
    token = CancelToken()
    stop = StopAfter(token, first=3, match="sweep")  # sweep 2, layer 1 of 2
    with pytest.raises(Cancelled, match=r"sweep 2, layer 2/2"):
        weight_match(p, kinds, progress=stop, cancel=token)
    assert stop.ticks[-1] == (1, 2, "sweep 2: layer 1/2") and stop.after == 0


def test_cancelled_starting_residual_fit_stops_before_its_next_step():
    p, kinds = pair()
    assert "residual_orth" in kinds
    token = CancelToken()
    stop = StopAfter(token)
    with pytest.raises(Cancelled, match=r"weight matching of the residual stream, step 2"):
        weight_match(p, kinds, progress=stop, cancel=token)
    assert stop.ticks == [(1, 50, "matching the residual stream, step 1 (of at most 50)")]


@pytest.mark.parametrize("method", ["learned", "dual"])
def test_learned_and_dual_say_their_starting_point_in_words(method):
    p, kinds = pair()
    token = CancelToken()
    stop = StopAfter(token)
    with pytest.raises(Cancelled):
        (align_learned if method == "learned" else align_dual)(AlignContext(p, kinds, steps=20, progress=stop,
                                                                            cancel=token))
    assert stop.ticks[0][2] == "weight matching, starting point: matching the residual stream, step 1 (of at most 50)"


@pytest.mark.parametrize("method", ["learned", "dual"])
def test_cancelled_learned_and_dual_runs_stop_before_the_next_step(method):
    p, kinds = pair(FAST)
    token = CancelToken()
    stop = StopAfter(token, match="step ")  # the optimisation's ticks, not the weight-matching start's
    ctx = AlignContext(p, kinds, steps=20, progress=stop, cancel=token)
    with pytest.raises(Cancelled, match=rf"{method} matching, step 2/20"):
        (align_learned if method == "learned" else align_dual)(ctx)
    assert len(stop.ticks) == 1 and stop.after == 0
    done, total, msg = stop.ticks[0]
    assert done == 1 and total == (40 if method == "dual" else 20)  # dual: its steps, then the one-sided comparison's
    assert msg.startswith("dual: step 1/20" if method == "dual" else "step 1/20")


def test_cancelled_activation_matching_stops_before_the_next_layer():
    p, kinds = pair()
    x, _ = next(train_batches(p.arch, 4, 0))
    token = CancelToken()
    stop = StopAfter(token)
    with pytest.raises(Cancelled, match=r"activation matching, layer 2/2"):
        activation_match(p, kinds, x, progress=stop, cancel=token)
    assert stop.ticks == [(1, 2, "layer 1/2")]


def test_cancelled_evaluation_stops_before_the_next_batch():
    m = random_model(tiny(n_ctx=16, vocab_size=256), 0)
    es = lm_eval_set("val", 16 * 8, n_ctx=16)  # 8 windows, one per batch below
    token = CancelToken()
    stop = StopAfter(token)
    with pytest.raises(Cancelled, match=r"evaluation, batch 2/8"):
        evaluate(m, es, max_tokens=16, progress=stop, cancel=token)
    assert stop.ticks == [(1, 8, "batch 1/8")]


def test_cancelled_interpolation_stops_before_the_next_point():
    cfg = tiny(n_ctx=16, vocab_size=256)
    a, b = random_model(cfg, 0), random_model(cfg, 1)
    es = lm_eval_set("val", 64, n_ctx=16)
    token = CancelToken()
    stop = StopAfter(token)
    with pytest.raises(Cancelled, match=r"interpolation, point 2/5"):
        interpolate(a, b, es, points=5, progress=stop, cancel=token)
    assert len(stop.ticks) == 1 and stop.ticks[0][:2] == (1, 5)


# ---------------------------------------------------------------------------------------------
# run_pair: phases, remaining time, cancellation


@pytest.fixture
def model_dirs(tmp_path):
    cfg = tiny(n_ctx=16, vocab_size=256)  # byte-level text needs the byte vocabulary
    for seed in (0, 1):
        save_model(random_model(cfg, seed, std=0.1), tmp_path / f"m{seed}")
    return str(tmp_path / "m0"), str(tmp_path / "m1")


def test_run_pair_reports_every_phase_in_order_with_a_remaining_time(model_dirs):
    seen: list[Update] = []
    rec = run_pair(RunConfig(*model_dirs, "weight", points=3, eval_items=128, dtype="float64"), seen.append)
    assert [u.phase for u in seen if u.done == 0] == list(PHASES)  # each announced once, in order
    by_phase = {ph: [u for u in seen if u.phase == ph] for ph in PHASES}
    assert [(u.done, u.total) for u in by_phase["load"]] == [(0, 2), (1, 2), (2, 2)]
    assert [(u.done, u.total) for u in by_phase["interpolate"]] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    diag = rec["alignment"]["diagnostics"]
    start = [u for u in by_phase["align"] if u.message.startswith("matching the residual stream")]
    layers = [u for u in by_phase["align"] if u.message.startswith("sweep")]
    assert len(by_phase["align"]) == 1 + len(start) + len(layers)  # announced, then its ticks
    assert len(start) == diag["initial_residual"]["steps"] and len(layers) == 2 * len(diag["sweeps"])
    assert [u.message for u in layers[:2]] == ["sweep 1: layer 1/2", "sweep 1: layer 2/2"]
    for u in seen:
        assert (u.eta_s is None) == (u.done == 0)
        if u.total and u.done == u.total:
            assert u.eta_s == 0.0
        assert u.elapsed_s >= 0
    assert len(by_phase["measure B"]) >= 2 and by_phase["measure B"][-1].fraction == 1.0


def test_run_pair_stops_in_the_phase_it_was_cancelled_in(model_dirs):
    token = CancelToken()
    seen: list[Update] = []

    def progress(u: Update) -> None:
        seen.append(u)
        if u.phase == "align" and u.done == 1:
            token.cancel()

    cfg = RunConfig(*model_dirs, "learned", classes=("heads", "mlp"), steps=30, points=3, eval_items=128,
                    dtype="float64")
    with pytest.raises(Cancelled, match="weight matching, sweep 1, layer 2/2"):
        run_pair(cfg, progress, cancel=token)
    assert seen[-1].phase == "align" and seen[-1].done == 1
    assert not any(u.phase == "interpolate" for u in seen)


def test_a_run_pair_cancelled_before_it_starts_loads_nothing(model_dirs, monkeypatch):
    from engine import pipeline

    loaded = []
    monkeypatch.setattr(pipeline, "load_named", lambda *a: loaded.append(a))
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled, match="loading, model A"):
        run_pair(RunConfig(*model_dirs, "naive"), cancel=token)
    assert loaded == []


# ---------------------------------------------------------------------------------------------
# Phases and estimates


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_remaining_time_follows_the_rate_of_the_current_pass():
    clock, seen = Clock(), []
    tick = Phases(seen.append, clock).phase("align", 4)
    assert seen[-1] == Update("align", 0, 4, "", 0.0, None)
    clock.t = 1.0
    tick(1, 4, "sweep 1: layer 1/4")  # 1 s per layer, 3 to go
    assert seen[-1].eta_s == pytest.approx(3.0)
    clock.t = 4.0
    tick(2, 4, "sweep 1: layer 2/4")  # 2 s per layer, 2 to go
    assert seen[-1].eta_s == pytest.approx(4.0)
    clock.t = 9.0
    tick(1, 4, "sweep 2: layer 1/4")  # a new sweep: its own rate, from the previous tick at 4 s
    assert seen[-1].eta_s == pytest.approx(15.0) and seen[-1].elapsed_s == pytest.approx(9.0)
    clock.t = 10.0
    tick(3, 8, "start over")  # another total: a new pass from the tick at 9 s
    assert seen[-1].eta_s == pytest.approx(1 / 3 * 5)


def test_relabel_moves_a_loop_into_a_stretch_of_a_longer_phase():
    got = []
    p = relabel(lambda *a: got.append(a), "one-sided comparison: ", offset=20, total=40)
    p(3, 20, "step 3/20")
    assert got == [(23, 40, "one-sided comparison: step 3/20")]
    assert relabel(None, "x") is None


def record(method, arch, items, points, timings, steps=0):
    return {"method": method, "arch": arch, "eval_tokens": items, "lambdas": [0.0] * points, "timings": timings,
            "config": {"steps": steps}}


def test_estimates_scale_earlier_records_by_items_points_and_steps():
    arch, other = {"d_model": 32}, {"d_model": 64}
    refs = [
        record("naive", other, 100, 11, {"load": 9.0, "align": 0.0, "interpolate": 99.0}),
        record("dual", arch, 1000, 21, {"load": 0.5, "align": 60.0, "interpolate": 42.0}, steps=100),
        record("weight", arch, 2000, 11, {"load": 0.7, "align": 5.0, "interpolate": 1.0}),
    ]
    est = estimate_seconds("dual", arch, eval_size=500, points=11, steps=50, refs=refs)
    per = 42.0 / (1000 * 21)  # seconds per item per point of the first same-architecture record
    assert est["interpolate"] == pytest.approx(per * 500 * 11)
    assert est["measure B"] == pytest.approx(per * 500)
    assert est["load"] == 0.5
    assert est["align"] == pytest.approx(60.0 * 50 / 100)
    weight = estimate_seconds("weight", arch, 500, 11, 0, refs)
    assert weight["align"] == 5.0  # no step budget: as measured
    naive = estimate_seconds("naive", arch, 500, 11, 0, refs)
    assert naive["align"] == 0.0 and naive["measure B"] == 0.0
    unknown = estimate_seconds("activation", {"d_model": 8}, 500, 11, 0, refs)
    assert set(unknown.values()) == {None}
    newer = estimate_seconds("weight", {**arch, "parallel_residual": False}, 500, 11, 0, refs)
    assert newer == weight  # a record written before Arch had a field still counts
    assert remaining_seconds(None, est) == pytest.approx(sum(est.values()))
    now = Update("align", 10, 100, "", 3.0, 7.0)  # 3 s into an align phase estimated at 30 s
    assert remaining_seconds(now, est) == pytest.approx(est["align"] - 3.0 + est["interpolate"])
    late = Update("align", 90, 100, "", 40.0, 2.0)  # past the estimate: the pass's own rate
    assert remaining_seconds(late, est) == pytest.approx(2.0 + est["interpolate"])
    unknown_align = {**est, "align": None}
    assert remaining_seconds(now, unknown_align) == pytest.approx(7.0 + est["interpolate"])
    assert remaining_seconds(Update("align", 0, 0, "", 0.1, None), unknown_align) is None
    assert remaining_seconds(None, unknown) is None


def test_remaining_times_read_well():
    assert [fmt_seconds(s) for s in (0.4, 8, 59.6, 125, 610, 3600 + 29 * 60 + 50)] == [
        "0 s", "8 s", "1 min", "2 min 5 s", "10 min", "1 h 30 min"]


def test_the_cli_draws_one_bar_per_phase(monkeypatch):
    from engine import cli

    bars = []

    class Bar:
        def __init__(self, total=None, desc="", leave=True, delay=0, disable=False):
            self.total, self.desc, self.n, self.closed, self.postfix = total, desc, 0, False, ""
            bars.append(self)

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(cli, "tqdm", Bar)
    update = cli._progress_bar("weight")
    for u in [Update("load", 0, 2, "", 0, None), Update("load", 2, 2, "model B", 1, 0.0),
              Update("align", 0, 0, "", 0, None), Update("align", 1, 4, "sweep 1: layer 1/4", 1, 3.0),
              Update("align", 1, 4, "sweep 2: layer 1/4", 5, 3.0),
              Update("interpolate", 0, 3, "", 0, None), Update("interpolate", 3, 3, "lambda = 1.00", 2, 0.0)]:
        update(u)
    assert not bars[-1].closed  # the run's last bar stays until the command closes it
    update.close()
    assert [(b.desc, b.total) for b in bars] == [("weight: load", 2), ("weight: align", None), ("weight: align", 4),
                                                ("weight: interpolate", 3)]
    assert all(b.closed for b in bars)
    assert bars[2].postfix == "sweep 2: layer 1/4" and bars[3].n == 3


def test_an_unset_token_changes_nothing():
    p, kinds = pair(FAST | {"qk", "vo"})
    g1, _ = weight_match(p, kinds)
    g2, _ = weight_match(p, kinds, cancel=CancelToken())
    assert all(torch.equal(x.mlp_perm, y.mlp_perm) for x, y in zip(g1.layers, g2.layers))
    assert torch.equal(g1.residual, g2.residual)
