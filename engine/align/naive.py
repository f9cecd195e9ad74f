"""Naive: no alignment. The path is the straight line between the models as trained (the baseline)."""

from __future__ import annotations

from engine.align.context import AlignContext, AlignOutput, identity_like
from engine.models.base import Arch


def align_naive(ctx: AlignContext) -> AlignOutput:
    """The identity element (registry entry `naive`)."""
    return AlignOutput(identity_like(ctx.pair), {"seconds": 0.0})


def scratch_bytes(arch: Arch, params: int, layer_params: int, itemsize: int) -> int:
    """No scratch: the identity moves nothing (registry entry `naive`)."""
    return 0
