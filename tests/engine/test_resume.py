"""A learned or dual optimisation interrupted and started again resumes at its last validation check and ends
where the uninterrupted run ends, bit for bit: histories, curve, flips and the kept elements
(engine.align.resume). Another run's state, or a torn one, is not resumed; a finished optimisation is
returned from its state without running; `cache build` resumes a killed run and deletes the state once
the record is stored."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from ref_models import byte_tiny, rope_pair

from engine.align import learned, resume
from engine.align.context import AlignContext
from engine.align.learned import Settings, optimise
from engine.align.resume import Checkpoint
from engine.symmetry import identity

# big permutation steps and lam over the whole path: the hard permutations flip, so the test sees them restored
ST = Settings(lr_perm=2.0, lambdas="uniform", eval_every=2, candidates=4, patience=None)


@pytest.fixture(autouse=True)
def small_validation(monkeypatch):
    monkeypatch.setattr(learned, "VAL_ITEMS", {"lm": 256})


class Killed(Exception):
    pass


def kill_at(step: int):
    def on_check(s, *_):
        if s == step:
            raise Killed
    return on_check


def same(res: dict, ref: dict) -> None:
    """The resumed result is the uninterrupted one: everything but the clock and the memory."""
    for key in ("history", "curve", "resolves", "permutation_solves", "best_step", "best_val_barrier",
                "best_val_midpoint_loss", "steps_done", "stopped", "settings"):
        got, want = res[key], ref[key]
        if key == "history":
            got, want = ({k: v for k, v in h.items() if k != "seconds"} for h in (got, want))
        assert got == want, key
    for side in ("g_a", "g_b"):
        if ref[side] is None:
            assert res[side] is None
            continue
        for el, el0 in zip(res[side].layers, ref[side].layers):
            for name in ("head_perm", "qk", "vo", "mlp_perm", "mlp_scale", "kv_perm"):
                assert torch.equal(getattr(el, name), getattr(el0, name)), name
        assert torch.equal(res[side].residual, ref[side].residual)


@pytest.mark.parametrize("dual", [False, True])
def test_an_interrupted_optimisation_resumes_where_it_stopped_and_ends_as_the_whole_run(tmp_path, dual):
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    ref = optimise(AlignContext(pair, kinds, steps=12), g0, dual=dual, steps=12, settings=ST)
    assert sum(ref["resolves"]["flips_heads"]) + sum(ref["resolves"]["flips_mlp"]) > 0  # permutations did move
    ck = Checkpoint(tmp_path / "state", run="r1")
    ctx = AlignContext(pair, kinds, steps=12, checkpoint=ck)
    with pytest.raises(Killed):  # killed inside the check at step 8: the state of step 6 is on disk
        optimise(ctx, g0, dual=dual, steps=12, settings=ST, on_check=kill_at(8))
    phase = "dual" if dual else "learned"
    meta = json.loads((tmp_path / "state" / f"{phase}.json").read_text())
    assert meta["step"] == 6 and not meta["finished"]
    res = optimise(ctx, g0, dual=dual, steps=12, settings=ST)
    same(res, ref)
    assert res["resumed_at"] == [6] and ref["resumed_at"] == []
    # the run's seconds count the killed process's up to its state (the aligners add them to their own clock)
    assert ref["earlier_seconds"] == 0.0 and res["earlier_seconds"] == meta["seconds"] > 0
    # finished: the state holds the result, which is returned without a step being run
    final = json.loads((tmp_path / "state" / f"{phase}.json").read_text())
    assert final["finished"]
    again = optimise(ctx, g0, dual=dual, steps=12, settings=ST, on_check=kill_at(0))  # no check runs at all
    same(again, ref)
    assert again["earlier_seconds"] == final["seconds"] > meta["seconds"]  # all of it was spent earlier


def test_a_run_without_mlp_permutations_resumes_too(tmp_path):
    pair, kinds = rope_pair()
    kinds = kinds - {"mlp"}  # no candidate graphs in the state
    g0 = identity(pair.arch)
    ref = optimise(AlignContext(pair, kinds, steps=8), g0, dual=True, steps=8, settings=ST)
    ctx = AlignContext(pair, kinds, steps=8, checkpoint=Checkpoint(tmp_path / "state", run="r1"))
    with pytest.raises(Killed):
        optimise(ctx, g0, dual=True, steps=8, settings=ST, on_check=kill_at(6))
    res = optimise(ctx, g0, dual=True, steps=8, settings=ST)
    assert res["resumed_at"] == [4]
    same(res, ref)


def test_another_run_or_optimisation_or_a_torn_state_starts_from_step_0(tmp_path):
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    ref = optimise(AlignContext(pair, kinds, steps=8), g0, dual=False, steps=8, settings=ST)
    ck = Checkpoint(tmp_path / "state", run="r1")
    with pytest.raises(Killed):
        optimise(AlignContext(pair, kinds, steps=8, checkpoint=ck), g0, dual=False, steps=8, settings=ST,
                 on_check=kill_at(6))
    for other in (AlignContext(pair, kinds, steps=8, checkpoint=replace(ck, run="r2")),  # another config
                  AlignContext(pair, kinds, steps=8, checkpoint=ck, seed=1)):  # another optimisation
        res = optimise(other, g0, dual=False, steps=8, settings=ST)
        assert res["resumed_at"] == []
    res = optimise(AlignContext(pair, kinds, steps=8, checkpoint=ck), g0, dual=False, steps=8, settings=ST)
    assert res["resumed_at"] == []  # the seed-1 run had replaced the state: this one starts afresh
    same(res, ref)
    # torn: the JSON names a step the tensors do not hold
    with pytest.raises(Killed):
        optimise(AlignContext(pair, kinds, steps=8, checkpoint=replace(ck, run="r3")), g0, dual=False, steps=8,
                 settings=ST, on_check=kill_at(6))
    f = tmp_path / "state" / "learned.json"
    meta = json.loads(f.read_text())
    f.write_text(json.dumps(meta | {"step": 2}))
    assert resume.load(replace(ck, run="r3"), "learned", meta["identity"]) is None
    res = optimise(AlignContext(pair, kinds, steps=8, checkpoint=replace(ck, run="r3")), g0, dual=False, steps=8,
                   settings=ST)
    assert res["resumed_at"] == []
    same(res, ref)


def test_keep_heads_is_part_of_the_run_s_identity_and_named_only_when_set(tmp_path):
    """A --keep-heads run resumes as itself; a run without it never takes its state, nor it theirs; and a run
    without it keeps the identity it had before the option existed (a state saved then still resumes)."""
    pair, kinds = rope_pair()
    g0 = identity(pair.arch)
    kept = replace(ST, keep_heads=True)
    ref = optimise(AlignContext(pair, kinds, steps=8), g0, dual=True, steps=8, settings=kept)
    ck = Checkpoint(tmp_path / "state", run="r1")
    with pytest.raises(Killed):
        optimise(AlignContext(pair, kinds, steps=8, checkpoint=ck), g0, dual=True, steps=8, settings=kept,
                 on_check=kill_at(6))
    meta = json.loads((tmp_path / "state" / "dual.json").read_text())
    assert meta["identity"]["settings"]["keep_heads"] is True
    res = optimise(AlignContext(pair, kinds, steps=8, checkpoint=ck), g0, dual=True, steps=8, settings=kept)
    assert res["resumed_at"] == [4]
    same(res, ref)
    off = replace(ck, run="r2")
    with pytest.raises(Killed):
        optimise(AlignContext(pair, kinds, steps=8, checkpoint=off), g0, dual=True, steps=8, settings=ST,
                 on_check=kill_at(6))
    meta = json.loads((tmp_path / "state" / "dual.json").read_text())
    assert "keep_heads" not in meta["identity"]["settings"] and "candidates" in meta["identity"]["settings"]
    res = optimise(AlignContext(pair, kinds, steps=8, checkpoint=off), g0, dual=True, steps=8, settings=kept)
    assert res["resumed_at"] == []  # the state of a run that learns its heads is not this one's


def test_cache_build_resumes_a_killed_dual_run_and_deletes_its_state(tmp_path, monkeypatch):
    from engine import builders
    from engine.api import build_cache
    from engine.models import save_model
    from engine.models.reference import build

    for s in (0, 1):
        save_model(build(byte_tiny(pe="rope", n_ctx=32), seed=s), tmp_path / "zoo" / f"lm-rope-s{s}")
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setattr(builders, "CONVERGED", {("lm", "small"): (10, None)})  # a check every step
    only = [("lm-rope-s0", "lm-rope-s1")]
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "whole"))
    whole = build_cache(methods=["dual"], eval_items=256, only=only)[0]
    assert not (tmp_path / "whole" / ".states").exists()  # deleted once the record was stored

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "killed"))
    real_save, saves = resume.save, []

    def save_then_die(ck, phase, identity, meta, tensors):  # killed after the one-sided comparison's 3rd check
        real_save(ck, phase, identity, meta, tensors)
        saves.append((phase, meta["step"], meta["finished"]))
        if phase == "one_sided" and meta["step"] == 3:
            raise Killed

    monkeypatch.setattr(resume, "save", save_then_die)
    with pytest.raises(Killed):
        build_cache(methods=["dual"], eval_items=256, only=only)
    assert ("dual", 10, True) in saves  # dual's own optimisation had finished and is kept as such
    monkeypatch.setattr(resume, "save", real_save)
    rec = build_cache(methods=["dual"], eval_items=256, only=only)[0]
    d, d0 = rec["alignment"]["diagnostics"], whole["alignment"]["diagnostics"]
    assert d["resumed_at"] == [] and d0["resumed_at"] == []  # dual's own run was taken whole from its state
    comp, comp0 = d["one_sided_same_budget"], d0["one_sided_same_budget"]
    assert {k: v for k, v in comp["history"].items() if k != "seconds"} == {
        k: v for k, v in comp0["history"].items() if k != "seconds"}
    assert d["history"]["val_barrier"] == d0["history"]["val_barrier"]
    assert rec["barrier"] == whole["barrier"] and rec["alignment"]["element"] == whole["alignment"]["element"]
    assert not (tmp_path / "killed" / ".states").exists()


def test_align_resume_resumes_a_killed_cli_run_and_refuses_what_is_not_a_state_in_one_sentence(tmp_path, monkeypatch,
                                                                                               capsys):
    from engine.cli import main
    from engine.models import save_model
    from engine.models.reference import build

    for s in (0, 1):
        save_model(build(byte_tiny(pe="rope", n_ctx=32), seed=s), tmp_path / f"m{s}")
    run = ["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--method", "learned", "--steps", "6",
           "--eval-items", "256", "--points", "3", "--no-attribution"]
    assert main(run + ["--out", str(tmp_path / "whole.json")]) == 0
    real_save = resume.save

    def save_then_die(ck, phase, identity, meta, tensors):
        real_save(ck, phase, identity, meta, tensors)
        if meta["step"] == 3:
            raise Killed

    monkeypatch.setattr(resume, "save", save_then_die)
    state = tmp_path / "state"
    assert main(run + ["--resume", str(state), "--out", str(tmp_path / "r.json")]) != 0  # the run dies at step 3
    assert sorted(p.name for p in state.iterdir()) == ["learned.json", "learned.safetensors"]
    monkeypatch.setattr(resume, "save", real_save)
    assert main(run + ["--resume", str(state), "--out", str(tmp_path / "r.json")]) == 0
    rec, whole = (json.loads((tmp_path / f).read_text()) for f in ("r.json", "whole.json"))
    d, d0 = rec["alignment"]["diagnostics"], whole["alignment"]["diagnostics"]
    assert d["resumed_at"] == [3] and d0["resumed_at"] == []
    assert d["history"]["val_barrier"] == d0["history"]["val_barrier"] and rec["barrier"] == whole["barrier"]
    assert not state.exists()  # deleted with the run's end
    capsys.readouterr()
    # refused before any work, in one sentence: a method without an optimisation, a file, a directory of other files
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    weight = ["align", str(tmp_path / "m0"), str(tmp_path / "m1"), "--method", "weight", "--resume", str(state)]
    for args, says in ((weight, "weight has no optimisation"),
                       (run + ["--resume", str(tmp_path / "whole.json")], "is not a directory"),
                       (run + ["--resume", str(tmp_path / "notes")], "holds files that are not an alignment state (mine.txt)"),
                       (run + ["--resume", str(tmp_path / "m0")], "is an input model directory")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
