"""Planted symlinks and foreign files in an output directory are refused, their targets untouched.

The refusal is ``tasks.files.UnsafeFile``, an ``OSError``; the tests catch ``OSError`` by its message.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tasks.files import append_durable, atomic_write_json
from tasks.shards import Journal, OutputDir
from tests.unit.shards.test_output import _row

SECRET = b"precious bytes of a file outside the output\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(SECRET)
    return path


def test_a_lock_symlink_is_refused_and_its_target_keeps_its_bytes(tmp_path: Path, victim: Path) -> None:
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    (out.path / "_lock").symlink_to(victim)
    with pytest.raises(OSError) as info, out.lock({"flow_run": "fr-1"}):
        pass
    assert str(info.value) == (
        f"refusing to write {out.path / '_lock'}: it is a symbolic link to {victim}; datagen writes only "
        f"regular files owned by the user running it (uid {os.geteuid()}): remove or replace "
        f"{out.path / '_lock'}, or choose another output")
    assert victim.read_bytes() == SECRET
    assert out.held_lock() is None


def test_a_journal_symlink_is_refused_and_its_target_gets_no_rows(tmp_path: Path, victim: Path) -> None:
    out = OutputDir(tmp_path / "out")
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=4)
        path = out.journal_path("ds", 0)
        path.parent.mkdir(parents=True)
        path.symlink_to(victim)
        with pytest.raises(OSError, match="it is a symbolic link to"):
            Journal(path).append(_row(0))
    assert victim.read_bytes() == SECRET


def test_a_rejects_symlink_is_refused_at_commit(tmp_path: Path, victim: Path) -> None:
    out = OutputDir(tmp_path / "out")
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)
        out.rejects_path("ds").parent.mkdir(parents=True)
        out.rejects_path("ds").symlink_to(victim)
        with pytest.raises(OSError, match=f"refusing to write {out.rejects_path('ds')}"):
            out.commit_shard("ds", 0, [_row(0)], [{"line": 2, "reason": "bad", "raw": "x"}])
    assert victim.read_bytes() == SECRET
    assert out.committed_indices("ds") == set()


def test_a_manifest_symlink_is_refused_and_its_target_kept(tmp_path: Path, victim: Path) -> None:
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.manifest_path.symlink_to(victim)
    with out.lock(), pytest.raises(OSError, match="_manifest.json: it is a symbolic link"):
        out.write_manifest({"shard_size": 2, "datasets": {}})
    assert victim.read_bytes() == SECRET and out.manifest_path.is_symlink()


def test_a_file_of_another_user_or_a_fifo_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(SECRET)
    if os.geteuid() == 0:
        os.chown(foreign, 54321, 54321)
        with pytest.raises(OSError, match="it is owned by uid 54321"):
            append_durable(foreign, b"rows\n")
        with pytest.raises(OSError, match="it is owned by uid 54321"):
            atomic_write_json(foreign, {"a": 1})
        assert foreign.read_bytes() == SECRET
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="it is not a regular file"):
        atomic_write_json(fifo, {"a": 1})
    assert fifo.is_fifo()


def test_append_durable_refuses_a_symlink(tmp_path: Path, victim: Path) -> None:
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        append_durable(link, b"row\n")
    assert victim.read_bytes() == SECRET


def test_a_planted_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    out = OutputDir(tmp_path / "out")
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)
        out.rejects_path("ds").parent.mkdir(parents=True)
        os.mkfifo(out.rejects_path("ds"))
        errors: list[BaseException] = []

        def commit() -> None:
            try:
                out.commit_shard("ds", 0, [_row(0)], [{"line": 2, "reason": "bad", "raw": "x"}])
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=commit, daemon=True)  # without a reader, a blocking open never returns
        t.start()
        t.join(10)
        assert not t.is_alive(), "the commit waits for a reader of the planted FIFO"
    assert len(errors) == 1 and isinstance(errors[0], OSError)
    assert str(errors[0]).startswith(f"refusing to write {out.rejects_path('ds')}: it is not a regular file")
