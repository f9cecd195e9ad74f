"""Held-out evaluation: fixed evaluation sets and the mean loss (nats per token) / accuracy of a model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.data import HFTokenizer, Tokenizer, default_splits, digits_splits, lm_eval_windows, load_text, split_text
from engine.errors import DataError
from engine.models import Model, model_logits

DEFAULT_LM_CTX = 128


@dataclass(frozen=True)
class EvalSet:
    task: str  # "lm" | "vit"
    inputs: torch.Tensor  # [N, T] token ids, or [N, C, H, W] images
    targets: torch.Tensor  # [N, T] next tokens, or [N] labels
    description: str  # what the set is, for records and captions

    @property
    def size(self) -> int:
        """Scored tokens (LM) or images (ViT)."""
        return self.targets.numel()


def lm_eval_set(
    split: str = "test",
    max_tokens: int | None = None,
    n_ctx: int = DEFAULT_LM_CTX,
    text: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> EvalSet:
    """Non-overlapping windows of a split of the Austen corpus (or of `text`)."""
    if text is None and tokenizer is None:
        splits = default_splits()
        source = "austen"
    else:
        splits = split_text(text if text is not None else load_text(), tokenizer)
        source = "austen" if text is None else "user text"
    w = lm_eval_windows(splits.split(split), n_ctx, max_tokens)  # [n, n_ctx + 1]
    tok = getattr(tokenizer, "name", "bytes")
    return EvalSet("lm", w[:, :-1], w[:, 1:], f"{source}/{split}, {w.shape[0] * n_ctx:,} tokens ({tok}), context {n_ctx}")


def vit_eval_set(split: str = "test", max_images: int | None = None) -> EvalSet:
    s = digits_splits()
    if split not in s:
        raise DataError(f"Unknown split {split!r}; expected train, val or test.")
    x, y = s[split].x, s[split].y
    if max_images is not None:
        x, y = x[:max_images], y[:max_images]
    return EvalSet("vit", x, y, f"digits/{split}, {len(y):,} images")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def tokenizer_for(model: Model) -> Tokenizer | None:
    """The checkpoint's own tokenizer when its directory ships one, else None (bytes)."""
    if model.path is not None and any((Path(model.path) / f).is_file() for f in TOKENIZER_FILES):
        return HFTokenizer(model.path)
    return None


def eval_set_for(model: Model, split: str = "test", max_items: int | None = None) -> EvalSet:
    if model.arch.task == "vit":
        return vit_eval_set(split, max_items)
    tok = tokenizer_for(model)
    if tok is not None and tok.vocab_size > model.arch.n_out:
        raise DataError(f"The tokenizer in {model.path} has {tok.vocab_size} tokens, more than the "
                        f"model's vocabulary of {model.arch.n_out}.")
    return lm_eval_set(split, max_items, n_ctx=min(model.arch.n_ctx, DEFAULT_LM_CTX), tokenizer=tok)


@torch.no_grad()
def evaluate(model: Model, es: EvalSet, batch_size: int = 64) -> dict[str, float | None]:
    """Mean cross-entropy in nats per scored item, and accuracy (classifiers) on `es`."""
    model.module.eval()
    dtype = next(model.module.parameters()).dtype
    device = next(model.module.parameters()).device
    total, correct = 0.0, 0
    for i in range(0, len(es.inputs), batch_size):
        x = es.inputs[i : i + batch_size].to(device)
        y = es.targets[i : i + batch_size].to(device)
        if x.is_floating_point():
            x = x.to(dtype)
        logits = model_logits(model, x).double()  # [B, T, V] or [B, C]
        total += F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum").item()
        if es.task == "vit":
            correct += (logits.argmax(-1) == y).sum().item()
    n = es.size
    return {"loss": total / n, "accuracy": correct / n if es.task == "vit" else None}
