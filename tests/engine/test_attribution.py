"""Barrier attribution (engine.attribution): the midpoint barrier by layer and by symmetry class."""

from __future__ import annotations

import pytest
import torch
from ref_models import random_model, tiny

from engine.api import run_pair
from engine.attribution import block_of, blocks, skipped
from engine.models import canonical, save_model, set_canonical
from engine.results import RunConfig

N_CTX = 16
EVAL_TOKENS = 8 * N_CTX


def one_layer_permuted(seed: int, layer: int):
    """A model and the same model with layer `layer`'s MLP neurons permuted: the same function, whose
    weights differ in that layer alone."""
    a = random_model(tiny(n_ctx=N_CTX, vocab_size=256), seed, std=0.3)
    b = random_model(tiny(n_ctx=N_CTX, vocab_size=256), seed, std=0.3)
    p = canonical(b)
    perm = torch.randperm(p[f"blocks.{layer}.mlp.W_in"].shape[1], generator=torch.Generator().manual_seed(7))
    p[f"blocks.{layer}.mlp.W_in"] = p[f"blocks.{layer}.mlp.W_in"][:, perm]
    p[f"blocks.{layer}.mlp.W_out"] = p[f"blocks.{layer}.mlp.W_out"][perm]
    set_canonical(b, p)
    return a, b


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("attr")
    a, b = one_layer_permuted(0, layer=1)
    save_model(a, root / "a")
    save_model(b, root / "b")
    return str(root / "a"), str(root / "b")


def test_a_pair_misaligned_in_one_layer_puts_the_whole_barrier_on_that_layer(planted):
    rec = run_pair(RunConfig(*planted, "naive", points=3, eval_items=EVAL_TOKENS, dtype="float64"), train_curve=False)
    at = rec["attribution"]
    assert rec["midpoint_barrier"] > 0.01  # a real barrier: the permuted MLP does not average with A's
    assert at["midpoint_barrier"] == pytest.approx(rec["midpoint_barrier"], rel=1e-12)
    rows = {(r["block"], r["part"]): r for r in at["blocks"]}
    assert rows[("layer 1", "all")]["excess"] == pytest.approx(rec["midpoint_barrier"], rel=1e-12)
    assert rows[("layer 1", "mlp")]["excess"] == pytest.approx(rec["midpoint_barrier"], rel=1e-12)
    for key in [("embedding", "all"), ("layer 0", "all"), ("layer 0", "attention"), ("layer 0", "mlp"),
                ("layer 1", "attention"), ("head", "all")]:
        assert rows[key]["excess"] == 0.0, key  # equal at both ends: nothing there
    assert at["sum_of_layers"] == pytest.approx(rec["midpoint_barrier"], rel=1e-12)
    assert at["classes"] == []  # naive: no element to take classes out of


def test_weight_matching_removes_the_planted_layer_and_the_classes_say_what_it_took(planted):
    rec = run_pair(RunConfig(*planted, "weight", classes=("mlp",), points=3, eval_items=EVAL_TOKENS,
                             dtype="float64"), train_curve=False)
    at = rec["attribution"]
    assert rec["barrier"] == pytest.approx(0.0, abs=1e-9)  # the permutation is recovered exactly
    assert all(abs(r["excess"]) < 1e-9 for r in at["blocks"])
    (only,) = at["classes"]
    assert only["class"] == "mlp"
    # without the MLP permutation B is back in its own coordinates: the naive barrier returns
    naive = run_pair(RunConfig(*planted, "naive", points=3, eval_items=EVAL_TOKENS, dtype="float64"),
                     train_curve=False, attribution=False)
    assert only["midpoint_barrier"] == pytest.approx(naive["midpoint_barrier"], rel=1e-9)
    assert only["rise"] == pytest.approx(naive["midpoint_barrier"] - at["midpoint_barrier"], rel=1e-9)
    assert "attribution" not in naive


