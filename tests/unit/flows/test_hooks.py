"""flows.hooks.cleanup_hook from the run record alone (as in a worker after a SIGKILL): the run's
server, recorded while it was still loading, is ended by process group, and hygiene touches only the
partition's server GPUs (another job on another GPU is spared)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from emulator.simgpu import SimGpus
from flows import hooks, runrecord
from tests.support.common import pid_alive

DATAGEN = str(Path(sys.executable).parent / "datagen")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _hold(gpu: int, procs: list[subprocess.Popen[bytes]], *, session: bool = False) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([DATAGEN, "gpu-sim", "hold", "--gpu", str(gpu), "--mib", "20000"],
                         stdout=subprocess.PIPE, start_new_session=session)
    procs.append(p)
    assert p.stdout is not None
    with p.stdout:
        assert p.stdout.readline().startswith(b"holding 20000 MiB"), "holder did not start"
    return p


def test_crash_hook_ends_the_recorded_server_and_spares_other_gpus(
        sim_gpus: SimGpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        procs: list[subprocess.Popen[bytes]]) -> None:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path / "state"))
    artifacts: list[str] = []
    monkeypatch.setattr(hooks, "_artifact", lambda run_id, markdown, logger, **kw: artifacts.append(markdown))
    server = _hold(1, procs, session=True)  # stands in for a server still loading on its GPU
    other = _hold(5, procs)  # the same user's job on a GPU the partition's server does not use
    run_id = str(uuid.uuid4())
    runrecord.planned(run_id, partition="demo", targets=["local"], out_dir=str(tmp_path / "out"), sim_gpus=None,
                      shared_server=False, gpus=[0, 1], target_gpus={"local": [0, 1]})
    runrecord.server_started(run_id, "local", server.pid, server.pid)
    flow_run = SimpleNamespace(id=run_id, name="crashed-run", parameters={"partition": "demo"}, deployment_id=None)
    hooks.cleanup_hook(SimpleNamespace(name="datagen"), flow_run, SimpleNamespace(name="Crashed"))

    assert server.wait(timeout=10) < 0 and not pid_alive(server.pid)
    assert other.poll() is None and pid_alive(other.pid)
    (md,) = artifacts
    assert f"server pid {server.pid} (process group {server.pid}): ended" in md
    assert "`: clean" in md and "holds selected" not in md  # the server was ended before hygiene ran
    assert f"spare pid {other.pid} (" in md and "holds only unselected GPU(s) 5" in md
    rec = runrecord.read(run_id)
    assert rec.servers[0].state == "ended" and rec.cleanup == "Crashed"
    on_disk = json.loads((tmp_path / "state" / "runs" / f"{run_id}.json").read_text())
    assert on_disk["cleanup"] == {"state": "Crashed", "done": True}  # as earlier versions wrote it
    used = [g["used_mib"] for g in sim_gpus.snapshot()["gpus"]]
    assert used == [0, 0, 0, 0, 0, 20000, 0, 0]
