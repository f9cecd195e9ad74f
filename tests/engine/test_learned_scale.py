"""Learned and dual matching at scale: the time budget, the memory record, the dual identity in the
model's dtype, and a GPT-2-shaped pair with the full 50,257-token vocabulary (the `slow` marker:
about 20 s; `-m "not slow"` leaves it out)."""

from __future__ import annotations

import pytest
import torch
from ref_models import rope_pair

from engine.align import dual, learned
from engine.align.context import AlignContext
from engine.align.dual import dual_identity
from engine.align.learned import Settings, align_learned, still_optimal
from engine.align.options import DualOptions
from engine.align.run import align, endpoint_check
from engine.align.solvers import assignment, perm_matrix
from engine.align.weight import weight_match
from engine.evaluate import eval_set_for, evaluate
from engine.models import load_model
from engine.symmetry import sample

F64 = torch.float64


def latent_count(arch, kinds) -> int:
    """Entries of every latent of learned.Transform for the default classes (no mlp_scale)."""
    L, h, hkv, d, m, D = arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp, arch.d_model
    n = L * (h * h + m * min(m, learned.DEFAULT_CANDIDATES[arch.task]) + hkv * d * d)  # Z_heads, Z_mlp (candidate graph), E_vo
    if arch.pe == "rope":  # full RoPE: one (log-modulus, phase) latent per pair, no GL(d) latent
        assert arch.rotary_dim == d
        n += L * hkv * arch.rotary_dim
    else:
        n += L * hkv * d * d  # E_qk
    return n + D * D  # E_res (residual_orth) or Z_res (residual_perm)


def test_a_certified_permutation_is_the_hungarian_answer():
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        perm = torch.randperm(6, generator=gen)
        Z = perm_matrix(perm) + 0.4 * torch.randn(6, 6, generator=gen, dtype=F64)  # [6, 6]
        ok = still_optimal(Z, perm)
        seen.add(ok)
        if ok:
            assert torch.equal(assignment(Z), perm)
        else:  # some row prefers another column; the Hungarian then often moves away from perm
            assert bool((Z.max(1).values > Z[torch.arange(6), perm]).any())
    assert seen == {True, False}


def test_time_budget_stops_the_optimisation_and_the_record_says_so():
    pair, kinds = rope_pair()
    assert kinds == {"heads", "mlp", "qk", "vo", "residual_orth"}
    out = align_learned(AlignContext(pair, kinds, steps=50, time_budget_s=0.0))
    info = out.info
    assert info["steps"] == 50 and info["steps_done"] == 0 and info["stopped"] == "time_budget"
    assert info["history"]["step"] == [0] and info["best_step"] == 0 and info["seconds_per_step"] is None
    g0, _ = weight_match(pair, kinds, None)  # nothing learned: the weight-matching start comes back
    for got, start in zip(out.g.layers, g0.layers):
        assert torch.equal(got.head_perm, start.head_perm) and torch.equal(got.mlp_perm, start.mlp_perm)
        assert (got.qk - start.qk).abs().max() < 1e-12
    info = align_learned(AlignContext(pair, kinds, steps=3)).info
    assert info["steps_done"] == 3 and info["stopped"] == "steps" and info["history"]["step"] == [0, 1, 2, 3]
    assert info["seconds_per_step"] > 0 and info["resolve_every"] == learned.RESOLVE_EVERY


def test_a_time_budget_is_the_whole_dual_run_and_the_record_says_the_comparison_was_skipped(monkeypatch):
    pair, kinds = rope_pair()
    ran = []
    optimise = dual.optimise

    def counted(ctx, g0, dual, *args, **kw):
        ran.append("dual" if dual else "one-sided")
        return optimise(ctx, g0, dual, *args, **kw)

    monkeypatch.setattr(dual, "optimise", counted)
    info = dual.align_dual(AlignContext(pair, kinds, steps=3, time_budget_s=60.0)).info
    assert ran == ["dual"] and info["steps_done"] == 3 and "one_sided_same_budget" not in info
    assert info["one_sided_skipped"].startswith("the 60 s time budget went to the dual optimisation")
    assert "--method learned --steps 3" in info["one_sided_skipped"]
    ran.clear()
    info = dual.align_dual(AlignContext(pair, kinds, steps=3)).info  # a step budget: the comparison runs
    assert ran == ["dual", "one-sided"] and info["one_sided_same_budget"]["steps"] == 3
    assert "one_sided_skipped" not in info
    ran.clear()
    kw = DualOptions(skip_comparison=True, batch=4).align_kwargs()  # --skip-comparison: the dual run alone
    assert kw["compare_one_sided"] is False and kw["learned"].batch == 4
    info = dual.align_dual(AlignContext(pair, kinds, steps=3, compare_one_sided=False)).info
    assert ran == ["dual"] and "one_sided_same_budget" not in info
    assert info["one_sided_skipped"].startswith("the run skipped it (--skip-comparison)")


def test_memory_record_counts_latents_and_adam_state_in_the_model_dtype():
    for dtype in (F64, torch.float32):
        pair, kinds = rope_pair(dtype=dtype)
        mem = align_learned(AlignContext(pair, kinds, steps=2)).info["memory"]
        assert mem["dtype"] == str(dtype).removeprefix("torch.")
        assert mem["latent_bytes"] == latent_count(pair.arch, kinds) * dtype.itemsize
        steps_bytes = 64 * len(pair.params_a)  # Adam's per-tensor step counters, generously
        assert 2 * mem["latent_bytes"] <= mem["adam_state_bytes"] <= 2 * mem["latent_bytes"] + steps_bytes
        assert mem["model_bytes"] == sum(v.numel() for v in pair.params_a.values()) * dtype.itemsize
        assert 0 < mem["peak_rss_bytes_before"] <= mem["peak_rss_bytes"]


