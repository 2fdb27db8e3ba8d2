"""Servers survive a short control outage: `datagen run` killed with kill -9 (its process alone, as an
OOM-kill or a crashed control host leaves a GPU host's server running), then the same run again.

Within the grace (``run.server_grace_s``) the rerun adopts the live server instead of cleaning and
relaunching (0 launches; the run record and the launch artifact say "adopted") and every row is
generated exactly once; past the grace, the server's guardian ends it and no process or simulated
GPU memory is left without an owner.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tasks.server import guardian_state
from tasks.server._leash import leash_socket
from tests.support.common import free_port, pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, done_rows, partition, records
from tests.support.sshd import SSHD, SshHost, hosts_env, start_hosts, stop_hosts

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def _setup(prefect_server: PrefectServer, tmp: Path, grace_s: float) -> tuple[Path, dict[str, list[str]],
                                                                             dict[str, str], list[str]]:
    part, ids = partition(tmp, {"ds": 96}, ["--emu-decode-ms-per-step", "30"], shard=16, conc=8, max_relaunches=1)
    part.write_text(part.read_text().replace("[run]\n", f"[run]\nserver_grace_s = {grace_s:g}\n"))
    SimGpus.init(tmp / "sim-gpus.json", count=2)
    env = prefect_server.env(**{ENV_VAR: str(tmp / "sim-gpus.json"), "DATAGEN_STATE_DIR": str(tmp / "state"),
                                "DATAGEN_RUN_DIR": str(tmp / "run")})
    return part, ids, env, [DATAGEN, "run", "--partition", str(part), "--out", str(tmp / "out")]


def _killed_mid_run(cmd: list[str], env: dict[str, str], tmp: Path, reap_pids: list[int]) -> tuple[str, int]:
    """Start the run, SIGKILL its process alone once 20 rows are done; its run id and server pid."""
    with open(tmp / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    reap_pids.append(first.pid)
    deadline = time.monotonic() + 90
    while done_rows(tmp / "out") < 20:
        assert first.poll() is None, (tmp / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the first run generated nothing"
        time.sleep(0.05)
    (run_id, record), = records(tmp).items()
    server_pid = int(record["servers"][0]["pid"])
    reap_pids.append(server_pid)
    first.send_signal(signal.SIGKILL)
    first.wait()
    return run_id, server_pid


def _gpus_free(tmp: Path) -> bool:
    return all(g["used_mib"] == 0 for g in SimGpus(tmp / "sim-gpus.json").snapshot()["gpus"])


def test_a_rerun_within_the_grace_adopts_the_server_and_launches_nothing(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    part, ids, env, cmd = _setup(prefect_server, tmp_path, grace_s=300)
    run_id, server_pid = _killed_mid_run(cmd, env, tmp_path, reap_pids)
    time.sleep(1.0)  # past the guardian's read of the closed pipe
    assert pid_alive(server_pid)  # kept: its owner died, its guardian waits for the next run
    assert guardian_state("local", server_pid).startswith("waiting "), guardian_state("local", server_pid)
    assert not _gpus_free(tmp_path)

    second = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert f"adopted: pid {server_pid} of dead run {run_id}" in text, text[-3000:]
    assert "hygiene-before-launch" not in text and "launch-local" not in text, text[-3000:]
    assert ", 0 relaunches" in text, text[-2000:]
    recs = records(tmp_path)
    assert [s["state"] for s in recs[run_id]["servers"]] == ["adopted"]
    (new_id,) = [k for k in recs if k != run_id]
    assert [(s["pid"], s["state"]) for s in recs[new_id]["servers"]] == [(server_pid, "stopped")]
    # the launch artifact says so (what the UI shows on the run's Artifacts tab)
    body = {"artifacts": {"flow_run_id": {"any_": [new_id]}, "key": {"like_": "server-launch"}}}
    arts = httpx.post(f"{prefect_server.api_url}/artifacts/filter", json=body, timeout=30).raise_for_status().json()
    (art,) = arts
    assert art["description"].startswith(f"OK: adopted the server of run {run_id} on {socket.gethostname()} "), art
    assert f"(pid {server_pid}, fraction " in art["description"] and "relaunched 0 times" in art["data"], art
    assert_exactly_once(tmp_path / "out", ids)
    # the adopting run stopped it as its own: nothing left; its guardian sees the group gone (it looks
    # every second) and leaves with its socket
    assert not pid_alive(server_pid)
    deadline = time.monotonic() + 15
    while os.path.exists(leash_socket(server_pid)):
        assert time.monotonic() < deadline, f"{leash_socket(server_pid)} left 15 s after the run"
        time.sleep(0.1)
    assert _gpus_free(tmp_path)


def _ended_after_the_grace(server_pid: int, gpus_free: Callable[[], bool], killed: float, grace: float) -> None:
    """Wait until the server is gone and its GPUs are free (the grace, the leash's stop and 15 s at most),
    and check that it was kept through its grace."""
    deadline = killed + grace + 20 + 15
    while pid_alive(server_pid) or not gpus_free():
        assert time.monotonic() < deadline, f"server {server_pid} alive {time.monotonic() - killed:.0f} s after the kill"
        time.sleep(0.2)
    assert time.monotonic() - killed >= grace - 0.5  # kept through its grace


def test_past_the_grace_the_guardian_ends_the_server_and_frees_its_gpus(
        prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    grace = 4.0
    part, ids, env, cmd = _setup(prefect_server, tmp_path, grace_s=grace)
    run_id, server_pid = _killed_mid_run(cmd, env, tmp_path, reap_pids)
    killed = time.monotonic()
    assert pid_alive(server_pid)
    # the guardian waits out the grace, then ends the group as a stop does (LEASH_GRACE_S at most)
    _ended_after_the_grace(server_pid, lambda: _gpus_free(tmp_path), killed, grace)
    assert not os.path.exists(leash_socket(server_pid))
    assert guardian_state("local", server_pid).startswith("none")  # nothing left to adopt


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SshHost]:
    """One sshd host; this process reaches it too (``guardian_state`` over SSH)."""
    if not os.path.exists(SSHD):
        pytest.skip("openssh-server is not installed: apt-get install -y openssh-server")
    (started,) = start_hosts(tmp_path / "hosts", ["127.0.0.6"])
    for name, value in hosts_env([started]).items():
        monkeypatch.setenv(name, value)
    try:
        yield started
    finally:
        stop_hosts([started])


def _remote(prefect_server: PrefectServer, tmp: Path, host: SshHost, grace_s: float) -> tuple[
        dict[str, list[str]], dict[str, str], list[str]]:
    part, ids = partition(tmp, {"ds": 96}, ["--emu-decode-ms-per-step", "30"], shard=16, conc=8, max_relaunches=1)
    target = (f'[{{ target = "{host.url()}", port = {free_port(host.address)}, '
              f'flags = {{ host = "{host.address}" }} }}]')
    part.write_text(part.read_text().replace("[run]\n", f"[run]\nserver_grace_s = {grace_s:g}\n")
                    .replace('targets = ["local"]', f"targets = {target}"))
    env = prefect_server.env(DATAGEN_STATE_DIR=str(tmp / "state"), DATAGEN_RUN_DIR=str(tmp / "run"),
                             **hosts_env([host]))
    env.pop(ENV_VAR, None)  # the host's own, from its sshd
    return ids, env, [DATAGEN, "run", "--partition", str(part), "--out", str(tmp / "out")]


def _host_gpus_free(host: SshHost) -> bool:
    return all(g["used_mib"] == 0 for g in SimGpus(host.sim_gpus).snapshot()["gpus"])


def test_a_server_on_an_ssh_host_is_adopted_over_ssh_within_the_grace(
        prefect_server: PrefectServer, host: SshHost, tmp_path: Path, reap_pids: list[int]) -> None:
    ids, env, cmd = _remote(prefect_server, tmp_path, host, grace_s=300)
    run_id, server_pid = _killed_mid_run(cmd, env, tmp_path, reap_pids)
    time.sleep(1.0)
    assert pid_alive(server_pid)  # the sshd host is this machine: its pids are ours to look at
    assert guardian_state(host.url(), server_pid).startswith("waiting "), guardian_state(host.url(), server_pid)

    second = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert f"adopted: pid {server_pid} of dead run {run_id}" in text, text[-3000:]
    assert ", 0 relaunches" in text, text[-2000:]
    assert_exactly_once(tmp_path / "out", ids)
    assert not pid_alive(server_pid)
    assert _host_gpus_free(host)


def test_past_the_grace_a_server_on_an_ssh_host_is_ended_there(
        prefect_server: PrefectServer, host: SshHost, tmp_path: Path, reap_pids: list[int]) -> None:
    grace = 4.0
    ids, env, cmd = _remote(prefect_server, tmp_path, host, grace_s=grace)
    run_id, server_pid = _killed_mid_run(cmd, env, tmp_path, reap_pids)
    killed = time.monotonic()
    assert pid_alive(server_pid)
    _ended_after_the_grace(server_pid, lambda: _host_gpus_free(host), killed, grace)
    assert guardian_state(host.url(), server_pid).startswith("none"), guardian_state(host.url(), server_pid)
