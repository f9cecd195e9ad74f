"""A learned or dual optimisation's resumable state: written at every validation check, read when the same
run starts again.

A converged medium-tier record optimises for an hour or more of one core, so a killed `cache build`
picks up at the last validation check instead of step 0. The state of each optimisation of a run (dual's
own and its one-sided comparison: `phase`) is two files in the run's checkpoint directory:
`{phase}.safetensors` (latents, hard permutations, the starting element and MLP candidates, the best
elements so far, Adam's moments) and `{phase}.json` (the run it belongs to, the step, the histories,
the lam generator's state, the clock). Both are written atomically, tensors first; the JSON names the
step the tensors hold, so a state torn between the two writes is recognised and ignored. Nothing is
unpickled. A state is resumed only by the run it names (`Checkpoint.run`: the record's config hash)
and the same optimisation (`identity`); anything else starts from step 0 and is replaced. A finished
optimisation keeps its state, marked finished, so that a run killed in a later phase does not redo it;
the checkpoint's owner deletes the state once the record is stored (`clear`: `cache build` and `align
--resume` do).

The resumed run is the uninterrupted run: the training batches are drawn again up to the step reached
(their order is a function of the seed alone) and everything else is restored, so histories and the
element agree bit for bit at the same thread count (tests/engine/test_resume.py).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from engine.errors import LMCError
from engine.models.io import check_dir_target, remove_stale, write_file_atomic, write_json_atomic
from engine.symmetry import GroupElement, LayerElement

VERSION = 1
PHASES = ("learned", "dual", "one_sided")  # the optimisations a run may hold: learned, dual and its comparison
OWN_FILES = frozenset(f"{phase}{suffix}" for phase in PHASES for suffix in (".json", ".safetensors"))  # all a state holds


@dataclass(frozen=True)
class Checkpoint:
    """Where a run's learned / dual optimisations keep their resumable state, and which run they belong to."""

    where: Path
    run: str  # the run's identity (a record's config hash): another run's state is never resumed


@dataclass
class State:
    meta: dict  # the JSON part: step, histories, scalars, the lam generator, the clock
    tensors: dict[str, Tensor]

    def part(self, prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def _files(ck: Checkpoint, phase: str) -> tuple[Path, Path]:
    return ck.where / f"{phase}.json", ck.where / f"{phase}.safetensors"


def check_dir(path: str | Path, inputs: tuple[Path, ...] = (), name: str = "--resume") -> Path:
    """A directory for a run's state, checked before any work: new, or a directory holding only state files
    (an earlier run's, resumed or replaced), not an input model's directory, writable."""
    label = f"{name} {path}"
    target = check_dir_target(path, inputs, label)
    if target.exists():
        remove_stale(target)  # temporary files of a write that a kill interrupted
        foreign = sorted(p.name for p in target.iterdir() if p.name not in OWN_FILES or not p.is_file())
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise LMCError(f"{label} holds files that are not an alignment state ({shown}); choose a new or "
                           "empty directory.")
    return target


def clear(where: Path) -> None:
    """Delete a run's state files (its record is stored) and the directory once nothing else is in it."""
    for name in OWN_FILES:
        (where / name).unlink(missing_ok=True)
    remove_stale(where)
    with contextlib.suppress(OSError):
        where.rmdir()


def save(ck: Checkpoint, phase: str, identity: dict, meta: dict, tensors: dict[str, Tensor]) -> None:
    """Write `phase`'s state (tensors first, then the JSON that names their step)."""
    meta_f, ten_f = _files(ck, phase)
    # each its own copy: the best element and the live hard permutations may share storage
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    ck.where.mkdir(parents=True, exist_ok=True)
    write_file_atomic(ten_f, lambda tmp: save_file(tensors, str(tmp), metadata={"step": str(meta["step"])}))
    write_json_atomic(meta_f, {"version": VERSION, "run": ck.run, "identity": identity} | meta)


def load(ck: Checkpoint, phase: str, identity: dict) -> State | None:
    """`phase`'s state of this very run and optimisation, or None: absent, torn or another run's (a warning
    names an unreadable one)."""
    meta_f, ten_f = _files(ck, phase)
    if not (meta_f.is_file() and ten_f.is_file()):
        return None
    try:
        meta = json.loads(meta_f.read_text())
        if not isinstance(meta, dict) or meta.get("version") != VERSION or meta.get("run") != ck.run:
            return None
        if meta.get("identity") != json.loads(json.dumps(identity)):
            return None
        with safe_open(str(ten_f), framework="pt") as f:
            if (f.metadata() or {}).get("step") != str(meta["step"]):
                return None  # torn between the two writes
        return State(meta, load_file(str(ten_f)))
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        warnings.warn(f"Alignment state {ten_f} is not usable ({e}); the optimisation starts from step 0.",
                      stacklevel=2)
        return None


def element_tensors(g: GroupElement, prefix: str) -> dict[str, Tensor]:
    out = {f"{prefix}residual": g.residual}
    for i, el in enumerate(g.layers):
        for name in ("head_perm", "qk", "vo", "mlp_perm", "mlp_scale", "kv_perm"):
            out[f"{prefix}{i}.{name}"] = getattr(el, name)
    return out


def element_from(t: dict[str, Tensor], prefix: str, n_layers: int) -> GroupElement:
    layers = tuple(LayerElement(*(t[f"{prefix}{i}.{n}"] for n in ("head_perm", "qk", "vo", "mlp_perm", "mlp_scale",
                                                                   "kv_perm"))) for i in range(n_layers))
    return GroupElement(layers, t[f"{prefix}residual"])
