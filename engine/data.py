"""Offline corpora and image sets: loading, deterministic splits, tokenisation, batching.

Text: the bundled Austen corpus (assets/data/austen.txt.gz, provenance in assets/data/README.md), a
user's UTF-8 file, or a local `datasets` directory. Nothing is downloaded. The default tokenizer is
byte-level (UTF-8 bytes, vocabulary 256), so any LM with a vocabulary of at least 256 can be
evaluated on any text; an HF checkpoint that ships its own tokenizer uses that one instead.

Images: scikit-learn's bundled 8x8 digits with a fixed stratified split.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.errors import DataError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
AUSTEN = ASSETS / "data" / "austen.txt.gz"
AUSTEN_SHA256 = "ae4140c6e5ab543cc81f68358120258f0935ac9e27a30f44a7a564b349307867"
BYTE_VOCAB = 256
SPLIT_BLOCK = 8192  # bytes; block i goes to val if i % 20 == 18, test if i % 20 == 19, else train
MIN_TEXT_BYTES = 4 * SPLIT_BLOCK * 20  # enough for every split to hold several context windows


# ---------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: torch.Tensor) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: lossless on any text, vocabulary 256."""

    vocab_size: int = BYTE_VOCAB
    name: str = "bytes"

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer, loaded from its local directory (never from the hub).

    Nothing in the directory is executed: a tokenizer_config.json or config.json with `auto_map`
    (Python code shipped with the checkpoint) is refused, and transformers is told never to trust
    remote code, so it cannot ask on a terminal either. A broken tokenizer file is one sentence.
    """

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        from engine.errors import ModelError
        from engine.models.io import read_json_object, refuse_code

        for name in ("tokenizer_config.json", "config.json"):
            f = Path(path) / name
            if f.exists() or f.is_symlink():
                refuse_code(read_json_object(f), str(f))
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise many types (a Rust error is a bare Exception)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"The tokenizer in {path} cannot be loaded ({type(e).__name__}: {msg[:200]}).") from None
        self.vocab_size = len(self.tok)
        self.name = f"hf:{Path(path).name}"

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tok.decode(ids.tolist())


# ---------------------------------------------------------------------------------------------
# Text corpora


def load_text(source: str | Path | None = None) -> str:
    """The bundled corpus (None), a UTF-8 text file (optionally .gz), or a local `datasets` dir."""
    if source is None:
        return _read_text_file(AUSTEN)
    path = Path(source)
    if not path.exists():
        raise DataError(f"Text source {path} does not exist.")
    if path.is_dir():
        return _read_datasets_dir(path)
    return _read_text_file(path)


def _read_text_file(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"Text file {path} is not a valid gzip file ({e}).") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"Text file {path} is not UTF-8 (bad byte at offset {e.start}).") from None
    return _check_length(text, str(path))


def _read_datasets_dir(path: Path) -> str:
    """A directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict), column `text`."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"Directory {path} is not a saved `datasets` dataset ({e}).") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if "text" not in ds.column_names:
        raise DataError(f"Dataset at {path} has no `text` column (columns: {ds.column_names}).")
    return _check_length("\n\n".join(ds["text"]), str(path))


def _check_length(text: str, name: str) -> str:
    n = len(text.encode("utf-8"))
    if n == 0:
        raise DataError(f"Text source {name} is empty.")
    if n < MIN_TEXT_BYTES:
        raise DataError(
            f"Text source {name} is too short: {n:,} bytes, need at least {MIN_TEXT_BYTES:,} "
            "for train, validation and test splits."
        )
    return text


@dataclass(frozen=True)
class TextSplits:
    train: torch.Tensor  # [N_train] token ids
    val: torch.Tensor
    test: torch.Tensor
    sha256: str  # of the UTF-8 text: identifies the data in manifests and run configs

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val", "test"):
            raise DataError(f"Unknown split {name!r}; expected train, val or test.")
        return getattr(self, name)


