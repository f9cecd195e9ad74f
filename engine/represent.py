"""Encoders without a head (BERT's BertModel, RoBERTa's RobertaModel): the path compared by its hidden states,
not by a loss.

An encoder-only checkpoint has no vocabulary output, so it has no loss to walk a path on. Along the path
theta(lam) = (1 - lam) theta_A + lam g.theta_B (g: the aligner's element, identity for naive) this module
compares the last hidden states instead (docs/MATH.md section 9):

- feature cosine c(lam): the mean over positions of cos(h_lam, (1 - lam) h_A + lam h_B'), h_B' the moved B's
  hidden state (in A's basis); 1 at both endpoints, and 1 everywhere when the path's features are the
  interpolated features of its endpoints (layerwise linear feature connectivity, Zhou et al., 2023);
- the representation barrier max_lam (1 - c(lam)), dimensionless (1 - cosine similarity), 0 at best;
- linear CKA of H_lam to H_A and to H_B (Kornblith et al., 2019), which no orthogonal map of the stream
  changes, so it compares the path's representations with each endpoint's whatever their bases.

Learned and dual matching optimise a loss along the path and are refused for these models.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from engine.cancel import CancelToken, check
from engine.errors import DataError, LMCError
from engine.models.base import Arch, Model

UNIT = "1 - cosine similarity (dimensionless)"
DEFAULT_TOKENS = 8_192  # evaluation positions: N x T rows of D hidden values per model on the path
LOSS_METHODS = ("learned", "dual")  # methods that need a loss along the path


def is_encoder(arch: Arch) -> bool:
    """A BERT, RoBERTa or XLM-RoBERTa without a masked-LM head (hf_bert.is_encoder)."""
    from engine.models.hf_bert import VARIANTS
    from engine.models.hf_bert import is_encoder as enc

    return arch.family in VARIANTS and enc(arch)


def encoder_pair(model_a: str | Path, model_b: str | Path) -> bool:
    """Whether a pair is of encoders without a head, from the configs; False for a pair engine.api.check_pair
    refuses, whose loss path then names the problem as for any pair."""
    from engine.pipeline import check_pair

    try:
        return is_encoder(check_pair(model_a, model_b)[0].arch)
    except LMCError:
        return False


def encoder_inputs(model: Model, split: str = "test", max_tokens: int | None = DEFAULT_TOKENS) -> tuple[Tensor, str]:
    """Unmasked windows [N, T] of a corpus split in the model's own tokens (its directory's tokenizer.json),
    else UTF-8 bytes, and a description."""
    from engine.data import BYTE_VOCAB, JSONTokenizer, default_splits, lm_eval_windows, load_text, split_text
    from engine.evaluate import DEFAULT_LM_CTX

    file = Path(model.path) / "tokenizer.json" if model.path is not None else None
    if file is not None and file.is_file():
        tok = JSONTokenizer(file)
        if tok.vocab_size > model.arch.n_out:
            raise DataError(f"The tokenizer in {model.path} has {tok.vocab_size} tokens, more than the "
                            f"model's vocabulary of {model.arch.n_out}.")
        splits, name = split_text(load_text(), tok), tok.name
    else:
        if model.arch.n_out < BYTE_VOCAB:
            raise DataError(f"Model {model.name or model.path} has a vocabulary of {model.arch.n_out} and ships no "
                            f"tokenizer.json; byte-level text needs at least {BYTE_VOCAB} tokens.")
        splits, name = default_splits(), "bytes"
    T = min(model.arch.n_ctx, DEFAULT_LM_CTX)
    w = lm_eval_windows(splits.split(split), T, max_tokens)[:, :-1]  # [N, T]
    return w, f"austen/{split}, {w.numel():,} tokens ({name}), context {T}"


def linear_cka(X: Tensor, Y: Tensor) -> float:
    """Linear CKA of two representations [n, D] of the same n inputs: ||Xc^T Yc||^2 / (||Xc^T Xc|| ||Yc^T Yc||),
    columns centred, Frobenius norms, in float64; 1 for X = Y R with R orthogonal (and any scale)."""
    Xc, Yc = (Z.to(torch.float64) - Z.to(torch.float64).mean(0) for Z in (X, Y))
    return float((Xc.mT @ Yc).square().sum() / ((Xc.mT @ Xc).norm() * (Yc.mT @ Yc).norm()))


@torch.no_grad()
def hidden_states(model: Model, inputs: Tensor, batch: int = 16) -> Tensor:
    """The last hidden states of `inputs` [N, T], as rows [N T, D] (in the model's dtype, on the CPU)."""
    from engine.models.hf_bert import hidden

    model.module.eval()
    dev = next(model.module.parameters()).device
    out = [hidden(model, inputs[i:i + batch].to(dev)).to("cpu") for i in range(0, len(inputs), batch)]
    return torch.cat(out).flatten(0, 1)  # [N*T, D]


def representation_path(a: Model, b: Model, inputs: Tensor, points: int = 21,
                        cancel: CancelToken | None = None, progress=None) -> dict:
    """The feature cosine, its barrier and the linear CKA to each endpoint at `points` lam in [0, 1] on the
    straight line from `a` to `b` (b already moved by the aligner)."""
    from engine.interpolate import LinearPath, grid

    lams = grid(points)
    path = LinearPath(a, b)
    ha, hb = hidden_states(a, inputs), hidden_states(b, inputs)
    cos, cka_a, cka_b = [], [], []
    for i, lam in enumerate(lams):
        check(cancel, f"representation path, point {i + 1}/{len(lams)}")
        h = ha if lam == 0.0 else hb if lam == 1.0 else hidden_states(path.at(lam), inputs)
        chord = torch.lerp(ha.double(), hb.double(), lam)  # [N*T, D]: the endpoints' features interpolated
        cos.append(float(torch.nn.functional.cosine_similarity(h.double(), chord, dim=-1).mean()))
        cka_a.append(linear_cka(h, ha))
        cka_b.append(linear_cka(h, hb))
        if progress:
            progress(i + 1, len(lams), f"point {i + 1}/{len(lams)}")
    gaps = [1.0 - c for c in cos]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"lambdas": lams, "feature_cosine": cos, "cka_a": cka_a, "cka_b": cka_b,
            "representation_barrier": gaps[worst], "barrier_lambda": lams[worst], "unit": UNIT,
            "cka_endpoints": linear_cka(ha, hb)}


