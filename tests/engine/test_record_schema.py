"""The record schema (engine.results.RECORD_SCHEMA, record_problem, load_record): every record a reader
meets (the store, the run history, an earlier --out file) is checked field by field before use.

The mutations start from shipped records of cached_results/ (read, never written) and cover each class
a hostile or damaged file can hold: a 401-digit integer, a missing optional field (still a record), a
missing required field, a wrong type (text for a number, an object for a list), NaN and Infinity, and a
huge list. Each refusal is one sentence naming the field. Then the same classes through the CLI, and
two processes writing into one store and one run history at once.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from engine.errors import LMCError
from engine.results import (
    CACHE,
    MAX_POINTS,
    RECORD_REQUIRED,
    RECORD_SCHEMA,
    SCHEMA_VERSION,
    fields_problem,
    load_record,
    record_problem,
)

DUAL = CACHE / "lm-learned-s0__lm-learned-s1__dual.json"  # diagnostics, attribution, train curve
NAIVE = CACHE / "vit-learned-s0__vit-learned-s1__naive.json"  # accuracy, the folded curve
BIG = int("9" * 401)


@pytest.fixture(scope="module")
def shipped() -> dict[str, dict]:
    return {f.name: json.loads(f.read_text()) for f in (DUAL, NAIVE)}


@pytest.fixture
def dual(shipped) -> dict:
    return copy.deepcopy(shipped[DUAL.name])


@pytest.fixture
def naive(shipped) -> dict:
    return copy.deepcopy(shipped[NAIVE.name])


def test_the_schema_is_a_json_schema_and_every_shipped_record_meets_it():
    Draft202012Validator.check_schema(RECORD_SCHEMA)
    files = sorted(CACHE.glob("*__*__*.json")) + sorted((CACHE / "widen").glob("*.json"))
    assert len(files) >= 40
    for f in files:
        assert record_problem(json.loads(f.read_text()), f.name) is None


def test_a_record_of_an_older_schema_is_refused_in_one_sentence_naming_the_version(dual, tmp_path):
    assert dual["schema"] == SCHEMA_VERSION == 2
    old = {**dual, "schema": 1}
    assert record_problem(old, "run X") == (
        "run X was written with record schema 1; this engine reads schema 2 (run it again, or rebuild the "
        "store with `python -m engine cache build --force`).")
    assert fields_problem(old, "run X") == record_problem(old, "run X")  # a kept unfinished run too
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    with pytest.raises(LMCError, match="record schema 1; this engine reads schema 2"):
        load_record(f)
    assert record_problem({k: v for k, v in dual.items() if k != "schema"}, "run X") == \
        "run X is not a result record (missing schema)."
    assert "field 'schema' must be 2" in record_problem({**dual, "schema": 3}, "run X")


def _set(path: str, value):
    """A mutation setting the field at a dotted path (list indices as numbers) to `value`."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]

    def mutate(rec: dict) -> None:
        for p in parents:
            rec = rec[p]
        rec[last] = value
    return mutate


def _drop(path: str):
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]

    def mutate(rec: dict) -> None:
        for p in parents:
            rec = rec[p]
        del rec[last]
    return mutate


