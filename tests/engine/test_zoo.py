"""The zoo's definitions: names, widths, pairs and the manifest (no training: metrics files are written by hand)."""

import json
from dataclasses import replace

import torch

from engine import zoo
from engine.train import lm_config, vit_config

# The built models (assets/zoo/, cached_results/): name -> task, PE, width, tier, seed.
NAMES = {
    "lm-none-s0": ("lm", "none", None, "small", 0), "lm-none-s1": ("lm", "none", None, "small", 1),
    "lm-learned-s0": ("lm", "learned", None, "small", 0), "lm-learned-s1": ("lm", "learned", None, "small", 1),
    "lm-sinusoidal-s0": ("lm", "sinusoidal", None, "small", 0),
    "lm-sinusoidal-s1": ("lm", "sinusoidal", None, "small", 1),
    "lm-rope-s0": ("lm", "rope", None, "small", 0), "lm-rope-s1": ("lm", "rope", None, "small", 1),
    "vit-learned-s0": ("vit", "learned", None, "small", 0), "vit-learned-s1": ("vit", "learned", None, "small", 1),
    "vit-sinusoidal-s0": ("vit", "sinusoidal", None, "small", 0),
    "vit-sinusoidal-s1": ("vit", "sinusoidal", None, "small", 1),
    "vit-rope-s0": ("vit", "rope", None, "small", 0), "vit-rope-s1": ("vit", "rope", None, "small", 1),
    "vit-learned-w128-s0": ("vit", "learned", 128, "small", 0),
    "vit-learned-w128-s1": ("vit", "learned", 128, "small", 1),
    "lm-learned-medium-s0": ("lm", "learned", None, "medium", 0),
    "lm-learned-medium-s1": ("lm", "learned", None, "medium", 1),
    "lm-rope-medium-s0": ("lm", "rope", None, "medium", 0), "lm-rope-medium-s1": ("lm", "rope", None, "medium", 1),
    "vit-learned-s2": ("vit", "learned", None, "small", 2),
    "lm-learned-dropout-s0": ("lm", "learned", None, "small", 0),
    "lm-learned-dropout-s1": ("lm", "learned", None, "small", 1),
    "lm-learned-medium-dropout-s0": ("lm", "learned", None, "medium", 0),
    "lm-learned-medium-dropout-s1": ("lm", "learned", None, "medium", 1),
}


def test_names_say_task_pe_width_tier_and_seed():
    assert {n: (e.task, e.pe, e.width, e.tier, e.seed) for n, e in zoo.ENTRIES.items()} == NAMES
    assert all(e.name == n for n, e in zoo.ENTRIES.items())


def test_the_medium_tier_is_the_reference_shape_on_the_same_recipe_stored_in_bfloat16():
    from engine.train import LM_TRAIN

    medium = [e for e in zoo.ENTRIES.values() if e.tier == "medium"]
    assert {e.name for e in medium} >= {"lm-learned-medium-s0", "lm-learned-medium-s1"}
    for e in medium:
        cfg = e.config()
        assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.d_mlp, cfg.n_ctx) == \
            (6, 256, 4, 64, 1024, 128)
        assert replace(cfg, n_layers=4, d_model=128, d_mlp=512) == lm_config(e.pe)  # all else as the small LM
        assert e.train_config() == replace(LM_TRAIN, dropout=e.dropout) and e.store_dtype == torch.bfloat16
    assert all(e.store_dtype == torch.float32 for e in zoo.ENTRIES.values() if e.tier == "small")


def test_a_wide_entry_is_the_same_recipe_at_its_width():
    wide = [e for e in zoo.ENTRIES.values() if e.width]
    assert wide, "the zoo has at least one wider pair"
    for e in wide:
        base = lm_config(e.pe) if e.task == "lm" else vit_config(e.pe)
        assert e.config() == replace(base, d_model=e.width, d_mlp=4 * e.width)
        assert e.config().d_model > base.d_model
        assert e.train_config() == zoo.ZooEntry(e.name, e.task, e.pe, e.seed).train_config()