def represent_pair(model_a: str | Path, model_b: str | Path, method: str = "weight",
                   classes: tuple[str, ...] = (), points: int = 21, split: str = "test",
                   max_tokens: int | None = DEFAULT_TOKENS, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", cancel: CancelToken | None = None, progress=None) -> dict:
    """Load two encoders without a head (on `device`), align B onto A with `method` (not learned or dual: they
    need a loss), and compare the hidden states along the path: a JSON-ready record whose `representation`
    holds representation_path's curves and barrier, in UNIT."""
    from engine.align import METHODS, method_entry
    from engine.align.run import align, alignment_record
    from engine.models import load_model
    from engine.models.base import check_same_architecture
    from engine.zoo import resolve

    method_entry(method)
    if method in LOSS_METHODS:
        raise LMCError(f"Method {method} optimises the loss along the path, which an encoder without a head does "
                       f"not have; choose one of {', '.join(m for m in METHODS if m not in LOSS_METHODS)}.")
    t0 = time.perf_counter()
    a, b = (load_model(resolve(str(p)), dtype=dtype) for p in (model_a, model_b))
    for m in (a, b):
        m.module.to(device)
    check_same_architecture(a, b)
    for m, p in ((a, model_a), (b, model_b)):
        if not is_encoder(m.arch):
            raise LMCError(f"Model {p} has a head; `align` measures its loss along the path.")
    inputs, described = encoder_inputs(a, split, max_tokens)
    al = align(a, b, method, classes, 0, seed, in_place=True, cancel=cancel)
    rep = representation_path(al.model_a, al.model_b, inputs, points, cancel, progress)
    return {"kind": "representation", "model_a": str(model_a), "model_b": str(model_b), "method": method,
            "classes": sorted(al.classes), "classes_left_out": al.left_out, "eval_set": described,
            "arch": a.arch.to_dict(), "alignment": alignment_record(al), "representation": rep,
            "seconds": time.perf_counter() - t0}


def format_record(rec: dict) -> str:
    """The representation path as a table, then its barrier in words."""
    r = rec["representation"]
    rows = [f"{'lambda':>7}  {'feature cosine':>14}  {'1 - cosine':>10}  {'CKA to A':>8}  {'CKA to B':>8}"]
    for lam, c, ka, kb in zip(r["lambdas"], r["feature_cosine"], r["cka_a"], r["cka_b"]):
        rows.append(f"{lam:7.3f}  {c:14.6f}  {1 - c:10.6f}  {ka:8.4f}  {kb:8.4f}")
    rows.append(f"{rec['method']}: representation barrier {r['representation_barrier']:.6f} ({r['unit']}) at lambda "
                f"{r['barrier_lambda']:.3f}; CKA between the endpoints {r['cka_endpoints']:.4f}; {rec['eval_set']}; "
                f"{rec['seconds']:.1f} s")
    return "\n".join(rows)
