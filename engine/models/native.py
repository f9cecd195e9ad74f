"""What the adapters of real ecosystems (HF transformers, timm) share.

Head splitting between native projection matrices and the canonical head-explicit layout
(engine/models/base.py), the in-place copy back into a module's own tensors, and loading/saving
HF checkpoints with the engine's errors. `transformers` is imported only when a checkpoint is
actually loaded, so importing the registry stays fast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from engine.errors import ModelError
from engine.models.io import (
    HF_RULES,
    check_fields,
    check_finite,
    check_weight_headers,
    read_config,
    refuse_optional_features,
    refuse_pickles,
    weight_files,
    write_into_dir,
)

if TYPE_CHECKING:
    from torch import nn


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor: canonical params never alias the module's storage."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def causal_lm_logits(model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] -> logits [B, T, V] of an HF causal LM; longer inputs than the model's context are
    refused for every family alike (GPT-2's position table would fail with an index error, RoPE would
    extrapolate)."""
    T = inputs.shape[-1]
    if T > model.arch.n_ctx:
        raise ModelError(f"Input length {T} exceeds the model's context of {model.arch.n_ctx}.")
    return model.module(input_ids=inputs, use_cache=False).logits


def rope_parameters(config) -> dict:
    """An HF config's RoPE settings as a dict (transformers keeps them in `rope_parameters`)."""
    rp = getattr(config, "rope_parameters", None) or {}
    return rp if isinstance(rp, dict) else dict(rp)


def rotary_dims(config, d: int, refuse: Callable[[str, str], None]) -> int:
    """The dims of a head of width `d` that RoPE rotates under the config's `partial_rotary_factor` (HF's own
    rounding, int(d * factor), as GPT-NeoX's and Phi's attention compute it); refused unless even and positive."""
    prf = float(rope_parameters(config).get("partial_rotary_factor", 1.0))
    r = int(d * prf)
    if r < 2 or r % 2:
        refuse(f"partial_rotary_factor={prf}", f"it rotates {r} of the {d} dims of a head; RoPE needs an even, "
               "positive number of them")
    return r


# ---------------------------------------------------------------------------------------------
# Float64-faithful submodules. transformers builds its RoPE tables (and some families normalise) in float32,
# whatever the input's dtype, so a float64 model would only be float32-accurate; the adapters switch those
# submodules to subclasses that compute in float64 when the input is float64 (same formulas and buffers;
# other dtypes take transformers' own path).


@functools.cache
def rotary64(Rotary: type) -> type:
    """A float64-faithful subclass of an HF rotary-embedding class with half-split pairs (Llama's layout:
    `inv_freq` [r/2], `config.rope_parameters`, `attention_scaling`): the frequencies of the reference family,
    frequency scaling included (engine.models.reference.rope_frequencies)."""
    from engine.models.reference import rope_frequencies, rope_scaling

    class Rotary64(Rotary):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
            if x.dtype != torch.float64:
                return super().forward(x, position_ids)
            r, rp = self.inv_freq.shape[0] * 2, rope_parameters(self.config)
            inv = rope_frequencies(r, float(rp["rope_theta"]), rope_scaling(rp)).to(x.device)  # [r/2]
            freqs = position_ids[..., None].to(torch.float64) * inv  # [B, T, r/2]
            emb = torch.cat((freqs, freqs), -1)  # [B, T, r]: half-split pairs share a frequency
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    Rotary64.__name__ = Rotary64.__qualname__ = f"{Rotary.__name__}64"
    return Rotary64


def switch_classes(module: nn.Module, classes: dict[type, type]) -> None:
    """Give every submodule of exactly a key class its value class (a subclass with the same parameters)."""
    for m in module.modules():
        if type(m) in classes:
            m.__class__ = classes[type(m)]


# ---------------------------------------------------------------------------------------------
# Head splitting. Native projections are one matrix per role; canonical ones are [heads, ...].


def heads_in(W: torch.Tensor, h: int) -> torch.Tensor:
    """A reader [D, h*d] (x @ W) whose columns run head-major -> [h, D, d]."""
    D = W.shape[0]
    return W.reshape(D, h, -1).permute(1, 0, 2)  # [h, D, d]


def heads_in_native(W: torch.Tensor) -> torch.Tensor:
    """Inverse of heads_in: [h, D, d] -> [D, h*d]."""
    h, D, d = W.shape
    return W.permute(1, 0, 2).reshape(D, h * d)  # [D, h*d]


def heads_out(W: torch.Tensor, h: int) -> torch.Tensor:
    """A writer [h*d, D] whose rows run head-major -> [h, d, D]."""
    return W.reshape(h, -1, W.shape[-1])  # [h, d, D]


def heads_out_native(W: torch.Tensor) -> torch.Tensor:
    """Inverse of heads_out: [h, d, D] -> [h*d, D]."""
    h, d, D = W.shape
    return W.reshape(h * d, D)  # [h*d, D]


