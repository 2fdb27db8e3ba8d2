"""The cyclic collector's young generation while rows stream (decision 114).

Every row in flight holds a few hundred container objects (its coroutines, futures, aiohttp's
request and response) that live for the length of a request. Under CPython's default threshold of
700 net allocations, a run over three fast servers collected its young generation every ten rows
or so, and every tenth of those scanned the older generations with them: a tenth of the client's
CPU went to collections that found almost nothing (docs/benchmarks.md). While any dataset streams,
the young generation's threshold is raised to ``GEN0_WHILE_STREAMING``; the older generations keep
their thresholds, reference counting still frees almost every object at once, and the collector's
settings are put back when the last stream of the process ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["GEN0_WHILE_STREAMING", "young_generation"]

GEN0_WHILE_STREAMING = 10_000  # objects; at most a few MB of young garbage waits for a collection

_lock = threading.Lock()
_streams = 0  # streams of this process inside young_generation() (server threads each run one)
_saved: tuple[int, int, int] | None = None  # the thresholds to put back; None: left as they were


@contextlib.contextmanager
def young_generation(threshold: int = GEN0_WHILE_STREAMING) -> Iterator[None]:
    """Raise the young generation's threshold to ``threshold`` while the block runs; nested and
    concurrent blocks (one per server thread) share one raise, undone when the last one ends.

    A threshold already at least ``threshold``, or 0 (automatic collection off), is left alone, and
    so is one that something else changed meanwhile: only the value set here is put back.
    """
    global _streams, _saved
    with _lock:
        if _streams == 0:
            current = gc.get_threshold()
            if 0 < current[0] < threshold:
                gc.set_threshold(threshold, current[1], current[2])
                _saved = current
            else:
                _saved = None
        _streams += 1
    try:
        yield
    finally:
        with _lock:
            _streams -= 1
            if _streams == 0 and _saved is not None:
                if gc.get_threshold()[0] == threshold:
                    gc.set_threshold(*_saved)
                _saved = None
