"""An interrupted training run resumes from its last validation point (engine.train_state)."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from engine import train_state
from engine.models import load_model
from engine.train import LM_TRAIN, VIT_TRAIN, lm_config, train, vit_config

LM = replace(lm_config("learned"), n_layers=2, d_model=32, d_mlp=64, n_ctx=32)
LM_TC = replace(LM_TRAIN, steps=12, eval_every=4, warmup=3, eval_items=512)
VIT = replace(vit_config("rope"), n_layers=1, d_model=16, d_mlp=32)
VIT_TC = replace(VIT_TRAIN, steps=12, eval_every=4, warmup=3, eval_items=64)


def interrupted(cfg, tc, out, at_step: int) -> None:
    """Train into `out`, killed (KeyboardInterrupt) inside optimiser step `at_step`."""
    orig, calls = torch.optim.AdamW.step, [0]

    def step(self, *a, **k):
        calls[0] += 1
        if calls[0] == at_step:
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    torch.optim.AdamW.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg, 3, tc, out=out, progress=False)
    finally:
        torch.optim.AdamW.step = orig


@pytest.mark.parametrize(("cfg", "tc"), [(LM, LM_TC), (VIT, VIT_TC)], ids=["lm", "vit-ema-augment"])
def test_a_resumed_run_ends_with_the_weights_and_curve_of_an_uninterrupted_one(tmp_path, cfg, tc):
    _, whole = train(cfg, 3, tc, out=tmp_path / "whole", progress=False)
    interrupted(cfg, tc, tmp_path / "part", at_step=10)  # after the checks at steps 4 and 8
    where = train_state.state_dir(tmp_path / "part")
    assert sorted(p.name for p in where.iterdir()) == ["state.json", "state.safetensors"]
    _, resumed = train(cfg, 3, tc, out=tmp_path / "part", progress=False)
    assert resumed["curve"] == whole["curve"]  # the same validation losses at every check, resumed or not
    assert resumed["test_loss"] == whole["test_loss"]
    a, b = load_model(tmp_path / "whole"), load_model(tmp_path / "part")
    for (k, u), v in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(u, v), k
    assert not where.exists()  # a finished run leaves no state behind


def test_another_run_s_state_is_not_resumed(tmp_path):
    interrupted(LM, LM_TC, tmp_path / "m", at_step=6)
    other = replace(LM_TC, lr=1e-3)
    assert train_state.load(train_state.state_dir(tmp_path / "m"), LM.to_dict(), 3, other) is None
    assert train_state.load(train_state.state_dir(tmp_path / "m"), LM.to_dict(), 4, LM_TC) is None
    assert train_state.load(train_state.state_dir(tmp_path / "m"), LM.to_dict(), 3, LM_TC).step == 4


def test_a_state_torn_between_its_two_writes_is_ignored(tmp_path):
    interrupted(LM, LM_TC, tmp_path / "m", at_step=10)
    where = train_state.state_dir(tmp_path / "m")
    meta = (where / "state.json").read_text()
    (where / "state.json").write_text(meta.replace('"step": 8', '"step": 4'))  # tensors of step 8, JSON of step 4
    assert train_state.load(where, LM.to_dict(), 3, LM_TC) is None


def test_bfloat16_storage_saves_and_measures_the_rounded_weights(tmp_path):
    model, met = train(LM, 3, LM_TC, out=tmp_path / "m", progress=False, store_dtype=torch.bfloat16)
    assert met["stored_dtype"] == "bfloat16"
    loaded = load_model(tmp_path / "m")
    for (k, u), v in zip(model.module.state_dict().items(), loaded.module.state_dict().values()):
        assert torch.equal(u, v), k  # the model measured is exactly the model saved
        assert torch.equal(v, v.to(torch.bfloat16).float()), k


def test_a_training_subset_draws_every_batch_from_its_first_bytes(tmp_path, monkeypatch):
    import engine.train as train_mod
    from engine.data import default_splits
    from engine.errors import DataError

    seen = []
    real = train_mod.lm_batches

    def spy(tokens, *a, **k):
        seen.append(tokens)
        return real(tokens, *a, **k)

    monkeypatch.setattr(train_mod, "lm_batches", spy)
    small = replace(LM_TC, steps=2, eval_every=2, train_bytes=4096)
    _, met = train(LM, 3, small, out=tmp_path / "m", progress=False)
    assert torch.equal(seen[0], default_splits().train[:4096]) and met["train_config"]["train_bytes"] == 4096
    _, whole = train(LM, 3, replace(small, train_bytes=None), progress=False)
    assert len(seen[1]) == len(default_splits().train) and whole["curve"] != met["curve"]
    # the whole split is the run without the field: its resume identity is unchanged
    assert train_state._identity(LM.to_dict(), 3, LM_TC)["train_config"] == \
        {k: v for k, v in asdict(LM_TC).items() if k not in ("train_bytes", "dropout")}
    with pytest.raises(DataError, match="larger than the train split"):
        train(LM, 3, replace(small, train_bytes=10**9), progress=False)


def test_residual_dropout_acts_in_training_only_and_leaves_no_hook_on_the_kept_model(tmp_path):
    from engine.errors import LMCError
    from engine.train import residual_dropout

    short = replace(LM_TC, steps=4, eval_every=4)
    _, met0 = train(LM, 3, short, progress=False)
    dropped, met = train(LM, 3, replace(short, dropout=0.5), out=tmp_path / "m", progress=False)
    assert met["train_config"]["dropout"] == 0.5 and met["curve"] != met0["curve"]  # the same seed, other steps
    net = dropped.module
    assert not any(m._forward_hooks for m in net.modules())  # the model kept computes its own function
    x = torch.randint(0, 256, (2, 16))
    net.train()
    assert torch.equal(net(x), net(x))  # no dropout left, even in training mode
    handles = residual_dropout(net, 0.5)
    assert len(handles) == 2 * LM.n_layers and not torch.equal(net(x), net(x))  # hooks drop in training
    net.eval()
    assert torch.equal(net(x), net(x))  # and never in evaluation
    for h in handles:
        h.remove()
    with pytest.raises(LMCError, match="dropout rate must be a fraction"):
        train(LM, 3, replace(short, dropout=1.0), progress=False)


@pytest.mark.parametrize(("tier", "shape"), [("small", (4, 128, 512)), ("medium", (6, 256, 1024))])
def test_train_cli_tier_picks_the_lm_shape(tmp_path, monkeypatch, capsys, tier, shape):
    from engine import cli

    seen = {}

    def fake_train(cfg, seed, tc, out=None, **kw):
        seen.update(cfg=cfg, tc=tc)
        return None, {"test_loss": 1.0, "test_accuracy": None, "steps": tc.steps, "train_seconds": 0.0}

    monkeypatch.setattr("engine.train.train", fake_train)
    cli.main(["train", "--task", "lm", "--pe", "learned", "--tier", tier, "--dropout", "0.2", "--steps", "5",
              "--out", str(tmp_path / "m")])
    cfg = seen["cfg"]
    assert (cfg.n_layers, cfg.d_model, cfg.d_mlp) == shape and cfg.n_heads == 4
    assert seen["tc"].dropout == 0.2 and seen["tc"].steps == 5
    assert "saved" in capsys.readouterr().out
