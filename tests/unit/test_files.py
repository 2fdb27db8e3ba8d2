"""tasks.files: an atomic write shows the old or the new content, never leaves a temp file; appends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.files import (
    TMP_MARK,
    append_durable,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
)


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def test_writes_replace_content_and_leave_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    atomic_write_bytes(path, b"one")
    assert path.read_bytes() == b"one"
    atomic_write_text(path, "two\u00e9")
    assert path.read_text(encoding="utf-8") == "two\u00e9"
    atomic_write_json(path, {"b": 1, "a": [1, 2]}, indent=2, sort_keys=True, newline=True)
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic_write_json(path, {"when": Path("/x")}, indent=None, default=str)
    assert json.loads(path.read_text()) == {"when": "/x"}
    with atomic_writer(path, "wb") as f:
        f.write(b"streamed")
    assert path.read_bytes() == b"streamed"
    assert _temps(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    assert path.stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_serializer_that_raises_leaves_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert _temps(tmp_path) == []


def test_an_error_mid_write_leaves_the_old_content_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_writer(path) as f:
        f.write("half of the new")
        f.flush()
        assert _temps(tmp_path) != []  # the new content goes to a temp file first
        raise RuntimeError("disk on fire")
    assert path.read_text() == "old"
    assert _temps(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_directory_without_write_permission_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "ro" / "f"
    path.parent.mkdir()
    path.write_text("old")
    path.parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            atomic_write_text(path, "new")
    finally:
        path.parent.chmod(0o755)
    assert path.read_text() == "old" and os.listdir(path.parent) == ["f"]


def test_a_failed_rename_removes_the_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "a-directory"
    (target / "inside").mkdir(parents=True)  # rename(2) of a file over a non-empty directory fails
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"x")
    assert target.is_dir() and _temps(tmp_path) == []


def test_writer_rejects_other_modes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"), atomic_writer(tmp_path / "f", "a"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_append_durable_creates_then_appends(tmp_path: Path) -> None:
    path = tmp_path / "rejects.jsonl"
    append_durable(path, b'{"n": 1}\n')
    append_durable(path, b'{"n": 2}\n' * 3)
    assert path.read_bytes() == b'{"n": 1}\n' + b'{"n": 2}\n' * 3
    big = os.urandom(1 << 20)
    append_durable(path, big)
    assert path.read_bytes().endswith(big) and path.stat().st_size == 9 * 4 + len(big)
    with pytest.raises(FileNotFoundError):
        append_durable(tmp_path / "missing" / "f", b"x")
