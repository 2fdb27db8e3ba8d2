"""Nightly output versions: a new dated directory per run, ``latest`` moved only to a validated one.

Layout under a partition's output root when ``output.versioned = true``::

    ROOT/versions/20260105T020000Z/          one run's OUT (see tasks.shards)
    ROOT/versions/20260104T020000Z.failed    marker: that version failed validation, never resumed
    ROOT/latest -> versions/20260104T020000Z  the last version that validated

A run resumes the newest version that is neither ``latest`` nor marked failed, else starts a new one.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from tasks.files import UnsafeFile, atomic_write_text, checked_dir, fsync_dir

__all__ = ["choose_version", "mark_failed", "promote_latest"]


def _versions(root: Path) -> Path:
    return root / "versions"


def choose_version(root: Path, now: dt.datetime | None = None) -> Path:
    """The output directory for this run: an unfinished version to resume, else a new one.

    Args:
        root: the partition's output root.
        now: the time that names a new version (default: now, UTC).

    Raises:
        UnsafeFile: ``versions`` or an entry in it is a symlink, or not this user's directory.
        OSError: the directories cannot be created.
    """
    versions = checked_dir(root, _versions(root), create=True)
    latest = root / "latest"
    current = latest.resolve() if latest.is_symlink() else None
    entries = list(versions.iterdir())
    for p in entries:
        if p.is_symlink():  # a version is a directory datagen made; a link would be written through
            raise UnsafeFile(p, f"it is a symbolic link to {os.readlink(p)}", directory=True)
    for d in sorted((p for p in entries if p.is_dir()), reverse=True):
        if current is not None and d.resolve() == current:
            break  # everything older than the promoted version is history
        if not (versions / f"{d.name}.failed").exists():
            return d
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    out = versions / stamp
    n = 1
    while out.exists():
        n += 1
        out = versions / f"{stamp}.{n}"
    out.mkdir(parents=True)
    return out


def mark_failed(version_dir: Path, reason: str) -> None:
    """Never resume this version again (its committed shards failed validation)."""
    atomic_write_text(version_dir.parent / f"{version_dir.name}.failed", reason + "\n")


def promote_latest(root: Path, version_dir: Path) -> Path:
    """Point ``ROOT/latest`` at ``version_dir`` atomically; returns the link path.

    ``latest`` is replaced with ``rename(2)`` over a temporary symlink, so readers see the old or the
    new target, never a missing one.

    Raises:
        OSError: the link cannot be created or renamed.
    """
    link = root / "latest"
    tmp = root / f".latest.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(version_dir, root), tmp)
    os.replace(tmp, link)
    fsync_dir(root)
    return link
