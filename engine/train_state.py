"""A training run's resumable state: written at every validation point, read when the same run restarts.

A medium zoo model trains for about half an hour on two cores, so an interrupted `zoo build --only
NAME` (or `train --out DIR`) picks up at its last validation point instead of step 0. The state is
two files in a hidden directory beside the output (`.NAME.train-state/`): `state.safetensors`
(weights, the weight average, the best checkpoint so far, Adam's moments, the RNG state) and
`state.json` (the run it belongs to, the step, the curve, the best validation loss). Both are written
atomically, tensors first; the JSON names the step the tensors hold, so a state torn between the two
writes is recognised and ignored. Nothing is unpickled. The state is resumed only by the same run:
the same model config, seed and training config; anything else starts from step 0 and replaces it.
Finishing the run deletes the two files (and the directory, once empty).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.models.io import write_file_atomic, write_json_atomic

TENSORS, META = "state.safetensors", "state.json"
VERSION = 1


def state_dir(out: Path) -> Path:
    """Where the run writing into `out` keeps its resumable state."""
    out = Path(out)
    return out.parent / f".{out.name}.train-state"


@dataclass
class Resumed:
    step: int  # steps done
    smooth: float | None
    curve: list[dict]
    best_loss: float
    best_step: int
    elapsed: float  # training seconds before the interruption
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    best: dict[str, torch.Tensor]
    optimizer: dict
    rng: torch.Tensor


# fields added to TrainConfig after states were first written, with the value that means "as before": a run
# leaving one there names the same run as a state written without it
UNSET = {"train_bytes": None, "dropout": 0.0}


def _identity(cfg: dict, seed: int, tc) -> dict:
    return {"config": cfg, "seed": seed, "train_config": {k: v for k, v in asdict(tc).items()
                                                          if not (k in UNSET and v == UNSET[k])}}


def save(where: Path, cfg: dict, seed: int, tc, step: int, smooth: float | None, curve: list[dict],
         best: tuple[float, int, dict], elapsed: float, net: torch.nn.Module, ema: torch.nn.Module | None,
         opt: torch.optim.Optimizer) -> None:
    """Write the state after `step` steps (tensors first, then the JSON that names them)."""
    tensors = {f"model.{k}": v for k, v in net.state_dict().items()}
    tensors |= {f"best.{k}": v for k, v in best[2].items()}
    if ema is not None:
        tensors |= {f"ema.{k}": v for k, v in ema.state_dict().items()}
    osd = opt.state_dict()
    for idx, st in osd["state"].items():
        for name, v in st.items():
            tensors[f"opt.{idx}.{name}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    tensors["rng"] = torch.get_rng_state()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    where.mkdir(parents=True, exist_ok=True)
    write_file_atomic(where / TENSORS, lambda tmp: save_file(tensors, str(tmp), metadata={"step": str(step)}))
    write_json_atomic(where / META, _identity(cfg, seed, tc) | {
        "version": VERSION, "step": step, "smooth": smooth, "curve": curve, "best_loss": best[0],
        "best_step": best[1], "elapsed": elapsed, "param_groups": osd["param_groups"]})


def load(where: Path, cfg: dict, seed: int, tc) -> Resumed | None:
    """The state of this very run (config, seed, training config), or None: absent, torn or another run's."""
    meta_f, ten_f = where / META, where / TENSORS
    if not (meta_f.is_file() and ten_f.is_file()):
        return None
    try:
        meta = json.loads(meta_f.read_text())
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            return None
        if {k: meta.get(k) for k in ("config", "seed", "train_config")} != json.loads(json.dumps(_identity(cfg, seed, tc))):
            return None
        tensors = load_file(str(ten_f))
        from safetensors import safe_open

        with safe_open(str(ten_f), framework="pt") as f:
            if (f.metadata() or {}).get("step") != str(meta["step"]):
                return None  # torn between the two writes
        opt_state: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, idx, name = k.split(".", 2)
                opt_state.setdefault(int(idx), {})[name] = v
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

        ema = part("ema.")
        return Resumed(step=int(meta["step"]), smooth=meta["smooth"], curve=list(meta["curve"]),
                       best_loss=float(meta["best_loss"]), best_step=int(meta["best_step"]),
                       elapsed=float(meta["elapsed"]), model=part("model."), ema=ema or None, best=part("best."),
                       optimizer={"state": opt_state, "param_groups": meta["param_groups"]}, rng=tensors["rng"])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        warnings.warn(f"Training state {where} is not usable ({e}); training starts from step 0.", stacklevel=2)
        return None


def clear(where: Path) -> None:
    """Delete the state's own files (and the directory when nothing else is left in it)."""
    for name in (TENSORS, META):
        (where / name).unlink(missing_ok=True)
    try:
        where.rmdir()
    except OSError:
        pass
