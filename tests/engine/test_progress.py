"""Honest time (engine.timing, engine.progress): the machine's measured speed, estimates scaled by it, the run's own
arithmetic where no record tells, and the remaining time refined from the run's pace."""

from __future__ import annotations

import pytest
from ref_models import random_model, tiny

from engine import timing
from engine.api import run_pair
from engine.models import save_model
from engine.progress import PHASES, Update, pace, remaining_seconds
from engine.results import RunConfig
from engine.timing import arithmetic_seconds, estimate_run, estimate_seconds, forward_flops

ARCH = {"family": "reference", "task": "lm", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 4,
        "d_head": 8, "d_mlp": 128, "n_out": 256, "n_ctx": 16, "pe": "learned", "mlp": "gelu", "causal": True,
        "tied_embeddings": False}


def record(method, timings, gflops=None, items=1000, points=21, steps=0, arch=ARCH):
    rec = {"method": method, "arch": arch, "eval_tokens": items, "lambdas": [0.0] * points, "timings": timings,
           "config": {"steps": steps}}
    if gflops is not None:
        rec["provenance"] = {"reference_gflops": gflops}
    return rec


def test_the_reference_is_measured_once_per_process_until_refreshed(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "_rates", {})
    monkeypatch.setattr(timing, "_measure_gflops", lambda device: calls.append(device) or 10.0 * len(calls))
    assert timing.reference_gflops("cpu") == 10.0
    assert timing.reference_gflops("cpu") == 10.0 and calls == ["cpu"]  # memoised
    assert timing.reference_gflops("cpu", refresh=True) == 20.0 and calls == ["cpu", "cpu"]
    assert timing.reference_gflops("cpu") == 20.0


def test_the_reference_measures_a_real_product():
    t = timing._measure_gflops("cpu")
    assert 0.01 < t < 1e5  # GFLOP/s of a float32 [512, 512] product on any CPU, loaded or not


def test_a_record_measured_at_half_today_s_speed_predicts_half_its_time():
    timings = {"load": 0.5, "align": 40.0, "interpolate": 21.0}
    slow = record("weight", timings, gflops=50.0)
    est = estimate_seconds("weight", ARCH, 1000, 21, 0, [slow], rate=100.0)
    assert est["interpolate"] == pytest.approx(21.0 / 2)
    assert est["align"] == pytest.approx(40.0 / 2)
    assert est["measure B"] == pytest.approx(21.0 / 2 / 21)  # one pass over the evaluation set
    assert est["load"] == 0.5  # the disk's time: not scaled by the processor's speed
    same = estimate_seconds("weight", ARCH, 1000, 21, 0, [slow], rate=50.0)
    assert same["interpolate"] == pytest.approx(21.0) and same["align"] == pytest.approx(40.0)
    unknown = estimate_seconds("weight", ARCH, 1000, 21, 0, [record("weight", timings)], rate=100.0)
    assert unknown["interpolate"] == pytest.approx(21.0)  # a record without its speed: as measured


def test_the_arithmetic_estimates_an_architecture_without_records():
    rate = 20.0
    est, source = estimate_run("learned", ARCH, 1000, 21, 400, [], rate, train_size=1000, attribution_size=500)
    assert set(source.values()) == {"arithmetic"} and set(source) == set(PHASES)
    assert all(v > 0 for v in est.values())
    calc = arithmetic_seconds("learned", ARCH, 1000, 21, 400, rate)
    f = forward_flops(ARCH)
    assert calc["measure B"] == pytest.approx(1000 * f / (rate * 1e9 * timing.EFFICIENCY["evaluate"]))
    twice = arithmetic_seconds("learned", ARCH, 1000, 42, 400, rate)
    assert twice["interpolate"] == pytest.approx(2 * calc["interpolate"])  # linear in the points
    steps = [arithmetic_seconds("learned", ARCH, 1000, 21, s, rate)["align"] for s in (100, 200, 300)]
    assert steps[1] - steps[0] == pytest.approx(steps[2] - steps[1]) and steps[1] > steps[0]  # linear in the steps
    dual = [arithmetic_seconds("dual", ARCH, 1000, 21, s, rate)["align"] for s in (100, 200)]
    assert dual[1] - dual[0] == pytest.approx(2 * (steps[1] - steps[0]))  # the dual run and its one-sided twin
    faster = arithmetic_seconds("learned", ARCH, 1000, 21, 400, 2 * rate)
    assert all(faster[p] == pytest.approx(calc[p] / 2) for p in PHASES if p != "load")
    assert arithmetic_seconds("naive", ARCH, 1000, 21, 0, rate)["align"] == 0.0
    assert set(arithmetic_seconds("weight", {"task": "lm"}, 1000, 21, 0, rate).values()) == {None}


def test_records_win_where_they_tell_and_the_arithmetic_fills_the_rest():
    ref = record("weight", {"load": 0.5, "align": 4.0, "interpolate": 21.0}, gflops=10.0)
    est, source = estimate_run("dual", ARCH, 1000, 21, 400, [ref], 10.0)
    assert source == {"load": "records", "measure B": "records", "align": "arithmetic", "interpolate": "records",
                      "attribution": "records"}
    assert est["interpolate"] == pytest.approx(21.0)
    assert est["align"] == pytest.approx(arithmetic_seconds("dual", ARCH, 1000, 21, 400, 10.0)["align"])
    none, source = estimate_run("dual", ARCH, 1000, 21, 400, [ref], None)  # no speed known: no arithmetic
    assert none["align"] is None and "align" not in source


