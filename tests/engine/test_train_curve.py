"""The train curve of a record: the path's points also scored on a bounded sample of the train split."""

from __future__ import annotations

import pytest
from ref_models import random_model, tiny

from engine import interpolate as interpolate_module
from engine.api import load_named, run_pair
from engine.cancel import CancelToken
from engine.cli import main
from engine.errors import Cancelled
from engine.evaluate import TRAIN_EVAL_ITEMS, eval_set_for, evaluate, train_eval_set_for, train_items
from engine.interpolate import barrier_metrics, interpolate
from engine.models import save_model
from engine.results import TRAIN_FIELDS, RunConfig, record_problem
from engine.timing import estimate_seconds

N_CTX = 16
EVAL_TOKENS = 8 * N_CTX  # eight windows


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    for seed in (0, 1):
        save_model(random_model(tiny(n_ctx=N_CTX, vocab_size=256), seed, std=0.1), root / f"m{seed}")
    return str(root / "m0"), str(root / "m1")


@pytest.fixture(scope="module")
def vit_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    for seed in (0, 1):
        save_model(random_model(tiny("vit"), seed, std=0.1), root / f"v{seed}")
    return str(root / "v0"), str(root / "v1")


@pytest.fixture(scope="module")
def naive_lm_record(lm_dirs):
    return run_pair(RunConfig(*lm_dirs, "naive", points=3, eval_items=EVAL_TOKENS, dtype="float64"))


def train_sample(name: str, items: int):
    """The endpoint model and the train sample run_pair scores it on (the test set of `items` beside it)."""
    m = load_named(name, "float64")
    return m, train_eval_set_for(m, eval_set_for(m, "test", items))


def test_a_naive_record_carries_a_train_curve_whose_endpoints_are_the_models_train_losses(lm_dirs, naive_lm_record):
    rec = naive_lm_record
    assert len(rec["train_loss"]) == len(rec["lambdas"]) == 3 and rec["train_accuracy"] is None
    a, es = train_sample(lm_dirs[0], EVAL_TOKENS)
    b, _ = train_sample(lm_dirs[1], EVAL_TOKENS)
    assert rec["train_eval_set"] == es.description and rec["train_eval_tokens"] == es.size == EVAL_TOKENS
    assert rec["train_eval_set"].startswith("austen/train, 128 tokens")
    assert rec["train_loss"][0] == evaluate(a, es)["loss"]  # lam 0 and 1 are the endpoints exactly (lerp)
    assert rec["train_loss"][-1] == evaluate(b, es)["loss"]
    m = barrier_metrics(rec["lambdas"], rec["train_loss"])
    assert rec["train_barrier"] == m["barrier"] and rec["train_midpoint_barrier"] == m["midpoint_barrier"]
    assert rec["train_loss"] != rec["loss"]  # another split: another curve
    assert record_problem(rec) is None


def test_an_aligned_record_s_train_endpoints_are_the_models_train_losses(lm_dirs):
    rec = run_pair(RunConfig(*lm_dirs, "weight", points=3, eval_items=EVAL_TOKENS, dtype="float64"))
    a, es = train_sample(lm_dirs[0], EVAL_TOKENS)
    b, _ = train_sample(lm_dirs[1], EVAL_TOKENS)
    # the aligned B (and the folded A) compute the same functions, up to float64 rounding
    assert rec["train_loss"][0] == pytest.approx(evaluate(a, es)["loss"], rel=1e-10)
    assert rec["train_loss"][-1] == pytest.approx(evaluate(b, es)["loss"], rel=1e-10)
    assert rec["train_barrier"] == barrier_metrics(rec["lambdas"], rec["train_loss"])["barrier"]


def test_a_vit_record_has_a_train_accuracy_curve_on_as_many_train_images(vit_dirs):
    rec = run_pair(RunConfig(*vit_dirs, "naive", points=3, eval_items=40, dtype="float64"))
    a, es = train_sample(vit_dirs[0], 40)
    b, _ = train_sample(vit_dirs[1], 40)
    assert rec["train_eval_images"] == es.size == 40 and rec["train_eval_set"] == "digits/train, 40 images"
    ra, rb = evaluate(a, es), evaluate(b, es)
    assert rec["train_loss"][0] == ra["loss"] and rec["train_loss"][-1] == rb["loss"]
    assert rec["train_accuracy"][0] == ra["accuracy"] and rec["train_accuracy"][-1] == rb["accuracy"]
    assert len(rec["train_accuracy"]) == 3 and record_problem(rec) is None


def test_the_lm_train_sample_is_bounded_and_never_larger_than_the_test_set(lm_dirs):
    m = load_named(lm_dirs[0], "float64")
    whole = eval_set_for(m, "test", None)  # the whole test split
    assert whole.size > TRAIN_EVAL_ITEMS
    assert train_eval_set_for(m, whole).size == TRAIN_EVAL_ITEMS
    small = eval_set_for(m, "test", 3 * N_CTX)
    train = train_eval_set_for(m, small)
    assert train.size == small.size and train.inputs.shape == small.inputs.shape
    assert "/train," in train.description and not train.inputs.equal(small.inputs)


