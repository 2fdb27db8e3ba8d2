"""Waiting for something to become true, bounded: the one poll loop of the product.

``Backoff(timeout_s, first_s, max_s)`` is the time between two looks: ``first_s``, doubling (or
growing by ``factor``) up to ``max_s``, never past the deadline. ``poll_until(check, ...)`` looks until ``check()`` is true or
the deadline passes. Both take the waiting function (``time.sleep``, an ``Event.wait`` that ends the
wait early, a child's ``wait``), so a loop that must notice a stop or an exit does so at once.

The GPU probe (tasks/gpus.py) keeps its own loop: it runs on remote hosts as a standalone script
that imports the standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Backoff", "poll_until"]


class Backoff:
    """The waits of one bounded poll (see the module docstring)."""

    def __init__(self, timeout_s: float, first_s: float, max_s: float, factor: float = 2.0) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.delay = first_s
        self.max_s = max_s
        self.factor = factor

    @property
    def left(self) -> float:
        """Seconds until the deadline (0 once it passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def wait(self, sleep: Callable[[float], Any] = time.sleep) -> bool:
        """Wait the next delay with ``sleep`` (at most until the deadline); False, without waiting,
        once the deadline has passed."""
        left = self.left
        if left <= 0:
            return False
        sleep(min(self.delay, left))
        self.delay = min(self.delay * self.factor, self.max_s)
        return True


def poll_until(check: Callable[[], bool], timeout_s: float, first_s: float, max_s: float,
               sleep: Callable[[float], Any] = time.sleep) -> bool:
    """Call ``check`` until it returns true (True) or ``timeout_s`` passes (False), waiting
    ``first_s`` doubling up to ``max_s`` between calls. ``check`` runs at least once."""
    backoff = Backoff(timeout_s, first_s, max_s)
    while True:
        if check():
            return True
        if not backoff.wait(sleep):
            return False
