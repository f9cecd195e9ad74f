"""Checkpoint files: config.json + model.safetensors, read with clear errors, written atomically.

Pickled checkpoints (.bin, .pt, .pth) are refused: loading them runs arbitrary code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import ModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ModelError(f"Model directory {path} has no config.json.")
    return read_json_object(f)


def read_json_object(f: Path) -> dict:
    """A JSON file holding an object, with clear errors when it is missing, unreadable or not an object."""
    f = Path(f)
    if not f.is_file():
        raise ModelError(f"{f} does not exist.")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{f} is not valid JSON ({e}).") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{f} does not hold a JSON object.")
    return cfg


def refuse_pickles(path: Path) -> None:
    pickles = [p.name for p in Path(path).iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not list(Path(path).glob("*.safetensors")):
        raise ModelError(
            f"Model directory {path} holds only pickled weights ({', '.join(sorted(pickles))}); "
            "convert them to safetensors first, pickles can run arbitrary code."
        )


def read_safetensors(file: Path, expected: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Load a safetensors file; check keys and shapes against `expected` and refuse NaN/inf."""
    file = Path(file)
    if not file.is_file():
        refuse_pickles(file.parent)
        raise ModelError(f"Model directory {file.parent} has no {file.name}.")
    try:
        state = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelError(f"{file} is not a readable safetensors file ({e}).") from None
    if expected is not None:
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise ModelError(f"{file} does not match its config: missing {missing[:3]}, unexpected {extra[:3]}.")
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ModelError(f"{file}: tensor {k} has shape {tuple(state[k].shape)}, config says {tuple(v.shape)}.")
    check_finite(state, str(file))
    return state


def check_finite(state: dict[str, torch.Tensor], name: str) -> None:
    for k, v in state.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ModelError(f"{name}: tensor {k} contains NaN or infinite values.")


def write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor], extra: dict[str, str] | None = None) -> None:
    """Write config.json + model.safetensors (+ extra text files) into `path`, atomically.

    Everything goes to a temporary sibling directory first, which then replaces `path`, so an
    interrupted save never leaves a half-written checkpoint.
    """

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / "model.safetensors"))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    write_dir_atomic(path, fill)


def write_dir_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """Run `fill` on a fresh temporary sibling directory of `path`, then swap it in for `path`.

    An interrupted write never leaves a half-written directory: on any error the temporary one is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        fill(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(file: Path, obj) -> None:
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
