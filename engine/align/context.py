"""What an aligner gets (AlignContext) and returns (AlignOutput), and the small helpers every aligner uses:
the identity element of a pair, a stopwatch, float64 views of parameters."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.align.pair import Pair
from engine.cancel import CancelToken
from engine.models.base import Params
from engine.progress import Progress
from engine.symmetry import GroupElement, identity

if TYPE_CHECKING:
    from engine.align.learned import Settings
    from engine.align.resume import Checkpoint
    from engine.align.weight import WeightSettings

F64 = torch.float64  # the solvers' working precision

@dataclass
class AlignContext:
    pair: Pair
    classes: frozenset[str]
    steps: int = 0  # optimisation budget (learned, dual); 0 = the method's default
    seed: int = 0
    batch: int = 16  # sequences / images per training batch
    progress: Progress | None = None
    qk_structure: str | None = None  # override the spec's Q/K group ("gl"): only to test the guard
    compare_one_sided: bool = True  # dual: also run one-sided learning at the same step budget
    # dual: a finished one-sided run of this very optimisation (a learned record's diagnostics, of the same config
    # but the method), taken as the comparison instead of running it again when it ran as many steps as dual did
    one_sided: dict | None = None
    time_budget_s: float | None = None  # learned, dual: also stop when this many seconds of optimisation are spent
    cancel: CancelToken | None = None  # checked before every layer / step (engine.cancel): Cancelled when set
    learned: Settings | None = None  # learned, dual: schedule, lam sampling, patience (None: the defaults)
    weight: WeightSettings | None = None  # weight: head cost, MLP score, residual weighting (None: the defaults)
    checkpoint: Checkpoint | None = None  # learned, dual: keep a resumable state there (engine.align.resume)


@dataclass
class AlignOutput:
    g: GroupElement  # moves B onto A: the path is theta_A -> g.theta_B
    info: dict = field(default_factory=dict)  # method-specific diagnostics (JSON-ready)
    g_a: GroupElement | None = None  # dual: A's own transform (the path is reported in A's frame)


def identity_like(pair: Pair) -> GroupElement:
    dtype = next(iter(pair.params_a.values())).dtype
    return identity(pair.arch, F64 if dtype != F64 else dtype)


def tick() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


class F64View(Mapping[str, Tensor]):
    """Params read as float64 CPU tensors one key at a time: the solvers' working precision and place
    (scipy, small matrices) without a float64 copy of the whole model."""

    def __init__(self, p: Params):
        self.p = p

    def __getitem__(self, k: str) -> Tensor:
        return self.p[k].detach().to("cpu", F64)

    def __iter__(self) -> Iterator[str]:
        return iter(self.p)

    def __len__(self) -> int:
        return len(self.p)
