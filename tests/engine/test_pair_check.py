"""engine.api.check_pair: a pair is refused from its configs, before any weight is read, with one
sentence per cause that names A or B by its full path and the families plainly."""

from dataclasses import replace

import pytest

from engine import api, pipeline
from engine.errors import ArchitectureMismatch, ModelError
from engine.models import save_model
from engine.models.reference import RefConfig, build
from engine.results import RunConfig

TINY = RefConfig(n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=32)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    for name, cfg, seed in (("a", TINY, 0), ("b", TINY, 1), ("wide", replace(TINY, d_mlp=128), 0),
                            ("vit", replace(TINY, task="vit"), 0)):
        save_model(build(cfg, seed=seed), root / name)
    (root / "empty").mkdir()
    (root / "noconfig").mkdir()
    (root / "noconfig" / "model.safetensors").write_bytes(b"")
    return root


def test_family_labels_are_plain():
    from engine.models import FAMILIES
    from engine.pipeline import FAMILY_LABELS

    assert set(FAMILIES) <= set(FAMILY_LABELS)  # every family has a name in words
    assert [api.family_label(f, t) for f, t in (("hf_gpt2", "lm"), ("hf_llama", "lm"), ("hf_neox", "lm"),
                                                ("timm_vit", "vit"), ("reference", "lm"), ("reference", "vit"))] \
        == ["GPT-2 LM", "Llama LM", "GPT-NeoX LM", "ViT", "reference LM", "reference ViT"]


def test_a_good_pair_is_described_by_what_it_is(dirs):
    a, b = api.check_pair(str(dirs / "a"), str(dirs / "b"))
    assert (a.label, b.label, a.path, b.path) == ("reference LM", "reference LM", dirs / "a", dirs / "b")
    assert api.describe_pair(str(dirs / "a"), str(dirs / "b")) == \
        "Two reference LMs of the same shape: reference LM, 2 layers, D = 32, 4 heads, RoPE."
    assert "same directory" in api.describe_pair(str(dirs / "a"), str(dirs / "a"))


def test_a_zoo_pair_says_how_long_its_recipe_trained():
    """Barriers compare only between pairs trained alike, so the description names the step budget."""
    assert api.describe_pair("lm-none-s0", "lm-none-s1").endswith(
        "the same recipe trained for 3,000 steps from seeds 0 and 1 (initialisation and data order).")
    assert "trained for 1,000 steps" in api.describe_pair("lm-learned-s0", "lm-learned-s1")
    assert "trained for 4,000 steps" in api.describe_pair("vit-rope-s0", "vit-rope-s1")


@pytest.mark.parametrize("a, b, error, text", [
    ("a", "vit", ArchitectureMismatch, "Model A is a reference LM and model B a reference ViT: "),
    ("a", "wide", ArchitectureMismatch, "Models A and B are both reference LMs but of different shapes (d_mlp"),
    ("a", "empty", ModelError, "Model B directory {root}/empty is empty"),
    ("noconfig", "a", ModelError, "Model A directory {root}/noconfig has no config.json"),
    ("a", "missing", ModelError, "Model B {root}/missing is neither a zoo model nor an existing directory."),
    ("a", "a/config.json", ModelError, "Model B {root}/a/config.json is neither a zoo model nor a model directory"),
])
def test_each_cause_has_its_own_sentence_naming_the_full_path(dirs, a, b, error, text):
    with pytest.raises(error) as e:
        api.check_pair(str(dirs / a), str(dirs / b))
    msg = str(e.value)
    assert msg.startswith(text.format(root=dirs)) and "\n" not in msg
    if error is ArchitectureMismatch:
        assert f"A: {dirs / a}, B: {dirs / b}" in msg


def test_run_pair_refuses_a_mismatch_before_loading(dirs, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pipeline, "load_named", no_loading)
    with pytest.raises(ArchitectureMismatch, match="reference LM and model B a reference ViT"):
        api.run_pair(RunConfig(str(dirs / "a"), str(dirs / "vit")))
