"""A run's element saved in full precision (`align --save-element`) and a later learned or dual run started
from it (`--start FILE`, engine.align.start): the file round-trips every tensor exactly, and the run started
from it begins where the saved run ended, on the same validation batch, from a one-sided or a dual file."""

from __future__ import annotations

import json

import pytest
import torch
from ref_models import rope_pair, tiny

from engine.align import learned
from engine.align.context import AlignContext
from engine.align.learned import Settings, optimise, relative, starting_point
from engine.align.pair import rewrite_for
from engine.align.start import check_start, is_element_file, read_element, save_element
from engine.cli import main
from engine.errors import LMCError
from engine.models import reference, save_model
from engine.symmetry import identity, sample

ST = Settings(lambdas="uniform", eval_every=2, candidates=4, patience=None)


@pytest.fixture(autouse=True)
def small_validation(monkeypatch):
    monkeypatch.setattr(learned, "VAL_ITEMS", {"lm": 256})


def same_element(g, h) -> None:
    for el, el0 in zip(g.layers, h.layers, strict=True):
        for name in ("head_perm", "qk", "vo", "mlp_perm", "mlp_scale", "kv_perm"):
            assert torch.equal(getattr(el, name), getattr(el0, name)), name
    assert torch.equal(g.residual, h.residual)


def test_an_element_file_holds_both_sides_exactly(tmp_path):
    pair, kinds = rope_pair()
    g_a, g_b = sample(pair.arch, kinds, seed=3), sample(pair.arch, kinds, seed=4)
    f = tmp_path / "e.safetensors"
    save_element(f, pair.arch, g_b, g_a, {"method": "dual", "classes": sorted(kinds), "rewrite": pair.rewrite})
    assert is_element_file(f)
    ef = read_element(f, pair.arch, kinds)
    same_element(ef.g_b, g_b)
    same_element(ef.g_a, g_a)
    assert ef.meta["dual"] and ef.meta["method"] == "dual" and len(ef.sha256) == 64


def test_the_coordinates_of_an_element_are_checked_before_any_model_loads(tmp_path):
    """The rewrite a run's classes will make (pair.rewrite_for, from the architecture alone) is the one
    prepare_pair makes, and an element found in other coordinates is refused on its header."""
    pair, kinds = rope_pair()
    assert rewrite_for(pair.arch, kinds) == pair.rewrite == "fold_norms"
    no_rotation = kinds - {"residual_orth"}
    assert rewrite_for(pair.arch, no_rotation) == ""
    f = tmp_path / "e.safetensors"
    save_element(f, pair.arch, identity(pair.arch), None,
                 {"method": "learned", "classes": sorted(no_rotation), "rewrite": ""})
    assert check_start(f, pair.arch, no_rotation, rewrite="")["rewrite"] == ""
    with pytest.raises(LMCError, match="aligned on the models as they are, this run's classes align them with "
                                       "their norm gains folded"):
        check_start(f, pair.arch, kinds, rewrite=rewrite_for(pair.arch, kinds))


@pytest.mark.parametrize("first_dual", [False, True])
def test_a_run_started_from_a_saved_element_begins_where_that_run_ended(tmp_path, first_dual):
    pair, kinds = rope_pair()
    first = optimise(AlignContext(pair, kinds, steps=6), identity(pair.arch), dual=first_dual, steps=6, settings=ST)
    g_a, g_b = first["g_a"], first["g_b"]  # each side's own element (None: A did not move)
    f = tmp_path / "e.safetensors"
    save_element(f, pair.arch, g_b, g_a, {"classes": sorted(kinds), "rewrite": pair.rewrite})
    ctx = AlignContext(pair, kinds, steps=2, learned=Settings(start=str(f)))
    s = starting_point(ctx)
    assert s.file["sha256"] and (s.g_a is None) == (not first_dual)
    for dual in (False, True):
        res = optimise(ctx, s.g_b if dual else s.one_sided(pair.arch), dual=dual, steps=2, settings=ST,
                       g0_a=s.g_a if dual else None, start_file=s.file)
        # the first check is the start's: the element the first run kept, measured on the same batch
        assert res["history"]["val_barrier"][0] == pytest.approx(first["best_val_barrier"], rel=1e-9, abs=1e-12)
        assert res["history"]["step"][0] == 0
    # the relative element survives the trip through B's own: g_A^{-1} (g_A rel) is rel to rounding
    back = relative(pair.arch, s.g_a, s.g_b) if first_dual else s.g_b
    want = relative(pair.arch, g_a, g_b)
    for el, el0 in zip(back.layers, want.layers):
        assert torch.equal(el.head_perm, el0.head_perm) and torch.equal(el.mlp_perm, el0.mlp_perm)
        assert torch.allclose(el.qk, el0.qk, rtol=0, atol=1e-12) and torch.allclose(el.vo, el0.vo, rtol=0, atol=1e-12)


