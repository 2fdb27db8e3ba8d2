"""The output lock: a flock on ``OUT/_lock`` held by the one run that writes the output.

The body is JSON ``{host, pid, flow_run, started}`` so a refused run can name the holder. The kernel
drops a flock when its holder dies, so a stale body from a killed run never blocks anyone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
from pathlib import Path
from typing import Any, Protocol

import orjson

from tasks.shards._errors import OutputLocked
from tasks.shards._fs import utc_now_iso

__all__ = ["LOCK_FILE", "OutputLock", "held_lock", "lock_holder", "read_lock_body"]

LOCK_FILE = "_lock"

# Locks this process holds, by resolved output path: flock locks belong to an open file description,
# so a second open+flock of the same file from this process would conflict with our own lock.
_HELD: dict[str, OutputLock] = {}
_HELD_GUARD = threading.Lock()


class _LockableDir(Protocol):
    """What the lock needs of an output directory (``tasks.shards.OutputDir``)."""

    @property
    def path(self) -> Path: ...

    @property
    def key(self) -> str: ...


def held_lock(key: str) -> OutputLock | None:
    """The lock this process holds on the output with resolved path ``key``, if any."""
    with _HELD_GUARD:
        return _HELD.get(key)


def read_lock_body(lock_path: Path) -> dict[str, Any]:
    """The JSON body of ``lock_path`` ({} when missing, empty or unreadable), held or not."""
    try:
        data = lock_path.read_bytes()
        body = orjson.loads(data) if data.strip() else {}
        return body if isinstance(body, dict) else {}
    except (OSError, orjson.JSONDecodeError):
        return {}


def lock_holder(lock_path: Path, key: str) -> dict[str, Any] | None:
    """The body of a lock that a live process holds right now, else None (stale bodies ignored)."""
    held = held_lock(key)
    if held is not None:
        return dict(held.info)
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return read_lock_body(lock_path) or {"host": None, "pid": None}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class OutputLock:
    """The flock on ``OUT/_lock``, held from ``acquire()`` to ``release()`` (or the process's death).

    The body is JSON ``{host, pid, flow_run, started}`` so a refused run can name the holder. The
    kernel drops a flock when its holder dies, so a stale body from a killed run never blocks.
    The descriptor is not inherited by child processes (servers started by the flow).
    """

    def __init__(self, out: _LockableDir, run_info: dict[str, Any] | None = None) -> None:
        self.out = out
        self.path = out.path / LOCK_FILE
        self.info: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "flow_run": None,
            "started": utc_now_iso(),
        }
        self.info.update(run_info or {})
        self._fd: int | None = None
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock without waiting (re-acquiring a held lock object nests).

        Raises:
            OutputLocked: another process, or another lock object here, holds it (names the holder).
        """
        key = self.out.key
        with _HELD_GUARD:
            mine = _HELD.get(key)
            if mine is not None:
                if mine is self:
                    self._depth += 1
                    return self
                raise OutputLocked(self.path, mine.info)
            self.out.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputLocked(self.path, read_lock_body(self.path)) from exc
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(self.info) + b"\n", 0)
            self._fd = fd
            self._depth = 1
            _HELD[key] = self
        return self

    def release(self) -> None:
        """Leave one level of nesting; the outermost release unlocks and empties the body."""
        with _HELD_GUARD:
            if self._fd is None:
                return
            self._depth -= 1
            if self._depth > 0:
                return
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # an unlocked file with a body would look like a holder
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            _HELD.pop(self.out.key, None)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
