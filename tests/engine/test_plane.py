"""The loss plane through A, B and aligned B (engine/plane.py): its axes are the orthonormal frame of the
three models' differences, each grid point is their affine combination, and the CLI writes it."""

from __future__ import annotations

import json

import pytest
import torch
from ref_models import random_model, tiny

from engine.errors import LMCError
from engine.evaluate import eval_set_for, evaluate
from engine.interpolate import _empty_copy
from engine.models import save_model
from engine.plane import axes, grid, loss_plane, plane_of, weights

F64 = torch.float64


def flat(m) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.module.parameters()]).to(F64)


def test_the_axes_are_the_orthonormal_frame_of_the_differences():
    a, b, c = (random_model(tiny(), seed=s) for s in (0, 1, 2))
    ax = axes(a, b, c)
    d1, d2 = flat(c) - flat(a), flat(b) - flat(a)
    u = d1 / d1.norm()
    v = (d2 - (d2 @ u) * u) / (d2 - (d2 @ u) * u).norm()
    assert ax["norm_d1"] == pytest.approx(float(d1.norm()), rel=1e-12)
    assert ax["c"] == pytest.approx(float(d2 @ u), rel=1e-12)
    assert ax["w"] == pytest.approx(float(d2 @ v), rel=1e-12)
    # the three models sit at (0, 0), (|d1|, 0) and (c, w): their weights pick each model alone
    assert weights(ax, 0.0, 0.0) == (0.0, 0.0)
    assert weights(ax, ax["norm_d1"], 0.0) == pytest.approx((1.0, 0.0), abs=1e-12)
    assert weights(ax, ax["c"], ax["w"]) == pytest.approx((0.0, 1.0), abs=1e-12)
    xs, ys = grid(ax, 5, margin=0.0)
    assert xs[0] == min(0.0, ax["c"]) and xs[-1] == max(ax["norm_d1"], ax["c"]) and (ys[0], ys[-1]) == (0.0, ax["w"])


def test_each_grid_point_is_the_affine_combination_of_the_three_models():
    a, b, c = (random_model(tiny(vocab_size=256), seed=s) for s in (0, 1, 2))
    es = eval_set_for(a, "test", 128)
    out = loss_plane(a, b, c, es, n=3)
    ax = out["axes"]
    for j in (0, 2):
        for i in (0, 1):
            alpha, beta = weights(ax, out["x"][i], out["y"][j])
            m = _empty_copy(a, "cpu")
            with torch.no_grad():
                for p, pa, pb, pc in zip(m.module.parameters(), a.module.parameters(), b.module.parameters(),
                                         c.module.parameters()):
                    p.copy_((1 - alpha - beta) * pa + alpha * pc + beta * pb)
            assert out["loss"][j][i] == pytest.approx(evaluate(m, es)["loss"], rel=1e-12)
    assert out["points"] == {"A": [0.0, 0.0], "B": [ax["c"], ax["w"]], "B_aligned": [ax["norm_d1"], 0.0]}
    with pytest.raises(LMCError, match="3 to 41 points"):
        loss_plane(a, b, c, es, n=2)
    with pytest.raises(LMCError, match="span no plane"):
        loss_plane(a, b, a, es, n=3)


def test_plane_of_a_pair_needs_an_aligning_method_and_puts_both_endpoints_of_b_on_it():
    a, b = random_model(tiny(vocab_size=256), seed=0), random_model(tiny(vocab_size=256), seed=1)
    es = eval_set_for(a, "test", 128)
    with pytest.raises(LMCError, match="needs an aligning method"):
        plane_of(a, b, "naive", es)
    out = plane_of(a, b, "weight", es, n=3)
    assert out["method"] == "weight" and "mlp" in out["classes"]
    assert out["axes"]["w"] > 0 and out["axes"]["norm_d1"] > 0


def test_the_cli_writes_the_plane(tmp_path, capsys):
    from engine.cli import main

    cfg = tiny(vocab_size=256)
    for s in (0, 1):
        save_model(random_model(cfg, seed=s), tmp_path / f"m{s}")
    out = tmp_path / "plane.json"
    assert main(["plane", str(tmp_path / "m0"), str(tmp_path / "m1"), "--method", "weight", "--grid", "3",
                 "--eval-items", "128", "--out", str(out)]) == 0, capsys.readouterr().err
    rec = json.loads(out.read_text())
    assert len(rec["loss"]) == 3 and len(rec["loss"][0]) == 3 and rec["method"] == "weight"
    assert rec["model_a"] == "m0" and rec["kind"] == "loss_plane" and "eval_set" in rec
    assert "loss plane" in capsys.readouterr().out
