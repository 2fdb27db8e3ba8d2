"""flows.runrecord: which recorded runs count as dead, and whose slot leases a new run releases.

Records are planted as the JSON a run (of this or an earlier version) left on disk."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from flows import runrecord
from tasks.config import state_dir


def _plant(run_id: str, **fields: object) -> None:
    """A record on disk as a run left it (``owner``/``servers`` as JSON objects)."""
    path = state_dir() / "runs" / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields))


def test_release_dead_leases_only_of_dead_runs_on_this_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    owner = runrecord.Owner.of()
    assert owner.host == socket.gethostname() and owner.pid == os.getpid() and owner.started
    me = dataclasses.asdict(owner)
    _plant("dead", lease="L-dead", owner={"host": me["host"], "started": 1.0, "pid": gone.pid})
    _plant("reused", lease="L-reused", owner=dict(me, started=me["started"] - 100))  # pid reused
    runrecord.lease_taken("alive", "L-alive")  # this process
    _plant("elsewhere", lease="L-else", owner={"host": "other-host", "pid": gone.pid, "started": 1.0})
    _plant("no-lease", owner={"host": me["host"], "pid": gone.pid, "started": 1.0})
    _plant("no-owner", lease="L-old")  # recorded before owners were: left to expire
    _plant("me", lease="L-me", owner={"host": me["host"], "pid": gone.pid, "started": 1.0})
    asked: list[str] = []

    def release(lease: str) -> bool:
        asked.append(lease)
        return lease != "L-reused"  # not released (the API did not know it): not marked, tried again

    assert runrecord.release_dead_leases(release, exclude="me") == ["L-dead"]
    assert sorted(asked) == ["L-dead", "L-reused"]
    assert runrecord.read("dead").lease_released and not runrecord.read("reused").lease_released
    assert runrecord.read("alive") == runrecord.RunRecord(owner=owner, lease="L-alive")
    assert runrecord.release_dead_leases(release, exclude="me") == []  # a released lease is tried once
    assert sorted(asked) == ["L-dead", "L-reused", "L-reused"]
    assert owner.alive() and not runrecord.Owner(owner.host, gone.pid).alive()


def test_end_dead_servers_checks_pid_and_start_time_and_spares_live_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_owner = {"host": socket.gethostname(), "pid": gone.pid, "started": 1.0}
    sleepers = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)]
    try:
        ours, reused, live_runs = sleepers
        _plant("dead", owner=dead_owner)
        runrecord.server_started("dead", "local", ours.pid, ours.pid)
        started = runrecord.read("dead").servers[0].started
        assert started is not None
        # the recorded server died; its pid now names another process
        _plant("dead-reused", owner=dead_owner, servers=[{"target": "local", "pid": reused.pid, "pgid": reused.pid,
                                                           "started": started - 100, "state": "starting"}])
        runrecord.lease_taken("alive", "L")
        runrecord.server_started("alive", "local", live_runs.pid, live_runs.pid)
        _plant("remote", owner=dead_owner, servers=[{"target": "ssh://h", "pid": 7, "pgid": 7}])

        ended = runrecord.end_dead_servers(grace_s=2.0)
        assert [(r, e.pid) for r, e in ended] == [("dead", ours.pid)]
        assert ours.wait(timeout=5) == -15  # SIGTERM to its process group was enough
        assert reused.poll() is None and live_runs.poll() is None
        assert runrecord.read("dead").servers[0].state == "ended"
        assert runrecord.read("dead-reused").servers[0].state == "gone"
        assert runrecord.read("alive").servers[0].state == "starting"
        assert runrecord.read("remote").servers[0].state is None
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
        runrecord.server_started("run", target, 4242, 4242)
        runrecord.server_ready("run", 4242, target=target, pgid=4242, url=f"http://{target[6:]}", log="l")

    threads = [threading.Thread(target=session, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    servers = runrecord.read("run").servers
    assert sorted(s.target for s in servers) == targets
    assert all(s.state == "ready" and s.url == f"http://{s.target[6:]}" for s in servers)


def test_prune_deletes_only_old_finished_records_beyond_the_newest(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = {"host": socket.gethostname(), "pid": gone.pid, "started": 1.0}
    _plant("old-done", owner=dead, lease="L1", lease_released=True,
           servers=[{"target": "local", "pid": 1, "state": "stopped"}])
    _plant("old-no-owner")
    _plant("old-lease-held", owner=dead, lease="L2", lease_released=False)
    _plant("old-server-running", owner=dead, servers=[{"target": "local", "pid": 1, "state": "running"}])
    runrecord.lease_taken("old-alive", "L3")
    runrecord.lease_released("old-alive")
    _plant("old-me", owner=dead)
    _plant("new-done", owner=dead)
    old = 1_000_000.0
    for name in ("old-done", "old-no-owner", "old-lease-held", "old-server-running", "old-alive", "old-me"):
        os.utime(tmp_path / "runs" / f"{name}.json", (old, old))
    now = old + 15 * 86400
    assert runrecord.prune(exclude="old-me", keep_last=6, now=now) == []  # the newest six are kept
    assert sorted(runrecord.prune(exclude="old-me", keep_last=1, now=now)) == ["old-done", "old-no-owner"]
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.json")) == [
        "new-done", "old-alive", "old-lease-held", "old-me", "old-server-running"]
    assert runrecord.prune(keep_last=0, now=old + 86400) == []  # nothing is older than 14 days then
