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
import stat
from pathlib import Path

from tasks.files import Dir, UnsafeFile

__all__ = ["choose_version", "mark_failed", "promote_latest"]


def choose_version(root: Path, now: dt.datetime | None = None) -> Path:
    """The output directory for this run: an unfinished version to resume, else a new one.

    ``versions`` and its entries are looked at through handles (``tasks.files.Dir``): a symlink among
    them is refused, never followed.

    Args:
        root: the partition's output root.
        now: the time that names a new version (default: now, UTC).

    Raises:
        UnsafeFile: ``versions`` or an entry in it is a symlink, or not this user's directory.
        OSError: the directories cannot be created.
    """
    with Dir.open(root, create=True) as r:
        versions = r.sub("versions", create=True)
        assert versions is not None
        with versions:
            current = r.target_key("latest")
            entries = {name: versions.lstat(name) for name in versions.names()}
            for name, st in entries.items():
                if st is not None and stat.S_ISLNK(st.st_mode):  # a version is a directory datagen made
                    raise UnsafeFile(versions.path / name,
                                     f"it is a symbolic link to {versions.readlink(name)}", directory=True)
            dirs = sorted((n for n, st in entries.items() if st is not None and stat.S_ISDIR(st.st_mode)), reverse=True)
            for name in dirs:
                st = entries[name]
                if current is not None and (st.st_dev, st.st_ino) == current:  # type: ignore[union-attr]
                    break  # everything older than the promoted version is history
                if f"{name}.failed" not in entries:
                    return root / "versions" / name
            stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
            name, n = stamp, 1
            while versions.exists(name):
                n += 1
                name = f"{stamp}.{n}"
            with versions.sub(name, create=True):  # type: ignore[union-attr]
                pass
            return root / "versions" / name


def mark_failed(version_dir: Path, reason: str) -> None:
    """Never resume this version again (its committed shards failed validation)."""
    with Dir.open(version_dir.parent) as versions:
        versions.write(f"{version_dir.name}.failed", (reason + "\n").encode("utf-8"))


def promote_latest(root: Path, version_dir: Path) -> Path:
    """Point ``ROOT/latest`` at ``version_dir`` atomically; returns the link path.

    ``latest`` is replaced with ``rename(2)`` over a temporary symlink, so readers see the old or the
    new target, never a missing one.

    Raises:
        OSError: the link cannot be created or renamed.
    """
    with Dir.open(root) as r:
        r.point("latest", os.path.relpath(version_dir, root))
    return root / "latest"
