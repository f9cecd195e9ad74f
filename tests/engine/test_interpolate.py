"""Linear paths, barrier metrics, result records and the interpolate CLI."""

import json

import pytest
import torch
from ref_models import byte_tiny

from engine.api import run_pair
from engine.cli import main
from engine.errors import ArchitectureMismatch, LMCError
from engine.evaluate import evaluate, lm_eval_set, vit_eval_set
from engine.interpolate import LinearPath, barrier_metrics, check_same_architecture, interpolate
from engine.models import save_model
from engine.models.reference import build
from engine.results import RunConfig, load_record

REQUIRED = ["method", "model_a", "model_b", "lambdas", "loss", "accuracy", "barrier", "midpoint_barrier",
            "endpoint_loss_a", "endpoint_loss_b", "timings", "config_hash"]


@pytest.mark.parametrize("task", ["lm", "vit"])
def test_endpoints_reproduce_each_models_loss_exactly(task):
    a, b = build(byte_tiny(task, n_ctx=32), seed=0), build(byte_tiny(task, n_ctx=32), seed=1)
    es = lm_eval_set("val", 2048, n_ctx=32) if task == "lm" else vit_eval_set("test", 100)
    r = interpolate(a, b, es, points=5)
    assert r["loss"][0] == evaluate(a, es)["loss"]
    assert r["loss"][-1] == evaluate(b, es)["loss"]
    assert r["lambdas"] == [0, 0.25, 0.5, 0.75, 1]
    assert r["barrier"] >= r["midpoint_barrier"]
    if task == "vit":
        assert r["eval_images"] == 100 and len(r["accuracy"]) == 5
    else:
        assert r["eval_tokens"] == 2048 and r["accuracy"] is None


def test_a_model_interpolated_with_itself_has_zero_barrier():
    a = build(byte_tiny(n_ctx=32), seed=3)
    r = interpolate(a, a, lm_eval_set("val", 1024, n_ctx=32), points=7)
    assert all(loss == r["loss"][0] for loss in r["loss"])
    assert abs(r["barrier"]) < 1e-12 and abs(r["midpoint_barrier"]) < 1e-12


def test_path_reuses_one_preallocated_model():
    a, b = build(byte_tiny(n_ctx=32), seed=0), build(byte_tiny(n_ctx=32), seed=1)
    path = LinearPath(a, b)
    ptrs = [p.data_ptr() for p in path.work.module.parameters()]
    m = path.at(0.3)
    assert [p.data_ptr() for p in m.module.parameters()] == ptrs
    wq = m.module.blocks[0].attn.W_Q
    expect = 0.7 * a.module.blocks[0].attn.W_Q + 0.3 * b.module.blocks[0].attn.W_Q
    assert torch.allclose(wq, expect, atol=1e-7)
    assert torch.equal(path.at(0.0).module.blocks[1].mlp.W_in, a.module.blocks[1].mlp.W_in)
    assert torch.equal(path.at(1.0).module.blocks[1].mlp.W_in, b.module.blocks[1].mlp.W_in)


def test_barrier_metric_against_hand_computed_values():
    m = barrier_metrics([0, 0.5, 1], [1.0, 3.0, 2.0])
    assert m["barrier"] == pytest.approx(1.5) and m["midpoint_barrier"] == pytest.approx(1.5)
    m = barrier_metrics([0, 0.25, 0.5, 0.75, 1], [2.0, 2.5, 2.0, 1.0, 1.0])
    assert m["barrier"] == pytest.approx(0.75) and m["midpoint_barrier"] == pytest.approx(0.5)


def test_different_architectures_name_the_first_mismatch():
    with pytest.raises(ArchitectureMismatch, match="pe is 'rope' vs 'learned'"):
        check_same_architecture(build(byte_tiny(n_ctx=32, pe="rope")), build(byte_tiny(n_ctx=32, pe="learned")))
    with pytest.raises(ArchitectureMismatch, match="d_mlp is 64 vs 128"):
        check_same_architecture(build(byte_tiny(n_ctx=32)), build(byte_tiny(n_ctx=32, d_mlp=128)))


