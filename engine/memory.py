"""Freed memory and the C library's allocator (glibc malloc; every helper is a no-op elsewhere).

A leaf: it imports nothing from the engine, so an aligner (engine.align.weight) and the run's entry
points (engine.api, the CLI, the app) use it without reaching the memory estimate (engine.resources,
which still re-exports these helpers under their old address).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager


@functools.cache
def _libc():
    """The C library, looked up once (find_library runs ldconfig), or None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


FREED_THRESHOLD = 128 * 1024  # bytes: return_freed_memory's fixed mmap threshold
REUSE_THRESHOLD = 32 * 1024 * 1024  # ... and reuse_freed_memory's (glibc's largest)
_threshold_after = REUSE_THRESHOLD  # what reuse_freed_memory restores


def _set_mmap_threshold(nbytes: int) -> bool:
    libc = _libc()
    try:
        return bool(libc and libc.mallopt(-3, nbytes))  # M_MMAP_THRESHOLD: fixed, so no dynamic raising
    except AttributeError:
        return False


def return_freed_memory() -> bool:
    """Make freed tensor memory go back to the operating system (glibc; a no-op elsewhere).

    glibc serves allocations above a threshold with mmap and returns them on free, but raises that
    threshold to the largest block freed so far: after one large temporary, later ones come from a
    heap that is never trimmed, and a streamed run's resident memory ratchets up to its worst moment
    plus fragmentation. A fixed 128 KiB threshold keeps every large tensor mmapped, so resident
    memory follows what is alive (measured in bench/RESULTS.md). Called by the CLI and the app.
    """
    global _threshold_after
    _threshold_after = FREED_THRESHOLD
    return _set_mmap_threshold(FREED_THRESHOLD)


@contextmanager
def reuse_freed_memory() -> Iterator[None]:
    """Within: blocks up to 32 MiB come from glibc's heap and are reused; after: the heap is trimmed.

    Weight matching frees and reallocates a layer's worth of tensors at every step; as fresh mappings
    each costs a page fault per 4 KiB (a third of GPT-2-small's weight-matching time). Its heap
    growth is bounded by one layer's scratch, which trim_freed_memory hands back at the end.
    """
    _set_mmap_threshold(REUSE_THRESHOLD)
    try:
        yield
    finally:
        _set_mmap_threshold(_threshold_after)
        trim_freed_memory()


def trim_freed_memory() -> None:
    """Give the heap's free pages back to the operating system (glibc's malloc_trim; a no-op elsewhere)."""
    libc = _libc()
    try:
        if libc:
            libc.malloc_trim(0)
    except AttributeError:
        pass
