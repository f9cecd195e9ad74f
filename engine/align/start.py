"""An alignment's group element on disk, for a later learned or dual run to start from.

`align --save-element FILE` keeps what a run found in full precision (a record keeps the permutations
but only the singular values of the Q/K and V/O maps); `align --method learned|dual --start FILE`
starts the latents there instead of at weight matching, so that a run that had not converged goes on
where it stopped, with a schedule of its own (docs/MATH.md section 4.4), and a costly weight matching
is done once.

The file is one safetensors file, nothing unpickled: B's element under `b.` and, from a dual run, A's
own under `a.` (a dual run moves both endpoints; B's is A's composed with the relative element the
record describes), with one metadata entry, `ELEMENT_KEY`, holding JSON: the version, the method and
models it came from, the architecture's shape, the classes and the rewrite the element acts in
(engine.align.pair.prepare_pair), and the run's barrier. A learned run started from a dual file starts
from the relative element g_A^{-1} g_B, the same function on the path; a dual run from a one-sided
file starts A at the identity.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from engine.align.resume import element_tensors
from engine.errors import LMCError, SpecError
from engine.models.base import Arch
from engine.models.io import check_output_file, refuse_foreign, regular_file, write_file_atomic
from engine.symmetry import GroupElement, LayerElement

VERSION = 1
ELEMENT_KEY = "lmc_explorer_element"  # the safetensors metadata entry that marks an element file
SUFFIX = ".safetensors"
MAX_ELEMENT_BYTES = 2 << 30  # a 70B Llama's element is about 1.3 GB in float64
KIND = "an element file"
# what an element's shape and group depend on (RoPE's commutant: its dims and layout; QK-norm; the MLP's scalings)
SHAPE = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp", "pe", "rotary_dim", "rope_layout",
         "qk_norm", "mlp")


@dataclass(frozen=True)
class ElementFile:
    """An element file's content: B's element, A's (dual runs) and what the file says of itself."""

    g_b: GroupElement
    g_a: GroupElement | None
    meta: dict
    sha256: str

    def summary(self, path: str) -> dict:
        """What a record says of the start it ran from."""
        keep = ("method", "model_a", "model_b", "steps", "barrier")
        return {"file": path, "sha256": self.sha256} | {k: self.meta.get(k) for k in keep}


def is_file_start(start: str | None) -> bool:
    """Whether a `start` setting names an element file (the others name an aligner)."""
    return isinstance(start, str) and start.endswith(SUFFIX)


def arch_shape(arch: Arch) -> dict:
    return {k: getattr(arch, k) for k in SHAPE}


def _tensors(g: GroupElement, prefix: str) -> dict[str, Tensor]:
    """The element's tensors as the resumable state names them, maps in float64 and indices in int64."""
    return {k: v.detach().to("cpu", torch.float64 if v.is_floating_point() else torch.int64).contiguous()
            for k, v in element_tensors(g, prefix).items()}


def save_element(file: str | Path, arch: Arch, g_b: GroupElement, g_a: GroupElement | None, meta: dict) -> Path:
    """Write the element(s) atomically (a file of this kind, or a new one: checked by check_save_target)."""
    tensors = _tensors(g_b, "b.") | (_tensors(g_a, "a.") if g_a is not None else {})
    head = {"version": VERSION, "arch": arch_shape(arch), "dual": g_a is not None} | meta
    return write_file_atomic(Path(file), lambda tmp: save_file(tensors, str(tmp),
                                                               metadata={ELEMENT_KEY: json.dumps(head)}))


def _header(file: Path, label: str) -> dict | None:
    """The element metadata of a safetensors file, None for a safetensors file without it; refuses a file that
    is not safetensors."""
    try:
        with safe_open(str(file), framework="pt") as f:
            text = (f.metadata() or {}).get(ELEMENT_KEY)
    except (SafetensorError, OSError, ValueError) as e:
        raise LMCError(f"{label} is not a safetensors file ({str(e).splitlines()[0][:120]}).") from None
    if text is None:
        return None
    try:
        head = json.loads(text)
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("version") != VERSION or not isinstance(head.get("arch"), dict):
        raise LMCError(f"{label} has element metadata this version cannot read.")
    return head


def is_element_file(file: str | Path) -> bool:
    """Whether `file` is an element file this tool wrote (so that --save-element may replace it)."""
    try:
        regular_file(Path(file), str(file), MAX_ELEMENT_BYTES, KIND)
        return _header(Path(file), str(file)) is not None
    except LMCError:
        return False


def read_header(file: str | Path, label: str = "--start") -> dict:
    """An element file's metadata, refused in one sentence unless it is one."""
    file = Path(file)
    label = f"{label} {file}"
    regular_file(file, label, MAX_ELEMENT_BYTES, KIND)
    head = _header(file, label)
    if head is None:
        raise LMCError(f"{label} is a safetensors file but not an element file (write one with `align "
                       "--save-element`).")
    return head