def split_text(text: str, tokenizer: Tokenizer | None = None) -> TextSplits:
    """Deterministic interleaved split by 8 KiB blocks: 90% train, 5% validation, 5% test.

    Interleaving (rather than the last novel as test) keeps every split representative of all six
    novels. Blocks are cut on the UTF-8 bytes, then decoded with errors replaced at cut points only
    when a tokenizer other than bytes needs text.
    """
    tokenizer = tokenizer or ByteTokenizer()
    raw = text.encode("utf-8")
    parts: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
    for i in range(0, len(raw), SPLIT_BLOCK):
        k = (i // SPLIT_BLOCK) % 20
        parts["val" if k == 18 else "test" if k == 19 else "train"].append(raw[i : i + SPLIT_BLOCK])
    enc = {}
    for name, blocks in parts.items():
        joined = b"".join(blocks)
        if isinstance(tokenizer, ByteTokenizer):
            enc[name] = torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()
        else:
            enc[name] = tokenizer.encode(joined.decode("utf-8", errors="replace"))
    return TextSplits(enc["train"], enc["val"], enc["test"], hashlib.sha256(raw).hexdigest())


@lru_cache(maxsize=4)
def default_splits() -> TextSplits:
    return split_text(load_text())


def lm_batches(tokens: torch.Tensor, batch: int, n_ctx: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless random windows [batch, n_ctx + 1]; the order is a function of `seed` alone."""
    if len(tokens) < n_ctx + 2:
        raise DataError(f"Training split has {len(tokens)} tokens, fewer than one window of {n_ctx + 1}.")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(n_ctx + 1)
    while True:
        starts = torch.randint(0, len(tokens) - n_ctx - 1, (batch,), generator=g)
        yield tokens[starts[:, None] + offsets]  # [batch, n_ctx + 1]


def lm_eval_windows(tokens: torch.Tensor, n_ctx: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, n_ctx + 1] from the start of a split; n * n_ctx scored tokens."""
    n = (len(tokens) - 1) // n_ctx
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // n_ctx))
    if n < 1:
        raise DataError(f"Evaluation split has {len(tokens)} tokens, fewer than one window of {n_ctx + 1}.")
    idx = torch.arange(n)[:, None] * n_ctx + torch.arange(n_ctx + 1)  # [n, n_ctx + 1]
    return tokens[idx]


# ---------------------------------------------------------------------------------------------
# Masked-LM data (docs/MATH.md section 9): BERT's masking, drawn from a seed


MLM_RATE, MLM_MASK, MLM_RANDOM = 0.15, 0.8, 0.1  # chosen positions; of those, masked / random / kept (the rest)
IGNORE_INDEX = -100  # a target cross-entropy skips: the positions a masked LM is not scored on


class JSONTokenizer:
    """A checkpoint's `tokenizer.json` read with the `tokenizers` library: a data file, nothing executed.
    `mask_id` is its mask token ([MASK] for BERT, <mask> for RoBERTa), None if it has neither."""

    def __init__(self, file: str | Path):
        from tokenizers import Tokenizer as RustTokenizer

        from engine.errors import ModelError

        try:
            self.tok = RustTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - a Rust error surfaces as a bare Exception
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"The tokenizer {file} cannot be loaded ({msg[:200]}).") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(t) for t in ("[MASK]", "<mask>")]
        self.mask_id = next((i for i in ids if i is not None), None)
        self.name = f"tokenizer.json:{Path(file).parent.name}"

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tok.decode(ids.tolist())


def mask_tokens(w: torch.Tensor, mask_id: int, n_random: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of windows w [N, T]: each position chosen with probability MLM_RATE; a chosen one
    becomes `mask_id` (MLM_MASK), a uniform token below `n_random` (MLM_RANDOM) or stays. Returns the inputs
    and the targets (the original token where chosen, IGNORE_INDEX elsewhere), a function of `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(w.shape, generator=g) < MLM_RATE  # [N, T]
    u = torch.rand(w.shape, generator=g)  # [N, T]
    random = torch.randint(0, n_random, w.shape, generator=g)  # [N, T]
    x = torch.where(chosen & (u < MLM_MASK), mask_id, w)
    x = torch.where(chosen & (u >= MLM_MASK) & (u < MLM_MASK + MLM_RANDOM), random, x)
    return x, torch.where(chosen, w, IGNORE_INDEX)


def mlm_batches(tokens: torch.Tensor, batch: int, n_ctx: int, seed: int, mask_id: int,
                n_random: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless masked (inputs, targets) [batch, n_ctx] from random windows; a function of `seed` alone."""
    for i, w in enumerate(lm_batches(tokens, batch, n_ctx, seed)):
        yield mask_tokens(w[:, :-1], mask_id, n_random, seed * 1_000_003 + i)


# ---------------------------------------------------------------------------------------------
# Images


@dataclass(frozen=True)
class ImageSplit:
    x: torch.Tensor  # [N, C, H, W] float32 in [0, 1]
    y: torch.Tensor  # [N] class ids


@lru_cache(maxsize=1)
def digits_splits() -> dict[str, ImageSplit]:
    """scikit-learn's 1,797 8x8 digits, stratified 70 / 10 / 20 split (train / val / test), fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]  # [N, 1, 8, 8]
    y = d.target.astype(np.int64)
    idx = np.arange(len(y))
    rest, test = train_test_split(idx, test_size=0.2, stratify=y, random_state=0)
    train, val = train_test_split(rest, test_size=0.125, stratify=y[rest], random_state=0)
    return {
        name: ImageSplit(torch.from_numpy(x[i]), torch.from_numpy(y[i]))
        for name, i in (("train", np.sort(train)), ("val", np.sort(val)), ("test", np.sort(test)))
    }


def digits_sha256() -> str:
    s = digits_splits()
    h = hashlib.sha256()
    for name in ("train", "val", "test"):
        h.update(s[name].x.numpy().tobytes())
        h.update(s[name].y.numpy().tobytes())
    return h.hexdigest()


def image_batches(split: ImageSplit, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled epochs; the order is a function of `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(split.y), generator=g)
        for i in range(0, len(perm) - batch + 1, batch):
            j = perm[i : i + batch]
            yield split.x[j], split.y[j]
