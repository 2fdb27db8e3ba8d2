"""Nightly output versions: resume the unfinished one, never a failed one; `latest` moves atomically."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from flows.versions import choose_version, mark_failed, promote_latest

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