def test_a_random_pair_with_every_class_has_one_row_per_layer_part_and_one_per_class(tmp_path):
    for seed in (0, 1):
        save_model(random_model(tiny(n_ctx=N_CTX, vocab_size=256), seed, std=0.1), tmp_path / f"m{seed}")
    rec = run_pair(RunConfig(str(tmp_path / "m0"), str(tmp_path / "m1"), "weight", points=3, eval_items=EVAL_TOKENS,
                             dtype="float64"), train_curve=False)
    at = rec["attribution"]
    assert [(r["block"], r["part"]) for r in at["blocks"]] == [
        ("embedding", "all"), ("layer 0", "all"), ("layer 0", "attention"), ("layer 0", "mlp"),
        ("layer 1", "all"), ("layer 1", "attention"), ("layer 1", "mlp"), ("head", "all")]
    assert [c["class"] for c in at["classes"]] == ["heads", "mlp", "qk", "vo", "residual"]
    assert at["midpoint_barrier"] == pytest.approx(rec["midpoint_barrier"], rel=1e-9)
    for c in at["classes"]:
        assert c["rise"] == pytest.approx(c["midpoint_barrier"] - at["midpoint_barrier"], abs=1e-12)
    assert rec["timings"]["attribution"] == round(at["seconds"], 3) and at["seconds"] > 0


@pytest.mark.parametrize(("key", "expected"), [
    ("embed.tok", ("embedding", None, "all")),
    ("blocks.2.norm1.g", ("layer 2", 2, "attention")),
    ("blocks.2.norm2.g", ("layer 2", 2, "mlp")),
    ("transformer.h.11.ln_2.weight", ("layer 11", 11, "mlp")),
    ("model.layers.3.post_attention_layernorm.weight", ("layer 3", 3, "mlp")),
    ("model.layers.3.self_attn.o_proj.weight", ("layer 3", 3, "attention")),
    ("gpt_neox.embed_in.weight", ("embedding", None, "all")),
    ("embed_out.weight", ("head", None, "all")),
    ("transformer.ln_f.bias", ("head", None, "all")),
    ("cls_token", ("embedding", None, "all")),
    ("fc_norm.weight", ("head", None, "all")),
])
def test_every_family_s_keys_fall_in_their_block(key, expected):
    assert block_of(key) == expected


def test_blocks_come_in_path_order():
    keys = ["head.W", "blocks.10.mlp.W_in", "blocks.2.attn.W_Q", "embed.tok", "norm_f.g"]
    assert [(n, p) for n, _, p, _ in blocks(keys)] == [
        ("embedding", "all"), ("layer 2", "all"), ("layer 2", "attention"), ("layer 10", "all"),
        ("layer 10", "mlp"), ("head", "all")]


def test_a_record_s_attribution_is_checked_before_use(planted):
    from engine.results import record_problem

    rec = run_pair(RunConfig(*planted, "weight", classes=("mlp",), points=3, eval_items=EVAL_TOKENS), train_curve=False)
    assert record_problem(rec) is None
    at = rec["attribution"]
    for bad, says in [
        ("oops", "field 'attribution' must be an object"),
        (at | {"midpoint_barrier": "0.1"}, "field 'attribution.midpoint_barrier' must be a number"),
        (at | {"blocks": []}, "field 'attribution.blocks' must be a list of 1 to"),
        (at | {"blocks": [at["blocks"][0] | {"part": "ffn"}]}, "field 'attribution.blocks[0].part' must be all,"),
        (at | {"blocks": [at["blocks"][0] | {"excess": None}]}, "field 'attribution.blocks[0].excess' must be a number"),
        (at | {"classes": [{"class": "mlp", "rise": 1.0}]}, "field 'attribution.classes[0]' must be an object with"),
        (at | {"classes": {"mlp": 1.0}}, "field 'attribution.classes' must be a list"),
    ]:
        assert says in record_problem(rec | {"attribution": bad})
    assert record_problem({k: v for k, v in rec.items() if k != "attribution"}) is None  # older records: fine


