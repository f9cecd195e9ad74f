"""Data for the data-driven aligners: training batches, and a fixed validation batch for model selection,
both held out from the evaluation split a record reports."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from engine.models.base import Arch

LM_CTX = 128


def train_batches(arch: Arch, batch: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (inputs, targets) from the training split (never the evaluation split)."""
    from engine.data import default_splits, digits_splits, image_batches, lm_batches

    if arch.task == "vit":
        return image_batches(digits_splits()["train"], batch, seed)
    n_ctx = min(arch.n_ctx, LM_CTX)
    if not arch.causal:  # a masked LM (docs/MATH.md section 9): bytes, the last id the mask
        from engine.data import BYTE_VOCAB, mlm_batches

        return mlm_batches(default_splits().train, batch, n_ctx, seed, arch.n_out - 1, BYTE_VOCAB)
    return ((w[:, :-1], w[:, 1:]) for w in lm_batches(default_splits().train, batch, n_ctx, seed))


def val_batch(arch: Arch, items: int) -> tuple[Tensor, Tensor]:
    """A fixed batch of the validation split: model selection inside an aligner, never reported as test."""
    from engine.evaluate import lm_eval_set, vit_eval_set

    if arch.task == "vit":
        es = vit_eval_set("val", items)
    elif not arch.causal:  # a masked LM: `items` positions, about 15% of them scored
        from engine.evaluate import mlm_eval_set

        es = mlm_eval_set("val", items, n_ctx=min(arch.n_ctx, LM_CTX), vocab=arch.n_out)
    else:
        n_ctx = min(arch.n_ctx, LM_CTX)
        es = lm_eval_set("val", items, n_ctx=n_ctx)
    return es.inputs, es.targets