def test_a_larger_batch_is_a_longer_and_larger_run():
    from engine.resources import estimate_run as memory
    from engine.zoo import resolve

    rate = 20.0
    calc = [arithmetic_seconds("learned", ARCH, 1000, 21, 400, rate, batch=b)["align"] for b in (None, 16, 64)]
    assert calc[0] == calc[1] < calc[2]  # none given: the default batch of 16
    start = arithmetic_seconds("weight", ARCH, 1000, 21, 0, rate)["align"]
    val = arithmetic_seconds("learned", ARCH, 1000, 21, 0, rate)["align"] - start  # the checks, no steps
    assert calc[2] - start - val == pytest.approx(4 * (calc[1] - start - val))  # the steps' work grows with the batch
    ref = record("learned", {"load": 0.5, "align": 40.0, "interpolate": 21.0}, gflops=10.0, steps=400)
    same = estimate_seconds("learned", ARCH, 1000, 21, 400, [ref], rate=10.0)["align"]
    big = estimate_seconds("learned", ARCH, 1000, 21, 400, [ref], rate=10.0, batch=64)["align"]
    assert same == pytest.approx(40.0) and big == pytest.approx(160.0)
    ref64 = {**ref, "alignment": {"diagnostics": {"settings": {"batch": 64}}}}  # a record run at 64 per step
    assert estimate_seconds("learned", ARCH, 1000, 21, 400, [ref64], rate=10.0)["align"] == pytest.approx(10.0)
    pair = [resolve("lm-learned-s0"), resolve("lm-learned-s1")]
    scratch = [memory(pair, "dual", batch=b).parts["dual matching scratch"] for b in (None, 64)]
    assert scratch[1] > scratch[0]  # the kept block inputs of four times the sequences


def test_a_time_budget_alone_is_the_optimisation_s_time():
    """Under a time budget alone (no step cap: MAX_STEPS) learned and dual matching align for weight matching's start
    and the budget; with a step cap too, for whichever ends first."""
    from engine.results import MAX_STEPS

    weight = record("weight", {"load": 0.5, "align": 4.0, "interpolate": 21.0}, gflops=10.0)
    learned = record("learned", {"load": 0.5, "align": 44.0, "interpolate": 21.0}, gflops=10.0, steps=400)
    arithmetic = arithmetic_seconds("weight", ARCH, 1000, 21, 0, 10.0)["align"]
    for refs, start in (([weight, learned], 4.0), ([], arithmetic)):  # from the records, and from the arithmetic
        assert estimate_run("weight", ARCH, 1000, 21, 0, refs, 10.0)[0]["align"] == pytest.approx(start)
        for method in ("learned", "dual"):
            capped = estimate_run(method, ARCH, 1000, 21, 400, refs, 10.0)[0]["align"]
            alone = estimate_run(method, ARCH, 1000, 21, MAX_STEPS, refs, 10.0, time_budget_s=600)[0]["align"]
            assert alone == pytest.approx(start + 600), (method, refs)
            both = estimate_run(method, ARCH, 1000, 21, 400, refs, 10.0, time_budget_s=600)[0]["align"]
            assert both == pytest.approx(min(capped, start + 600))
            short = estimate_run(method, ARCH, 1000, 21, 400, refs, 10.0, time_budget_s=1e-3)[0]["align"]
            assert short == pytest.approx(start + 1e-3) and short < capped
    naive = estimate_run("weight", ARCH, 1000, 21, 0, [weight], 10.0, time_budget_s=600)[0]["align"]
    assert naive == 4.0  # a method without steps has no budget to spend


def test_the_remaining_time_follows_the_run_s_pace():
    est = {"load": 1.0, "measure B": 2.0, "align": 30.0, "interpolate": 12.0, "attribution": 3.0}
    phases = {"load": Update("load", 2, 2, "", 5.0, 0.0), "measure B": Update("measure B", 4, 4, "", 4.0, 0.0),
              "align": Update("align", 1, 10, "", 1.0, 9.0)}
    assert pace(phases, est) == pytest.approx(2.0)  # measure B took twice its estimate; loading is the disk's
    left = remaining_seconds(phases["align"], est, phases)
    assert left == pytest.approx((2 * 30.0 - 1.0) + 2 * 12.0 + 2 * 3.0)
    assert remaining_seconds(phases["align"], est) == pytest.approx(29.0 + 12.0 + 3.0)  # without the phases: as planned
    short = {**est, "measure B": 0.2}  # too short a finished phase says nothing of the pace
    assert pace(phases, short) == 1.0
    path = Update("interpolate", 3, 12, "", 6.0, 18.0)  # one pass: its own rate once it has one
    begun = {**phases, "align": Update("align", 10, 10, "", 60.0, 0.0), "interpolate": path}
    assert remaining_seconds(path, est, begun) == pytest.approx(18.0 + 3.0 * pace(begun, est))
    assert remaining_seconds(Update("interpolate", 0, 12, "", 0.1, None), est) == pytest.approx(12.0 - 0.1 + 3.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    for seed in (0, 1):
        save_model(random_model(tiny(n_ctx=16, vocab_size=256), seed), root / f"m{seed}")
    return str(root / "m0"), str(root / "m1")


def test_a_record_keeps_the_machine_s_speed_as_it_ran(pair, monkeypatch):
    monkeypatch.setattr(timing, "_measure_gflops", lambda device: 12.345)
    rec = run_pair(RunConfig(*pair, "naive", points=3, eval_items=64), train_curve=False, attribution=False)
    assert rec["provenance"]["reference_gflops"] == 12.35
    assert timing.record_gflops(rec) == 12.35