REFUSED = [
    # A 401-digit integer, wherever it is: no arithmetic ever sees it.
    (_set("eval_tokens", BIG), ("field 'eval_tokens' must be a whole number from 1 to 1,000,000,000,000 "
                               "(found an integer of 401 digits)")),
    (_set("barrier", BIG), "field 'barrier' must be a number (found an integer of 401 digits)"),
    (_set("loss.3", BIG), "field 'loss' must be a list of at most 1,001 numbers (item 3 is an integer of 401 digits)"),
    (_set("arch.d_model", BIG), ("field 'arch.d_model' must be a whole number from 0 to 1,048,576 "
                                "(found an integer of 401 digits)")),
    (_set("config.points", BIG), ("field 'config.points' must be a whole number from 2 to 1,001 "
                                 "(found an integer of 401 digits)")),
    (_set("timings.align", BIG), ("field 'timings.align' must be a finite number of at least 0 "
                                 "(found an integer of 401 digits)")),
    (_set("alignment.element.layers.1.mlp_perm.3", BIG),
     ("field 'alignment.element.layers[1].mlp_perm' must be a list of at most 1,048,576 whole numbers from 0 to "
     "1,048,576 (item 3 is an integer of 401 digits)")),
    (_set("alignment.diagnostics.history.step.2", BIG),
     ("field 'alignment.diagnostics.history.step' must be a list of at most 100,001 whole numbers from 0 to "
     "1,000,000,000,000 (item 2 is an integer of 401 digits)")),
    (_set("attribution.blocks.0.excess", BIG),
     "field 'attribution.blocks[0].excess' must be a number (found an integer of 401 digits)"),
    # A missing required field, at the top and inside an object a reader indexes.
    (_drop("barrier"), "is not a result record (missing barrier)"),
    (_drop("lambdas"), "is not a result record (missing lambdas)"),
    (_drop("train_eval_set"), "a record with train_loss needs train_eval_set"),
    (_drop("arch"), "a record with alignment needs arch"),
    (_drop("alignment.element"), "field 'alignment' must be an object with element (lacks element)"),
    (_drop("attribution.blocks.3.excess_a"),
     "field 'attribution.blocks[3]' must be an object with block, part, excess, excess_a, excess_b (lacks excess_a)"),
    (_drop("alignment.element.layers.2.head_perm"),
     "field 'alignment.element.layers[2]' must be an object with head_perm, kv_perm, mlp_perm (lacks head_perm)"),
    # A wrong type.
    (_set("barrier", "0.5"), "field 'barrier' must be a number (found the text '0.5')"),
    (_set("eval_tokens", True), "field 'eval_tokens' must be a whole number from 1 to 1,000,000,000,000 (found true)"),
    (_set("eval_tokens", 2048.0), ("field 'eval_tokens' must be a whole number from 1 to 1,000,000,000,000 "
                                  "(found 2048.0)")),
    (_set("lambdas", {"a": 1}), ("field 'lambdas' must be a list of 2 to 1,001 finite numbers from 0 to 1 "
                                "(found an object)")),
    (_set("loss.2", "x"), "field 'loss' must be a list of at most 1,001 numbers (item 2 is the text 'x')"),
    (_set("provenance", "x"), "field 'provenance' must be an object (found the text 'x')"),
    (_set("arch", "x"), ("field 'arch' must be an object with n_layers, d_model, n_heads, n_kv_heads, d_head, d_mlp "
                        "(found the text 'x')")),
    (_set("classes_left_out", [1]), "field 'classes_left_out' must be an object of sentences (found a list of 1 items)"),
    (_set("alignment.element.residual.matrix", {"0": [1.0]}),
     "field 'alignment.element.residual.matrix' must be a list of at most 1,048,576 lists of numbers (found an object)"),
    (_set("attribution.blocks.0.part", "ffn"), ("field 'attribution.blocks[0].part' must be all, attention or mlp "
                                               "(found the text 'ffn')")),
    (_set("config.eval_split", "train"), "field 'config.eval_split' must be val or test (found the text 'train')"),
    # NaN and Infinity where a setting belongs (a measurement may hold them: see below).
    (_set("lambdas.2", math.nan), ("field 'lambdas' must be a list of 2 to 1,001 finite numbers from 0 to 1 "
                                  "(item 2 is NaN)")),
    (_set("timings.align", math.inf), "field 'timings.align' must be a finite number of at least 0 (found Infinity)"),
    (_set("attribution.lambda", -math.inf), ("field 'attribution.lambda' must be a finite number from 0 to 1 "
                                            "(found -Infinity)")),
    # A huge list, a huge text.
    (_set("lambdas", [0.5] * 10**6), ("field 'lambdas' must be a list of 2 to 1,001 finite numbers from 0 to 1 "
                                     "(found a list of 1,000,000 items)")),
    (_set("alignment.diagnostics.sweeps", [{"sweep": 1, "objective": 0.5}] * 200_000),
     "field 'alignment.diagnostics.sweeps' must be a list of at most 100,001 sweeps (found a list of 200,000 items)"),
    (_set("eval_set", "x" * 20_000), "field 'eval_set' must be text of at most 10,000 characters"),
    # Fields that disagree with each other.
    (lambda r: r.__setitem__("loss", r["loss"][:-1]), "loss must be one number per lambda (21), not 20 values"),
    (lambda r: r.__setitem__("train_loss", r["train_loss"][:1]), ("train_loss must be one number per lambda (21), "
                                                                 "not 1 value")),
]


@pytest.mark.parametrize(("mutate", "says"), REFUSED, ids=[s[:48] for _, s in REFUSED])
def test_a_broken_field_is_one_sentence_naming_it(dual, mutate, says):
    mutate(dual)
    problem = record_problem(dual, "record X")
    assert problem is not None and says in problem, problem
    assert problem.startswith("record X") and problem.endswith(".") and problem.count(". ") == 0


