"""Half-precision weights computed in float32 where the CPU has no fast half-precision products.

A model kept in bfloat16 (as 1B checkpoints are stored, `--dtype bfloat16`) runs its forward passes in
bfloat16 where that is fast: on a GPU, or on a CPU whose oneDNN has bfloat16 kernels (AVX-512: 2x the
float32 rate on avx512_bf16). Elsewhere torch falls back to generic loops: on an AVX2-only CPU a medium zoo
LM evaluated 83 times slower in bfloat16 than in float32, and a 2048^3 bfloat16 product took 270 times
the float32 one (bench/RESULTS.md, "bfloat16 on a CPU without bfloat16 products"). There `widened`
runs the forward with each block's half-precision parameters widened to float32 just before that block runs
and restored just after, the parameters outside the blocks for the whole forward: the weights stay stored as
they are, one block's float32 copy lives at a time, and the products run at the float32 rate (widening is
exact; the arithmetic is float32's, closer to the exact function than bfloat16's).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)
FORCE: bool | None = None  # None: decide per device (fast_half); True / False: always / never widen (tests)


@functools.cache
def _cpu_has(dtype: torch.dtype) -> bool:
    """Whether oneDNN has native kernels for `dtype` on this CPU (torch's own check; False when it cannot say)."""
    name = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):
        return False


def fast_half(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in `dtype` (a half-precision one) run fast on `device`."""
    return device.type != "cpu" or _cpu_has(dtype)


def widens_dtype(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether weights of `dtype` on `device` compute in float32: a half-precision dtype on a device without fast
    products for it (or FORCE)."""
    if dtype not in HALF:
        return False
    return FORCE if FORCE is not None else not fast_half(dtype, torch.device(device))


def widens(module: nn.Module) -> bool:
    """Whether `widened(module)` changes anything (widens_dtype of its first half-precision parameter)."""
    p = next((p for p in module.parameters() if p.dtype in HALF), None)
    return p is not None and widens_dtype(p.dtype, p.device)


def blocks(module: nn.Module) -> list[nn.Module]:
    """The elements of every outermost nn.ModuleList / nn.Sequential in `module`: its blocks (HF's layers, timm's
    and the reference family's blocks), each called as a module and reading only its own parameters."""
    out, todo = [], [module]
    while todo:
        for c in todo.pop().children():
            if isinstance(c, (nn.ModuleList, nn.Sequential)):
                out.extend(c)
            else:
                todo.append(c)
    return out


@contextlib.contextmanager
def widened(module: nn.Module) -> Iterator[bool]:
    """Forward passes of `module` inside the block compute in float32 where `widens(module)`; yields whether.

    Each block (`blocks`) widens its half-precision parameters (`param.data`, no gradient history) in a forward
    pre-hook and restores them in its forward hook; the parameters outside every block (embeddings, final norm,
    head: some read by the root's own forward, not by a module of theirs) are widened for the whole `with`
    block, and floating inputs of the root module too (images arrive in the model's dtype). On leaving,
    whatever a forward stopped by an exception left widened is restored as well, so the module ends exactly
    as it started. No-grad forwards only: a parameter's storage is swapped while the forward runs."""
    if not widens(module):
        yield False
        return
    stack: list[list[tuple[nn.Parameter, torch.Tensor]]] = []

    def widen(params) -> None:
        swapped = [(p, p.data) for p in params if p.dtype in HALF]
        for p, data in swapped:
            p.data = data.float()
        stack.append(swapped)

    def restore() -> None:
        for p, data in stack.pop():
            p.data = data

    def wide(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF else x

    def inputs(m: nn.Module, args, kwargs):
        return tuple(wide(a) for a in args), {k: wide(v) for k, v in kwargs.items()}

    inner = blocks(module)
    hooks = [module.register_forward_pre_hook(inputs, with_kwargs=True)]
    for b in inner:
        hooks += [b.register_forward_pre_hook(lambda m, a: widen(m.parameters())),
                  b.register_forward_hook(lambda m, a, out: restore())]
    own = {id(p) for b in inner for p in b.parameters()}
    try:
        widen(p for p in module.parameters() if id(p) not in own)
        with torch.no_grad():
            yield True
    finally:
        for h in hooks:
            h.remove()
        while stack:
            restore()
