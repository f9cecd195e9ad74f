"""Corpora, splits, tokenizer and batching."""

import gzip

import pytest
import torch

from engine import data
from engine.data import ByteTokenizer, DataError


def test_byte_tokenizer_round_trips_any_utf8():
    tok = ByteTokenizer()
    text = "Emma Woodhouse, handsome — naïve? 日本語 🙂"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_austen_corpus_is_the_documented_file():
    s = data.default_splits()
    assert s.sha256 == data.AUSTEN_SHA256
    n = len(s.train) + len(s.val) + len(s.test)
    assert n == 4_025_033
    # interleaved 8 KiB blocks: 18/20 train, 1/20 validation, 1/20 test (up to the last partial block)
    assert abs(len(s.val) / n - 0.05) < 0.002 and abs(len(s.test) / n - 0.05) < 0.002


def test_split_is_deterministic_and_disjoint():
    text = data.load_text()
    a, b = data.split_text(text), data.split_text(text)
    assert torch.equal(a.test, b.test) and torch.equal(a.train, b.train)
    block = bytes(a.test[: data.SPLIT_BLOCK].tolist())
    assert block == text.encode()[19 * data.SPLIT_BLOCK : 20 * data.SPLIT_BLOCK]
    assert block not in bytes(a.train[: 50 * data.SPLIT_BLOCK].tolist())


def test_lm_batches_depend_on_seed_only():
    toks = data.default_splits().train
    x1 = next(data.lm_batches(toks, 4, 16, seed=3))
    x2 = next(data.lm_batches(toks, 4, 16, seed=3))
    x3 = next(data.lm_batches(toks, 4, 16, seed=4))
    assert x1.shape == (4, 17) and torch.equal(x1, x2) and not torch.equal(x1, x3)


def test_eval_windows_are_contiguous_and_non_overlapping():
    toks = torch.arange(1000)
    w = data.lm_eval_windows(toks, 10, max_tokens=50)
    assert w.shape == (5, 11)
    assert torch.equal(w[1], torch.arange(10, 21))


def test_digits_split_is_fixed_and_stratified():
    s = data.digits_splits()
    assert [len(s[k].y) for k in ("train", "val", "test")] == [1257, 180, 360]
    assert s["train"].x.shape[1:] == (1, 8, 8) and float(s["train"].x.max()) == 1.0
    assert torch.bincount(s["test"].y).min() >= 35
    # the split every cached ViT record names in config.data_sha256
    assert data.digits_sha256() == "8d18975e181b9760afe33669d9c7210cf686f3bc4ce2d21632ac72e2d04e66f8"


def test_user_text_file_and_gzip(tmp_path):
    text = ("It is a truth universally acknowledged. " * 20_000)
    f = tmp_path / "book.txt"
    f.write_text(text)
    g = tmp_path / "book.txt.gz"
    g.write_bytes(gzip.compress(text.encode()))
    assert data.load_text(f) == text == data.load_text(g)


def test_local_datasets_directory(tmp_path):
    import datasets

    rows = {"text": [f"Chapter {i}. " + "word " * 2000 for i in range(80)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    text = data.load_text(tmp_path / "ds")
    assert text.startswith("Chapter 0. word") and "Chapter 79." in text


@pytest.mark.parametrize(
    "content, message",
    [(b"", "is empty"), (b"short text", "too short"), (b"\xff\xfe" * 200_000, "not UTF-8")],
)
def test_bad_text_gets_one_clear_sentence(tmp_path, content, message):
    f = tmp_path / "bad.txt"
    f.write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        data.load_text(f)
    assert str(f) in str(e.value)


def test_missing_source_and_non_dataset_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_text(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="not a saved `datasets` dataset"):
        data.load_text(tmp_path)
