"""Runs in bfloat16 (`--dtype bfloat16`): checkpoints stored as released 1B models are (bfloat16 safetensors in
shards with model.safetensors.index.json) stay in bfloat16 through alignment and the path; the endpoint check
allows one bfloat16 rounding unit (2^-8) and still catches a transform outside the group."""

from __future__ import annotations

import json

import pytest
import torch

from engine.align.run import TOLERANCE, align, endpoint_check
from engine.cli import DTYPES, main
from engine.errors import ExactnessError
from engine.evaluate import evaluate, lm_eval_set
from engine.models import hf_llama, load_model
from engine.pipeline import DTYPES as PIPELINE_DTYPES
from engine.pipeline import load_named
from engine.results import DTYPE_NAMES

BF16 = torch.bfloat16
LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "bos_token_id": 0,
         "eos_token_id": 0, "rope_theta": 500.0, "tie_word_embeddings": False}


def test_the_cli_offers_the_dtypes_a_record_accepts():
    assert tuple(DTYPES) == DTYPE_NAMES == tuple(PIPELINE_DTYPES)
    assert TOLERANCE[BF16] == 2**-8


def _store_sharded(seed: int, path) -> None:
    m = hf_llama.build(LLAMA, seed=seed)
    m.module.to(BF16).save_pretrained(path, safe_serialization=True, max_shard_size="100KB")


@pytest.fixture(scope="module")
def sharded_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    _store_sharded(0, root / "a")
    _store_sharded(1, root / "b")
    return root / "a", root / "b"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["weight", "activation", "dual"])
def test_a_sharded_bfloat16_llama_pair_aligns_and_interpolates_in_bfloat16(sharded_pair, method, tmp_path):
    """Every aligner on bfloat16 endpoints: the data-driven ones run their reference-family twin in bfloat16
    (checked against Hugging Face's bfloat16 forward to TWIN_TOLERANCE)."""
    a, b = sharded_pair
    assert (a / "model.safetensors.index.json").exists() and len(list(a.glob("*.safetensors"))) > 1
    assert load_model(a, BF16).module.lm_head.weight.dtype == BF16
    out = tmp_path / "r.json"
    rc = main(["align", str(a), str(b), "--method", method, "--points", "3", "--eval-items", "512",
               "--dtype", "bfloat16", "--out", str(out)] + (["--steps", "2"] if method == "dual" else []))
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["dtype"] == "bfloat16" and rec["provenance"]["dtype"] == "bfloat16"
    check = rec["endpoint_check"]
    assert check["tolerance"] == 2**-8 and check["rel_diff"] <= 2**-8 and check["exact"]
    if method == "dual":
        assert rec["alignment"]["diagnostics"]["identity"]["holds"]
    assert "residual_orth" in rec["alignment"]["classes"]  # a rotation: every weight rounded to bfloat16 again
    loss = rec["loss"]
    assert loss[-1] == check["loss_b_moved"] and loss[-1] == pytest.approx(check["loss_b"], rel=2**-8)
    # the endpoints' losses are those of the bfloat16 models as stored
    es = lm_eval_set("test", 512, n_ctx=32)
    assert loss[0] == pytest.approx(evaluate(load_model(a, BF16), es)["loss"], rel=1e-6)


def test_in_bfloat16_a_transform_outside_the_group_is_still_caught():
    """On the trained RoPE LM of the zoo, in bfloat16: the RoPE group's Q/K maps move the loss by about 2e-4
    relative (rounding), a GL(d) map on RoPE queries and keys, no symmetry, by far more than 2^-8. (On
    untrained tiny models a GL map's loss change can stay under 2^-8: the guard sees only what the loss does.)"""
    a, b = load_named("lm-rope-s0", "bfloat16"), load_named("lm-rope-s1", "bfloat16")
    es = lm_eval_set("val", 1024, n_ctx=64)
    right = align(a, b, "weight", classes=("heads", "qk"))
    assert endpoint_check(b, right, es, evaluate(right.model_b, es)["loss"])["rel_diff"] < 1e-3
    wrong = align(a, b, "weight", classes=("heads", "qk"), qk_structure="gl")
    with pytest.raises(ExactnessError, match="not a symmetry"):
        endpoint_check(b, wrong, es, evaluate(wrong.model_b, es)["loss"])


def test_a_large_bfloat16_b_is_moved_in_float32_and_rounded_once(sharded_pair, monkeypatch):
    """move_in_place at scale (above SMALL_MODEL, patched down here): each parameter of a bfloat16 B is moved in
    float32 and rounded to bfloat16 once: every entry within half a bfloat16 unit (at most 2^-8 relative) of the float32
    move of the same weights, up to float32's own summation order; no bfloat16 product (slow loops on a CPU
    without bfloat16 kernels, and a rounding per partial sum)."""
    from engine.align import run
    from engine.align.pair import prepare_pair
    from engine.classes import default_classes
    from engine.spec import build_spec
    from engine.symmetry import apply, sample

    monkeypatch.setattr(run, "SMALL_MODEL", 0)
    a, b = (load_model(p, BF16) for p in sharded_pair)
    kinds = default_classes(build_spec(a.arch, run.canonical(a, copy=False)))
    assert "residual_orth" in kinds
    pair = prepare_pair(a, b, kinds, in_place=True)
    g = sample(pair.arch, kinds, seed=5)
    want = apply(pair.arch, g, {k: v.float() for k, v in pair.params_b.items()})  # float32, unrounded
    run.move_in_place(pair, g)
    for k, w in want.items():
        got = pair.params_b[k]
        assert got.dtype == BF16, k
        err = ((got.float() - w).abs() - 2**-8 * w.abs()).max() / w.abs().max()
        assert err <= 1e-6, (k, float(err))
