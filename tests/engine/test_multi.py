"""N models in one basis (engine/multi.py, docs/MATH.md section 10): planted recovery, exactness of every aligned
model, the pairwise barrier matrices, the triangle, the record and its checks, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from ref_models import random_model, tiny

from engine import multi
from engine.align.pair import model_for, prepare_pair
from engine.cancel import CancelToken
from engine.checks import EXACT_TOL, example_inputs
from engine.classes import choose_classes
from engine.errors import ArchitectureMismatch, Cancelled, LMCError
from engine.evaluate import eval_set_for, evaluate
from engine.interpolate import _empty_copy, interpolate
from engine.models import canonical, model_logits, save_model
from engine.symmetry import apply, compose, invert, sample

F64 = torch.float64
PLANT = frozenset({"heads", "mlp", "residual_perm"})


def planted(cfg, n: int = 3, kinds=PLANT):
    """n models, each an exact group transform g_i* of one random model X (in the aligners' coordinates)."""
    x = random_model(cfg, seed=0)
    pair = prepare_pair(x, x, choose_classes(x.arch, "weight").classes)
    gs = [sample(pair.arch, kinds, seed=s) for s in range(1, n + 1)]
    models = [model_for(pair.model_a, pair.arch, apply(pair.arch, g, pair.params_a)) for g in gs]
    for i, m in enumerate(models):
        m.name = f"m{i}"
    return models, gs, pair.arch


def independent(cfg, n: int = 3):
    models = [random_model(cfg, seed=s) for s in range(n)]
    for i, m in enumerate(models):
        m.name = f"m{i}"
    return models


def max_rel_logits(a, b, inputs) -> float:
    with torch.no_grad():
        ya, yb = model_logits(a, inputs), model_logits(b, inputs)
    return float((ya - yb).abs().max() / ya.abs().max())


def same_element(got, want) -> None:
    for eg, ew in zip(got.layers, want.layers):
        assert torch.equal(eg.head_perm, ew.head_perm) and torch.equal(eg.mlp_perm, ew.mlp_perm)
        assert (eg.qk - ew.qk).abs().max() < 1e-8 and (eg.vo - ew.vo).abs().max() < 1e-8
    assert (got.residual - want.residual).abs().max() < 1e-9


# ---------------------------------------------------------------------------------------------
# Planted recovery


@pytest.mark.parametrize("cfg", [tiny(vocab_size=256), tiny(task="vit", pe="learned", norm="layernorm", bias=True)],
                         ids=["lm-rope-rmsnorm", "vit-learned-layernorm"])
def test_three_permutations_of_one_model_are_recovered_to_the_reference(cfg):
    models, gs, arch = planted(cfg)
    sh = multi.align_models(models, "reference")
    for i in range(3):  # g_i moves model i onto model 0: g_0* (g_i*)^-1
        same_element(sh.elements[i], compose(arch, gs[0], invert(arch, gs[i])))
        err = max(float((sh.params[i][k].to(F64) - sh.params[0][k].to(F64)).abs().max()) for k in sh.params[0])
        assert err < 1e-10
    es = eval_set_for(models[0], "test", 64 if cfg.task == "vit" else 256)
    before, after = (multi.barrier_matrix(ms, es) for ms in (sh.prep.models, sh.models))
    assert max(abs(v) for row in after["barrier"] + after["midpoint_barrier"] for v in row) < 1e-9
    assert min(abs(before["midpoint_barrier"][i][j]) for i in range(3) for j in range(3) if i != j) > 1e-3


def test_three_permutations_of_one_model_share_the_barycentre_after_one_round():
    models, gs, arch = planted(tiny(vocab_size=256))
    sh = multi.align_models(models, "barycentre")
    d = sh.diagnostics
    assert d["converged"] and [r["permutation_changes"] for r in d["rounds"]] == [None, 0]
    assert d["rounds"][0]["spread"] < 1e-20 and d["rounds"][1]["spread"] < 1e-20
    common = compose(arch, sh.elements[0], gs[0])  # every g_i g_i* is the same element: one basis
    for i in (1, 2):
        same_element(compose(arch, sh.elements[i], gs[i]), common)


def test_rotations_and_within_head_maps_are_recovered_too():
    models, gs, arch = planted(tiny(vocab_size=256), kinds=choose_classes(tiny().arch(), "weight").classes)
    sh = multi.align_models(models, "reference")
    for i in (1, 2):
        want = compose(arch, gs[0], invert(arch, gs[i]))
        assert (sh.elements[i].residual - want.residual).abs().max() < 1e-9
        for eg, ew in zip(sh.elements[i].layers, want.layers):
            assert torch.equal(eg.head_perm, ew.head_perm) and (eg.qk - ew.qk).abs().max() < 1e-8


# ---------------------------------------------------------------------------------------------
# Exactness: every aligned model computes its original function


@pytest.mark.parametrize("to", multi.TOS)
@pytest.mark.parametrize("cfg", [tiny(vocab_size=256), tiny(task="vit", pe="learned", norm="layernorm", bias=True),
                                 tiny(vocab_size=256, pe="sinusoidal")], ids=["lm-rope", "vit-layernorm", "lm-sinusoidal"])
def test_every_aligned_model_computes_its_original_function(cfg, to):
    models = independent(cfg)
    sh = multi.align_models(models, to, max_rounds=4)
    x = example_inputs(models[0])
    for orig, aligned in zip(models, sh.models):
        assert max_rel_logits(orig, aligned, x) < EXACT_TOL
    if to == "barycentre":
        rounds = sh.diagnostics["rounds"]
        assert 1 <= len(rounds) - 1 <= 4 and sh.diagnostics["converged"] == (rounds[-1]["permutation_changes"] == 0)
        assert sh.elements[0] is not None and rounds[-1]["spread"] <= rounds[0]["spread"]


def test_a_tied_model_whose_final_gain_is_one_is_untied_with_the_others():
    cfg = tiny(vocab_size=256, tied_embeddings=True)
    models = independent(cfg)
    with torch.no_grad():
        models[0].module.norm_f.g.fill_(1.0)  # folding keeps its tie; the others' gains untie them
    prep = multi.prepare(models)
    assert not prep.arch.tied_embeddings and {m.arch for m in prep.models} == {prep.arch}
    sh = multi.align_models(models, "reference", prep=prep)
    x = example_inputs(models[0])
    assert max(max_rel_logits(o, a, x) for o, a in zip(models, sh.models)) < EXACT_TOL


def test_the_models_passed_in_are_left_as_they_were():
    models = independent(tiny(vocab_size=256))
    before = [{k: v.clone() for k, v in canonical(m).items()} for m in models]
    multi.align_models(models, "barycentre", max_rounds=2)
    for m, b in zip(models, before):
        assert all(torch.equal(v, b[k]) for k, v in canonical(m).items())


# ---------------------------------------------------------------------------------------------
# The barrier matrix and the triangle


def test_the_barrier_matrix_is_symmetric_with_a_zero_diagonal_and_each_entry_its_path():
    models = independent(tiny(task="vit", pe="learned"), n=4)
    es = eval_set_for(models[0], "test", 48)
    bm = multi.barrier_matrix(models, es, points=5)
    for key in ("barrier", "midpoint_barrier", "accuracy_drop"):
        m = bm[key]
        assert all(m[i][i] == 0.0 and m[i][j] == m[j][i] for i in range(4) for j in range(4))
    assert len(bm["paths"]) == 6
    for i, j in ((0, 1), (1, 3)):
        r = interpolate(models[i], models[j], es, points=5)
        assert bm["barrier"][i][j] == pytest.approx(r["barrier"], rel=1e-12, abs=1e-15)
        assert bm["midpoint_barrier"][i][j] == pytest.approx(r["midpoint_barrier"], rel=1e-12)
        assert bm["accuracy_drop"][i][j] == pytest.approx(r["accuracy_drop"], abs=1e-12)
    assert bm["loss"] == [evaluate(m, es)["loss"] for m in models]


def test_the_triangle_is_the_barycentric_grid_of_three_models():
    models = independent(tiny(vocab_size=256))
    es = eval_set_for(models[0], "test", 128)
    assert len(multi.simplex_grid(6)) == 21 and multi.simplex_grid(2) == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0],
                                                                           [0.0, 0.0, 1.0]]
    assert all(abs(sum(w) - 1) < 1e-15 and min(w) >= 0 for w in multi.simplex_grid(6))
    ticks = []
    tri = multi.triangle(models, es, per_edge=4, stage=lambda *a: ticks.append(a))
    assert [t[1:3] for t in ticks] == [(k, 11) for k in range(1, 12)] and {t[0] for t in ticks} == {"triangle"}
    own = [evaluate(m, es)["loss"] for m in models]
    assert tri["vertex_loss"] == pytest.approx(own, rel=1e-12)
    w = tri["weights"][4]  # an interior point: the affine combination, evaluated independently
    m = _empty_copy(models[0], "cpu")
    with torch.no_grad():
        for p, *ps in zip(m.module.parameters(), *(x.module.parameters() for x in models)):
            p.copy_(sum(wi * q for wi, q in zip(w, ps)))
    assert tri["loss"][4] == pytest.approx(evaluate(m, es)["loss"], rel=1e-12)
    assert tri["excess"][4] == pytest.approx(tri["loss"][4] - sum(a * b for a, b in zip(w, own)), rel=1e-9)
    assert tri["barrier"] == max(tri["excess"]) and tri["centroid"]["loss"] > 0