def test_accuracy_and_the_folded_curve_are_checked_against_the_lambdas(naive):
    assert record_problem(naive) is None
    assert record_problem(naive | {"accuracy": naive["accuracy"][:3]}) == (
        "record: accuracy must be null or one number per lambda (21), not 3 values.")
    assert record_problem(naive | {"loss_folded": naive["loss_folded"] * 2}) == (
        "record: loss_folded must be one number per lambda (21), not 42 values.")
    assert record_problem(naive | {"accuracy_drop": None}) == (
        "record: a record with accuracy needs a numeric accuracy_drop.")
    assert record_problem(naive | {"accuracy_folded": [0.5, "x"]}) == (
        "record: field 'accuracy_folded' must be a list of at most 1,001 numbers (item 1 is the text 'x').")


@pytest.mark.parametrize("field", ["provenance", "eval_set", "alignment", "attribution", "train_loss",
                                   "timings", "created", "config", "endpoint_check", "classes_left_out"])
def test_a_missing_optional_field_is_still_a_record(dual, field):
    rec = {k: v for k, v in dual.items() if k != field}
    if field == "train_loss":  # the train curve goes as a whole (records from before it have none)
        rec = {k: v for k, v in rec.items() if not k.startswith("train_")}
    assert record_problem(rec) is None


def test_every_required_field_is_named_when_missing(dual):
    for k in RECORD_REQUIRED:
        assert record_problem({f: v for f, v in dual.items() if f != k}) == (
            f"record is not a result record (missing {k}).")
    assert record_problem([1, 2]) == "record holds a JSON list, not a result record."


def test_a_diverged_measurement_may_be_nan_a_setting_may_not(dual):
    """What the engine writes for a run whose interpolated models overflow stays readable."""
    loss = [*dual["loss"][:10], math.nan, *dual["loss"][11:]]
    assert record_problem(dual | {"loss": loss, "barrier": math.nan, "midpoint_barrier": math.inf}) is None
    assert "item 1 is NaN" in record_problem(dual | {"lambdas": [0.0, math.nan, *dual["lambdas"][2:]]})


def test_a_record_not_yet_written_holds_tuples(dual):
    assert record_problem(dual | {"config": dual["config"] | {"classes": ("heads", "mlp"), "extra": ()}}) is None


def test_fields_problem_asks_for_no_field_but_checks_those_present(dual):
    assert fields_problem({"method": "weight"}) is None
    assert fields_problem({"arch": dual["arch"] | {"n_heads": BIG}}) == (
        "record: field 'arch.n_heads' must be a whole number from 0 to 1,048,576 (found an integer of 401 digits).")


def test_load_record_names_the_file_and_the_field(dual, tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(dual | {"eval_tokens": BIG}))
    with pytest.raises(LMCError) as e:
        load_record(f)
    assert str(e.value) == (f"Result file {f}: field 'eval_tokens' must be a whole number from 1 to "
                            "1,000,000,000,000 (found an integer of 401 digits).")
    f.write_text(json.dumps(dual).replace('"barrier": ', '"barrier": NaN, "x": ', 1))  # NaN token, as Python writes
    assert math.isnan(load_record(f)["barrier"])
    f.write_text(json.dumps(dual).replace('"lambdas": [0.0', '"lambdas": [Infinity', 1))
    with pytest.raises(LMCError, match=r"field 'lambdas' .* \(item 0 is Infinity\)\.$"):
        load_record(f)


def test_a_record_file_larger_than_any_record_is_refused_unread(dual, tmp_path, monkeypatch):
    from engine import results

    f = tmp_path / "r.json"
    f.write_text(json.dumps(dual))
    monkeypatch.setattr(results, "MAX_RECORD_BYTES", 1000)
    with pytest.raises(LMCError, match=rf"^Result file {f} is [\d,]+ bytes, too large"):
        load_record(f)


def test_the_limits_match_the_run_config():
    assert RECORD_SCHEMA["properties"]["lambdas"]["maxItems"] == MAX_POINTS
    assert RECORD_SCHEMA["properties"]["config"]["properties"]["points"]["maximum"] == MAX_POINTS


# ---------------------------------------------------------------------------------------------
# Probes through the CLI: the store (`cache table`), the run history (`runs list`, `runs show`) and an
# earlier --out record. A broken record never ends in "internal error": the store and `runs list`
# skip it with one warning naming the file and the field; `runs show` and --out refuse it in one line.

RUN_ID = "20261201T032634Z-a3f29c"
STORED = "lm-learned-s0__lm-learned-s1__dual.json"  # a zoo pair: `cache table` looks it up by name

