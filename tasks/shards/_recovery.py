"""Undoing a half-finished shard commit (see tasks.shards for the commit order it relies on).

Each step only removes what a crash between two commit steps can leave behind; the rows of a
removed shard file are still in its journal, so they are recommitted without new requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import orjson

from tasks.files import TMP_MARK, atomic_write_bytes
from tasks.shards._fs import shard_index_of

__all__ = [
    "journal_indices",
    "prune_rejects",
    "remove_orphan_shards",
    "remove_stale_journals",
    "remove_temp_files",
]


def remove_temp_files(directories: Iterable[Path]) -> int:
    """Remove the temp files of interrupted atomic writes in ``directories``; returns how many."""
    removed = 0
    for directory in directories:
        if not directory.is_dir():
            continue
        for p in directory.iterdir():
            if TMP_MARK in p.name and p.is_file():
                p.unlink()
                removed += 1
    return removed


def remove_orphan_shards(shard_dir: Path, committed: set[int]) -> int:
    """Remove Parquet shards the manifest does not list; returns how many.

    Such a file was renamed into place before the manifest update: its journal still holds the rows.
    """
    return _remove_shard_files(shard_dir, "parquet", lambda index: index not in committed)


def remove_stale_journals(journal_dir: Path, committed: set[int]) -> int:
    """Remove journals of shards the manifest lists (committed, but the journal outlived it)."""
    return _remove_shard_files(journal_dir, "jsonl", lambda index: index in committed)


def _remove_shard_files(directory: Path, suffix: str, doomed: Callable[[int], bool]) -> int:
    removed = 0
    if directory.is_dir():
        for p in directory.glob(f"shard-*.{suffix}"):
            index = shard_index_of(p.name)
            if index is not None and doomed(index):
                p.unlink()
                removed += 1
    return removed


def prune_rejects(path: Path, committed: set[int]) -> int:
    """Drop reject lines of uncommitted shards (and unreadable ones); returns how many were dropped.

    The file is rewritten atomically, also when only a torn last line has to go.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    keep: list[bytes] = []
    dropped = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
            ok = int(rec["shard"]) in committed
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            ok = False
        if ok:
            keep.append(line)
        else:
            dropped += 1
    if dropped or (data and not data.endswith(b"\n")):
        atomic_write_bytes(path, b"".join(line + b"\n" for line in keep))
    return dropped


def journal_indices(journal_dir: Path) -> list[int]:
    """Sorted indices of the shards that have a journal in ``journal_dir`` (open, uncommitted)."""
    if not journal_dir.is_dir():
        return []
    found = (shard_index_of(p.name) for p in journal_dir.glob("shard-*.jsonl"))
    return sorted(i for i in found if i is not None)
