"""Say what a run needs before starting it: its peak memory, from the model configs alone.

Each model directory's config is built on the meta device, which holds shapes without data: the
parameter count comes from the real module (HF, timm or reference) and no weight file is read.

Model of the peak, in bytes. P = parameters and buffers of one model, b = bytes per element of the
run's dtype (4 float32, 8 float64); L layers, D d_model, h heads of d, m d_mlp, V vocabulary (or
classes), T positions per sequence (LM windows of at most 128, a ViT's patches + class token):

    endpoints      2 P b         both models, loaded
    path model     1 P b         the one work model every grid point is lerped into
                                 (engine.interpolate; the grid size does not change the peak)
    aligned B      1 P b         g.theta_B as a copy: only where the exactness check needs the original B
                                 (a sinusoidal model's approximate residual map, when asked for); otherwise
                                 B is moved in place (engine.align.run.move_in_place)
    untied heads   2 V D b       residual_orth (the default) on tied embeddings: the norms are folded (or a
                                 LayerNorm model rewritten) into the models' own tensors, and only the
                                 unembedding diag(g) E^T is new (engine.align.pair.prepare_pair); naive
                                 runs too, for their second curve in the aligned runs' coordinates
    method scratch
      naive        0
      weight       w (2 P_layer + 4 h (D+1) D + m^2 + 2 C) + 16 m^2 + 32 D^2 + 2 w max(V D, D m)
                   w = 8 up to 20M parameters, else 4 (the work dtype of engine.align.weight): B's block
                   moved twice (by Omega, by its own transform), both models' head circuits
                   [h, D+1, D], the MLP cost [m, m] (and its float64 copy for the assignment solver),
                   the summed circuits of every layer for the starting residual map per model (C: L D^2
                   per circuit, or 2 L D r as factors when r <= D / 2, r = h_kv d under grouped-query
                   attention: engine.align.weight.circuit_bytes), residual cross products, and the largest
                   parameter moved in the work dtype
      activation   weight's scratch
                   + 2 N_act (3 L + 1) D b            both models' captured residual streams and normalised
                                                      block inputs of one batch (no logits: the capture
                                                      stops before the unembedding)
                   + 2 x 8 N_act (4 h d + h T + 3 m)  one layer's q, k, v, mixed values, patterns and
                                                      hidden units (with their centred copies) in float64
                   + 2 x 2 T V b                      the twin check's logits (two sequences)
      learned      the larger of weight matching's scratch (its start, freed before the first step) and the
                   optimisation's, in the compute dtype c = max(4, b) (bfloat16 weights stay as they are
                   stored and are widened a block at a time: engine.align.learned.stages):
                   + 4 c Z + 8 L m k + 26 D^2 c       latents Z (value, gradient, two Adam moments), the MLP
                                                      candidate graphs, a residual rotation's Newton-Schulz graph
                   + 8 P_layer c                      one block formed again in the backward pass: both sides'
                                                      moved copies, the saved inputs of their chains, the mix
                                                      and its gradient (no whole moved or interpolated model)
                   + 5 V D c                          the readout's mix and gradient, the embedding's dense
                                                      gradient and its moved copies
                   + N_tr (L + 1) D c                 each block's input, kept for the backward pass
                   + N_tr (6 D + 3 m + h T) c         one block's activations, formed again in the backward pass
                   + 3 LOGIT_BYTES                    one micro-batch's logits, softmax and gradient
      dual         learned with both sides' latents, candidates and rotation graphs
    evaluation     one forward of engine.evaluate: items per batch x item bytes (logits + widest
                   activations, at most EVAL_BUDGET_BYTES), and no larger than the evaluation set
    float32 widening  4 (P_outer + P_layer): bfloat16 weights on a CPU without bfloat16 products compute in
                   float32, the parameters outside the blocks for a whole forward, one block's at a time
                   (engine.models.widening)

N_act, N_tr: the positions of one activation-matching / training batch (sequences of T, or images).
Z = L (h^2 + m k + m + 2 h_kv d^2 + h_kv r) + 2 D^2 latents (k = min(m, learned.DEFAULT_CANDIDATES of the task) MLP
candidates per neuron; every class; r the rotary dims). The evaluation set itself (token ids) is left out: a few MB. `check_fits` compares the total with the memory free on the device: MemAvailable on
the CPU, cudaMemGetInfo on CUDA.

Each method's scratch is computed by its registry entry (`engine.align.METHODS[name].scratch`, a
function beside the aligner: weight.scratch_bytes, ...), and a run's classes by engine.classes: this
module imports no aligner's internals, and no aligner imports it (the allocator helpers it used to
hold live in engine.memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import LMCError, ResourceError
from engine.evaluate import item_bytes, items_per_batch, seq_len
from engine.memory import return_freed_memory, reuse_freed_memory, trim_freed_memory  # noqa: F401 (their old address)
from engine.models.base import Arch
from engine.models.widening import widens_dtype

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """What a run's memory depends on, from one model's config: architecture and element counts."""

    family: str
    arch: Arch
    params: int  # parameters, tied ones once
    buffers: int  # floating buffer elements (RoPE tables, ...)
    other_buffer_bytes: int  # integer / boolean buffers (masks, position ids) at their own size
    layer_params: int  # parameters of one block
    # the module's parameters, (name, shape): what a weight file must store, as floating point and in that shape
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def bytes(self, itemsize: int) -> int:
        return (self.params + self.buffers) * itemsize + self.other_buffer_bytes


@dataclass(frozen=True)
class Estimate:
    """A run's estimated peak memory: the total and its parts (bytes), on `device`."""

    total_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "float32"
    params: int = 0  # of model A


