"""Stopping a run on request: a token any thread may set, checked by every long loop of the engine.

A researcher who starts a minutes-long dual run must be able to stop it, and a run nobody waits for
any more (a new run started, the page left, the session closed) must not keep the CPU busy. The
caller sets the token; the engine checks it before every unit of work (a weight-matching layer, an
activation-matching layer, an optimisation step, an evaluation batch, a grid point) and raises
Cancelled, so a stopped run gives its CPU back within one unit of work and writes nothing.
"""

from __future__ import annotations

import threading

from engine.errors import Cancelled


class CancelToken:
    """A one-way switch: `cancel()` from any thread, `check(where)` in the worker."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = "stopped on request"

    def cancel(self, reason: str = "stopped on request") -> None:
        """Ask the run to stop; the first reason given is the one reported."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self, where: str) -> None:
        """Raise Cancelled, naming `where` the run was, once the token is set."""
        if self._event.is_set():
            raise Cancelled(f"The run was {self.reason} during {where}.")


def check(token: CancelToken | None, where: str) -> None:
    """token.check(where), for loops whose token is optional."""
    if token is not None:
        token.check(where)


__all__ = ["CancelToken", "Cancelled", "check"]
