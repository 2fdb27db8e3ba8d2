"""The server session against the emulator on simulated GPUs, in a real Prefect flow run: it stops
its server whatever ends the session, and relaunches a dead server within the run's budget, then
lets ``ServerGone`` through."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.context import RunContext, RunPlan
from flows.session import ServerSession
from tasks.config import load_partition
from tasks.inference import Endpoint, ServerGone
from tests.support.common import pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer

pytestmark = pytest.mark.slow
FAST_EMU = ["--emu-load-time", "0.2", "--emu-graph-time", "0.05", "--emu-warmup-time", "0.1"]


@pytest.fixture
def api(prefect_server: PrefectServer, tmp_path: Path, sim_gpus: object,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path / "state"))
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        yield


def _partition(tmp: Path, max_relaunches: int) -> str:
    (tmp / "in.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    part = tmp / "session.toml"
    part.write_text(f"""[datasets]
ds = "{tmp / 'in.jsonl'}"
[model]
path = "{REPO_ROOT}/data/models/demo"
[server]
backend = "emulator"
extra_args = {json.dumps(FAST_EMU)}
[run]
max_relaunches = {max_relaunches}
hygiene_grace_s = 1
hang_timeout_s = 0
""")
    return str(part)


def _context(partition: str, tmp: str) -> RunContext:
    cfg = load_partition(partition)
    out = Path(tmp) / "out"
    plan = RunPlan(out_dir=out, root=out, version=None, sim_gpus=os.environ.get("DATAGEN_SIM_GPUS"),
                   log_dir=Path(tmp) / "logs")
    return RunContext.build(cfg, plan, None)


@flow(validate_parameters=False)
def _fails_inside(partition: str, tmp: str, seen: list[int]) -> None:
    with ServerSession(_context(partition, tmp)) as session:
        assert session.handle is not None and session.handle.is_alive()
        seen.append(session.handle.pid)
        raise KeyError("boom")


@flow(validate_parameters=False)
def _server_keeps_dying(partition: str, tmp: str, seen: list[int], succeed_after: int | None,
                        told: list[str] | None = None) -> str:
    with ServerSession(_context(partition, tmp)) as session:
        def work(endpoint: Endpoint, next_relaunch: str) -> str:
            handle = session.handle
            assert handle is not None and endpoint.url == handle.url and endpoint.alive is not None
            seen.append(handle.pid)
            if told is not None:
                told.append(next_relaunch)
            if succeed_after is not None and len(seen) > succeed_after:
                return f"done after {session.relaunches} relaunches"
            os.killpg(handle.pgid, signal.SIGKILL)
            raise ServerGone(f"server {endpoint.url} died")

        return session.run(work)


def test_session_stops_its_server_when_the_work_raises(api: None, tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(KeyError, match="boom"):
        _fails_inside(_partition(tmp_path, 3), str(tmp_path), seen)
    assert len(seen) == 1 and not pid_alive(seen[0])


def test_session_relaunches_within_the_budget_then_lets_server_gone_through(api: None, tmp_path: Path) -> None:
    seen: list[int] = []
    told: list[str] = []
    with pytest.raises(ServerGone, match="died"):
        _server_keeps_dying(_partition(tmp_path, 2), str(tmp_path), seen, None, told)
    assert len(seen) == 3 and len(set(seen)) == 3  # the first server and two relaunches
    assert told == ["relaunch 1/2", "relaunch 2/2", ""]  # what the work is told follows a death
    assert not any(pid_alive(p) for p in seen)


def test_session_resumes_the_work_on_a_relaunched_server(api: None, tmp_path: Path) -> None:
    seen: list[int] = []
    result = _server_keeps_dying(_partition(tmp_path, 3), str(tmp_path), seen, 1)
    assert result == "done after 1 relaunches"
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not any(pid_alive(p) for p in seen)