# ---------------------------------------------------------------------------------------------
# Shapes from configs, on the meta device


def model_shape(path: str | Path) -> Shape:
    """The shape of the model in directory `path`, from config.json alone (no weight file is read)."""
    from engine.models import meta_module

    fam, arch, module = meta_module(Path(path))
    params = sum(p.numel() for p in module.parameters())
    floating = [b for b in module.buffers() if b.is_floating_point()]
    others = [b for b in module.buffers() if not b.is_floating_point()]
    stacks = [m for m in module.modules()
              if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) == arch.n_layers > 0]
    layer = sum(p.numel() for p in stacks[0][0].parameters()) if stacks else params // max(1, arch.n_layers)
    return Shape(fam.name, arch, params, sum(b.numel() for b in floating),
                 sum(b.numel() * b.element_size() for b in others), layer,
                 tuple((k, tuple(p.shape)) for k, p in module.named_parameters()))


# ---------------------------------------------------------------------------------------------
# The estimate


def method_scratch(shape: Shape, method: str, itemsize: int, batch: int | None = None) -> int:
    """Peak scratch of an aligner beyond the models (bytes): its registry entry's `scratch`
    (engine.align.METHODS, defined beside the aligner); the module docstring gives the arithmetic.
    `batch`: learned and dual matching's sequences or images per step, when the run sets one."""
    from engine.align import METHODS, method_entry

    entry = method_entry(method)
    if entry.scratch is None:
        known = ", ".join(k for k, m in METHODS.items() if m.scratch is not None)
        raise LMCError(f"Method {method!r} has no memory model; choose one of: {known}.")
    return entry.scratch(shape.arch, shape.params, shape.layer_params, itemsize, **({"batch": batch} if batch else {}))


def evaluation_bytes(arch: Arch, itemsize: int, eval_items: int | None = None) -> int:
    """One evaluation forward (engine.evaluate's batch rule), no larger than the evaluation set."""
    itemsize = max(4, itemsize)  # losses are taken in float32 at least
    n = items_per_batch(arch, itemsize)
    if eval_items is not None:  # LM: eval_items counts tokens; ViT: images
        n = min(n, math.ceil(eval_items / seq_len(arch)) if arch.task == "lm" else eval_items)
    return max(1, n) * item_bytes(arch, itemsize)


def _itemsize(dtype: str | torch.dtype) -> tuple[str, int]:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch."), dtype.itemsize
    if dtype not in DTYPE_BYTES:
        raise LMCError(f"Unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}.")
    return dtype, DTYPE_BYTES[dtype]


