"""The launcher, readiness, stop and the tuner against the real emulator process on simulated GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from emulator.simgpu import SimGpus
from tasks.procs import same_process, terminate_group
from tasks.server import (
    FileStore,
    FractionMemory,
    LaunchFailed,
    ServerConfig,
    ServerError,
    ServerHandle,
    launch,
    launch_tuned,
    record_runtime_oom,
    runtime_failure,
    stop_server,
)
from tasks.targets import run_command
from tests.support.common import PortTaker, free_port, impostor_server, pid_alive
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
DEMO = "data/models/demo"
FAST = ("--emu-load-time", "0.2", "--emu-graph-time", "0.05", "--emu-warmup-time", "0.05")


def cfg_for(port: int, *extra: str, **kw) -> ServerConfig:
    return ServerConfig(model_path=DEMO, backend="emulator", port=port, extra_args=(*FAST, *extra), **kw)


@pytest.fixture
def started():
    """Handles to stop (SIGKILL of the whole group) whatever a test leaves running: by the product's
    terminate_group, which never signals a group id or member pid recycled since."""
    handles: list[ServerHandle] = []
    yield handles
    for h in handles:
        terminate_group(h.pgid, 0.0, first=signal.SIGKILL, kill_wait_s=10.0, kill_pids=h._members, leader=h._popen)
        for m in h._members:  # those that left the group, should the group have ended at once
            if same_process(m):
                with contextlib.suppress(OSError):
                    os.kill(m.pid, signal.SIGKILL)
        if h._popen is not None:
            h._popen.wait(10)


def used_mib(sim) -> list[int]:
    return [g["used_mib"] for g in sim.snapshot()["gpus"]]


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


async def _burst(url: str, n: int, words: int, headers=None) -> list[int]:
    prompt = " ".join(f"w{i}" for i in range(words))
    async with httpx.AsyncClient(timeout=30, headers=headers) as c:

        async def one(i: int) -> int:
            try:
                r = await c.post(url + "/generate", json={"text": f"{i} {prompt}",
                                                          "sampling_params": {"max_new_tokens": 4}})
                return r.status_code
            except httpx.TransportError:
                return -1

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def burst(url: str, n: int = 24, words: int = 400, headers=None) -> list[int]:
    """A concurrent burst of long prompts: one prefill batch far over 2,048 tokens."""
    return asyncio.run(_burst(url, n, words, headers))


def test_launch_api_key_hidden_then_clean_stop(sim_gpus, started, tmp_path):
    secret = "sk-datagen-test-5f1e2d"
    cfg = cfg_for(free_port(), api_key=secret, mem_fraction_static=0.88)
    h = launch(cfg, "local", 0.88, tmp_path / "logs", deadline_s=30)
    started.append(h)
    assert h.is_alive() and h.pgid == h.pid and h.progress.phase == "ready"
    assert h.headroom_gib == pytest.approx(5.57, abs=0.05)
    assert h.progress.kv_tokens and h.progress.weights_gib
    assert h.member_pids and h.pid in h.member_pids
    assert used_mib(sim_gpus)[0] > 50_000
    # the key is on no command line of the group, nowhere in `ps`, and not in the log
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    assert secret not in ps
    for pid in h.member_pids:
        assert secret not in " ".join(psutil.Process(pid).cmdline())
    log_text = Path(h.log_path).read_text()
    assert "api_key=" in log_text and secret not in log_text and "***" in log_text
    # ... yet the server enforces it
    assert httpx.post(h.url + "/generate", json={"text": "hi"}, timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {secret}"}
    assert httpx.post(h.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                      headers=auth, timeout=10).status_code == 200
    t0 = time.monotonic()
    report = stop_server(h, grace_s=10)
    assert time.monotonic() - t0 < 5.0  # the main process drained: no wait for the group's grace
    assert report.verdict == "clean"
    assert not any(pid_alive(p) for p in h.member_pids)
    # SIGTERM to the key bootstrap reached the server, which drained and exited 0; the bootstrap mirrored it
    assert h.exit_status() == 0
    log_text = Path(h.log_path).read_text()
    assert "Graceful shutdown completed." in log_text and "OSError" not in log_text
    assert used_mib(sim_gpus) == [0] * 8
    stop_server(h, grace_s=1)  # idempotent


@pytest.mark.slow
def test_runtime_oom_at_093_then_tuner_relaunches_lower_and_remembers(sim_gpus, started, tmp_path):
    memory = FractionMemory(FileStore(tmp_path / "state" / "fractions.json"))
    cfg = cfg_for(free_port(), mem_fraction_static=0.93)
    h, report = launch_tuned(cfg, "local", tmp_path / "logs", deadline_s=30, memory=memory)
    started.append(h)
    assert [a.fraction for a in report.attempts] == [0.93] and report.start_source == "configured"
    assert h.headroom_gib == pytest.approx(0.79, abs=0.05)
    codes = burst(h.url)
    wait_until(lambda: not h.is_alive(), 15, "the server to die of the OOM")
    assert h.exit_status() == -9
    failure = runtime_failure(h.read_log())
    assert failure is not None and failure.kind == "too_high" and "OutOfMemoryError" in failure.evidence
    assert codes.count(200) < len(codes)
    entry = record_runtime_oom(cfg, "local", h.fraction, memory=memory)
    assert (entry.fraction, entry.runtime_oom_at) == (0.88, 0.93)
    assert stop_server(h, grace_s=5).verdict == "clean"

    h2, report2 = launch_tuned(cfg, "local", tmp_path / "logs", deadline_s=30, memory=memory)
    started.append(h2)
    assert [a.fraction for a in report2.attempts] == [0.88] and report2.start_source == "remembered"
    assert burst(h2.url) == [200] * 24 and h2.is_alive()
    assert memory.get(report2.key).fraction == 0.88
    assert memory.get(report2.key).headroom_gib == pytest.approx(5.57, abs=0.05)
    assert stop_server(h2, grace_s=5).verdict == "clean"

    # a third (nightly) run launches once, at the remembered value
    h3, report3 = launch_tuned(cfg, "local", tmp_path / "logs", deadline_s=30, memory=memory)
    started.append(h3)
    assert report3.summary() == "0.88 -> ok"
    stop_server(h3, grace_s=5)
    assert used_mib(sim_gpus) == [0] * 8


@pytest.mark.slow
def test_too_low_steps_up(sim_gpus, started, tmp_path):
    memory = FractionMemory(FileStore(tmp_path / "fractions.json"))
    cfg = cfg_for(free_port(), mem_fraction_static=0.55)
    h, report = launch_tuned(cfg, "local", tmp_path / "logs", deadline_s=30, memory=memory)
    started.append(h)
    assert [(a.fraction, a.failure.kind if a.failure else None) for a in report.attempts] == [
        (0.55, "too_low"), (0.6, None)]
    assert "Not enough memory" in Path(report.attempts[0].log_path).read_text()
    stop_server(h, grace_s=5)
    assert used_mib(sim_gpus) == [0] * 8


@pytest.mark.slow
def test_never_fits_gives_up_after_bounded_attempts(sim_gpus, started, tmp_path):
    # 58.6 GiB GPUs: the demo model's 56 GiB of weights load, but even at 0.95 no KV pool fits
    SimGpus.init(os.environ["DATAGEN_SIM_GPUS"], count=2, total_mib=60_000)
    memory = FractionMemory(FileStore(tmp_path / "fractions.json"))
    cfg = cfg_for(free_port())
    t0 = time.monotonic()
    with pytest.raises(LaunchFailed) as ei:
        launch_tuned(cfg, "local", tmp_path / "logs", deadline_s=30, memory=memory)
    err = ei.value
    assert [a.fraction for a in err.attempts] == [None, 0.93, 0.95]
    assert all(a.failure.kind == "too_low" for a in err.attempts)
    msg = str(err)
    assert "after 3 attempt(s) [default (0.88) -> too_low, 0.93 -> too_low, 0.95 -> too_low]" in msg
    assert "no fraction in [0.5, 0.95] fits" in msg
    assert memory.entries() == []
    assert time.monotonic() - t0 < 30
    assert [g["used_mib"] for g in SimGpus(os.environ["DATAGEN_SIM_GPUS"]).snapshot()["gpus"]] == [0, 0]


def test_exit_during_load_fails_fast_with_log_tail(sim_gpus, started, tmp_path):
    cfg = ServerConfig(model_path=str(tmp_path / "no-such-model"), backend="emulator", port=free_port(),
                       extra_args=("--emu-load-time", "20"))
    t0 = time.monotonic()
    with pytest.raises(LaunchFailed) as ei:
        launch(cfg, "local", 0.88, tmp_path / "logs", deadline_s=60)
    assert time.monotonic() - t0 < 10
    e = ei.value
    assert e.failure.kind == "model_not_found"
    assert "is not a local folder" in e.log_tail and "is not a local folder" in str(e)
    assert e.exit_status == 1 and e.log_path and os.path.exists(e.log_path)


def test_startup_hang_hits_deadline_and_kills_group(sim_gpus, started, tmp_path):
    cfg = ServerConfig(model_path=DEMO, backend="emulator", port=free_port(),
                       extra_args=("--emu-load-time", "120"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    with pytest.raises(LaunchFailed) as ei:
        launch(cfg, "local", 0.88, tmp_path / "logs", deadline_s=2.0)
    elapsed = time.monotonic() - t0
    assert 2.0 <= elapsed < 9
    e = ei.value
    assert e.failure.kind == "timeout" and "not ready within 2 s" in e.failure.explanation
    assert "Load weight begin" in e.log_tail
    assert e.exit_status is not None  # reaped: nothing of the group is left
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if pid_alive(p)]
    wait_until(lambda: used_mib(sim_gpus) == [0] * 8, 10, "sim GPUs to be released")


def test_port_in_use_is_refused_before_starting(sim_gpus, started, tmp_path):
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(LaunchFailed) as ei:
            launch(cfg_for(port), "local", 0.88, tmp_path / "logs", deadline_s=30)
        assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    assert ei.value.failure.kind == "port_in_use"
    assert f"127.0.0.1:{port}" in str(ei.value) and "choose another --port" in str(ei.value)
    assert ei.value.failure.evidence.startswith(f"127.0.0.1:{port} is already in use by pid {os.getpid()} (")


def test_readiness_refuses_a_200_from_another_process_on_the_port(sim_gpus, started, tmp_path):
    """The port is free at the pre-check and taken before the server binds it: the impostor's 200
    must not pass for the launched server's."""
    port = free_port()
    with PortTaker(port) as taker, pytest.raises(LaunchFailed) as ei:
        launch(cfg_for(port, "--emu-load-time", "2"), "local", 0.88, tmp_path / "logs", deadline_s=30,
               on_started=taker)
    e = ei.value
    assert e.failure.kind == "port_in_use"
    assert e.failure.evidence.startswith(f"127.0.0.1:{port} is held by pid {os.getpid()} (")
    assert f"not by the launched server (pid {taker.pids[0]})" in e.failure.evidence
    assert not pid_alive(taker.pids[0])  # the launched group was killed


