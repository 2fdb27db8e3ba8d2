"""`datagen run` with no Prefect server (its own API server), killed or interrupted: kill -9 at
start-up and launch never blocks the next run, nothing of a killed run stays alive (its
API server included), Ctrl-C and SIGTERM end a run within seconds with one line, and a live holder
of the GPU slot makes a second run wait, name it, and give up after the bound.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tests.support.common import pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.prefect import migrated_home
from tests.support.runs import FAST_EMU, assert_exactly_once, done_rows, partition, records

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
SLOW_DECODE = ["--emu-decode-ms-per-step", "25"]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """No Prefect server anywhere: `datagen run` must start (and own) its API server."""
    SimGpus.init(tmp / "sim-gpus.json", count=2)
    env = dict(os.environ, PREFECT_HOME=str(migrated_home(tmp / "prefect-home")), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", DATAGEN_STATE_DIR=str(tmp / "state"), DATAGEN_RUN_DIR=str(tmp / "run"),
               **{ENV_VAR: str(tmp / "sim-gpus.json")})
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for(proc: subprocess.Popen[bytes], log: Path, what: str, ready: Callable[[], bool],
              timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"never reached {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _api_records(tmp: Path) -> list[Path]:
    folder = tmp / "state" / "api"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def _alive(pids: list[int], within_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _flow_state(tmp: Path, run_id: str) -> str:
    with sqlite3.connect(tmp / "prefect-home" / "prefect.db") as db:
        states = {str(r[0]).replace("-", ""): str(r[1]) for r in db.execute("select id, state_type from flow_run")}
    return states.get(run_id.replace("-", ""), f"no flow run {run_id}")


def _slow_run(tmp: Path, rows: int) -> tuple[dict[str, list[str]], dict[str, str], Path, list[str]]:
    """A run of ``rows`` ids slow enough to be caught in inference: ids, environment, output, command."""
    part, ids = partition(tmp, {"ds": rows}, FAST_EMU + SLOW_DECODE, shard=20, conc=8, max_relaunches=1)
    out = tmp / "out"
    return ids, _env(tmp), out, [DATAGEN, "run", "--partition", str(part), "--out", str(out)]


def test_kill9_at_startup_and_launch_then_ctrl_c_and_sigterm_in_inference_and_the_next_run_completes(
        tmp_path: Path, reap_pids: list[int]) -> None:
    """One output, five interrupted runs in a row, then a run that completes it: kill -9 at start-up
    (its API server exists) and at launch (slot held, server starting) never block the next run;
    Ctrl-C and SIGTERM in inference end the run within seconds with one line, its flow run CRASHED
    (not left Running). (kill -9 in inference: tests/e2e/test_resume.py, test_chaos_quick.py.)"""
    ids, env, out, cmd = _slow_run(tmp_path, 120)
    seen_runs: set[str] = set()

    def new_record(pred: Callable[[dict], bool]) -> Callable[[], bool]:
        return lambda: any(k not in seen_runs and pred(r) for k, r in records(tmp_path).items())

    moments: list[tuple[str, Callable[[subprocess.Popen[bytes]], bool]]] = [
        ("start-up", lambda proc: bool(_descendants(proc.pid))),  # its Prefect API server exists
        ("launch", lambda proc: new_record(lambda r: bool(r.get("servers")))()),  # slot held, server starting
    ]
    killed: list[int] = []
    for i, (moment, ready) in enumerate(moments):
        log = tmp_path / f"kill-{i}.log"
        proc = _start(cmd, env, log)
        reap_pids.append(proc.pid)
        _wait_for(proc, log, moment, lambda: ready(proc))  # noqa: B023 (called before the next round)
        family = [proc.pid, *(p.pid for p in _descendants(proc.pid))]
        reap_pids.extend(family)
        killed.extend(family)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seen_runs.update(records(tmp_path))
    for i, (sig, code, word, cause) in enumerate([(signal.SIGINT, 130, "interrupted", "interrupted (Ctrl-C)"),
                                                  (signal.SIGTERM, 143, "terminated",
                                                   "terminated (SIGTERM to datagen run)")]):
        err_log = tmp_path / f"run-{i}.err"
        with open(tmp_path / f"run-{i}.log", "wb") as fh, open(err_log, "wb") as err:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=fh, stderr=err, start_new_session=True)
        reap_pids.append(proc.pid)
        rows = done_rows(out)
        _wait_for(proc, err_log, "inference", lambda: done_rows(out) >= rows + 10)  # noqa: B023
        family = [proc.pid, *(p.pid for p in _descendants(proc.pid))]
        reap_pids.extend(family)
        assert len(family) >= 3  # the run, its API server, the emulator server (and its workers)
        started = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does: the whole foreground group
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=30) == code
        assert time.monotonic() - started < 10
        stderr = err_log.read_text()
        assert stderr.splitlines()[-1] == f"datagen run: {word}"
        # the summary's line: a person stopped it (issue 25 item 1), what is kept, how to resume
        assert "CANCELLED: recovery: " in stderr and f"; {cause}; " in stderr, stderr[-3000:]
        assert "shards were committed and are kept: a rerun with the same parameters resumes after them" in stderr
        assert "ERROR: " not in stderr and "Crash detected" not in stderr
        assert f"stopped: {cause}" in stderr
        assert "Traceback" not in stderr and "ConnectError" not in stderr
        assert _alive(family, within_s=5) == []
        (run_id,) = set(records(tmp_path)) - seen_runs
        seen_runs.add(run_id)
        assert _flow_state(tmp_path, run_id) == "CRASHED"  # not left "Running"
        assert _api_records(tmp_path) == []
    log = tmp_path / "final.log"
    final = _start(cmd, env, log)
    reap_pids.append(final.pid)
    assert final.wait(timeout=240) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "waiting for the GPU slot" not in text  # the dead runs' slots were released at start
    assert_exactly_once(out, ids)
    assert _alive(killed) == [], [psutil.Process(p).cmdline() for p in _alive(killed, 0)]
    assert _api_records(tmp_path) == []  # every API server record ended and forgotten
    assert _descendants(final.pid) == []
    lease_files = [p.name for p in (tmp_path / "prefect-home" / "concurrency_leases").glob("*.json")]
    assert lease_files in ([], ["expirations.json"])  # no lease left behind


def test_a_live_slot_holder_is_named_and_the_wait_is_bounded(tmp_path: Path, reap_pids: list[int]) -> None:
    part, _ = partition(tmp_path, {"ds": 400}, FAST_EMU + ["--emu-decode-ms-per-step", "100"], shard=50, conc=4,
                        max_relaunches=0)
    env = _env(tmp_path)
    log = tmp_path / "holder.log"
    holder = _start([DATAGEN, "run", "--partition", str(part), "--out", str(tmp_path / "out-a")], env, log)
    reap_pids.append(holder.pid)
    _wait_for(holder, log, "the holder's inference", lambda: done_rows(tmp_path / "out-a") >= 4)
    (holder_run, record), = records(tmp_path).items()
    reap_pids.extend(p.pid for p in _descendants(holder.pid))
    started = time.monotonic()
    waiter = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(tmp_path / "out-b")],
                            env=dict(env, DATAGEN_SLOT_WAIT_S="6"), cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=180)
    took = time.monotonic() - started
    assert waiter.returncode == 1, waiter.stderr[-3000:]
    who = f"gpu:{socket.gethostname()} held by host {socket.gethostname()} pid {holder.pid} flow run {holder_run}"
    assert f"waiting for the GPU slot ({who})" in waiter.stderr
    last = waiter.stderr.strip().splitlines()[-1]
    # the time it waited, the bound or a little more: the answer that ends the wait comes after it
    gave_up = re.fullmatch(r"datagen run: run failed: gave up waiting for the GPU slot after (\d+) s \((.*)\); "
                           r"the bound is DATAGEN_SLOT_WAIT_S \(now 6 s\)", last)
    assert gave_up and gave_up[2] == who, last
    assert 6 <= int(gave_up[1]) <= took < 120, (last, took)
    assert holder.poll() is None and record["lease"]  # the holder was never disturbed
    os.killpg(holder.pid, signal.SIGINT)
    assert holder.wait(timeout=30) == 130


def test_the_api_server_start_up_bound_is_configurable_and_nothing_is_left(tmp_path: Path) -> None:
    part, _ = partition(tmp_path, {"ds": 4}, FAST_EMU, shard=4, conc=2, max_relaunches=0)
    env = _env(tmp_path, DATAGEN_API_START_TIMEOUT_S="0.01")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part)], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("datagen run: the Prefect API server did not answer after 0.01 s of its own CPU "
                           "time (DATAGEN_API_START_TIMEOUT_S raises the bound)\n")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert _api_records(tmp_path) == []
    bad = subprocess.run([DATAGEN, "run", "--partition", str(part)], env=dict(env, DATAGEN_API_START_TIMEOUT_S="soon"),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr == "datagen run: DATAGEN_API_START_TIMEOUT_S='soon': expected a positive number of seconds\n"


def test_a_slow_api_server_start_delays_the_run_and_never_fails_it(tmp_path: Path, reap_pids: list[int]) -> None:
    """A busy host: the run's API server gets no CPU for longer than the start bound by the clock
    (SIGSTOP, then SIGCONT). The bound is on the server's own CPU time, so the run waits and completes."""
    part, ids = partition(tmp_path, {"ds": 4}, FAST_EMU, shard=4, conc=2, max_relaunches=0)
    env = _env(tmp_path, DATAGEN_API_START_TIMEOUT_S="20")
    log = tmp_path / "run.log"
    proc = _start([DATAGEN, "run", "--partition", str(part)], env, log)
    reap_pids.append(proc.pid)
    _wait_for(proc, log, "the API server's record", lambda: bool(_api_records(tmp_path)), timeout_s=60)
    server = int(_api_records(tmp_path)[0].stem)
    reap_pids.append(server)
    os.kill(server, signal.SIGSTOP)
    try:
        time.sleep(25)  # past the bound by the clock: the server used no CPU meanwhile
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        os.kill(server, signal.SIGCONT)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path / "out", ids)
    assert _alive([server]) == [] and _api_records(tmp_path) == []


@pytest.mark.parametrize("delay_s", [1.0, 4.0])
def test_ctrl_c_during_start_up_is_an_interrupt_130_never_a_configuration_error(
        tmp_path: Path, reap_pids: list[int], delay_s: float) -> None:
    """At any moment of start-up (imports, Prefect settings, the API server, the flow's first tasks)."""
    _, env, out, cmd = _slow_run(tmp_path, 40)
    err_log = tmp_path / "run.err"
    with open(tmp_path / "run.log", "wb") as fh, open(err_log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=fh, stderr=err, start_new_session=True)
    reap_pids.append(proc.pid)
    time.sleep(delay_s)
    family = [proc.pid, *(p.pid for p in _descendants(proc.pid))]
    reap_pids.extend(family)
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=60)
    stderr = err_log.read_text()
    if code == 0:
        pytest.skip(f"the run finished within {delay_s} s")
    assert code == 130, stderr[-3000:]
    assert stderr.splitlines()[-1] == "datagen run: interrupted", stderr[-3000:]
    assert "Traceback" not in stderr and "Error calling function" not in stderr, stderr[-3000:]
    assert _alive(family, within_s=10) == []
    assert _api_records(tmp_path) == []
