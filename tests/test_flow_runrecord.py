"""flows.runrecord: which recorded runs count as dead, and whose slot leases a new run releases."""

from __future__ import annotations

import os
import socket
import subprocess
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
        return lease != "L-reused"  # an already-expired lease: not listed, still marked

    assert runrecord.release_dead_leases(release, exclude="me") == ["L-dead"]
    assert sorted(asked) == ["L-dead", "L-reused"]
    assert runrecord.read("dead")["lease_released"] is True and runrecord.read("reused")["lease_released"] is True
    assert "lease_released" not in runrecord.read("alive")
    assert runrecord.release_dead_leases(release, exclude="me") == []  # each is tried once
    assert sorted(asked) == ["L-dead", "L-reused"]
    assert runrecord.process_alive(me) and not runrecord.process_alive({"pid": gone.pid})
