"""`datagen run` on an output where someone planted directory symlinks, with a real Prefect server and
the emulator: each run is refused (exit 2) naming the planted link, before a server is launched, and
nothing outside the output changes (a checksum of the links' targets before and after)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.e2e.test_flow_recovery import DATAGEN, ROOT, _env
from tests.support.common import pid_alive, tree_digest
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, done_rows, partition, records

pytestmark = pytest.mark.slow

SENTINEL = b"bytes of a file that is not datagen's\n"


def sentinel_tree(root: Path) -> None:
    """Files a run that followed a link would write, delete or rewrite."""
    (root / "ds").mkdir(parents=True)
    for name in ("ds.jsonl", "notes.tmp-77-abcd", "shard-00000.parquet", "shard-00000.jsonl",
                 "ds/shard-00001.jsonl", "server.log"):
        (root / name).write_bytes(SENTINEL)


# Through `datagen run`: a dataset's directory (every directory OutputDir opens is refused by the same
# check: tests/unit/shards/test_planted_files.py plants each of ds, _rejects, _journal and _journal/ds)
# and the servers' log directory, which the launch writes and no unit test opens.
PLANTED = ["ds", "_logs"]


def test_planted_directory_symlinks_are_refused_naming_the_link(prefect_server: PrefectServer,
                                                                tmp_path: Path) -> None:
    part, _ = partition(tmp_path, {"ds": 8}, [], shard=4, conc=4, max_relaunches=0)
    env = _env(prefect_server, tmp_path)
    runs: dict[str, subprocess.Popen[str]] = {}
    digests: dict[int, str] = {}
    for i, planted in enumerate(PLANTED):
        target = tmp_path / f"elsewhere-{i}"
        sentinel_tree(target)
        digests[i] = tree_digest(target)
        out = tmp_path / f"out-{i}"
        (out / planted).parent.mkdir(parents=True, exist_ok=True)
        (out / planted).symlink_to(target, target_is_directory=True)
        runs[planted] = subprocess.Popen([DATAGEN, "run", "--partition", str(part), "--out", str(out)],
                                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, stdin=subprocess.DEVNULL)
    for i, (planted, proc) in enumerate(runs.items()):
        _, err = proc.communicate(timeout=300)
        link = tmp_path / f"out-{i}" / planted
        assert proc.returncode == 2, (planted, err[-3000:])
        assert (f"refusing to use {link}: it is a symbolic link to {tmp_path / f'elsewhere-{i}'}; datagen writes "
                f"only into real directories inside the output") in err, (planted, err[-3000:])
        assert tree_digest(tmp_path / f"elsewhere-{i}") == digests[i], planted
        assert (tmp_path / f"elsewhere-{i}" / "server.log").read_bytes() == SENTINEL
    assert not any(r.get("servers") for r in records(tmp_path).values())  # refused before any launch


def test_unusable_journal_lines_are_skipped_named_and_their_rows_generated(prefect_server: PrefectServer,
                                                                           tmp_path: Path) -> None:
    part, ids = partition(tmp_path, {"ds": 8}, [], shard=4, conc=4, max_relaunches=0)
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    journal = out / "_journal" / "ds" / "shard-00000.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b'{"_reject": true, "_pos": "abc"}\n{"id": "ds-0001", "_pos": 1, "prompt_tokens": "x"}\n'
                        b'{"torn": \n')
    run = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    logs = run.stdout + run.stderr
    assert run.returncode == 0, logs[-3000:]
    assert f"dataset ds: skipped journal {journal} line 1: _pos 'abc' is not a whole number; that row is " \
           f"generated again" in logs
    assert f"dataset ds: skipped journal {journal} line 2: row 'ds-0001' cannot be stored: column " in logs
    assert "2 shards committed (2 now, 0 resumed), 8 rows generated" in logs
    assert_exactly_once(out, ids)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 128 KiB tmpfs (a full disk within a few shards); unmounted after the test, also on failure."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_with_exit_1_naming_the_file_and_the_rerun_resumes(
        prefect_server: PrefectServer, tmp_path: Path, small_disk: Path) -> None:
    part, ids = partition(tmp_path, {"ds": 60}, [], shard=4, conc=4, max_relaunches=0)
    env = _env(prefect_server, tmp_path)
    out = small_disk / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    full = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert full.returncode == 1, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"datagen run: run failed: cannot write {out}/"), last
    assert "No space left on device (errno 28); what was committed is kept: free space on that filesystem" in last
    assert "Traceback" not in full.stderr
    committed = OutputDir(out).committed_indices("ds")
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"15 shards committed ({15 - len(committed)} now, {len(committed)} resumed)" in again.stdout + again.stderr
    assert_exactly_once(out, ids)


def test_a_run_killed_with_sigkill_leaves_no_server_and_no_gpu_memory_held(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    """No rerun follows: the run's own leash must end its server (the simulated GPU holds 0 MiB). With
    ``run.server_grace_s = 0`` it does so at once, as before the grace (its expiry: test_adopt.py)."""
    part, _ = partition(tmp_path, {"ds": 200}, ["--emu-decode-ms-per-step", "30"], shard=20, conc=8,
                        max_relaunches=0)
    part.write_text(part.read_text().replace("[run]\n", "[run]\nserver_grace_s = 0\n"))
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    reap_pids.append(proc.pid)
    deadline = time.monotonic() + 180
    while done_rows(out) < 10:
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run generated nothing"
        time.sleep(0.05)
    (record,) = records(tmp_path).values()
    server = record["servers"][0]
    family = [p.pid for p in psutil.Process(server["pid"]).children(recursive=True)] + [server["pid"]]
    reap_pids.extend(family)
    assert any(g["used_mib"] > 0 for g in SimGpus(tmp_path / "sim-gpus.json").snapshot()["gpus"])
    proc.send_signal(signal.SIGKILL)  # `kill -9 PID` of the run alone
    proc.wait(10)
    killed = time.monotonic()
    while [p for p in family if pid_alive(p)]:
        assert time.monotonic() - killed < 30, f"server processes alive 30 s after the run died: {family}"
        time.sleep(0.2)
    while any(g["used_mib"] > 0 for g in SimGpus(tmp_path / "sim-gpus.json").snapshot()["gpus"]):
        assert time.monotonic() - killed < 30, "GPU memory still held 30 s after the run died"
        time.sleep(0.2)
