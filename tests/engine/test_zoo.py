"""The zoo's definitions: names, widths, pairs and the manifest (no training: metrics files are written by hand)."""

import json
from dataclasses import replace

from engine import zoo
from engine.train import lm_config, vit_config


def test_names_say_task_pe_width_and_seed():
    for name, e in zoo.ENTRIES.items():
        width = f"-w{e.width}" if e.width else ""
        assert name == f"{e.task}-{e.pe}{width}-s{e.seed}"


def test_a_wide_entry_is_the_same_recipe_at_its_width():
    wide = [e for e in zoo.ENTRIES.values() if e.width]
    assert wide, "the zoo has at least one wider pair"
    for e in wide:
        base = lm_config(e.pe) if e.task == "lm" else vit_config(e.pe)
        assert e.config() == replace(base, d_model=e.width, d_mlp=4 * e.width)
        assert e.config().d_model > base.d_model
        assert e.train_config() == zoo.ZooEntry(e.name, e.task, e.pe, e.seed).train_config()


def test_pairs_join_seeds_of_one_architecture_only():
    pairs = zoo.pairs()
    assert ("vit-learned-w128-s0", "vit-learned-w128-s1") in pairs
    for a, b in pairs:
        ea, eb = zoo.ENTRIES[a], zoo.ENTRIES[b]
        assert (ea.task, ea.pe, ea.width) == (eb.task, eb.pe, eb.width) and ea.seed != eb.seed
    assert len(pairs) == len(zoo.ENTRIES) // 2


def test_the_manifest_gives_each_model_its_width(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path))
    for name in ("vit-learned-s0", "vit-learned-w128-s0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(
            {"parameters": 1, "test_loss": 0.1, "test_accuracy": 0.97, "steps": 4000}))
    rows = {r["name"]: r for r in zoo.write_manifest()}
    assert rows["vit-learned-s0"]["d_model"] == 64 and rows["vit-learned-w128-s0"]["d_model"] == 128
    assert [r["name"] for r in zoo.manifest()] == list(rows)