def test_dual_identity_runs_in_the_model_dtype_above_the_size_limit(monkeypatch):
    pair, kinds = rope_pair(dtype=torch.float32)
    g_a, g_b = sample(pair.arch, kinds, seed=5), sample(pair.arch, kinds, seed=6)
    small = dual_identity(pair, g_a, g_b)
    assert small["dtype"] == "float64" and small["holds"] and small["max_logit_relative_error"] < 1e-10
    monkeypatch.setattr(dual, "IDENTITY_F64_MAX_PARAMS", 0)
    big = dual_identity(pair, g_a, g_b)
    assert big["dtype"] == "float32" and big["tolerance"] == dual.IDENTITY_TOLERANCE[torch.float32]
    assert big["holds"] and 1e-10 < big["max_logit_relative_error"] < big["tolerance"]  # float32 rounding, not zero


@pytest.mark.slow
def test_gpt2_shaped_pair_with_the_full_vocabulary(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(learned, "VAL_ITEMS", {"lm": 128})  # the vocabulary, not the batch, is under test
    monkeypatch.setattr(dual, "IDENTITY_ITEMS", {"lm": 128})
    for s in (0, 1):
        torch.manual_seed(s)
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=50257)).save_pretrained(
            tmp_path / f"m{s}", safe_serialization=True)
    a, b = load_model(tmp_path / "m0"), load_model(tmp_path / "m1")
    es = eval_set_for(a, "val", 256)
    for method in ("learned", "dual"):
        al = align(a, b, method, steps=2, compare_one_sided=False, learned=Settings(batch=2))  # 2 x 128 tokens
        check = endpoint_check(b, al, es, evaluate(al.model_b, es)["loss"])  # raises unless exact
        assert check["exact"] and check["rel_diff"] < 1e-4
        info = al.out.info
        assert info["steps_done"] == 2 and info["memory"]["dtype"] == "float32"
        sides = 2 if method == "dual" else 1
        assert info["memory"]["latent_bytes"] == sides * 4 * latent_count(al.pair.arch, al.classes)
    assert "one_sided_same_budget" not in info and info["identity"]["holds"]


@pytest.mark.parametrize("dual_run", [False, True])
def test_keeping_every_block_s_graph_changes_no_bit_of_the_run(monkeypatch, dual_run):
    """Below SMALL_MODEL a step keeps every block's graph instead of forming it again in the backward pass
    (learned.blocks_checkpointed); the run is the checkpointed one to the last bit: losses, validation and the
    kept element."""
    from engine.align.learned import optimise
    from engine.align.weight import SMALL_MODEL
    from engine.symmetry import identity

    assert learned.blocks_checkpointed(SMALL_MODEL) and not learned.blocks_checkpointed(SMALL_MODEL - 1)
    pair, kinds = rope_pair(dtype=torch.float32)
    st = Settings(lr_perm=2.0, lambdas="uniform", eval_every=2, candidates=4, patience=None)
    monkeypatch.setattr(learned, "VAL_ITEMS", {"lm": 256})
    runs, real = [], learned.checkpoint
    for small in (True, False):
        monkeypatch.setattr(learned, "blocks_checkpointed", lambda params, small=small: not small)
        calls = []
        monkeypatch.setattr(learned, "checkpoint", lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k))
        runs.append(optimise(AlignContext(pair, kinds, steps=8), identity(pair.arch), dual=dual_run, steps=8,
                             settings=st))
        runs[-1]["checkpoints"] = len(calls)
    kept, ck = runs
    assert ck["checkpoints"] > kept["checkpoints"]  # the blocks ran under checkpointing in one run only
    for key in ("curve", "history"):
        a, b = kept[key], ck[key]
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}
    for el, el0 in zip(kept["g_b"].layers, ck["g_b"].layers):
        assert torch.equal(el.qk, el0.qk) and torch.equal(el.vo, el0.vo) and torch.equal(el.head_perm, el0.head_perm)
    assert torch.equal(kept["g_b"].residual, ck["g_b"].residual)


def test_a_dual_run_whose_budget_ends_before_its_first_step_is_a_whole_record_the_history_keeps(tmp_path):
    """On a busy machine weight matching's start can use up a short time budget: the run takes no step, and
    its record (no seconds per step, no comparison to make) must still be one the store and history accept."""
    from engine.history import list_runs, save_run
    from engine.models import reference, save_model
    from engine.pipeline import run_pair
    from engine.results import RunConfig, record_problem

    for s in (0, 1):
        save_model(reference.build(reference.RefConfig(task="lm", n_layers=2, d_model=32, n_heads=4, d_mlp=64,
                                                       n_ctx=32, pe="rope"), seed=s), tmp_path / f"m{s}")
    cfg = RunConfig(str(tmp_path / "m0"), str(tmp_path / "m1"), "dual", points=3, eval_items=256,
                    options=DualOptions(time_budget_s=1e-6))
    rec = run_pair(cfg, attribution=False)
    d = rec["alignment"]["diagnostics"]
    assert d["steps_done"] == 0 and d["seconds_per_step"] is None and d["stopped"] == "time_budget"
    assert d["one_sided_skipped"].endswith("which ended before the first step: there is no step to compare")
    assert record_problem(rec) is None
    save_run(rec, root=tmp_path / "home")
    assert [r["alignment"]["diagnostics"]["steps_done"] for r in list_runs(tmp_path / "home")] == [0]