def test_a_cancelled_run_stops_at_once():
    models = independent(tiny(vocab_size=256))
    es = eval_set_for(models[0], "test", 128)
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        multi.run(models, "reference", es, cancel=token)
    with pytest.raises(Cancelled):
        multi.triangle(models, es, cancel=token)


# ---------------------------------------------------------------------------------------------
# A run, its record and its errors


def test_a_run_makes_a_checked_record_that_survives_the_round_trip(tmp_path):
    models, _, _ = planted(tiny(vocab_size=256))
    es = eval_set_for(models[0], "test", 128)
    stages = []
    body = multi.run(models, "barycentre", es, points=5, per_edge=6, stage=lambda s, *a: stages.append(s))
    assert list(dict.fromkeys(stages)) == ["measure", "barriers before", "align", "barriers after", "triangle"]
    assert body["lambdas"] == [0.0, 0.25, 0.5, 0.75, 1.0] and len(body["triangle"]["loss"]) == 21
    assert max(e["rel_diff"] for e in body["exactness"]["models"]) < 1e-12
    assert abs(body["triangle"]["barrier"]) < 1e-9 and abs(body["triangle"]["centroid"]["excess"]) < 1e-9
    rec = multi.make_record(body, "cpu", "float64")
    f = multi.write_record(rec, tmp_path / "r.json")
    assert multi.read_record(f) == json.loads(json.dumps(rec))
    for broken, phrase in ((rec | {"models": ["a", "b"]}, "at least 3 models"),
                           (rec | {"to": "median"}, "basis is 'median'"),
                           (rec | {"after": rec["after"] | {"barrier": [[0, 1, 0], [2, 0, 0], [0, 0, 0]]}},
                            "not symmetric"),
                           (rec | {"triangle": rec["triangle"] | {"per_edge": 5}}, "barycentric grid"),
                           (rec | {"exactness": {"models": []}}, "3 finite relative differences"),
                           (rec | {"alignment": rec["alignment"] | {"rounds": []}}, "has no rounds")):
        with pytest.raises(LMCError, match=phrase):
            multi.check_record(broken)
    (tmp_path / "bad.json").write_text(json.dumps(rec | {"kind": "loss_plane"}))
    with pytest.raises(LMCError, match=r"bad.json is unusable: it is not a multi-model record"):
        multi.read_record(tmp_path / "bad.json")
    store = tmp_path / "store"
    multi.write_record(rec, multi.store_file(rec["models"], "barycentre", store))
    multi.write_record(rec, multi.store_file(rec["models"], "reference", store))  # a barycentre record, misnamed
    recs, skipped = multi.stored(store)
    assert [r["to"] for r in recs] == ["barycentre"] and len(skipped) == 1
    assert "m0__m1__m2__reference.json holds m0, m1, m2 to the barycentre, not what its name says" in skipped[0]


