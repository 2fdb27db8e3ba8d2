"""The output lock: a flock on ``OUT/_lock`` held by the one run that writes the output.

The body is JSON ``{host, pid, flow_run, started}`` so a refused run can name the holder. The kernel
drops a flock when its holder dies, so a stale body from a killed run never blocks anyone. The lock's
identity in this process is the output's directory handle (device and inode), never a path: the lock
file is opened relative to that handle, and every later operation of the run goes through it.
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

from tasks.files import Dir
from tasks.shards._errors import OutputLocked
from tasks.shards._fs import utc_now_iso

__all__ = ["LOCK_FILE", "OutputLock", "held_lock", "lock_holder", "read_lock_body"]

LOCK_FILE = "_lock"

# Locks this process holds, by the output directory's (device, inode): flock locks belong to an open
# file description, so a second open+flock of the same file from this process would conflict with our
# own lock.
Key = tuple[int, int]
_HELD: dict[Key, OutputLock] = {}
_HELD_GUARD = threading.RLock()  # acquire() opens the root, which asks held_lock()


class _LockableDir(Protocol):
    """What the lock needs of an output directory (``tasks.shards.OutputDir``)."""

    @property
    def path(self) -> Path: ...

    def open_root(self, *, create: bool = False) -> Dir | None: ...


def held_lock(key: Key) -> OutputLock | None:
    """The lock this process holds on the output directory with ``(device, inode)`` ``key``, if any."""
    with _HELD_GUARD:
        return _HELD.get(key)


def _body(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        body = orjson.loads(data) if data.strip() else {}
        return body if isinstance(body, dict) else {}
    except (OSError, orjson.JSONDecodeError):
        return {}


def read_lock_body(root: Dir) -> dict[str, Any]:
    """The JSON body of ``_lock`` in the output ``root`` ({} when missing, empty or unreadable), held or not."""
    try:
        fd = root.open_file(LOCK_FILE, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _body(fd)
    finally:
        os.close(fd)


def lock_holder(root: Dir) -> dict[str, Any] | None:
    """The body of a lock that a live process holds right now on the output ``root``, else None (stale
    bodies ignored).

    Raises:
        UnsafeFile: ``_lock`` is a symlink or not a regular file.
    """
    held = held_lock(root.key)
    if held is not None:
        return dict(held.info)
    try:
        fd = root.open_file(LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _body(fd) or {"host": None, "pid": None}
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
        self.root: Dir | None = None  # the output's handle while held
        self._key: Key | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock without waiting (re-acquiring a held lock object nests).

        Raises:
            OutputLocked: another process, or another lock object here, holds it (names the holder).
            UnsafeFile: ``_lock`` is a symlink, not a regular file, or owned by another user.
        """
        with _HELD_GUARD:
            if self._fd is not None:
                self._depth += 1
                return self
            root = self.out.open_root(create=True)
            assert root is not None
            key = root.key
            mine = _HELD.get(key)
            if mine is not None:
                raise OutputLocked(self.path, mine.info)
            fd = root.open_file(LOCK_FILE, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                body = _body(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputLocked(self.path, body) from exc
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(self.info) + b"\n", 0)
            self._fd = fd
            self._depth = 1
            self.root, self._key = root, key
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
            _HELD.pop(self._key, None)  # type: ignore[arg-type]
            self.root, self._key = None, None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
