"""Planted symlinks and foreign files in an output directory are refused, their targets untouched.

The refusal is ``tasks.files.UnsafeFile``, an ``OSError``; the tests catch ``OSError`` by its message.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tasks.files import Dir, append_durable, atomic_write_json
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
            out.journal("ds", 0).append(_row(0))
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


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``: a file's bytes, a directory or link by kind (a sentinel's checksum)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = f"link:{os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A directory outside the output holding what a careless run would write, delete or rewrite."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "ds.jsonl").write_bytes(SECRET)
    (d / "notes.tmp-123").write_bytes(SECRET)
    (d / "shard-00000.parquet").write_bytes(SECRET)
    (d / "shard-00001.jsonl").write_bytes(SECRET)
    (d / "ds").mkdir()
    (d / "ds" / "shard-00000.jsonl").write_bytes(SECRET)
    return d


@pytest.mark.parametrize("planted", ["ds", "_rejects", "_journal", "_journal/ds"])
def test_a_directory_symlink_in_the_output_is_refused_at_open_and_its_target_untouched(
        tmp_path: Path, elsewhere: Path, planted: str) -> None:
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    link = out.path / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    before = _tree(elsewhere)
    with out.lock(), pytest.raises(OSError) as info:
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)
    assert str(info.value) == (
        f"refusing to use {link}: it is a symbolic link to {elsewhere}; datagen writes only into real "
        f"directories inside the output (no symbolic links) owned by the user running it (uid {os.geteuid()}): "
        f"remove or replace {link}, or choose another output")
    assert _tree(elsewhere) == before
    assert out.read_manifest() is None  # refused before the dataset was recorded


@pytest.mark.parametrize("planted", ["ds", "_rejects", "_journal", "_journal/ds"])
def test_a_directory_symlink_planted_after_open_is_refused_by_recover_commit_and_journal(
        tmp_path: Path, elsewhere: Path, planted: str) -> None:
    out = OutputDir(tmp_path / "out")
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)
        link = out.path / planted
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(elsewhere, target_is_directory=True)
        before = _tree(elsewhere)
        with pytest.raises(OSError, match=f"refusing to use {link}: it is a symbolic link"):
            out.recover("ds")
        with pytest.raises(OSError, match=f"refusing to use {link}: it is a symbolic link"):
            out.commit_shard("ds", 0, [_row(0)], [{"line": 2, "reason": "bad", "raw": "x"}])
        if planted.startswith("_journal"):
            with pytest.raises(OSError, match=f"refusing to use {link}: it is a symbolic link"):
                out.journal("ds", 1)
            journal = _journal_past_the_check(out)
            with pytest.raises(OSError, match=f"refusing to use {link}: it is a symbolic link"):
                journal.append(_row(2))
        assert _tree(elsewhere) == before
        assert out.committed_indices("ds") == set()


def test_a_directory_of_another_user_or_a_file_in_its_place_is_refused(tmp_path: Path) -> None:
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    (out.path / "_rejects").write_bytes(SECRET)
    with out.lock(), pytest.raises(OSError, match=r"refusing to use .*_rejects: it is not a directory"):
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)
    (out.path / "_rejects").unlink()
    if os.geteuid() == 0:
        (out.path / "ds").mkdir()
        os.chown(out.path / "ds", 54321, 54321)
        with out.lock(), pytest.raises(OSError, match=r"refusing to use .*/ds: it is owned by uid 54321"):
            out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=2)


def test_an_output_that_is_itself_a_symlink_is_used(tmp_path: Path) -> None:
    real = tmp_path / "big-disk"
    real.mkdir()
    (tmp_path / "out").symlink_to(real, target_is_directory=True)
    out = OutputDir(tmp_path / "out")
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=1)
        out.commit_shard("ds", 0, [_row(0)])
    assert (real / "ds" / "shard-00000.parquet").is_file()


def test_a_name_that_is_not_one_plain_component_is_refused(tmp_path: Path) -> None:
    with Dir.open(tmp_path) as d:
        for bad in ("..", ".", "a/b", ""):
            with pytest.raises(OSError, match="is not a plain file name"):
                d.sub(bad, create=True)
            with pytest.raises(OSError, match="is not a plain file name"):
                d.write(bad, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == []



def _journal_past_the_check(out: OutputDir) -> Journal:
    """A journal whose directory check passed before the link was planted (the check is at creation)."""
    return Journal(lambda: out._dir("_journal", "ds", create=True), "shard-00001.jsonl", out.journal_path("ds", 1))  # type: ignore[arg-type,return-value]