PROBES = {
    "401-digit integer": (_set("eval_tokens", BIG), "field 'eval_tokens' must be a whole number"),
    "401-digit barrier": (_set("barrier", BIG), "field 'barrier' must be a number"),
    "401-digit loss": (_set("loss.3", BIG), "field 'loss' must be a list of at most 1,001 numbers"),
    "missing required field": (_drop("midpoint_barrier"), "is not a result record (missing midpoint_barrier)"),
    "string for a number": (_set("endpoint_loss_a", "1.5"), "field 'endpoint_loss_a' must be a number"),
    "dict for a list": (_set("loss", {"0": 1.0}), "field 'loss' must be a list"),
    "string for an object": (_set("provenance", "cpu"), "field 'provenance' must be an object"),
    "text for a folded curve": (lambda r: r.update(loss_folded="x", barrier_folded=0.1, midpoint_barrier_folded=0.1,
                                                   folded_rewrite="fold_norms"), "field 'loss_folded' must be a list"),
    "Infinity in lambdas": (_set("lambdas.1", math.inf), "field 'lambdas' must be a list of 2 to 1,001 finite"),
    "huge list": (lambda r: r.update(lambdas=[0.0] * 10**6, loss=[1.0] * 10**6), "found a list of 1,000,000 items"),
}


def _write(f: Path, rec: dict) -> Path:
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(rec))  # Python writes NaN and Infinity as the engine does
    return f