@pytest.mark.slow
def test_remote_port_in_use_is_refused_before_starting(remote, sim_gpus, tmp_path):
    port = free_port()
    cfg = ServerConfig(model_path=str(REPO / DEMO), backend="emulator", port=port, extra_args=FAST)
    with impostor_server(port):
        with pytest.raises(LaunchFailed) as ei:
            launch(cfg, remote.url(), 0.88, str(tmp_path / "remote-logs"), deadline_s=30)
    e = ei.value
    assert e.failure.kind == "port_in_use" and e.exit_status is None
    # Read on the target by the probe (the target is this host, so the holder is this test process).
    assert e.failure.evidence.startswith(f"127.0.0.1:{port} is already in use by pid {os.getpid()} (")
    assert not (tmp_path / "remote-logs").exists()  # nothing was started there
    assert not [p for p in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])]


def test_unknown_flag_is_bad_flag(sim_gpus, started, tmp_path):
    with pytest.raises(LaunchFailed) as ei:
        launch(cfg_for(free_port(), "--no-such-flag"), "local", 0.88, tmp_path / "logs", deadline_s=30)
    e = ei.value
    assert (e.failure.kind, e.exit_status) == ("bad_flag", 2)
    assert "--no-such-flag" in e.failure.evidence


def test_sigterm_ignoring_server_is_group_killed(sim_gpus, started, tmp_path):
    h = launch(cfg_for(free_port(), "--emu-ignore-sigterm", tp_size=2), "local", 0.88, tmp_path / "logs",
               deadline_s=30)
    started.append(h)
    assert len(h.member_pids) >= 4  # main, 2 schedulers, detokenizer
    t0 = time.monotonic()
    report = stop_server(h, grace_s=1.0)
    assert time.monotonic() - t0 >= 1.0
    assert h.exit_status() == -9
    assert not any(pid_alive(p) for p in h.member_pids)
    assert report.verdict == "clean" and used_mib(sim_gpus) == [0] * 8


