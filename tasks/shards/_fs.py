"""Durable file primitives and names shared by the parts of tasks.shards.

Every file the output directory replaces goes through ``atomic_write_bytes`` (temp name in the same
directory, fsync, rename, fsync dir), so a reader sees the old or the new file, never half of one;
a crash leaves at most a temp file, which ``OutputDir.recover()`` removes (it looks for ``TMP_MARK``).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

__all__ = [
    "TMP_MARK",
    "append_durable",
    "atomic_write_bytes",
    "check_dataset_name",
    "fsync_dir",
    "shard_file_name",
    "shard_index_of",
    "utc_now_iso",
]

TMP_MARK = ".tmp-"
_SHARD_FILE = re.compile(r"^shard-(\d+)\.(parquet|jsonl)$")
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def utc_now_iso() -> str:
    """The current UTC time as ISO 8601 text with microseconds (the manifest's timestamps)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def shard_file_name(index: int) -> str:
    """The stem of shard ``index``'s files (``shard-00007``), shared by Parquet and journal."""
    return f"shard-{index:05d}"


def check_dataset_name(dataset: str) -> None:
    """Raises ValueError for a name that is not a safe single path component."""
    if not _DATASET_NAME.match(dataset) or dataset.startswith("_"):
        raise ValueError(
            f"dataset name {dataset!r} must be 1-128 of [A-Za-z0-9._-], not starting with '_' or '.'"
        )


def shard_index_of(name: str) -> int | None:
    """The shard index of a ``shard-NNNNN.parquet``/``.jsonl`` file name, else None."""
    m = _SHARD_FILE.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a create or rename in it) durable. Raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory: fsync, rename, fsync dir.

    Raises ``OSError`` (the temp file may be left behind; recovery removes it).
    """
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_durable(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing) and fsync it. Raises ``OSError``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