def copy_into(module: nn.Module, native: dict[str, torch.Tensor]) -> None:
    """Copy native-layout tensors into the module's own parameters, in place.

    Interpolation and alignment keep references to the module's tensors, so a conversion back from
    canonical coordinates must never replace them. Every parameter must be covered, with its exact
    shape: a silent broadcast would corrupt the model without an error. A tied parameter is covered by any
    one of its names (XLM-RoBERTa lists its tied decoder before the word embedding it shares).
    """
    params = dict(module.named_parameters())  # tied parameters appear once, under the first of their names
    first = {id(p): k for k, p in params.items()}
    alias = {k: first[id(p)] for k, p in module.named_parameters(remove_duplicate=False)}
    native = {alias.get(k, k): v for k, v in native.items()}
    missing = sorted(set(params) - set(native))
    unknown = sorted(set(native) - set(params))
    if missing or unknown:
        raise ModelError(f"Canonical parameters do not cover the model: missing {missing[:3]}, unknown {unknown[:3]}.")
    with torch.no_grad():
        for k, p in params.items():
            v = native[k]
            if tuple(v.shape) != tuple(p.shape):
                raise ModelError(
                    f"Canonical parameter for {k} has shape {tuple(v.shape)}, the model needs {tuple(p.shape)}."
                )
            p.copy_(v)


# ---------------------------------------------------------------------------------------------
# HF transformers checkpoints


def hf_model_type(path: Path) -> str | None:
    """The model_type of an HF checkpoint directory, or None (cheap: reads config.json only).

    An unreadable config is None here; `engine.models.family_of` reads it first and names the problem.
    """
    try:
        cfg = read_config(Path(path))
    except ModelError:
        return None
    if "family" in cfg:  # the engine's own formats name their family explicitly
        return None
    t = cfg.get("model_type")
    return t if isinstance(t, str) else None


def check_hf_config(config: dict, source: str) -> None:
    """Refuse an HF config dict that transformers would refuse, in one sentence naming the field.

    The fields the adapters read are type-checked first (io.HF_RULES); then, for a model_type
    transformers knows, its own config class validates every other field (transformers 5 checks
    types strictly: an int where a float belongs, a list as a token id).
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_fields(config, HF_RULES, source)
    refuse_optional_features(config, source)
    mt = config.get("model_type")
    if mt not in CONFIG_MAPPING:
        return
    try:
        AutoConfig.for_model(mt, **{k: v for k, v in config.items() if k != "model_type"})
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as e:
        lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
        raise ModelError(f"{source} is not a valid {mt} config ({' '.join(lines[:2])[:300]}).") from None


def load_hf(cls, path: Path, dtype: torch.dtype, model_type: str, display: str):
    """`cls.from_pretrained` from a local directory, safetensors only, refusing anything partial.

    HF fills weights missing from a checkpoint with a fresh random init and only logs a warning;
    an LMC measurement on such a model would be silently meaningless, so any missing or
    mismatched key is an error here.
    """
    from huggingface_hub.errors import StrictDataclassError

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"Model path {path} is not a directory.")
    refuse_pickles(path)
    cfg = read_config(path)  # a JSON object without auto_map
    check_hf_config(cfg, f"{path / 'config.json'}")  # sizes and flags of the right types, before any build
    if cfg.get("model_type") != model_type:
        raise ModelError(
            f"Model directory {path} has model_type {cfg.get('model_type')!r}, not {model_type!r} ({display})."
        )
    weight_files(path)
    try:
        module, info = cls.from_pretrained(
            str(path), local_files_only=True, use_safetensors=True, dtype=dtype, trust_remote_code=False,
            attn_implementation="sdpa",  # eager attention in some HF models runs softmax in float32
            output_loading_info=True,
        )
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError,
            ArithmeticError, AssertionError, IndexError, StrictDataclassError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            f"Model directory {path} could not be loaded as {display} ({type(e).__name__}: {msg})."
        ) from None
    bad = {k: sorted(info.get(k) or []) for k in ("missing_keys", "mismatched_keys", "unexpected_keys")}
    if any(bad.values()):
        detail = "; ".join(f"{k.replace('_', ' ')} {v[:3]}" for k, v in bad.items() if v)
        raise ModelError(f"Model directory {path} does not match its config ({detail}).")
    check_weight_headers(path, {k: tuple(p.shape) for k, p in module.named_parameters()})
    check_finite(dict(module.state_dict()), f"Model directory {path}")
    return module.eval()


def save_hf(module, path: Path) -> None:
    """`save_pretrained` (safetensors) into a temporary directory, then each file moved into `path`.

    The tool's own directory is replaced whole in one step; any other is written into, file by file
    (engine.models.io.write_into_dir).
    """
    write_into_dir(path, lambda tmp: module.save_pretrained(str(tmp)))


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Construct modules under a private RNG state: HF and timm initialise from torch's global one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