@pytest.mark.slow
def test_orphan_on_crash_found_by_hygiene_after_stop(sim_gpus, started, tmp_path):
    h = launch(cfg_for(free_port(), "--emu-orphan-on-crash", "--emu-crash-after", "1", tp_size=2),
               "local", 0.88, tmp_path / "logs", deadline_s=30)
    started.append(h)
    members = list(h.member_pids)
    burst(h.url, n=2, words=5)
    wait_until(lambda: not h.is_alive(), 15, "the crash")
    orphans = [p for p in members if pid_alive(p)]
    assert orphans, "the emulator left no orphan"
    assert max(used_mib(sim_gpus)) > 50_000  # the orphan still holds its GPU
    report = stop_server(h, grace_s=2)
    assert report.verdict == "clean"
    assert not any(pid_alive(p) for p in orphans)
    assert used_mib(sim_gpus) == [0] * 8


def test_weights_that_do_not_fit_stop_the_tuner_at_once(sim_gpus, started, tmp_path):
    SimGpus.init(os.environ["DATAGEN_SIM_GPUS"], count=1, total_mib=50_000)
    memory = FractionMemory(FileStore(tmp_path / "fractions.json"))
    with pytest.raises(LaunchFailed) as ei:
        launch_tuned(cfg_for(free_port(), mem_fraction_static=0.9), "local", tmp_path / "logs", deadline_s=30,
                     memory=memory)
    assert [a.fraction for a in ei.value.attempts] == [0.9]
    assert ei.value.failure.kind == "weights_too_big"
    assert "use more GPUs (--tp-size)" in str(ei.value)


