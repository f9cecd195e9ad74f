"""Training reference models: AdamW, linear warmup then cosine decay, one seed for init and data order.

The saved checkpoint is the one with the lowest validation loss among the evaluation points (for the
LMs, whose validation loss falls monotonically under the cosine schedule, that is the last one; the
small digits ViTs overfit late in training).

`seed` sets both the initialisation and the order of training batches, the same policy for every
positional encoding, so two seeds of one configuration differ exactly as "trained from different
random seeds" does in the LMC literature.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from engine import train_state
from engine.data import default_splits, digits_sha256, digits_splits, image_batches, lm_batches
from engine.errors import DataError, LMCError
from engine.evaluate import evaluate, lm_eval_set, vit_eval_set
from engine.models import save_model
from engine.models.base import Model
from engine.models.io import check_output_dir, write_json_atomic
from engine.models.reference import RefConfig, build


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_items: int = 32_768  # validation tokens / images per curve point
    threads: int = 0  # 0: leave torch's default
    augment: bool = False  # ViT: random one-pixel shifts
    ema_decay: float = 0.0  # > 0: evaluate and keep an exponential moving average of the weights
    train_bytes: int | None = None  # LM: train on the first this many tokens of the train split only (None: all)
    dropout: float = 0.0  # residual dropout: each attention and MLP output, in training only (GPT-2's resid_pdrop)


LM_TRAIN = TrainConfig()
VIT_TRAIN = TrainConfig(steps=4000, batch=64, lr=2e-3, warmup=200, weight_decay=0.05, eval_every=200, augment=True,
                        ema_decay=0.995)


def lm_config(pe: str, **kw) -> RefConfig:
    """The zoo's LM: 4 layers, D 128, 4 heads, context 128, byte-level."""
    return RefConfig(task="lm", n_layers=4, d_model=128, n_heads=4, d_mlp=512, n_ctx=128, pe=pe, **kw)


def vit_config(pe: str, **kw) -> RefConfig:
    """The zoo's ViT on 8x8 digits: patch 2 (16 patches + class token), 4 layers, D 64, 4 heads."""
    return RefConfig(task="vit", n_layers=4, d_model=64, n_heads=4, d_mlp=256, pe=pe, patch_size=2, **kw)