def test_run_pair_writes_a_complete_record_and_cli_matches(tmp_path, capsys):
    for s in (0, 1):
        save_model(build(byte_tiny(n_ctx=32), seed=s), tmp_path / f"m{s}")
    cfg = RunConfig(str(tmp_path / "m0"), str(tmp_path / "m1"), points=3, eval_items=1024)
    rec = run_pair(cfg)
    assert all(k in rec for k in REQUIRED) and rec["eval_tokens"] == 1024
    out = tmp_path / "r.json"
    rc = main(["interpolate", str(tmp_path / "m0"), str(tmp_path / "m1"), "--points", "3",
               "--eval-items", "1024", "--out", str(out)])
    assert rc == 0
    cli = load_record(out)
    assert cli["loss"] == rec["loss"] and cli["config_hash"] == rec["config_hash"]
    assert "barrier" in capsys.readouterr().out
    assert json.loads(out.read_text())["method"] == "naive"


def test_cli_reports_mismatch_in_one_line(tmp_path, capsys):
    save_model(build(byte_tiny(n_ctx=32, pe="rope")), tmp_path / "a")
    save_model(build(byte_tiny(n_ctx=32, pe="none")), tmp_path / "b")
    rc = main(["interpolate", str(tmp_path / "a"), str(tmp_path / "b"), "--points", "3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "pe is 'rope' vs 'none'" in err and "\n" not in err
    rc = main(["interpolate", "lm-nope-s9", str(tmp_path / "b")])
    assert rc == 2 and "neither a zoo model" in capsys.readouterr().err


@pytest.mark.slow
def test_hf_checkpoint_with_its_own_tokenizer_is_evaluated_with_it(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.data import load_text
    from engine.evaluate import eval_set_for
    from engine.models import hf_gpt2, load_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([load_text()[:200_000]], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    n_vocab = len(tok)
    model = hf_gpt2.build({"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": n_vocab}, seed=0)
    save_model(model, tmp_path / "gpt2")
    tok.save_pretrained(str(tmp_path / "gpt2"))
    m = load_model(tmp_path / "gpt2")
    es = eval_set_for(m, "test", 2048)
    assert "hf:gpt2" in es.description and int(es.inputs.max()) < n_vocab
    assert int(es.inputs.max()) >= 256  # merged tokens, not bytes
    assert evaluate(m, es)["loss"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offloaded_path_equals_the_plain_path(dtype):
    a, b = build(byte_tiny(n_ctx=32), seed=0, dtype=dtype), build(byte_tiny(n_ctx=32), seed=1, dtype=dtype)
    plain, off = LinearPath(a, b), LinearPath(a, b, offload=True, device="cpu")
    for lam in (0.0, 0.3, 0.5, 0.9, 1.0):
        sp, so = plain.at(lam).module.state_dict(), off.at(lam).module.state_dict()
        assert all(torch.equal(sp[k], so[k]) for k in sp)
    assert torch.equal(off.at(1.0).module.blocks[0].attn.W_Q, b.module.blocks[0].attn.W_Q)
    es = lm_eval_set("val", 512, n_ctx=32)
    assert interpolate(a, b, es, points=3, offload=True)["loss"] == interpolate(a, b, es, points=3)["loss"]


def test_the_work_model_is_the_only_copy():
    a, b = build(byte_tiny(n_ctx=32), seed=0), build(byte_tiny(n_ctx=32), seed=1)
    path = LinearPath(a, b)
    work = {p.data_ptr() for p in path.work.module.parameters()}
    ends = {p.data_ptr() for m in (a, b) for p in m.module.parameters()}
    assert not work & ends
    assert all(v.data_ptr() in ends for v in (*path._sa.values(), *path._sb.values()))  # views of the endpoints
    assert torch.equal(path.work.module.blocks[0].mlp.W_in, a.module.blocks[0].mlp.W_in)  # starts as A


def test_path_placement_errors_are_one_sentence():
    a, b = build(byte_tiny(n_ctx=32), seed=0), build(byte_tiny(n_ctx=32), seed=1)
    with pytest.raises(LMCError, match="must both live on the path's device meta"):
        LinearPath(a, b, device="meta")
    b.module.to("meta")
    with pytest.raises(LMCError, match="keeps the endpoints on the CPU"):
        LinearPath(a, b, offload=True)
