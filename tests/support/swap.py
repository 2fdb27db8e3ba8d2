"""An attacker with write access to OUT: swap a name for a symlink at the moment datagen uses it.

``inotify`` tells the moment (a file created in, or a directory opened under, a watched directory);
``renameat2(RENAME_EXCHANGE)`` swaps two names atomically, so there is no instant at which either is
missing. Both names lie inside OUT: the attacker needs no access anywhere else. The watcher runs in a
thread of the test process (ctypes releases the GIL while it waits).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["IN_CREATE", "IN_OPEN", "Swap", "exchange", "swap_on"]

IN_ACCESS = 0x00000001
IN_OPEN = 0x00000020
IN_CREATE = 0x00000100
IN_ISDIR = 0x40000000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``)."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


class Swap:
    """The outcome of one watch: whether the swap was made, and on which event."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.event: str | None = None
        self.swaps = 0
        self.error: BaseException | None = None


@contextlib.contextmanager
def swap_on(watch: Path, mask: int, when: Callable[[str], bool], a: Path, b: Path,
            *, skip: int = 0, storm_s: float = 0.0) -> Iterator[Swap]:
    """While the block runs, watch directory ``watch`` for ``mask`` events and, at the first (after
    ``skip``) whose name satisfies ``when``, swap ``a`` and ``b``. With ``storm_s``, go on swapping them
    back and forth as fast as possible for that long (every instant of a check-then-use window is
    hit), ending swapped. The watch ends with the block."""
    fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    if _libc.inotify_add_watch(fd, os.fsencode(watch), mask) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"inotify_add_watch({watch})")
    result, stop = Swap(), threading.Event()
    seen = [0]

    def watcher() -> None:
        try:
            while not stop.is_set() and not result.done.is_set():
                ready, _, _ = select.select([fd], [], [], 0.05)
                if not ready:
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                offset = 0
                while offset < len(data):
                    _, ev_mask, _, length = _EVENT.unpack_from(data, offset)
                    name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0").decode()
                    offset += _EVENT.size + length
                    if ev_mask & mask and when(name):
                        seen[0] += 1
                        if seen[0] > skip:
                            exchange(a, b)
                            result.event = name
                            swaps, end = 1, time.monotonic() + storm_s
                            while time.monotonic() < end and not stop.is_set():
                                exchange(a, b)
                                swaps += 1
                            if swaps % 2 == 0:
                                exchange(a, b)
                                swaps += 1
                            result.swaps = swaps
                            result.done.set()
                            return
        except BaseException as exc:  # reported by the test, never swallowed
            if not (isinstance(exc, OSError) and exc.errno == errno.EBADF):
                result.error = exc

    thread = threading.Thread(target=watcher, name=f"swap {a.name}", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(5)
        os.close(fd)
