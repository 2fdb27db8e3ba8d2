"""Nightly output versions: resume the unfinished one, never a failed one; `latest` moves atomically."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from tasks.shards import choose_version, mark_failed, promote_latest

T1 = dt.datetime(2026, 1, 4, 2, 0, tzinfo=dt.UTC)
T2 = dt.datetime(2026, 1, 5, 2, 0, tzinfo=dt.UTC)


def test_new_resume_promote_and_failed(tmp_path: Path) -> None:
    v1 = choose_version(tmp_path, T1)
    assert v1 == tmp_path / "versions" / "20260104T020000Z" and v1.is_dir()
    assert choose_version(tmp_path, T2) == v1  # unfinished (crashed) run: resumed, not restarted
    link = promote_latest(tmp_path, v1)
    assert link.resolve() == v1.resolve() and not link.readlink().is_absolute()
    v2 = choose_version(tmp_path, T2)
    assert v2.name == "20260105T020000Z"
    assert (tmp_path / "latest").resolve() == v1.resolve()  # last good stays until v2 validates
    mark_failed(v2, "validation failed")
    v3 = choose_version(tmp_path, T2)
    assert v3.name == "20260105T020000Z.2"  # a failed version is never resumed
    promote_latest(tmp_path, v3)
    assert (tmp_path / "latest").resolve() == v3.resolve()
    assert not list(tmp_path.glob(".latest.*"))


def test_a_planted_versions_link_or_version_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "20260101T000000Z").mkdir(parents=True)
    root = tmp_path / "root"
    root.mkdir()
    (root / "versions").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OSError, match=f"refusing to use {root / 'versions'}: it is a symbolic link to {elsewhere}"):
        choose_version(root)
    (root / "versions").unlink()
    (root / "versions").mkdir()
    (root / "versions" / "20260102T000000Z").symlink_to(elsewhere / "20260101T000000Z")
    with pytest.raises(OSError, match="20260102T000000Z: it is a symbolic link to"):
        choose_version(root)
    assert [p.name for p in elsewhere.iterdir()] == ["20260101T000000Z"]
    assert not any((elsewhere / "20260101T000000Z").iterdir())