def test_interpolate_walks_the_path_once_and_ticks_once_per_point(lm_dirs, monkeypatch):
    a, train = train_sample(lm_dirs[0], EVAL_TOKENS)
    b, _ = train_sample(lm_dirs[1], EVAL_TOKENS)
    test = eval_set_for(a, "test", EVAL_TOKENS)
    seen, models = [], []
    real = interpolate_module.evaluate

    def spy(model, es, *args, **kw):
        models.append((id(model), es.description))
        return real(model, es, *args, **kw)

    monkeypatch.setattr(interpolate_module, "evaluate", spy)
    r = interpolate(a, b, test, points=3, progress=lambda *t: seen.append(t), train_es=train)
    assert [(d, n) for d, n, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(", train " in msg for *_, msg in seen)
    assert [d for _, d in models] == [test.description, train.description] * 3
    assert len({i for i, _ in models}) == 1  # one work model: the train split reuses each point
    assert r["train_loss"][-1] == real(b, train)["loss"] and r["train_eval_set"] == train.description
    assert "train_loss" not in interpolate(a, b, test, points=2)  # no train set, no train fields


def test_a_run_stopped_after_a_point_s_test_evaluation_stops_before_its_train_one(lm_dirs, monkeypatch):
    a, train = train_sample(lm_dirs[0], EVAL_TOKENS)
    b, _ = train_sample(lm_dirs[1], EVAL_TOKENS)
    test = eval_set_for(a, "test", EVAL_TOKENS)
    token, calls = CancelToken(), []
    real = interpolate_module.evaluate

    def stop_after_first(model, es, *args, **kw):
        calls.append(es.description)
        out = real(model, es, *args, **kw)
        token.cancel()
        return out

    monkeypatch.setattr(interpolate_module, "evaluate", stop_after_first)
    with pytest.raises(Cancelled, match=r"interpolation, point 1/3, train split"):
        interpolate(a, b, test, points=3, train_es=train, cancel=token)
    assert calls == [test.description]


def test_old_records_without_a_train_curve_still_validate(naive_lm_record):
    old = {k: v for k, v in naive_lm_record.items() if k not in TRAIN_FIELDS}
    assert record_problem(old) is None


@pytest.mark.parametrize(("change", "problem"), [
    ({"train_loss": [1.0, 2.0]}, "record: train_loss must be one number per lambda (3), not 2 values."),
    ({"train_loss": [1.0, "x", 2.0]},
     "record: field 'train_loss' must be a list of at most 1,001 numbers (item 1 is the text 'x')."),
    ({"train_loss": 1.5}, "record: field 'train_loss' must be a list of at most 1,001 numbers (found 1.5)."),
    ({"train_barrier": None}, "record: field 'train_barrier' must be a number (found null)."),
    ({"train_accuracy": [0.5]}, "record: train_accuracy must be null or one number per lambda (3), not 1 value."),
    ({"train_eval_set": 3}, "record: field 'train_eval_set' must be text of at most 10,000 characters (found 3)."),
    ({"train_eval_tokens": 0},
     "record: field 'train_eval_tokens' must be a whole number from 1 to 1,000,000,000,000 (found 0)."),
    ({"train_eval_tokens": 1.5},
     "record: field 'train_eval_tokens' must be a whole number from 1 to 1,000,000,000,000 (found 1.5)."),
])
def test_a_broken_train_curve_is_refused_with_one_sentence(naive_lm_record, change, problem):
    assert record_problem(naive_lm_record | change) == problem


def test_train_fields_without_a_train_curve_are_refused(naive_lm_record):
    rec = {k: v for k, v in naive_lm_record.items() if k != "train_loss"}
    assert record_problem(rec) == "record: train_accuracy is given without train_loss."


def test_the_cli_prints_the_train_barrier_beside_the_test_one(lm_dirs, capsys):
    assert main(["interpolate", *lm_dirs, "--points", "3", "--eval-items", str(EVAL_TOKENS), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    test_line = next(line for line in out.splitlines() if line.startswith("barrier "))
    train_line = next(line for line in out.splitlines() if line.startswith("train barrier "))
    assert out.splitlines().index(train_line) == out.splitlines().index(test_line) + 1
    assert "(austen/train, 128 tokens" in train_line


def test_a_run_without_a_train_curve_has_no_train_fields_and_the_same_test_curve(lm_dirs, naive_lm_record):
    rec = run_pair(RunConfig(*lm_dirs, "naive", points=3, eval_items=EVAL_TOKENS, dtype="float64"), train_curve=False)
    assert not set(TRAIN_FIELDS) & set(rec) and record_problem(rec) is None
    assert rec["loss"] == naive_lm_record["loss"]  # the train split changes nothing of the test curve


def test_estimates_count_the_train_items_a_path_scores_at_every_point():
    arch = {"d_model": 32}
    ref = {"method": "weight", "arch": arch, "eval_tokens": 3000, "train_eval_tokens": 1000, "lambdas": [0.0] * 10,
           "timings": {"load": 0.5, "align": 2.0, "interpolate": 8.0}, "config": {}}
    per = 8.0 / ((3000 + 1000) * 10)  # the record's path scored test and train items at every point
    test = 500
    est = estimate_seconds("weight", arch, test, 21, 0, [ref], train_size=train_items("lm", test))
    assert est["interpolate"] == pytest.approx(per * 21 * (test + test))  # a small run's train sample: as large
    assert est["measure B"] == pytest.approx(per * test)  # B is measured on the test set only
    big = estimate_seconds("weight", arch, 65_536, 21, 0, [ref], train_size=train_items("lm", 65_536))
    assert big["interpolate"] == pytest.approx(per * 21 * (65_536 + TRAIN_EVAL_ITEMS))
    assert train_items("vit", 360) == 360
    no_train = {k: v for k, v in ref.items() if k != "train_eval_tokens"}
    assert estimate_seconds("weight", arch, test, 21, 0, [no_train])["interpolate"] == pytest.approx(8.0 / 3000 / 10 * 21 * test)
