"""Checking committed shards against the manifest, and un-committing the ones that fail.

A committed shard is damaged when its file is missing, is not a regular file, or its bytes no longer
hash to the manifest's sha256. ``uncommit`` drops such shards from the manifest so the next run
generates exactly those again; the files themselves are then cleaned up like any uncommitted shard.
"""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tasks.files import Dir, UnsafeFile
from tasks.shards._manifest import ShardRecord, iter_shard_records

__all__ = ["ShardDamage", "file_sha256", "find_damage", "uncommit"]


@dataclass(frozen=True)
class ShardDamage:
    """A committed shard whose file does not match the manifest. ``problem`` says how."""

    dataset: str
    index: int
    file: str
    problem: str

    def describe(self) -> str:
        return f"shard {self.index} of {self.dataset!r} ({self.file}): {self.problem}"

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "shard": self.index, "file": self.file, "problem": self.problem}


def file_sha256(f: IO[bytes]) -> str:
    """The sha256 (hex) of what is left to read in ``f``, read in chunks.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    while chunk := f.read(1 << 22):
        digest.update(chunk)
    return digest.hexdigest()


def _problem(rec: ShardRecord, shard_dir: Dir | None) -> str | None:
    st = shard_dir.lstat(rec.name) if shard_dir is not None else None
    if st is None:
        return "the file is missing"
    if stat.S_ISLNK(st.st_mode):  # planted in OUT: refused (exit 2), not un-committed as damage
        raise UnsafeFile(rec.path, f"it is a symbolic link to {shard_dir.readlink(rec.name)}")  # type: ignore[union-attr]
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    try:
        with shard_dir.reader(rec.name) as f:  # type: ignore[union-attr]
            digest = file_sha256(f)
    except UnsafeFile:
        raise
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if digest != rec.sha256:
        return f"sha256 {digest[:12]}... differs from the manifest's {rec.sha256[:12]}... (changed after commit)"
    return None


def find_damage(manifest: dict[str, Any] | None, root: Path, dataset_dir: Callable[[str], Dir | None],
                dataset: str | None = None) -> Iterator[ShardDamage]:
    """The damaged committed shards of ``dataset`` (or of every dataset), in dataset then index order.

    Args:
        manifest: the output's manifest (None: nothing is committed).
        root: the output directory (for the messages).
        dataset_dir: a dataset's directory, held open (None when it is missing).
        dataset: only this dataset.

    Raises:
        UnsafeFile: a dataset's directory is a symlink or not a directory.
    """
    dirs: dict[str, Dir | None] = {}
    for rec in iter_shard_records(manifest, root, dataset):
        if rec.dataset not in dirs:
            dirs[rec.dataset] = dataset_dir(rec.dataset)
        problem = _problem(rec, dirs[rec.dataset])
        if problem is not None:
            yield ShardDamage(rec.dataset, rec.index, rec.file, problem)


def uncommit(manifest: dict[str, Any], damaged: Iterable[ShardDamage]) -> set[str]:
    """Drop ``damaged`` shards from ``manifest`` (edited in place); returns the datasets touched."""
    touched = set()
    for d in damaged:
        entry = manifest["datasets"][d.dataset]
        if entry["shards"].pop(str(d.index), None) is not None:
            entry["complete"] = False
            touched.add(d.dataset)
    return touched
