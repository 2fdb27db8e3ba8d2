"""Durable file writes: the one way this package replaces or appends to a file it keeps.

A replaced file is written to a temp file in the same directory, fsynced, renamed over the target and
the directory fsynced, so a reader sees the old or the new content, never half of one, and a crash
keeps whichever was last made durable. A failed write removes its temp file; a crash may leave one
behind, recognisable by ``TMP_MARK`` in its name.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TMP_MARK",
    "append_durable",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_writer",
    "fsync_dir",
]

TMP_MARK = ".tmp-"


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a create or a rename in it) durable.

    Args:
        path: the directory.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    # pid + random: concurrent writers (processes or threads) never share a temp file
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Replace ``path`` with what the ``with`` block writes to the yielded file, atomically.

    The content becomes visible only when the block ends without an exception; on an exception the
    temp file is removed and ``path`` keeps its old content (or stays absent).

    Args:
        path: the file to replace; its directory must exist.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: text encoding for ``"w"``.

    Raises:
        ValueError: ``mode`` is neither ``"w"`` nor ``"wb"``.
        OSError: the temp file cannot be written, synced or renamed (``path`` is unchanged).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = _temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Args:
        path: the file to replace; its directory must exist.
        data: the new content.

    Raises:
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    with atomic_writer(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: Path | str, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically and durably.

    Args:
        path: the file to replace; its directory must exist.
        text: the new content.
        encoding: how ``text`` is encoded.

    Raises:
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: Path | str, doc: Any, *, indent: int | None = 1, sort_keys: bool = False,
                      default: Callable[[Any], Any] | None = None, newline: bool = False) -> None:
    """Replace ``path`` with ``doc`` as JSON, atomically and durably.

    ``doc`` is serialised before the file is touched, so a value that cannot be serialised leaves
    ``path`` as it was.

    Args:
        path: the file to replace; its directory must exist.
        doc: the value to write.
        indent, sort_keys, default: as for ``json.dumps``.
        newline: end the file with a newline.

    Raises:
        TypeError, ValueError: ``doc`` cannot be serialised.
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    text = json.dumps(doc, indent=indent, sort_keys=sort_keys, default=default)
    atomic_write_text(path, text + "\n" if newline else text)


def append_durable(path: Path | str, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing) and fsync it.

    Args:
        path: the file to append to; its directory must exist.
        data: the bytes to append (written whole: short writes are continued).

    Raises:
        OSError: the file cannot be opened, written or synced.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
