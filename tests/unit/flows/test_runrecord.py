"""flows.runrecord: which recorded runs count as dead, and whose slot leases a new run releases."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from flows import runrecord


def test_release_dead_leases_only_of_dead_runs_on_this_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    me = runrecord.owner()
    assert me["host"] == socket.gethostname() and me["pid"] == os.getpid() and me["started"]
    runrecord.update("dead", lease="L-dead", owner=runrecord.owner(gone.pid) | {"started": 1.0, "pid": gone.pid})
    runrecord.update("reused", lease="L-reused", owner=dict(me, started=me["started"] - 100))  # pid reused
    runrecord.update("alive", lease="L-alive", owner=me)
    runrecord.update("elsewhere", lease="L-else", owner={"host": "other-host", "pid": gone.pid, "started": 1.0})
    runrecord.update("no-lease", owner={"host": me["host"], "pid": gone.pid, "started": 1.0})
    runrecord.update("no-owner", lease="L-old")  # recorded before owners were: left to expire
    runrecord.update("me", lease="L-me", owner={"host": me["host"], "pid": gone.pid, "started": 1.0})
    asked: list[str] = []

    def release(lease: str) -> bool:
        asked.append(lease)
        return lease != "L-reused"  # not released (the API did not know it): not marked, tried again

    assert runrecord.release_dead_leases(release, exclude="me") == ["L-dead"]
    assert sorted(asked) == ["L-dead", "L-reused"]
    assert runrecord.read("dead")["lease_released"] is True and "lease_released" not in runrecord.read("reused")
    assert "lease_released" not in runrecord.read("alive")
    assert runrecord.release_dead_leases(release, exclude="me") == []  # a released lease is tried once
    assert sorted(asked) == ["L-dead", "L-reused", "L-reused"]
    assert runrecord.process_alive(me) and not runrecord.process_alive({"pid": gone.pid})


def test_end_dead_servers_checks_pid_and_start_time_and_spares_live_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_owner = {"host": socket.gethostname(), "pid": gone.pid, "started": 1.0}
    sleepers = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)]
    try:
        ours, reused, live_runs = sleepers
        runrecord.update("dead", owner=dead_owner)
        runrecord.add_server("dead", "local", ours.pid, ours.pid)
        runrecord.update("dead-reused", owner=dead_owner)
        runrecord.add_server("dead-reused", "local", reused.pid, reused.pid)
        data = runrecord.read("dead-reused")
        data["servers"][0]["started"] -= 100  # the recorded server died; its pid now names another process
        runrecord._write("dead-reused", data)
        runrecord.update("alive", owner=runrecord.owner())
        runrecord.add_server("alive", "local", live_runs.pid, live_runs.pid)
        runrecord.update("remote", owner=dead_owner, servers=[{"target": "ssh://h", "pid": 7, "pgid": 7}])

        ended = runrecord.end_dead_servers(grace_s=2.0)
        assert [(r, e["pid"]) for r, e in ended] == [("dead", ours.pid)]
        assert ours.wait(timeout=5) == -15  # SIGTERM to its process group was enough
        assert reused.poll() is None and live_runs.poll() is None
        assert runrecord.read("dead")["servers"][0]["state"] == "ended"
        assert runrecord.read("dead-reused")["servers"][0]["state"] == "gone"
        assert runrecord.read("alive")["servers"][0]["state"] == "starting"
        assert "state" not in runrecord.read("remote")["servers"][0]
        assert runrecord.end_dead_servers(grace_s=2.0) == []  # each is looked at once
    finally:
        for p in sleepers:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)


def test_concurrent_sessions_record_every_server_and_tell_hosts_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Server sessions of one run record from threads at once; two hosts may use the same pid.
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    targets = [f"ssh://h{i}" for i in range(8)]

    def session(target: str) -> None:
        runrecord.add_server("run", target, 4242, 4242)
        runrecord.update_server("run", 4242, target=target, url=f"http://{target[6:]}", state="ready")

    threads = [threading.Thread(target=session, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    servers = runrecord.read("run")["servers"]
    assert sorted(s["target"] for s in servers) == targets
    assert all(s["state"] == "ready" and s["url"] == f"http://{s['target'][6:]}" for s in servers)


def test_prune_deletes_only_old_finished_records_beyond_the_newest(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = {"host": socket.gethostname(), "pid": gone.pid, "started": 1.0}
    runrecord.update("old-done", owner=dead, lease="L1", lease_released=True,
                     servers=[{"target": "local", "pid": 1, "state": "stopped"}])
    runrecord.update("old-no-owner")
    runrecord.update("old-lease-held", owner=dead, lease="L2", lease_released=False)
    runrecord.update("old-server-running", owner=dead, servers=[{"target": "local", "pid": 1, "state": "running"}])
    runrecord.update("old-alive", owner=runrecord.owner())
    runrecord.update("old-me", owner=dead)
    runrecord.update("new-done", owner=dead)
    old = 1_000_000.0
    for name in ("old-done", "old-no-owner", "old-lease-held", "old-server-running", "old-alive", "old-me"):
        os.utime(tmp_path / "runs" / f"{name}.json", (old, old))
    now = old + 15 * 86400
    assert runrecord.prune(exclude="old-me", keep_last=6, now=now) == []  # the newest six are kept
    assert sorted(runrecord.prune(exclude="old-me", keep_last=1, now=now)) == ["old-done", "old-no-owner"]
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.json")) == [
        "new-done", "old-alive", "old-lease-held", "old-me", "old-server-running"]
    assert runrecord.prune(keep_last=0, now=old + 86400) == []  # nothing is older than 14 days then