@pytest.fixture
def homes(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("LMC_EXPLORER_HOME", str(tmp_path / "home"))
    return tmp_path / "store", tmp_path / "home" / "runs"


def _kept(rec: dict) -> dict:
    return rec | {"run": {"id": RUN_ID, "status": "done", "saved": "2026-12-01T03:26:34.000000Z"}}


def _no_internal_error(rc: int, err: str) -> None:
    assert rc in (0, 2) and "internal error" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("probe", PROBES)
def test_cache_table_skips_a_broken_record_with_one_warning(probe, dual, homes, capsys):
    from engine.cli import main

    mutate, says = PROBES[probe]
    mutate(dual)
    f = _write(homes[0] / STORED, dual)
    rc = main(["cache", "table"])
    out, err = capsys.readouterr()
    _no_internal_error(rc, err)
    lines = err.strip().splitlines()
    assert rc == 0 and len(lines) == 1 and lines[0].startswith(f"warning: skipped a cached record: Result file {f}")
    assert says in lines[0]
    row = next(line for line in out.splitlines() if line.startswith("| lm-learned-s0 / lm-learned-s1 |"))
    assert set(row.strip("| ").split(" | ")[1:]) == {"-"}  # the broken record is a "-", the table stands


@pytest.mark.parametrize("probe", PROBES)
def test_the_run_history_skips_a_broken_run_and_refuses_to_show_it(probe, dual, shipped, homes, capsys):
    from engine.cli import main

    mutate, says = PROBES[probe]
    mutate(dual)
    f = _write(homes[1] / f"run-{RUN_ID}.json", _kept(dual))
    good_id = "20261201T040000Z-00beef"
    _write(homes[1] / f"run-{good_id}.json", _kept(shipped[DUAL.name]) | {
        "run": {"id": good_id, "status": "done", "saved": "2026-12-01T04:00:00.000000Z"}})
    rc = main(["runs", "list"])
    out, err = capsys.readouterr()
    _no_internal_error(rc, err)
    lines = err.strip().splitlines()
    assert rc == 0 and len(lines) == 1 and lines[0].startswith("warning: ") and str(f) in lines[0] and says in lines[0]
    assert good_id in out and RUN_ID not in out and "1 run(s) in" in out
    for argv in (["runs", "show", RUN_ID], ["runs", "show", RUN_ID, "--json"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        _no_internal_error(rc, err)
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and str(f) in err
        assert says in err


def test_a_nan_measurement_is_shown_and_written_as_null(dual, homes, capsys):
    """NaN is what the engine writes for a diverged run: shown as nan, and null in strict JSON."""
    from engine.cli import main

    _write(homes[0] / STORED, dual | {"barrier": math.nan})
    _write(homes[1] / f"run-{RUN_ID}.json", _kept(dual | {"barrier": math.nan}))
    assert main(["cache", "table"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and f"| nan / {dual['midpoint_barrier']:.3f}" in out
    assert main(["runs", "show", RUN_ID, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["barrier"] is None


@pytest.mark.parametrize("probe", PROBES)
def test_an_earlier_out_record_that_breaks_the_schema_is_not_replaced(probe, dual, homes, tmp_path, capsys):
    from engine.cli import main

    mutate, _ = PROBES[probe]
    mutate(dual)
    earlier = _write(tmp_path / "earlier.json", dual)
    before = earlier.read_bytes()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rc = main(["interpolate", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(earlier), "--device", "cpu"])
    _out, err = capsys.readouterr()
    _no_internal_error(rc, err)
    assert rc == 2 and err == (f"error: --out {earlier} already holds a file that is not a result record of this "
                               "tool; choose another file name (only an earlier result record is replaced).\n")
    assert earlier.read_bytes() == before


def test_the_real_entry_point_skips_a_401_digit_record(dual, tmp_path):
    import os
    import subprocess
    import sys

    f = _write(tmp_path / "store" / STORED, dual | {"eval_tokens": BIG})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMC_CACHE_DIR": str(tmp_path / "store"),
           "LMC_EXPLORER_HOME": str(tmp_path / "home")}
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "engine", "cache", "table"], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300, check=False)
    assert p.returncode == 0 and p.stderr.strip() == (
        f"warning: skipped a cached record: Result file {f}: field 'eval_tokens' must be a whole number from 1 to "
        "1,000,000,000,000 (found an integer of 401 digits).")


def test_a_record_missing_optional_fields_is_shown_whole(dual, homes, capsys):
    from engine.cli import main

    optional = ("provenance", "eval_set", "arch", "alignment", "attribution", "timings", "created", "config",
                "classes", "classes_left_out", "endpoint_check")
    rec = {k: v for k, v in dual.items() if k not in optional}
    _write(homes[0] / STORED, rec)
    _write(homes[1] / f"run-{RUN_ID}.json", _kept(rec))
    assert main(["cache", "table"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and f"| {dual['barrier']:.3f} / {dual['midpoint_barrier']:.3f}" in out
    assert main(["runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and RUN_ID in out and f"{dual['barrier']:8.4f}" in out
    assert main(["runs", "show", RUN_ID]) == 0
    out, err = capsys.readouterr()
    assert err == "" and f"barrier {dual['barrier']:.4f}" in out and "created -" in out


# ---------------------------------------------------------------------------------------------
# Concurrent writers: two processes writing records into one store and one run history at once (two
# cache builds, two browser tabs keeping runs). Every write is a temporary file renamed over its
# target, so no reader ever sees a torn file, and no record is lost.

WRITES = 20


def _write_many(tag: str, rec: dict, store_dir: str, home: str, shared: str, start) -> None:
    """One writer: WRITES records into the store (each rebuilding the manifest), WRITES runs into the
    history, and every record once more over one shared file the other writer also writes."""
    from engine.history import save_run
    from engine.results import store, write_record

    start.wait()  # both writers begin together
    for i in range(WRITES):
        mine = rec | {"model_a": f"{tag}-{i}", "created": f"{tag}-{i}"}
        store(mine, Path(store_dir))
        save_run(mine, root=home)
        write_record(mine, Path(shared))


@pytest.mark.slow
def test_two_writers_at_once_tear_no_file_and_lose_no_record(dual, tmp_path, monkeypatch):
    import multiprocessing

    from engine.history import scan_runs
    from engine.results import list_cached, scan_store

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    rec = {k: v for k, v in dual.items() if k not in ("alignment", "arch")}  # 20 kB: a write takes a while
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    shared = tmp_path / "shared" / "record.json"
    writers = [ctx.Process(target=_write_many, args=(tag, rec, str(tmp_path / "store"), str(tmp_path / "home"),
                                                       str(shared), start)) for tag in ("p", "q")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=600)
    assert [w.exitcode for w in writers] == [0, 0]
    expected = {f"{tag}-{i}" for tag in ("p", "q") for i in range(WRITES)}
    # The store: every record whole, none lost, the manifest listing them all, no temporary file left.
    good, problems = scan_store(tmp_path / "store")
    assert problems == [] and {r["model_a"] for r in good.values()} == expected
    assert {r["model_a"] for r in list_cached(tmp_path / "store")} == expected
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted([*good, "manifest.json"])
    # The history: every run whole and kept once.
    runs, problems = scan_runs(tmp_path / "home")
    assert problems == [] and sorted(r["created"] for r in runs) == sorted(expected)
    assert len(list((tmp_path / "home").iterdir())) == 2 * WRITES
    # The shared file: one writer's whole record, the last one of either.
    assert record_problem(json.loads(shared.read_text())) is None
    assert json.loads(shared.read_text())["created"] in {f"{tag}-{WRITES - 1}" for tag in ("p", "q")}
    assert [p.name for p in shared.parent.iterdir()] == ["record.json"]
