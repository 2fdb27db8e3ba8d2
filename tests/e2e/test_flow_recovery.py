"""`datagen run` recovery with a real Prefect server and the emulator: leases and servers of SIGKILLed
runs are released and ended by the next run, a rerun of a finished output launches nothing, hygiene
spares other jobs' GPUs, and ``run.max_relaunches`` is one budget per run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from flows.gpulimit import LEASE_S
from tests.support.common import pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, done_rows, partition, records

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
DATAGEN = str(Path(sys.executable).parent / "datagen")
def _env(prefect_server: PrefectServer, tmp: Path, gpus: int = 2) -> dict[str, str]:
    SimGpus.init(tmp / "sim-gpus.json", count=gpus)
    return prefect_server.env(**{ENV_VAR: str(tmp / "sim-gpus.json"), "DATAGEN_STATE_DIR": str(tmp / "state"),
                                 "DATAGEN_RUN_DIR": str(tmp / "run")})


def test_rerun_after_kill9_releases_the_dead_runs_lease_at_once_and_a_third_run_launches_nothing(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    part, ids = partition(tmp_path, {"ds": 96}, ["--emu-decode-ms-per-step", "30"], shard=16, conc=8,
                           max_relaunches=1)
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    reap_pids.append(first.pid)
    deadline = time.monotonic() + 90
    while done_rows(out) < 20:  # mid-run: the slot is held, the server is generating
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the first run generated nothing"
        time.sleep(0.05)
    (run_id, record), = records(tmp_path).items()
    assert record["lease"] and record["owner"]["pid"] == first.pid  # on_lease reached the run record
    assert record["owner"]["started"] == pytest.approx(psutil.Process(first.pid).create_time())
    server_pid = record["servers"][0]["pid"]
    reap_pids.append(server_pid)  # its leash ends it (tasks.server._leash), else the rerun's hygiene would
    first.send_signal(signal.SIGKILL)
    first.wait()

    started = time.monotonic()
    with open(tmp_path / "second.log", "wb") as log:
        second = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    reap_pids.append(second.pid)
    deadline = started + 120
    while not [r for k, r in records(tmp_path).items() if k != run_id and r.get("servers")]:
        assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    to_launch = time.monotonic() - started  # slot acquired, hygiene done, server up: inference starts
    assert second.wait(timeout=120) == 0, (tmp_path / "second.log").read_text()[-3000:]
    text = (tmp_path / "second.log").read_text()
    assert f"released gpu slot lease {record['lease']} of a dead run on this host" in text
    assert to_launch < LEASE_S / 2, f"rerun waited {to_launch:.1f} s for the slot"
    assert records(tmp_path)[run_id]["lease_released"] is True
    assert not pid_alive(server_pid)
    assert_exactly_once(out, ids)
    assert all(g["used_mib"] == 0 for g in SimGpus(tmp_path / "sim-gpus.json").snapshot()["gpus"])

    # The identical command once more, on the finished output: it is recognised as complete under its
    # lock, before hygiene or a launch; exit 0, the same rows, and no server in this run's record.
    before = set(records(tmp_path))
    shards = sorted(p.name for p in (out / "ds").glob("shard-*.parquet"))
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    text = again.stdout + again.stderr
    assert f"dataset ds: 6 shards committed (0 now, 6 resumed), 0 rows generated: complete in {out}, " \
           "no server needed" in text
    assert "hygiene-before-launch" not in text and "launch-" not in text and "server on" not in text
    (record,) = [r for k, r in records(tmp_path).items() if k not in before]
    assert not record.get("servers") and not record.get("lease")
    assert sorted(p.name for p in (out / "ds").glob("shard-*.parquet")) == shards
    assert_exactly_once(out, ids)


def test_max_relaunches_is_one_budget_for_the_whole_run(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    # Every server dies after 35 requests; each 40-row dataset alone needs one relaunch, the two need
    # two. A budget of 1 per dataset would finish; per run, the second crash fails the run.
    part, ids = partition(tmp_path, {"a": 40, "b": 40}, ["--emu-decode-ms-per-step", "2", "--emu-crash-after", "35"],
                           shard=20, conc=4, max_relaunches=1)
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "hygiene-relaunch-1" in text and "hygiene-relaunch-2" not in text
    assert "ServerGone" in text and "its server process is dead" in text
    # the lifecycle's moves, as it logs them: one relaunch, then the budget is spent
    assert "lifecycle: pending -> starting -> serving -> dropped -> relaunching -> serving -> dropped -> lost" in text
    (record,) = records(tmp_path).values()
    assert len(record["servers"]) == 2
    assert all(not pid_alive(s["pid"]) for s in record["servers"])
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["datasets"]["a"]["complete"] is True and "b" in manifest["datasets"]
    assert not manifest["datasets"]["b"].get("complete")


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    """`gpu-sim hold` processes a test starts: killed by pid and reaped at the end."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _hold(env: dict[str, str], gpu: int, mib: int, holders: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """A `datagen gpu-sim hold` process of this user on ``gpu``, returned once it holds the memory."""
    proc = subprocess.Popen([DATAGEN, "gpu-sim", "hold", "--gpu", str(gpu), "--mib", str(mib)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    holders.append(proc)
    assert proc.stdout is not None
    with proc.stdout:  # it prints this one line only
        line = proc.stdout.readline()  # blocks until the allocation is in the state file, or EOF
    assert line.startswith(f"holding {mib} MiB on GPU {gpu} pid {proc.pid}"), line
    return proc


def test_hygiene_spares_a_job_on_a_gpu_the_partition_server_does_not_use(
        prefect_server: PrefectServer, tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    # A shared 4-GPU host: the partition's server runs on GPU 2 only; the same user's other job
    # holds GPU 0 (where a default tp_size=1 server would go) and a leftover holds GPU 2.
    part, ids = partition(tmp_path, {"ds": 24}, [], shard=12, conc=8, max_relaunches=0, server="gpus = [2]")
    env = _env(prefect_server, tmp_path, gpus=4)
    other = _hold(env, 0, 30000, holders)
    leftover = _hold(env, 2, 30000, holders)
    out = tmp_path / "out"
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert leftover.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
    assert other.poll() is None and pid_alive(other.pid)
    assert re.search(rf"kill +pid {leftover.pid} \(.*GPU 2 30000 MiB.*holds selected GPU\(s\) 2; ended by SIG",
                     text), text[-3000:]
    assert re.search(rf"spare pid {other.pid} \(.*GPU 0 .*holds only unselected GPU\(s\) 0", text), text[-3000:]
    # The same in the hygiene artifact of the run.
    body = {"artifacts": {"key": {"like_": "hygiene-before-launch-%"}}, "sort": "CREATED_DESC", "limit": 1}
    (art,) = httpx.post(f"{prefect_server.api_url}/artifacts/filter", json=body, timeout=30).json()
    assert f"spare pid {other.pid}" in art["data"] and "holds only unselected GPU(s) 0" in art["data"]
    (record,) = records(tmp_path).values()
    assert record["gpus"] == [2] and all(not pid_alive(s["pid"]) for s in record["servers"])
    assert_exactly_once(out, ids)
    used = {g["index"]: g["used_mib"] for g in SimGpus(tmp_path / "sim-gpus.json").snapshot()["gpus"]}
    assert used == {0: 30000, 1: 0, 2: 0, 3: 0}


def _group(pgid: int) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return found


def test_server_left_loading_by_a_sigkilled_run_is_ended_by_the_next_run(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    part, ids = partition(tmp_path, {"ds": 24}, ["--emu-load-time", "120"], shard=12, conc=8, max_relaunches=0)
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    reap_pids.append(first.pid)
    deadline = time.monotonic() + 90
    while not [r for r in records(tmp_path).values() if r.get("servers")]:  # recorded when it exists
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no server recorded"
        time.sleep(0.05)
    (run_id, record), = records(tmp_path).items()
    (entry,) = record["servers"]
    pgid = entry["pgid"]
    assert entry["state"] == "starting" and entry["pid"] == pgid
    assert entry["started"] == pytest.approx(psutil.Process(pgid).create_time())
    while len(_group(pgid)) < 3:  # the main process and its scheduler + detokenizer, loading weights
        assert time.monotonic() < deadline, _group(pgid)
        time.sleep(0.05)
    members = _group(pgid)
    reap_pids.extend(members)
    # The second line of defence: the run and the server's guardian (tasks.server._leash) both killed,
    # as by an OOM killer, so only the run record tells the next run what to end.
    guardians = [p for p in psutil.Process(first.pid).children(recursive=True) if p.pid not in members]
    assert guardians
    for p in [psutil.Process(first.pid), *guardians]:
        p.send_signal(signal.SIGKILL)
    first.wait()
    psutil.wait_procs(guardians, timeout=10)
    time.sleep(1.0)
    assert pid_alive(pgid) and sorted(_group(pgid)) == sorted(members)  # the loading server lives on

    part.write_text(part.read_text().replace(', "--emu-load-time", "120"', ""))  # the rerun loads fast
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    ended = f"ended server pid {pgid} (process group {pgid}) of dead run {run_id} on this host"
    assert ended in text, text[-3000:]
    assert text.index(ended) < text.index("hygiene before-launch")
    assert _group(pgid) == [] and not [p for p in members if pid_alive(p)]
    recs = records(tmp_path)
    assert recs[run_id]["servers"][0]["state"] == "ended"
    assert all(not pid_alive(s["pid"]) and not _group(s["pgid"]) for r in recs.values() for s in r["servers"])
    assert_exactly_once(out, ids)
    assert all(g["used_mib"] == 0 for g in SimGpus(tmp_path / "sim-gpus.json").snapshot()["gpus"])


def test_a_changed_input_of_the_second_dataset_is_refused_before_any_launch(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    # Every dataset is opened under the lock before the fleet starts: the second dataset's changed
    # input stops the rerun with exit 2 before hygiene or a launch (it used to be found only after
    # the first dataset had been served).
    part, ids = partition(tmp_path, {"a": 8, "b": 8}, [], shard=4, conc=4, max_relaunches=1)
    cmd, env, out = _finished_run(prefect_server, tmp_path, part)
    (first_id, _), = records(tmp_path).items()
    src = tmp_path / "b.jsonl"
    lines = src.read_text().splitlines()
    row = json.loads(lines[0])
    row["messages"][-1]["content"] += " (edited)"
    src.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = again.stdout + again.stderr
    assert again.returncode == 2, text[-3000:]
    assert "InputChanged" in text and str(src) in text, text[-3000:]
    assert "hygiene-before-launch" not in text and "server on" not in text
    (record,) = [r for k, r in records(tmp_path).items() if k != first_id]
    assert not record.get("servers") and not record.get("lease")
    assert_exactly_once(out, ids)


def _finished_run(prefect_server: PrefectServer, tmp: Path, part: Path) -> tuple[list[str], dict[str, str], Path]:
    """``datagen run`` of ``part`` to completion; its command and environment, for the rerun."""
    env = _env(prefect_server, tmp)
    out = tmp / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    return cmd, env, out
