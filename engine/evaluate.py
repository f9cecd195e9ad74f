"""Held-out evaluation: fixed evaluation sets and the mean loss (nats per token) / accuracy of a model.

A causal LM is scored on every next token, a masked LM (an LM that is not causal: BERT) on the positions
its seeded masking chose (docs/MATH.md section 9), a classifier on every image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import distributed
from engine.cancel import CancelToken, check
from engine.data import (
    BYTE_VOCAB,
    IGNORE_INDEX,
    HFTokenizer,
    JSONTokenizer,
    Tokenizer,
    default_splits,
    digits_splits,
    lm_eval_windows,
    load_text,
    mask_tokens,
    split_text,
)
from engine.errors import DataError, LMCError
from engine.models import Model, hf_bert, model_logits
from engine.models.base import Arch
from engine.progress import Progress

DEFAULT_LM_CTX = 128


@dataclass(frozen=True)
class EvalSet:
    task: str  # "lm" | "vit"
    inputs: torch.Tensor  # [N, T] token ids, or [N, C, H, W] images
    targets: torch.Tensor  # [N, T] next tokens (masked LM: the masked tokens, IGNORE_INDEX elsewhere), or [N] labels
    description: str  # what the set is, for records and captions

    @property
    def size(self) -> int:
        """Scored tokens (LM) or images (ViT)."""
        return int((self.targets != IGNORE_INDEX).sum()) if self.task == "lm" else self.targets.numel()


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


MLM_SEED = 0  # the masks of every masked-LM evaluation: the same at every point of a path


def is_masked_lm(arch: Arch) -> bool:
    return arch.task == "lm" and not arch.causal


def mlm_eval_set(split: str = "test", max_tokens: int | None = None, n_ctx: int = DEFAULT_LM_CTX, vocab: int = 0,
                 tokenizer: JSONTokenizer | None = None, seed: int = MLM_SEED) -> EvalSet:
    """Non-overlapping windows of n_ctx tokens of a split of the Austen corpus, masked as BERT is
    (data.mask_tokens, seeded); `max_tokens` bounds the positions, about 15% of which are scored.

    With `tokenizer` its mask token masks and random tokens come from its vocabulary; without, UTF-8
    bytes, the mask the last id of the model's vocabulary `vocab`, which must exceed the 256 bytes.
    """
    if tokenizer is None:
        if vocab <= BYTE_VOCAB:
            raise DataError(f"A masked LM with a vocabulary of {vocab} and no tokenizer.json cannot be evaluated on "
                            f"bytes: it needs at least {BYTE_VOCAB + 1} tokens (the bytes and a mask).")
        splits, mask_id, n_random = default_splits(), vocab - 1, BYTE_VOCAB
    else:
        if tokenizer.mask_id is None:
            raise DataError(f"The tokenizer {tokenizer.name} has no mask token ([MASK] or <mask>).")
        splits, mask_id, n_random = split_text(load_text(), tokenizer), tokenizer.mask_id, tokenizer.vocab_size
    w = lm_eval_windows(splits.split(split), n_ctx, max_tokens)[:, :-1]  # [n, n_ctx]
    x, y = mask_tokens(w, mask_id, n_random, seed)
    tok = tokenizer.name if tokenizer is not None else "bytes"
    return EvalSet("lm", x, y, f"austen/{split}, {int((y != IGNORE_INDEX).sum()):,} masked of {w.numel():,} tokens "
                               f"({tok}), context {n_ctx}, mask seed {seed}")


def mlm_eval_set_for(model: Model, split: str = "test", max_items: int | None = None) -> EvalSet:
    """A masked LM's evaluation set: its directory's tokenizer.json when it has one, else bytes."""
    tok = None
    if model.path is not None and (Path(model.path) / "tokenizer.json").is_file():
        tok = JSONTokenizer(Path(model.path) / "tokenizer.json")
        if tok.vocab_size > model.arch.n_out:
            raise DataError(f"The tokenizer in {model.path} has {tok.vocab_size} tokens, more than the "
                            f"model's vocabulary of {model.arch.n_out}.")
    return mlm_eval_set(split, max_items, n_ctx=min(model.arch.n_ctx, DEFAULT_LM_CTX), vocab=model.arch.n_out,
                        tokenizer=tok)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def lm_tokenizer(arch: Arch, path: Path | None, name: str) -> Tokenizer | None:
    """The tokenizer a causal LM's evaluation text is encoded with: its directory's own when it ships one, else
    None (bytes). Refused in one sentence when it cannot serve the model: a broken tokenizer, more tokens than
    the model's vocabulary, or no tokenizer for a vocabulary smaller than the bytes'. engine.pipeline.check_inputs
    asks before any model loads."""
    tok = None
    if path is not None and any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        tok = HFTokenizer(path)
        if tok.vocab_size > arch.n_out:
            raise DataError(f"The tokenizer in {path} has {tok.vocab_size} tokens, more than the "
                            f"model's vocabulary of {arch.n_out}.")
    elif arch.n_out < BYTE_VOCAB:
        raise DataError(f"Model {name} has a vocabulary of {arch.n_out} and ships no "
                        f"tokenizer; byte-level evaluation text needs at least {BYTE_VOCAB} tokens.")
    return tok


def eval_set_for(model: Model, split: str = "test", max_items: int | None = None) -> EvalSet:
    if model.arch.task == "vit":
        return vit_eval_set(split, max_items)
    if is_masked_lm(model.arch):
        if hf_bert.is_encoder(model.arch):  # no head, no loss: engine.represent compares hidden states
            raise DataError(hf_bert.no_loss(model.name or str(model.path), model.family))
        return mlm_eval_set_for(model, split, max_items)
    tok = lm_tokenizer(model.arch, model.path, model.name or str(model.path))
    return lm_eval_set(split, max_items, n_ctx=min(model.arch.n_ctx, DEFAULT_LM_CTX), tokenizer=tok)


# The train curve of a record: the path's points also scored on a bounded sample of the train split,
# at most a quarter of the default test evaluation (engine.api.DEFAULT_EVAL_ITEMS), so the curve that
# says whether a barrier is one of optimisation or of generalisation costs little. Digits are cheap:
# as many train images as the test set has.
TRAIN_EVAL_ITEMS = 16_384


def train_items(task: str, test_size: int) -> int:
    """Items the train curve scores beside a test set of `test_size`: as many images (ViT), or
    min(test_size, TRAIN_EVAL_ITEMS) tokens (LM, rounded down to whole windows by eval_set_for)."""
    return test_size if task == "vit" else min(test_size, TRAIN_EVAL_ITEMS)


def train_eval_set_for(model: Model, test: EvalSet) -> EvalSet:
    """The train split's sample beside the evaluation set `test`: its first train_items scored tokens
    (LM, in the model's evaluation windows, as eval_set_for) or images (ViT)."""
    return eval_set_for(model, "train", train_items(test.task, test.size))


# Evaluation memory. One forward holds its logits and its widest activations; both grow with the
# tokens it scores, and at a GPT-2 vocabulary (50,257) the logits dominate: a batch is sized so the
# two together stay under EVAL_BUDGET_BYTES (128 MiB: a quarter of GPT-2-small's weights; at 256 MiB
# a whole GPT-2 run peaked at 4.09 models instead of 3.70, for no measurable gain in tokens/s). The loss
# is then taken in chunks of rows, so the float32 (or float64) copy cross-entropy works on never
# exceeds LOSS_CHUNK_BYTES.
EVAL_BUDGET_BYTES = 128 * 2**20
LOSS_CHUNK_BYTES = 32 * 2**20


def seq_len(arch: Arch) -> int:
    """Positions in one evaluation item: an LM window (at most DEFAULT_LM_CTX) or a ViT's patches + class token."""
    return min(arch.n_ctx, DEFAULT_LM_CTX) if arch.task == "lm" else arch.n_ctx


def item_bytes(arch: Arch, itemsize: int = 4, n_pos: int | None = None) -> int:
    """Bytes one evaluation item (LM window / image) occupies in a forward: logits + widest activations.

    Per position: the residual stream, q/k/v and the attention output (4 D), the MLP pre-activation,
    gate and activation (3 m), and one row of attention scores per head (h T, when the kernel
    materialises them); plus n_out logits per position (LM) or per image (ViT).
    """
    T = n_pos or seq_len(arch)
    per_pos = 4 * arch.d_model + 3 * arch.d_mlp + arch.n_heads * T
    logits = arch.n_out * (T if arch.task == "lm" else 1)
    return itemsize * (T * per_pos + logits)


MAX_BATCH_POSITIONS = 8192  # beyond this a small model's forward gets slower on the CPU (cache misses)


def items_per_batch(arch: Arch, itemsize: int = 4, budget_bytes: int = EVAL_BUDGET_BYTES, n_pos: int | None = None) -> int:
    """Sequences / images per forward so that one forward stays under `budget_bytes` and scores at most
    MAX_BATCH_POSITIONS positions (at least one item). On the zoo LM 64 windows of 128 evaluate 1.2x
    faster than 186 (bench/bench_evaluate.py); GPT-2-small is bound by its logits' bytes first."""
    per_item = seq_len(arch) if arch.task == "lm" else 1
    return max(1, min(budget_bytes // item_bytes(arch, itemsize, n_pos), MAX_BATCH_POSITIONS // per_item))


def evaluate(model: Model, es: EvalSet, max_tokens: int | None = None, autocast: bool = False,
             progress: Progress | None = None, cancel: CancelToken | None = None) -> dict[str, float | None]:
    """Mean cross-entropy in nats per scored item, and accuracy (classifiers) on `es`.

    Each forward scores at most `max_tokens` positions (default: as many as fit EVAL_BUDGET_BYTES, at
    least one item). The loss is taken in float32 row chunks and summed in a float64 scalar, never
    over float64 logits; a float64 model keeps float64 throughout, so exactness checks stay exact.
    `autocast` runs the forward under bfloat16 autocast on CUDA (ignored on other devices and for
    float64 models). `progress` hears of every batch; `cancel` is checked before each (Cancelled).
    """
    p = next(model.module.parameters())
    dtype, device = p.dtype, p.device
    if es.size == 0:
        raise DataError(f"The evaluation set ({es.description}) is empty.")
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    n_pos = es.inputs.shape[-1] if es.task == "lm" else model.arch.n_ctx
    if max_tokens is not None:
        if max_tokens < 1:
            raise LMCError(f"max_tokens must be a positive number of tokens per forward, got {max_tokens}.")
        per_batch = max(1, max_tokens // n_pos)
    else:
        per_batch = items_per_batch(model.arch, max(4, dtype.itemsize), n_pos=n_pos)
    cast = autocast and device.type == "cuda" and dtype != torch.float64
    model.module.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync per chunk
    correct = torch.zeros((), dtype=torch.int64, device=device)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cast):
        batches = -(-len(es.inputs) // per_batch)
        for b in distributed.my_batches(batches):  # all of them in one process; a share under torchrun
            i = b * per_batch
            check(cancel, f"evaluation, batch {i // per_batch + 1}/{batches}")
            x = es.inputs[i : i + per_batch].to(device, non_blocking=True)
            y = es.targets[i : i + per_batch].to(device, non_blocking=True)
            if x.is_floating_point():
                x = x.to(dtype)
            logits = model_logits(model, x)  # [B, T, V] or [B, C]
            logits, y = logits.flatten(0, -2), y.flatten()  # [N, V], [N]
            rows = max(1, LOSS_CHUNK_BYTES // (loss_dtype.itemsize * logits.shape[-1]))
            for j in range(0, len(y), rows):
                chunk, t = logits[j : j + rows].to(loss_dtype), y[j : j + rows]  # [n, V], [n]
                total += F.cross_entropy(chunk, t, reduction="sum").to(torch.float64)
                if es.task == "vit":
                    correct += (chunk.argmax(-1) == t).sum()
            del logits, chunk  # before the next forward: two batches' logits would double the peak
            if progress:
                progress(i // per_batch + 1, batches, f"batch {i // per_batch + 1}/{batches}")
    distributed.all_sum(total, correct)
    n = es.size
    return {"loss": total.item() / n, "accuracy": correct.item() / n if es.task == "vit" else None}