def test_a_dropout_entry_is_the_recipe_trained_with_residual_dropout():
    for e in (x for x in zoo.ENTRIES.values() if x.dropout):
        base = zoo.ZooEntry(e.name, e.task, e.pe, e.seed, tier=e.tier)
        assert e.config() == base.config() and e.store_dtype == base.store_dtype  # the same architecture
        assert e.train_config() == replace(base.train_config(), dropout=e.dropout) and 0 < e.dropout < 1
    assert zoo.ENTRIES["lm-learned-dropout-s1"].dropout == 0.1
    assert ("lm-learned-dropout-s0", "lm-learned-dropout-s1") in zoo.pairs()
    assert not any({a, b} == {"lm-learned-s0", "lm-learned-dropout-s1"} for a, b in zoo.pairs())
    # at the medium tier too: the medium shape, stored in bfloat16, paired with its own seed only
    e = zoo.ENTRIES["lm-learned-medium-dropout-s0"]
    assert (e.tier, e.dropout, e.config().d_model, e.store_dtype) == ("medium", 0.1, 256, torch.bfloat16)
    assert ("lm-learned-medium-dropout-s0", "lm-learned-medium-dropout-s1") in zoo.pairs()
    assert not any({a, b} & {"lm-learned-medium-dropout-s0"} and {a, b} & {"lm-learned-medium-s1",
                                                                     "lm-learned-dropout-s1"} for a, b in zoo.pairs())


def test_pairs_join_seeds_of_one_architecture_only():
    pairs = zoo.pairs()
    assert ("vit-learned-w128-s0", "vit-learned-w128-s1") in pairs
    assert ("lm-learned-medium-s0", "lm-learned-medium-s1") in pairs and ("lm-learned-s0", "lm-learned-medium-s1") not in pairs
    for a, b in pairs:
        ea, eb = zoo.ENTRIES[a], zoo.ENTRIES[b]
        assert (ea.task, ea.pe, ea.width, ea.tier, ea.dropout) == (eb.task, eb.pe, eb.width, eb.tier, eb.dropout)
        assert ea.seed != eb.seed
    assert len(pairs) == sum(e.seed == 0 for e in zoo.ENTRIES.values())


def test_a_further_seed_is_its_recipe_with_another_seed_and_joins_no_pair():
    e, s0 = zoo.ENTRIES["vit-learned-s2"], zoo.ENTRIES["vit-learned-s0"]
    assert (e.task, e.pe, e.seed, e.width, e.tier) == ("vit", "learned", 2, None, "small")
    assert e.config() == s0.config() and e.train_config() == s0.train_config() and e.store_dtype == s0.store_dtype
    assert all("vit-learned-s2" not in p for p in zoo.pairs()) and ("vit-learned-s0", "vit-learned-s1") in zoo.pairs()
    assert {n for n, x in zoo.ENTRIES.items() if x.seed not in zoo.SEEDS} == {"vit-learned-s2"}


def test_the_manifest_gives_each_model_its_width(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path))
    for name in ("vit-learned-s0", "vit-learned-w128-s0", "lm-learned-medium-s0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(
            {"parameters": 1, "test_loss": 0.1, "test_accuracy": 0.97, "steps": 4000}
            | ({"stored_dtype": "bfloat16"} if "medium" in name else {})))
    rows = {r["name"]: r for r in zoo.write_manifest()}
    assert rows["vit-learned-s0"]["d_model"] == 64 and rows["vit-learned-w128-s0"]["d_model"] == 128
    assert [rows["lm-learned-medium-s0"][k] for k in ("d_model", "n_layers", "tier", "stored_dtype")] == \
        [256, 6, "medium", "bfloat16"]
    assert rows["vit-learned-s0"]["tier"] == "small" and rows["vit-learned-s0"]["stored_dtype"] == "float32"
    assert [r["name"] for r in zoo.manifest()] == list(rows)