@pytest.mark.slow
def test_remote_ssh_launch_tunnel_and_stop(remote, sim_gpus, started, tmp_path):
    target = remote.url()
    cfg = ServerConfig(model_path=str(REPO / DEMO), backend="emulator", port=free_port(), extra_args=FAST)
    h = launch(cfg, target, 0.88, str(tmp_path / "remote-logs"), deadline_s=30)
    started.append(h)
    assert h.target == target and h._popen is None and h.is_remote
    assert h.url != cfg.url and h.url.startswith("http://127.0.0.1:")  # through the SSH forward
    assert h.headroom_gib == pytest.approx(5.57, abs=0.05)
    assert h.is_alive() and pid_alive(h.pid)
    assert httpx.get(h.url + "/health_generate", timeout=10).status_code == 200
    report = stop_server(h, grace_s=5)
    assert report.verdict == "clean"
    assert not pid_alive(h.pid) and used_mib(sim_gpus) == [0] * 8
    assert h._tunnel is None


@pytest.mark.slow
def test_remote_launch_with_api_key_keeps_it_off_every_command_line(remote, sim_gpus, started, tmp_path):
    secret = "sk-remote-datagen-7c41a9"
    target = remote.url()
    cfg = ServerConfig(model_path=str(REPO / DEMO), backend="emulator", port=free_port(), extra_args=FAST,
                       api_key=secret)
    h = launch(cfg, target, 0.88, str(tmp_path / "remote-logs"), deadline_s=30)
    started.append(h)
    assert h._popen is None and h.url != cfg.url
    # `ps` on the target sees the server (bootstrap leader + emulator), but never the key
    ps = run_command(target, ["ps", "-eo", "args"], 30).stdout
    assert f"--port {cfg.port}" in ps and secret not in ps
    log_text = Path(h.log_path).read_text()  # the target is this host: its log is readable here
    assert "api_key=" in log_text and "***" in log_text and secret not in log_text
    assert secret not in str(h.to_dict())
    # ... and the server enforces it, through the tunnel
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(h.url + "/generate", json=body, timeout=10).status_code == 401
    assert httpx.post(h.url + "/generate", json=body, headers={"Authorization": f"Bearer {secret}"},
                      timeout=10).status_code == 200
    assert stop_server(h, grace_s=5).verdict == "clean"
    assert not pid_alive(h.pid) and used_mib(sim_gpus) == [0] * 8


