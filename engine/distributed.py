"""Data-parallel runs across processes: torch.distributed, launched by torchrun (docs/SCALE.md).

    torchrun --nproc_per_node N -m engine align A B --method dual ...

starts N copies of the CLI. Every process holds both models and the latents and does the same
deterministic work (loading, weight matching, Hungarian solves, Adam steps); what scales with data
is split: each process scores its share of every training batch, validation batch and evaluation
set, and the partial sums are added across processes (`all_sum`). Gradients are summed the same
way before each step, so every process takes the same step and reaches the same element, equal to
one process's up to the order of floating-point sums. Process 0 alone prints and writes. One
process (no torchrun) runs the same code with a world of one, where every function here is a no-op.

The backend is gloo on the CPU and nccl when the processes use CUDA devices.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from engine.errors import LMCError


def launched() -> bool:
    """Whether torchrun started this process as one of several (WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def start(device: str = "cpu") -> None:
    """Join the process group torchrun describes (nothing for a single process). `device` "cuda"
    picks nccl and this process's GPU (LOCAL_RANK); anything else gloo."""
    if not launched() or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def shard(n: int) -> slice:
    """This process's contiguous share of n rows (the first n % size processes take one more)."""
    w, r = size(), rank()
    if n < w:
        raise LMCError(f"A batch of {n} items cannot be split over {w} processes; run fewer processes.")
    base, extra = divmod(n, w)
    lo = r * base + min(r, extra)
    return slice(lo, lo + base + (r < extra))


def my_batches(n_batches: int) -> range:
    """The batch indices this process scores: every size()-th, starting at its rank."""
    return range(rank(), n_batches, size())


def all_sum(*tensors: Tensor) -> None:
    """Sum each tensor over the processes, in place (one flat reduction for all of them)."""
    if size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat)
    i = 0
    for t in tensors:
        t.copy_(flat[i:i + t.numel()].view_as(t).to(t.dtype))
        i += t.numel()


def agree(x: float) -> float:
    """Process 0's value of x on every process (a clock reading that decides a step's size or the
    end of a run must be the same everywhere, or the processes would part ways)."""
    if size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, 0)
    return float(t)