def test_the_cli_saves_an_element_and_a_later_run_goes_on_from_it(tmp_path, monkeypatch, capsys):
    cfg = tiny(vocab_size=256)
    for s in (0, 1):
        save_model(reference.build(cfg, seed=s), tmp_path / f"m{s}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(learned, "EVALS", 2)  # a check every other step of two
    run = ["align", "m0", "m1", "--points", "3", "--eval-items", "128", "--no-attribution", "--steps", "2"]
    assert main([*run, "--method", "learned", "--save-element", "e1.safetensors", "--out", "r1.json"]) == 0
    assert main([*run, "--method", "dual", "--start", "e1.safetensors", "--save-element", "e2.safetensors",
                 "--out", "r2.json"]) == 0
    assert main([*run, "--method", "learned", "--start", "e2.safetensors", "--out", "r3.json"]) == 0
    out = capsys.readouterr().out
    assert "started from e1.safetensors (learned, 2 steps" in out
    r1, r2, r3 = (json.loads((tmp_path / f"r{i}.json").read_text()) for i in (1, 2, 3))
    for prev, rec, f in ((r1, r2, "e1.safetensors"), (r2, r3, "e2.safetensors")):
        d, d0 = rec["alignment"]["diagnostics"], prev["alignment"]["diagnostics"]
        assert d["settings"]["start"] == f
        assert d["start_element"]["sha256"] == prev["element_file"]["sha256"]
        assert d["start_element"]["method"] == prev["method"] and d["start_element"]["barrier"] == prev["barrier"]
        assert d["history"]["val_barrier"][0] == pytest.approx(d0["best_val_barrier"], rel=1e-6)
    arch = reference.build(cfg).arch
    e2 = read_element(tmp_path / "e2.safetensors", arch, frozenset(r2["classes"]))
    assert e2.g_a is not None and e2.meta["model_a"] == "m0" and e2.meta["steps"] == 2
    # the file keeps B's own element; A's inverse times it is the relative element the record describes
    rel = relative(arch, e2.g_a, e2.g_b)
    assert r2["alignment"]["element"]["layers"][0]["mlp_perm"] == rel.layers[0].mlp_perm.tolist()
    assert r2["alignment"]["element_a"]["layers"][0]["head_perm"] == e2.g_a.layers[0].head_perm.tolist()


def test_a_saved_state_resumes_only_the_run_of_the_same_start_file(tmp_path):
    from engine.align.resume import Checkpoint

    pair, kinds = rope_pair()
    files = []
    for seed in (5, 6):  # two different starts of the same shape
        f = tmp_path / f"e{seed}.safetensors"
        save_element(f, pair.arch, sample(pair.arch, kinds - {"heads", "mlp"}, seed=seed), None,
                     {"classes": sorted(kinds), "rewrite": pair.rewrite})
        files.append(f)

    def run(f, on_check=None):
        ctx = AlignContext(pair, kinds, steps=6, learned=Settings(start=str(f)),
                           checkpoint=Checkpoint(tmp_path / "state", run="r1"))
        s = starting_point(ctx)
        return optimise(ctx, s.g_b, dual=False, steps=6, settings=ST, start_file=s.file, on_check=on_check)

    class Killed(Exception):
        pass

    def kill_at_4(step, *_):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        run(files[0], kill_at_4)
    assert run(files[1])["resumed_at"] == []  # another start: its own run from step 0
    with pytest.raises(Killed):
        run(files[0], kill_at_4)
    assert run(files[0])["resumed_at"] == [2]  # the same start: resumed at its last check