def shift_augment(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Translate each digit by up to one pixel (zero fill): 8x8 digits overfit a ViT without it.

    The shifts come from the global generator, which `train` seeds, so runs stay reproducible.
    """
    x, y = batch
    B, C, H, W = x.shape
    padded = F.pad(x, (1, 1, 1, 1))  # [B, C, H + 2, W + 2]
    di, dj = torch.randint(0, 3, (2, B))
    rows = (di[:, None] + torch.arange(H))[:, None, :, None].expand(B, C, H, W + 2)  # [B, C, H, W + 2]
    x = padded.gather(2, rows)  # [B, C, H, W + 2]
    cols = (dj[:, None] + torch.arange(W))[:, None, None, :].expand(B, C, H, W)  # [B, C, H, W]
    return x.gather(3, cols), y


def residual_dropout(net: torch.nn.Module, p: float) -> list:
    """Dropout on every attention and MLP output before it joins the residual stream, active only while
    the module trains (GPT-2's resid_pdrop); forward hooks, so the model and its saved config are those
    of a run without it. Returns the hooks' handles (none for p = 0)."""
    if not p:
        return []
    drop = (lambda m, args, out: F.dropout(out, p, training=m.training))
    return [part.register_forward_hook(drop) for b in net.blocks for part in (b.attn, b.mlp)]


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train(cfg: RefConfig, seed: int, tc: TrainConfig | None = None, out: Path | None = None,
          progress: bool = True, overwrite: bool = False, store_dtype: torch.dtype = torch.float32) -> tuple[Model, dict]:
    """Train one reference model; save checkpoint + metrics.json to `out` if given.

    `out` is checked before training (engine.models.io.check_output_dir: a non-empty directory the
    tool did not write needs `overwrite`), so a finished training is never lost to a bad location.
    With `out`, the run is resumable: its state is written at every validation point
    (engine.train_state) and an interrupted run of the same model, seed and recipe continues from
    there, to the same weights up to float summation order. `store_dtype` bfloat16 rounds the kept
    weights before the held-out evaluation and saves them so (the medium zoo tier: half the bytes);
    the metrics are those of the rounded model.
    """
    tc = tc or (LM_TRAIN if cfg.task == "lm" else VIT_TRAIN)
    if not (isinstance(tc.steps, int) and tc.steps >= 1 and isinstance(tc.eval_every, int) and tc.eval_every >= 1):
        raise LMCError(f"Training needs at least one step and an evaluation interval of at least one, "
                       f"not steps={tc.steps!r}, eval_every={tc.eval_every!r}.")
    if not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise LMCError(f"The training seed must be an integer from 0 to 2**32 - 1, not {seed!r}.")
    if out is not None:
        check_output_dir(out, overwrite, name="Training output directory")
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if not (isinstance(tc.dropout, (int, float)) and 0 <= tc.dropout < 1):
        raise LMCError(f"The dropout rate must be a fraction in [0, 1), not {tc.dropout!r}.")
    torch.manual_seed(seed)
    model = build(cfg, seed=seed)
    net = model.module
    hooks = residual_dropout(net, tc.dropout)
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    if cfg.task == "lm":
        splits = default_splits()
        batches = (lambda b: (b[:, :-1], b[:, 1:]))
        if tc.train_bytes is not None and tc.train_bytes > len(splits.train):
            raise DataError(f"The training subset of {tc.train_bytes:,} bytes is larger than the train split "
                            f"({len(splits.train):,} bytes).")
        tokens = splits.train if tc.train_bytes is None else splits.train[:tc.train_bytes]
        stream = map(batches, lm_batches(tokens, tc.batch, cfg.n_ctx, seed))
        val = lm_eval_set("val", tc.eval_items, cfg.n_ctx)
        data_hash = splits.sha256
    else:
        stream = image_batches(digits_splits()["train"], tc.batch, seed)
        stream = map(shift_augment, stream) if tc.augment else stream
        val = vit_eval_set("val", tc.eval_items)
        data_hash = digits_sha256()

    curve: list[dict] = []
    # The digits ViT's validation loss still jumps by 0.1-0.2 between evaluations late in training;
    # averaging the weights (time constant 1 / (1 - decay) steps) smooths that out.
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(tc.ema_decay)) if tc.ema_decay else None
    scored = replace(model, module=ema.module) if ema is not None else model  # the weights evaluated and kept
    smooth = None
    best: tuple[float, int, dict] = (float("inf"), 0, {})
    where = train_state.state_dir(out) if out is not None else None
    start, elapsed = 0, 0.0
    resumed = train_state.load(where, cfg.to_dict(), seed, tc) if where is not None else None
    if resumed is not None:
        net.load_state_dict(resumed.model)
        if ema is not None and resumed.ema is not None:
            ema.load_state_dict(resumed.ema)
        opt.load_state_dict(resumed.optimizer)
        for _ in range(resumed.step):  # the same data order: the streams are functions of the seed alone
            next(stream)
        torch.set_rng_state(resumed.rng)
        start, elapsed, smooth, curve = resumed.step, resumed.elapsed, resumed.smooth, resumed.curve
        best = (resumed.best_loss, resumed.best_step, resumed.best)
    t0 = time.perf_counter() - elapsed
    label = out.name if out is not None else f"{cfg.task}-{cfg.pe}-s{seed}"  # a zoo model's own name
    bar = tqdm(range(start, tc.steps), desc=f"train {label}", disable=not progress, initial=start, total=tc.steps)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        net.train()
        x, y = next(stream)
        logits = net(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), tc.grad_clip)
        opt.step()
        if ema is not None:
            ema.update_parameters(net)
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
            v = evaluate(scored, val)
            curve.append({"step": step + 1, "train_loss": smooth, "val_loss": v["loss"], "val_accuracy": v["accuracy"]})
            bar.set_postfix(train=f"{smooth:.3f}", val=f"{v['loss']:.3f}")
            if v["loss"] < best[0]:  # keep the checkpoint with the lowest validation loss
                best = (v["loss"], step + 1, {k: t.detach().clone() for k, t in scored.module.state_dict().items()})
            if where is not None and step + 1 < tc.steps:
                train_state.save(where, cfg.to_dict(), seed, tc, step + 1, smooth, curve, best,
                                 time.perf_counter() - t0, net, ema, opt)
    train_s = time.perf_counter() - t0
    for h in hooks:  # the kept model computes its function, with no trace of training's dropout
        h.remove()
    net.load_state_dict(best[2])
    if store_dtype != torch.float32:  # what is saved is what is measured
        with torch.no_grad():
            for t in net.parameters():
                t.copy_(t.to(store_dtype))

    test = lm_eval_set("test", None, cfg.n_ctx) if cfg.task == "lm" else vit_eval_set("test")
    held = evaluate(model, test)
    metrics = {
        "seed": seed, "steps": tc.steps, "best_step": best[1], "train_config": asdict(tc), "train_seconds": round(train_s, 1),
        "curve": curve, "test_loss": held["loss"], "test_accuracy": held["accuracy"],
        "test_set": test.description, "data_sha256": data_hash,
        "parameters": sum(p.numel() for p in net.parameters()),
    }
    if store_dtype != torch.float32:
        metrics["stored_dtype"] = str(store_dtype).removeprefix("torch.")
    if out is not None:
        saved = model if store_dtype == torch.float32 else replace(model, module=copy.deepcopy(net).to(store_dtype))
        save_model(saved, out, overwrite=overwrite)
        write_json_atomic(Path(out) / "metrics.json", metrics)
        train_state.clear(where)
    return model, metrics
