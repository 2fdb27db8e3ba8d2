"""Issue 47's race tier: an attacker with write access to OUT swaps a directory datagen uses for a
symlink at the moment of use, and nothing outside OUT is created, changed or deleted.

The moment comes from inotify (a temp shard created, a directory opened), the swap is one atomic
``renameat2(RENAME_EXCHANGE)`` of two names inside OUT (``tests/support/swap.py``): OUT/<name> becomes
a link to a decoy directory (or to a sibling output's dataset directory) and the real directory moves
to the link's old name, inside OUT. Each case runs the user's command (`datagen run` with a real
Prefect server and the emulator, `datagen repair`, `resplit`, `export`) several times, and checks:
- the decoy and the sibling output are as they were, to the inode (``snapshot``);
- the command either finished or was refused with exit 2 naming the link;
- once the operator undoes the swap, the next command finishes and every input row is committed
  exactly once: no committed row was lost (for `datagen run`, after the second attempt of each case).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_flow_recovery import DATAGEN, ROOT, _env
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, partition
from tests.support.swap import IN_CREATE, IN_OPEN, swap_on

pytestmark = pytest.mark.slow

QUICK_ATTEMPTS = 4
STORM_S = 1.0  # an attacker swapping back and forth as fast as it can, from the moment on
SENTINEL = b"a file that is not this output's\n"
NAMES = ("shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet", "shard-00003.parquet",
         "shard-00000.jsonl", "shard-00001.jsonl", "ds.jsonl", "server.log")


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry below ``root`` (itself included): its kind, inode and content (a link's target), links
    never followed."""
    out: dict[str, tuple[Any, ...]] = {}
    for here, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            p = Path(here) / name if name != "." else Path(here)
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", st.st_ino, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_ino)
            else:
                out[rel] = ("file", st.st_ino, st.st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def decoy(path: Path) -> Path:
    """A directory outside OUT holding files with the names datagen writes and deletes."""
    path.mkdir(parents=True)
    for name in NAMES:
        (path / name).write_bytes(SENTINEL)
    return path


def _run(argv: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _undo(real: Path, link: Path) -> None:
    """What the operator does on finding the link: remove it and put the directory back."""
    if link.is_symlink():
        link.unlink()
        real.rename(link)
    elif real.is_symlink():
        real.unlink()


def _refused_or_done(res: subprocess.CompletedProcess[str], link: Path) -> None:
    assert res.returncode in (0, 2), res.stderr[-3000:]
    if res.returncode == 2:
        assert (f"refusing to use {link}: it is a symbolic link" in res.stderr
                or f"refusing to use {link}: it is being replaced" in res.stderr), res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def _created_tmp(name: str) -> bool:
    return ".tmp-" in name


def _is(wanted: str) -> Callable[[str], bool]:
    return lambda name: name == wanted


# case -> (directory swapped, whether it is there before the run, and per attempt: the directory
# watched, the event, which names, how long to go on swapping after the first). Attempt 0 swaps once
# at the moment of use; attempt 1 swaps back and forth for STORM_S from an earlier moment, so that every
# instant between a check and a use is hit. Through `datagen run`:
RUN_CASES: dict[str, tuple[str, bool, list[tuple[str, int, Callable[[str], bool], float]]]] = {
    # 1. OUT/<dataset> at the first shard commit (its temp file appears)
    "dataset-dir-at-commit": ("ds", True, [("ds", IN_CREATE, _created_tmp, 0.0), ("ds", IN_CREATE, _created_tmp, STORM_S)]),
    # 2. OUT/_journal/<dataset> at a commit (between the Parquet file and the journal's removal)
    "journal-dir-at-commit": ("_journal/ds", True, [("ds", IN_CREATE, _created_tmp, 0.0),
                                                    ("ds", IN_CREATE, _created_tmp, STORM_S)]),
    # 2. OUT/_logs as it is created (the launch then creates the server log in it)
    "logs-dir-at-launch": ("_logs", False, [(".", IN_CREATE, _is("_logs"), 0.0), (".", IN_CREATE, _is("_logs"), STORM_S)]),
    # 3. an empty OUT/<dataset>, planted, swapped for another output's dataset directory as the start-up
    #    cleanup opens it, or from the moment the run takes the lock
    "planted-dataset-dir-at-cleanup": ("ds", True, [(".", IN_OPEN, _is("ds"), 0.0), (".", IN_CREATE, _is("_lock"), STORM_S)]),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_datagen_run_never_follows_a_swapped_directory(prefect_server: PrefectServer, tmp_path: Path,
                                                        case: str) -> None:
    swapped, planted, moments = RUN_CASES[case]
    part, ids = partition(tmp_path, {"ds": 8}, [], shard=2, conc=2, max_relaunches=0)
    env = _env(prefect_server, tmp_path)
    sibling = tmp_path / "sibling"  # another output: its dataset directory is what a swap points at
    decoy(sibling / "ds")
    for attempt, (watched, mask, when, storm_s) in enumerate(moments):
        out = tmp_path / f"out-{attempt}"
        elsewhere = decoy(tmp_path / f"elsewhere-{attempt}")
        target = sibling / "ds" if case.startswith("planted") else elsewhere
        before = {"elsewhere": snapshot(elsewhere), "sibling": snapshot(sibling)}
        link = out / swapped
        parked = link.with_name(f".parked-{link.name}")
        parked.parent.mkdir(parents=True)
        if planted:  # the directory is there before the run (planted, or left by a previous one)
            link.mkdir()
        (out / watched).mkdir(parents=True, exist_ok=True)
        parked.symlink_to(target, target_is_directory=True)
        cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
        with swap_on(out / watched, mask, when, link, parked, storm_s=storm_s) as swap:
            res = _run(cmd, env)
        assert swap.error is None, swap.error
        assert swap.done.is_set(), f"{case}: the moment never came ({res.stderr[-2000:]})"
        _refused_or_done(res, link)
        assert snapshot(elsewhere) == before["elsewhere"], case
        assert snapshot(sibling) == before["sibling"], case
        _undo(parked, link)
        if attempt == len(moments) - 1:  # once per case (a whole run each): nothing committed was lost
            again = _run(cmd, env)
            assert again.returncode == 0, again.stderr[-3000:]
            assert_exactly_once(out, ids)
            assert snapshot(sibling) == before["sibling"]


@pytest.fixture(scope="module")
def finished(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A finished output of 8 rows in 4 shards (generated once for the module), its partition, its ids."""
    tmp = tmp_path_factory.mktemp("finished")
    part, ids = partition(tmp, {"ds": 8}, [], shard=2, conc=2, max_relaunches=0)
    res = _run([DATAGEN, "run", "--partition", str(part), "--out", str(tmp / "out")], _env(prefect_server, tmp))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "out", part, ids


def _quick_env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "DATAGEN_RUN_DIR": str(tmp / "run"), "DATAGEN_STATE_DIR": str(tmp / "state")}


@pytest.mark.parametrize("command", ["repair", "resplit", "export"])
def test_repair_resplit_and_export_never_follow_a_swapped_dataset_directory(
        finished: tuple[Path, Path, dict], tmp_path: Path, command: str) -> None:
    base, _, ids = finished
    sibling = tmp_path / "sibling"
    shutil.copytree(base, sibling, symlinks=True)  # another output, with the same file names
    env = _quick_env(tmp_path)
    for attempt in range(QUICK_ATTEMPTS):
        out = tmp_path / f"out-{attempt}"
        shutil.copytree(base, out, symlinks=True)
        if command == "repair":  # a damaged shard: repair un-commits it and deletes its file
            (out / "ds" / "shard-00003.parquet").write_bytes(b"damaged")
        before = snapshot(sibling)
        link, parked = out / "ds", out / ".parked-ds"
        parked.symlink_to(sibling / "ds", target_is_directory=True)
        argv = {"repair": [DATAGEN, "repair", str(out)],
                "resplit": [DATAGEN, "resplit", str(out), "--parser", "deepseek-r1"],
                "export": [DATAGEN, "export", str(out), "--format", "sharegpt", "--out", str(tmp_path / f"x-{attempt}.jsonl")],
                }[command]
        # the moment: the command opens a shard file of OUT/ds (to hash, read or rewrite it)
        with swap_on(out / "ds", IN_OPEN, lambda n: n.startswith("shard-"), link, parked, skip=attempt % 2,
                     storm_s=STORM_S * (attempt // 2)) as swap:
            res = _run(argv, env, timeout=120)
        assert swap.error is None, swap.error
        assert swap.done.is_set(), f"{command}: the moment never came ({res.stderr[-2000:]})"
        assert res.returncode in (0, 2), res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        assert snapshot(sibling) == before, command
        _undo(parked, link)
        if command == "export" and res.returncode == 0:  # what it wrote are this output's rows only
            assert sorted(_export_ids(tmp_path / f"x-{attempt}.jsonl")) == sorted(ids["ds"])
        again = _run(argv, env, timeout=120)
        assert again.returncode == 0, again.stderr[-3000:]
        if command != "repair":
            assert_exactly_once(out, ids)
        assert not any(".tmp-" in p.name for p in out.rglob("*"))


def _export_ids(path: Path) -> list[str]:
    import orjson

    return [orjson.loads(line)["id"] for line in path.read_bytes().splitlines() if line.strip()]