def _check_coordinates(file: str | Path, head: dict, rewrite: str, label: str) -> None:
    """The element was found in the coordinates (Pair.rewrite) this run aligns in: its maps mean nothing in
    others."""
    was = head.get("rewrite") or ""
    if was != rewrite:
        said = {"": "as they are", "fold_norms": "with their norm gains folded",
                "layernorm_to_rmsnorm": "with LayerNorm rewritten as RMSNorm"}
        raise LMCError(f"{label} {file} was aligned on the models {said.get(was, was)}, this run's classes "
                       f"align them {said.get(rewrite, rewrite)}; run with the classes it was aligned with.")


def check_start(file: str | Path, arch: Arch, classes: frozenset[str], label: str = "--start",
                rewrite: str | None = None) -> dict:
    """Before any model loads: the file is an element file of this architecture's shape whose classes the
    run uses too, and (`rewrite` given: pair.rewrite_for) found in the coordinates the run aligns in.
    Returns its metadata."""
    head = read_header(file, label)
    want, got = arch_shape(arch), head["arch"]
    diff = [k for k in SHAPE if k in got and got[k] != want[k]]  # what the file records (the exactness guard checks the rest)
    if diff:
        k = diff[0]
        raise LMCError(f"{label} {file} holds an element of a model with {k} {got.get(k)!r}, not {want[k]!r} as "
                       "these models have.")
    extra = sorted(set(head.get("classes") or ()) - classes)
    if extra:
        raise LMCError(f"{label} {file} moves {', '.join(extra)}, which this run's classes leave out; run with "
                       "the classes it was aligned with.")
    if rewrite is not None:
        _check_coordinates(file, head, rewrite, label)
    return head


def _element(t: dict[str, Tensor], prefix: str, arch: Arch, label: str) -> GroupElement:
    h, hkv, d, m, D = arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp, arch.d_model
    shapes = {"head_perm": (h,), "qk": (hkv, d, d), "vo": (hkv, d, d), "mlp_perm": (m,), "mlp_scale": (m,),
              "kv_perm": (hkv,)}

    def get(key: str, shape: tuple) -> Tensor:
        v = t.get(prefix + key)
        if v is None or tuple(v.shape) != shape:
            raise LMCError(f"{label} lacks {prefix}{key} of shape {list(shape)}; the file is damaged.")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise LMCError(f"{label} holds non-finite values in {prefix}{key}; the file is damaged.")
        return v

    layers = []
    for i in range(arch.n_layers):
        parts = {n: get(f"{i}.{n}", s) for n, s in shapes.items()}
        for n in ("head_perm", "mlp_perm", "kv_perm"):
            p = parts[n]
            if p.is_floating_point() or not torch.equal(torch.sort(p).values, torch.arange(len(p))):
                raise LMCError(f"{label}: {prefix}{i}.{n} is not a permutation; the file is damaged.")
        try:
            layers.append(LayerElement(**parts))
        except SpecError as e:
            raise LMCError(f"{label}: layer {i} is not an element of this model's group ({e})") from None
    return GroupElement(tuple(layers), get("residual", (D, D)))


def file_sha256(file: str | Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_save_target(file: str | Path, inputs: tuple[Path, ...] = (), label: str = "--save-element") -> Path:
    """Before any work: where `save_element` will write, a new file or an element file this tool wrote
    (nothing else is replaced), named like one, outside the input models' directories."""
    lab = f"{label} {file}"
    if not str(file).endswith(SUFFIX):
        raise LMCError(f"{lab}: name the file *{SUFFIX}, as --start reads it.")
    target = check_output_file(file, label)
    for d in inputs:
        if target.parent == Path(os.path.realpath(d)):
            raise LMCError(f"{lab} would write into the input model directory {d}; choose a file elsewhere.")
    refuse_foreign(target, lab, is_element_file, "element file")
    return target


def read_element(file: str | Path, arch: Arch, classes: frozenset[str], label: str = "--start",
                 rewrite: str | None = None) -> ElementFile:
    """The element(s) of an element file, checked against the architecture, classes and (`rewrite` given) the
    coordinates of the run (check_start)."""
    head = check_start(file, arch, classes, label, rewrite)
    lab = f"{label} {file}"
    try:
        t = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LMCError(f"{lab} cannot be read ({str(e).splitlines()[0][:120]}).") from None
    g_b = _element(t, "b.", arch, lab)
    g_a = _element(t, "a.", arch, lab) if head.get("dual") else None
    return ElementFile(g_b, g_a, head, file_sha256(file))
