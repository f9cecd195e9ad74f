"""The default symmetry classes (one choice per architecture and method), the record fields that say
what a run used and left out, the merged model's format, and the naive curve in the aligned runs'
coordinates.

Tiny float64 models (2 layers, D 32, 4 heads); nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from ref_models import byte_tiny, randomise_norms

from engine.align.run import align
from engine.api import run_pair
from engine.classes import choose_classes, default_classes
from engine.cli import main
from engine.errors import LMCError
from engine.evaluate import eval_set_for
from engine.interpolate import LinearPath
from engine.models import Model, canonical, load_model, model_logits, save_model, set_canonical
from engine.models.base import SCALED_MLPS
from engine.models.reference import RefConfig, build
from engine.results import RunConfig
from engine.spec import KINDS, build_spec
from engine.symmetry import apply, sample

F64 = torch.float64
EXACT = {"heads", "mlp", "qk", "vo"}


def gpt2(seed: int = 0) -> Model:
    from engine.models import hf_gpt2

    return hf_gpt2.build({"vocab_size": 256, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4,
                          "bos_token_id": 0, "eos_token_id": 0}, seed=seed, dtype=F64)


# ---------------------------------------------------------------------------------------------
# The default choice per family and positional encoding


def _families() -> dict[str, Model]:
    from engine.models import hf_llama, timm_vit

    return {
        "reference lm none": build(byte_tiny(pe="none"), dtype=F64),
        "reference lm rope": build(byte_tiny(pe="rope"), dtype=F64),
        "reference vit learned": build(byte_tiny("vit", pe="learned"), dtype=F64),
        "reference lm layernorm": build(byte_tiny(pe="learned", norm="layernorm", bias=True, mlp="relu"), dtype=F64),
        "hf_gpt2": gpt2(),
        "hf_llama": hf_llama.build({"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0}, dtype=F64),
        "timm_vit": timm_vit.build({"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10,
                                    "embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}, dtype=F64),
    }


def test_every_family_with_an_exact_residual_map_rotates_it_by_default_for_every_aligner():
    for name, m in _families().items():
        spec = build_spec(m.arch, canonical(m, copy=False))
        scaled = {"mlp_scale"} if m.arch.mlp in SCALED_MLPS else set()
        for method in ("weight", "activation", "learned", "dual"):
            c = choose_classes(m.arch, method)
            assert c.classes == EXACT | scaled | {"residual_orth"}, (name, method)
            assert c.classes <= set(spec.kinds) and default_classes(spec, method) == c.classes
            assert set(c.left_out) == set(KINDS) - c.classes  # every kind not used has its reason
            assert "contained in residual_orth" in c.left_out["residual_perm"]
            if not scaled:
                assert "not a symmetry of a" in c.left_out["mlp_scale"]


def test_sinusoidal_leaves_both_residual_maps_out_and_says_why():
    arch = build(byte_tiny(pe="sinusoidal"), dtype=F64).arch
    c = choose_classes(arch, "weight")
    assert c.classes == EXACT
    assert {"residual_perm", "residual_orth"} <= set(c.left_out)
    assert all("sinusoidal" in c.left_out[k] for k in ("residual_perm", "residual_orth"))


def test_a_layernorm_model_that_cannot_be_rewritten_permutes_its_residual_stream():
    from dataclasses import replace

    arch = build(byte_tiny(pe="rope", norm="layernorm", bias=True, mlp="swiglu"), dtype=F64).arch
    c = choose_classes(arch, "weight")
    assert "residual_perm" in c.classes and "residual_orth" not in c.classes
    assert "gate has no bias" in c.left_out["residual_orth"]
    assert "residual_orth" in choose_classes(replace(arch, norm_bias=False, attn_bias=False, out_bias=False,
                                                     mlp_bias=False), "weight").classes


def test_naive_and_asked_classes_say_why_the_rest_is_left_out():
    arch = build(byte_tiny(pe="rope"), dtype=F64).arch
    c = choose_classes(arch, "naive")
    assert c.classes == frozenset() and set(c.left_out) == set(KINDS)
    assert c.left_out["heads"] == "the naive baseline applies no symmetry"
    c = choose_classes(arch, "weight", ("heads", "mlp"))
    assert c.classes == {"heads", "mlp"} and c.left_out["qk"] == "not asked for (--classes)"
    assert "not a symmetry" in c.left_out["mlp_scale"]
    with pytest.raises(LMCError, match="'mlp_scale' is not a symmetry of this gelu"):
        choose_classes(arch, "weight", ("mlp_scale",))


# ---------------------------------------------------------------------------------------------
# Records, the CLI, the merged model's format


def _save_pair(tmp_path, make, randomise: bool = True) -> tuple[str, str]:
    dirs = []
    for s in (0, 1):
        m = make(s)
        if randomise:
            randomise_norms(m, 10 + s, gain=0.3, bias=0.2)
        save_model(m, tmp_path / f"m{s}")
        dirs.append(str(tmp_path / f"m{s}"))
    return dirs[0], dirs[1]


def test_gpt2_pair_is_rotated_and_saved_as_a_reference_rmsnorm_model_computing_the_path_model(tmp_path, capsys):
    a_dir, b_dir = _save_pair(tmp_path, gpt2)
    out, merged = tmp_path / "r.json", tmp_path / "merged"
    rc = main(["align", a_dir, b_dir, "--method", "weight", "--points", "3", "--eval-items", "256", "--device", "cpu",
               "--out", str(out), "--save-merged", str(merged), "--alpha", "0.3"])
    printed = capsys.readouterr().out
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["classes"] == ["heads", "mlp", "qk", "residual_orth", "vo"]
    assert set(rec["classes_left_out"]) == {"mlp_scale", "residual_perm"}
    assert rec["alignment"]["rewrite"] == "layernorm_to_rmsnorm"
    fmt = rec["merged"]["format"]
    assert rec["merged"]["family"] == "reference" and fmt.startswith("reference family, rmsnorm (not hf_gpt2")
    assert f"merged model format: {fmt}" in printed and "left out residual_perm: contained" in printed
    m = load_model(merged, dtype=F64)
    assert m.family == "reference" and m.arch.norm == "rmsnorm"
    # the same function as the path model at alpha, rebuilt here in float64 from the same pair
    a, b = load_model(a_dir, dtype=F64), load_model(b_dir, dtype=F64)
    al = align(a, b, "weight")
    path_model = LinearPath(al.model_a, al.model_b).at(0.3)
    other = LinearPath(al.model_a, al.model_b).at(0.6)  # and not the function of another point
    x = eval_set_for(a, "test", 256).inputs[:4]
    with torch.no_grad():
        y, want, y_other = model_logits(m, x), model_logits(path_model, x), model_logits(other, x)
    # aligned and saved in float32 by the run: float32 solves and weights, against a float64 rebuild
    assert float((y - want).abs().max() / want.abs().max()) < 3e-5
    assert float((y - y_other).abs().max() / want.abs().max()) > 1e-3


def test_a_model_kept_in_its_family_says_so():
    from engine.api import merged_format

    a = build(byte_tiny(pe="rope"), dtype=F64)
    assert merged_format(a, a, "fold_norms") == "reference (the models' own format, norm gains folded into the readers)"
    assert merged_format(a, a, "") == "reference (the models' own format)"


# ---------------------------------------------------------------------------------------------
# The naive curve in the aligned runs' coordinates


def _naive(a_dir: str, b_dir: str) -> dict:
    return run_pair(RunConfig(a_dir, b_dir, "naive", points=5, eval_items=256, dtype="float64", device="cpu"))


def _planted_twin(tmp_path, cfg: RefConfig, randomise: bool, kinds: tuple[str, ...]) -> tuple[str, str]:
    """A and B = g*(A) for a random g* of `kinds`: a planted pair (its gains differ only if g* moves them)."""
    a = build(cfg, seed=0, dtype=F64)
    if randomise:
        randomise_norms(a, 3, gain=0.3, bias=0.2)
    b = build(cfg, seed=1, dtype=F64)
    set_canonical(b, apply(a.arch, sample(a.arch, list(kinds), seed=2), canonical(a)))
    save_model(a, tmp_path / "a")
    save_model(b, tmp_path / "b")
    return str(tmp_path / "a"), str(tmp_path / "b")


WITHIN = ("heads", "mlp", "qk", "vo")


@pytest.mark.parametrize("randomise, kinds, agree", [
    (False, (*WITHIN, "residual_perm"), True),  # unit gains: folding changes nothing
    (True, WITHIN, True),  # the same gains at both ends: folding them commutes with the lerp
    (True, (*WITHIN, "residual_perm"), False),  # permuted gains: they interpolate inside the readers
])
def test_naive_folded_curve_coincides_where_the_coordinates_agree_and_differs_where_folding_changes_the_path(
        tmp_path, randomise, kinds, agree):
    rec = _naive(*_planted_twin(tmp_path, byte_tiny(pe="learned"), randomise, kinds))
    assert rec["folded_rewrite"] == "fold_norms" and rec["classes"] == [] and len(rec["classes_left_out"]) == len(KINDS)
    nat, fol = rec["loss"], rec["loss_folded"]
    assert len(fol) == len(rec["lambdas"]) == 5
    for i in (0, -1):  # the endpoints compute their own functions in either coordinates
        assert fol[i] == pytest.approx(nat[i], rel=1e-12)
    interior = max(abs(f - n) / n for f, n in zip(fol[1:-1], nat[1:-1]))
    if agree:
        assert interior < 1e-12 and rec["barrier_folded"] == pytest.approx(rec["barrier"], rel=1e-9, abs=1e-12)
    else:
        assert interior > 1e-6  # far above float64 rounding (the agreeing cases stay below 1e-12)


def test_naive_folded_curve_after_the_layernorm_rewrite_and_none_under_sinusoidal_pe(tmp_path, capsys):
    rec = _naive(*_save_pair(tmp_path / "g", gpt2))
    assert rec["folded_rewrite"] == "layernorm_to_rmsnorm"
    assert rec["loss_folded"][0] == pytest.approx(rec["loss"][0], rel=1e-10)
    assert max(abs(f - n) for f, n in zip(rec["loss_folded"][1:-1], rec["loss"][1:-1])) > 1e-4
    (tmp_path / "s").mkdir()
    a, b = _save_pair(tmp_path / "s", lambda s: build(byte_tiny(pe="sinusoidal"), seed=s, dtype=F64))
    rec = _naive(a, b)
    assert rec["folded_rewrite"] == "" and rec["loss_folded"] == rec["loss"]  # no rewrite: the same coordinates
    assert main(["interpolate", a, b, "--points", "3", "--eval-items", "256", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "in the aligned runs' coordinates (the same coordinates" in out and "classes: none" in out


def test_a_naive_run_reports_both_paths_as_one_phase_and_its_estimate_counts_both(tmp_path):
    from engine.timing import estimate_seconds, naive_paths

    a, b = _save_pair(tmp_path, lambda s: build(byte_tiny(pe="rope"), seed=s, dtype=F64))
    updates = []
    rec = run_pair(RunConfig(a, b, "naive", points=3, eval_items=256, dtype="float64", device="cpu"),
                   progress=updates.append)
    walk = [u for u in updates if u.phase == "interpolate"]
    assert [u.done for u in walk] == list(range(7)) and {u.total for u in walk} == {6}
    assert walk[-1].message.startswith("aligned coordinates, lambda = 1.00")
    rope, sinus = rec["arch"], {**rec["arch"], "pe": "sinusoidal", "rope_layout": None, "rotary_dim": 0}
    assert naive_paths(rope) == 2 and naive_paths(sinus) == 1 and naive_paths({"d_model": 32}) == 1
    refs = [rec]
    one = rec["timings"]["interpolate"] / ((256 + rec["train_eval_tokens"]) * 3)  # s per token per point, test + train
    assert estimate_seconds("naive", rope, 512, 5, 0, refs)["interpolate"] == pytest.approx(2 * one * 512 * 5)
    assert estimate_seconds("weight", rope, 512, 5, 0, refs)["interpolate"] == pytest.approx(one * 512 * 5)