def test_a_tied_embedding_is_one_block_whatever_names_it_has(tmp_path):
    """HF GPT-2 ties lm_head.weight to transformer.wte.weight: two names, one tensor, one block (the
    embedding's). Two models that differ in that tensor alone put the whole barrier there."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=N_CTX, vocab_size=256, initializer_range=0.2)
    a = GPT2LMHeadModel(cfg)
    b = GPT2LMHeadModel(cfg)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.transformer.wte.weight.add_(0.3 * torch.randn(b.transformer.wte.weight.shape))
    assert b.lm_head.weight.data_ptr() == b.transformer.wte.weight.data_ptr()
    for name, m in (("a", a), ("b", b)):
        m.save_pretrained(tmp_path / name, safe_serialization=True)
    rec = run_pair(RunConfig(str(tmp_path / "a"), str(tmp_path / "b"), "naive", points=3, eval_items=EVAL_TOKENS,
                             dtype="float64"), train_curve=False)
    rows = {(r["block"], r["part"]): r["excess"] for r in rec["attribution"]["blocks"]}
    assert abs(rec["midpoint_barrier"]) > 1e-3
    assert rows[("embedding", "all")] == pytest.approx(rec["midpoint_barrier"], rel=1e-9)
    assert all(v == 0.0 for k, v in rows.items() if k != ("embedding", "all"))


TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048}


def test_by_default_the_attribution_runs_unless_it_would_dwarf_the_path():
    from engine.models import arch_from_config
    from engine.models.io import read_config
    from engine.zoo import resolve

    for name in ("lm-learned-s0", "lm-learned-medium-s0", "vit-rope-s0"):  # every zoo pair, any path
        arch = arch_from_config(read_config(resolve(name))).to_dict()
        assert all(skipped(m, arch, n, k) is None for m in ("naive", "dual") for n in (360, 65_536) for k in (2, 21))
    big = arch_from_config(TINYLLAMA).to_dict()
    assert skipped("weight", big, 65_536, 21) is None  # 1.7 times the path's items
    why = skipped("weight", big, 1024, 3)
    assert why == ("Barrier attribution skipped: its 145 evaluations of 1,024 tokens would score 48 times the "
                   "3-point path's 3,072 (by default it runs when it costs at most 2 times the path's own "
                   "evaluations, or about a minute).")


def test_a_skipped_attribution_is_recorded_and_said_and_can_be_forced(planted, monkeypatch, capsys):
    from app.figures.alignment import attribution_missing
    from engine import attribution
    from engine.cli import main
    from engine.results import record_problem

    monkeypatch.setattr(attribution, "FREE_FLOP", 0.0)
    monkeypatch.setattr(attribution, "PATH_SHARE", 0.5)
    cfg = RunConfig(*planted, "weight", classes=("mlp",), points=3, eval_items=EVAL_TOKENS)
    rec = run_pair(cfg, train_curve=False)
    assert "attribution" not in rec and rec["attribution_skipped"].startswith("Barrier attribution skipped: its ")
    assert record_problem(rec) is None
    assert attribution_missing(rec).endswith("The CLI's `--attribution` runs it.")
    assert run_pair(cfg, train_curve=False, attribution=True)["attribution"]["blocks"]
    assert main(["align", *planted, "--method", "weight", "--classes", "mlp", "--points", "3", "--eval-items",
                 str(EVAL_TOKENS)]) == 0
    assert "--attribution runs it." in capsys.readouterr().out
    assert main(["align", *planted, "--method", "weight", "--classes", "mlp", "--points", "3", "--eval-items",
                 str(EVAL_TOKENS), "--attribution"]) == 0
    assert "barrier attribution (midpoint barrier" in capsys.readouterr().out