@pytest.mark.slow
def test_remote_tunnel_failure_kills_the_started_server(remote, sim_gpus, tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_ssh = bindir / "ssh"  # the forward is the only thing run through the ssh binary
    fake_ssh.write_text("#!/bin/sh\necho 'bind [127.0.0.1]:1: Address already in use' >&2\nexit 255\n")
    fake_ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    cfg = ServerConfig(model_path=str(REPO / DEMO), backend="emulator", port=free_port(),
                       extra_args=("--emu-load-time", "30"))
    with pytest.raises(ServerError) as ei:
        launch(cfg, remote.url(), 0.88, str(tmp_path / "remote-logs"), deadline_s=30)
    assert "SSH port forward to" in str(ei.value) and "exit 255" in str(ei.value)
    assert "Address already in use" in ei.value.log_tail

    def ours() -> list[int]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if f"--port {cfg.port}" in " ".join(p.info["cmdline"] or []) and pid_alive(p.pid):
                found.append(p.pid)
        return found

    wait_until(lambda: not ours(), 10, "the remote server to be gone")
    wait_until(lambda: used_mib(sim_gpus) == [0] * 8, 10, "sim GPUs to be released")


def test_on_started_names_the_process_before_readiness(sim_gpus, started, tmp_path):
    port = free_port()
    told: list[tuple[int, int, bool, bool, bool]] = []

    def on_started(pid: int, pgid: int) -> None:
        with socket.socket() as s:
            listening = s.connect_ex(("127.0.0.1", port)) == 0
        told.append((pid, pgid, os.getpgid(pid) == pgid, pid_alive(pid), listening))

    h = launch(cfg_for(port), "local", 0.88, tmp_path / "logs", deadline_s=30, on_started=on_started)
    started.append(h)
    assert told == [(h.pid, h.pgid, True, True, False)]  # once, alive, its own group, not yet serving
    stop_server(h, grace_s=2.0)


def test_on_started_that_raises_kills_the_new_group(sim_gpus, started, tmp_path):
    pids: list[int] = []

    def on_started(pid: int, pgid: int) -> None:
        pids.append(pid)
        raise OSError("run record not writable")

    cfg = ServerConfig(model_path=DEMO, backend="emulator", port=free_port(), extra_args=("--emu-load-time", "60"))
    with pytest.raises(OSError, match="run record not writable"):
        launch(cfg, "local", 0.88, tmp_path / "logs", deadline_s=30, on_started=on_started)
    (pid,) = pids
    wait_until(lambda: not pid_alive(pid), 10, "the unrecorded server to be killed")
    wait_until(lambda: used_mib(sim_gpus) == [0] * 8, 10, "sim GPUs to be released")