def test_fewer_than_three_models_two_shapes_and_a_non_finite_loss_are_one_sentence_each():
    models = independent(tiny(vocab_size=256))
    es = eval_set_for(models[0], "test", 64)
    with pytest.raises(LMCError, match="at least 3 models, not 2") as e:
        multi.run(models[:2], "reference", es)
    assert "\n" not in str(e.value)
    other = random_model(tiny(vocab_size=256, d_mlp=32), seed=5)
    other.name = "narrow"
    with pytest.raises(ArchitectureMismatch, match="narrow"):
        multi.run(models[:2] + [other], "reference", es)
    with pytest.raises(LMCError, match="not 'median'"):
        multi.run(models, "median", es)
    with pytest.raises(LMCError, match="points per edge"):
        multi.run(models, "reference", es, per_edge=1)
    huge = random_model(tiny(vocab_size=256), seed=7)  # in-process: loading a directory refuses such weights
    huge.name = "huge"
    with torch.no_grad():
        huge.module.head.W[0, 0] = float("inf")
    with pytest.raises(LMCError, match="Model huge has a loss that is not finite"):
        multi.run(models[:2] + [huge], "reference", es)


def test_the_cli_writes_a_record_and_refuses_bad_input(tmp_path, capsys):
    from engine.cli import main

    models, _, _ = planted(tiny(vocab_size=256))
    dirs = []
    for i, m in enumerate(models):
        save_model(m, tmp_path / f"m{i}")
        dirs.append(str(tmp_path / f"m{i}"))
    out = tmp_path / "multi.json"
    assert main(["multi", *dirs, "--to", "barycentre", "--eval-items", "128", "--out", str(out)]) == 0
    rec = multi.read_record(out)
    assert rec["models"] == ["m0", "m1", "m2"] and rec["to"] == "barycentre" and rec["eval_tokens"] == 128
    assert max(abs(v) for row in rec["after"]["barrier"] for v in row) < 1e-4
    text = capsys.readouterr().out
    assert "barrier before" in text and "centroid" in text and f"wrote {out}" in text
    assert main(["multi", *dirs[:2], "--out", str(tmp_path / "x.json")]) == 2
    assert "at least 3 models" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    save_model(random_model(tiny(vocab_size=256, d_mlp=32), seed=5), tmp_path / "narrow")
    assert main(["multi", *dirs[:2], str(tmp_path / "narrow")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "different shapes" in err and err.count("\n") == 1
    (tmp_path / "foreign.json").write_text("{}")
    assert main(["multi", *dirs, "--out", str(tmp_path / "foreign.json")]) == 2
    assert "not a result record" in capsys.readouterr().err
    assert main(["cache", "build", "--multi", "--only", "vit-learned-s0"]) == 2
    assert "--only and --methods do not apply to `cache build --multi`" in capsys.readouterr().err
