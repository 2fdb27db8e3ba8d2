"""Undoing a half-finished shard commit (see tasks.shards for the commit order it relies on).

Each step only removes what a crash between two commit steps can leave behind; the rows of a
removed shard file are still in its journal, so they are recommitted without new requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import orjson

from tasks.files import TMP_MARK, Dir
from tasks.shards._fs import shard_index_of

__all__ = [
    "journal_indices",
    "prune_rejects",
    "remove_orphan_shards",
    "remove_stale_journals",
    "remove_temp_files",
]


def remove_temp_files(directories: Iterable[Dir | None]) -> int:
    """Remove the temp files of interrupted atomic writes in ``directories`` (None: absent); returns how
    many."""
    removed = 0
    for directory in directories:
        if directory is None:
            continue
        for name in directory.names():
            if TMP_MARK in name and directory.remove(name):
                removed += 1
    return removed


def remove_orphan_shards(shard_dir: Dir | None, committed: set[int]) -> int:
    """Remove Parquet shards the manifest does not list; returns how many.

    Such a file was renamed into place before the manifest update: its journal still holds the rows.
    """
    return _remove_shard_files(shard_dir, "parquet", lambda index: index not in committed)


def remove_stale_journals(journal_dir: Dir | None, committed: set[int]) -> int:
    """Remove journals of shards the manifest lists (committed, but the journal outlived it)."""
    return _remove_shard_files(journal_dir, "jsonl", lambda index: index in committed)


def _remove_shard_files(directory: Dir | None, suffix: str, doomed: Callable[[int], bool]) -> int:
    removed = 0
    if directory is not None:
        for name in directory.names():
            index = shard_index_of(name)
            if index is not None and name.endswith(f".{suffix}") and doomed(index) and directory.remove(name):
                removed += 1
    return removed


def prune_rejects(rejects_dir: Dir | None, name: str, committed: set[int]) -> int:
    """Drop reject lines of uncommitted shards (and unreadable ones) from ``rejects_dir/name``; returns how
    many were dropped.

    The file is rewritten atomically, also when only a torn last line has to go.
    """
    if rejects_dir is None:
        return 0
    try:
        data = rejects_dir.read(name)
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
        rejects_dir.write(name, b"".join(line + b"\n" for line in keep))
    return dropped


def journal_indices(journal_dir: Dir | None) -> list[int]:
    """Sorted indices of the shards that have a journal in ``journal_dir`` (open, uncommitted)."""
    if journal_dir is None:
        return []
    found = (shard_index_of(name) for name in journal_dir.files(".jsonl"))
    return sorted(i for i in found if i is not None)