def estimate_run(model_dirs: Sequence[str | Path], method: str = "naive", points: int = 21,
                 eval_items: int | None = None, dtype: str | torch.dtype = "float32",
                 device: str = "cpu", classes: Sequence[str] = (), batch: int | None = None) -> Estimate:
    """The peak memory of aligning and interpolating the models in `model_dirs` (A, B), from configs.

    `points` is accepted for the record: the path reuses one work model, so the grid size changes
    the time of a run, not its memory.
    """
    from engine.align import method_entry

    if len(model_dirs) != 2:
        raise LMCError(f"A run compares two models; got {len(model_dirs)} model directories.")
    method_entry(method)
    name, b = _itemsize(dtype)
    sa, sb = (model_shape(p) for p in model_dirs)
    parts = {"endpoints": sa.bytes(b) + sb.bytes(b), "path model": sa.bytes(b)}
    from engine.classes import choose_classes
    from engine.spec import approximate_kinds

    # naive runs also walk the path in the default aligned runs' coordinates (engine.api)
    used = choose_classes(sa.arch, "weight" if method == "naive" else method, tuple(classes)).classes
    if method != "naive" and used & approximate_kinds(sa.arch):
        parts["aligned B"] = sb.bytes(b)
    if "residual_orth" in used and sa.arch.tied_embeddings:
        parts["untied heads"] = 2 * sa.arch.n_out * sa.arch.d_model * b
    scratch = method_scratch(sa, method, b, batch)
    if scratch:
        parts[f"{method} matching scratch"] = scratch
    parts["evaluation"] = evaluation_bytes(sa.arch, b, eval_items)
    if widens_dtype(getattr(torch, name), device):
        outer = sa.params - sa.arch.n_layers * sa.layer_params
        parts["float32 widening"] = 4 * (outer + sa.layer_params)
    return Estimate(sum(parts.values()), parts, device, name, sa.params)


# ---------------------------------------------------------------------------------------------
# Checking and describing


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Memory free for a new run on `device` (bytes), or None where it cannot be told."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0]) if torch.cuda.is_available() else None
    if dev.type != "cpu":
        return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def fmt_bytes(n: int) -> str:
    """Decimal units, one decimal: 9.1 GB, 350.2 MB, 12.0 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= 0.1 * scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _parts(est: Estimate) -> str:
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.parts.items())


def describe(est: Estimate) -> str:
    """One line for the CLI: 'needs about X GB: endpoints ..., path model ... (cpu, float32)'."""
    return f"needs about {fmt_bytes(est.total_bytes)}: {_parts(est)} ({est.device}, {est.dtype})"


def check_fits(est: Estimate, device: str | torch.device | None = None,
               available: int | Callable[[str | torch.device], int | None] | None = None) -> None:
    """Raise ResourceError when `est` exceeds the memory free on `device` (default: the estimate's).

    `available` overrides the measurement: a number of bytes, or a function of the device.
    """
    device = str(device if device is not None else est.device)
    free = available(device) if callable(available) else available if available is not None else available_bytes(device)
    if free is not None and est.total_bytes > free:
        raise ResourceError(f"This run needs about {fmt_bytes(est.total_bytes)} ({_parts(est)}) but only "
                            f"{fmt_bytes(free)} are available on {device}.")


def _run_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def split_offloaded(est: Estimate) -> tuple[Estimate, Estimate]:
    """(device part, host part) of a run whose endpoints stay on the CPU (engine.interpolate offload):
    the device holds the path model and the evaluation batch, the host everything else."""
    on_device = {k: v for k, v in est.parts.items() if k in ("path model", "evaluation")}
    on_host = {k: v for k, v in est.parts.items() if k not in on_device}
    return (Estimate(sum(on_device.values()), on_device, est.device, est.dtype, est.params),
            Estimate(sum(on_host.values()), on_host, "cpu", est.dtype, est.params))


def check_run(cfg, available: int | Callable[[str | torch.device], int | None] | None = None,
              offload: bool = False) -> Estimate:
    """Estimate a RunConfig's memory from its models' configs and refuse it if it cannot fit.

    With `offload` on a GPU the device must hold the path model and the host the rest."""
    from engine.zoo import resolve

    def estimate(dtype: str) -> Estimate:
        return estimate_run([resolve(cfg.model_a), resolve(cfg.model_b)], cfg.method, cfg.points, cfg.eval_items,
                            dtype, _run_device(cfg.device), tuple(cfg.classes or ()),
                            batch=getattr(cfg.options, "batch", None))

    def fits(e: Estimate) -> None:
        for part in split_offloaded(e) if offload and e.device != "cpu" else (e,):
            check_fits(part, available=available)

    est = estimate(cfg.dtype)
    try:
        fits(est)
    except ResourceError as e:
        if cfg.dtype == "bfloat16":
            raise
        half = estimate("bfloat16")  # what a 1B checkpoint stored in bfloat16 needs kept as it is stored
        try:
            fits(half)
        except ResourceError:
            raise e from None
        raise ResourceError(f"{e} In bfloat16 (--dtype bfloat16) it would need about "
                            f"{fmt_bytes(half.total_bytes)}.") from None
    return est
