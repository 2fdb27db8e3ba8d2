"""The Prefect server on PostgreSQL, two control hosts: `datagen up --database-url` starts a server on a
throwaway PostgreSQL cluster with two deployments, each on its own work pool, and its worker ("host
A"); `datagen worker` starts the second ("host B", its own run and state directories). Two partitions
run at the same time as deployment runs, each through its own worker, and every process is gone
afterwards. A database that cannot be used stops `up` before it starts anything, naming the URL
without its password.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psutil
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tests.support.common import free_port, pid_alive
from tests.support.emulator import FAST_ARGS
from tests.support.paths import REPO_ROOT
from tests.support.postgres import Postgres
from tests.support.prefect import PrefectApi
from tests.support.runs import FAST_EMU, assert_exactly_once, partition

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS = 40
SERVER_HOST = "127.0.0.2"


def _env(base: Path, host: str, **extra: str) -> dict[str, str]:
    """A control host's environment: its own run and state directories, one PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(
        PREFECT_HOME=str(base / "prefect"), DATAGEN_HOME=str(REPO_ROOT),
        DATAGEN_RUN_DIR=str(base / f"run-{host}"), DATAGEN_STATE_DIR=str(base / f"state-{host}"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
        PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


def _datagen(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DATAGEN, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _pid(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / f"{name}.pid").read_text())["pid"])


def _prefect_file(base: Path, parts: dict[str, Path]) -> Path:
    """A prefect.yaml with one deployment per partition, each on a work pool of its own name."""
    deployments = "".join(
        f"  - name: {name}\n    entrypoint: flows/datagen.py:datagen\n"
        f"    parameters: {{partition: {json.dumps(str(path))}}}\n"
        f"    work_pool: {{name: {name}, work_queue_name: default, job_variables: {{}}}}\n"
        for name, path in parts.items())
    f = base / "prefect.yaml"
    f.write_text("name: datagen\nprefect-version: 3.9.1\nbuild: null\npush: null\n"
                 "pull:\n  - flows.home.enter_datagen_home: {}\n" f"deployments:\n{deployments}")
    return f


def _shared_server_partition(tmp: Path, url: str) -> tuple[Path, dict[str, list[str]]]:
    """A partition run against a server someone else runs (``run.server_url``): no launch, no GPU slot."""
    part, ids = partition(tmp, {"beta": ROWS}, [], shard=20, conc=8, max_relaunches=0)
    text = part.read_text().replace("[run]\n", f'[run]\nserver_url = "{url}"\n')
    part.write_text(text)
    return part, ids


@pytest.fixture
def hosts(tmp_path: Path, postgres: Postgres, emulator_factory: Any) -> Iterator[dict[str, Any]]:
    """Host A: `datagen up --database-url` (server on PostgreSQL, pools ``pg-a`` and ``pg-b``, the
    two deployments, a worker on ``pg-a``); host B: `datagen worker --pool pg-b`. Partition ``pg-a``
    launches its own emulator (``local``, simulated GPUs), partition ``pg-b`` uses one this test runs;
    both hold every /generate while their hold file exists. `datagen down` on both hosts afterwards."""
    holds = {"pg-a": tmp_path / "hold-a", "pg-b": tmp_path / "hold-b"}
    for hold in holds.values():
        hold.touch()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    part_a, ids_a = partition(tmp_path / "a", {"alpha": ROWS}, ["--emu-hold-while", str(holds["pg-a"])],
                              shard=20, conc=8, max_relaunches=0, server="\n[sim_gpus]\ncount = 1")
    gpus = SimGpus.init(tmp_path / "b-gpus.json", count=1)
    em = emulator_factory([*FAST_ARGS, *FAST_EMU, "--emu-hold-while", str(holds["pg-b"])],
                          env={ENV_VAR: str(gpus.path)})
    part_b, ids_b = _shared_server_partition(tmp_path / "b", em.url)
    # The server listens on host A's own address (a loopback alias stands in), where host B finds it.
    port = free_port(SERVER_HOST)
    env_a = _env(tmp_path, "a", DATAGEN_PREFECT_PORT=str(port), DATAGEN_PREFECT_HOST=SERVER_HOST)
    env_b = _env(tmp_path, "b")
    api = PrefectApi(f"http://{SERVER_HOST}:{port}/api")
    try:
        up = _datagen(env_a, "up", "--database-url", postgres.url, "--prefect-file",
                      str(_prefect_file(tmp_path, {"pg-a": part_a, "pg-b": part_b})), "--pool", "pg-a", "--name", "host-a")
        assert up.returncode == 0, up.stdout + up.stderr
        worker = _datagen(env_b, "worker", "--pool", "pg-b", "--name", "host-b", "--api-url", f"http://{SERVER_HOST}:{port}/api")
        assert worker.returncode == 0, worker.stdout + worker.stderr
        pids = {"server": _pid(tmp_path / "run-a", "server"), "worker-a": _pid(tmp_path / "run-a", "worker-pg-a"),
                "worker-b": _pid(tmp_path / "run-b", "worker-pg-b"), "emulator-b": em.pid}
        yield {"base": tmp_path, "api": api, "up": up.stdout + up.stderr, "worker": worker.stdout, "holds": holds,
               "out": {"pg-a": tmp_path / "a" / "out", "pg-b": tmp_path / "b" / "out"},
               "ids": {"pg-a": ids_a, "pg-b": ids_b}, "pids": pids, "emulator": em, "port": port}
    finally:
        api.http.close()
        for env in (env_b, env_a):
            down = _datagen(env, "down", timeout=90)
            assert down.returncode == 0, down.stdout + down.stderr


def _wait_held(url_of: Callable[[], str | None], deadline_s: float = 180) -> None:
    """Until the server ``url_of()`` names (None: not yet known) holds a /generate request."""
    deadline = time.monotonic() + deadline_s
    while True:
        url = url_of()
        if url:
            with contextlib.suppress(httpx.HTTPError):
                metrics = httpx.get(f"{url}/metrics", timeout=5).text
                if any(line.startswith("sglang:emu_held_requests") and float(line.split()[-1]) > 0
                       for line in metrics.splitlines()):
                    return
        assert time.monotonic() < deadline, f"no request held at {url} within {deadline_s} s"
        time.sleep(0.2)


def _when(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_two_partitions_run_at_once_on_postgres_through_two_workers(hosts: dict[str, Any], postgres: Postgres) -> None:
    api: PrefectApi = hosts["api"]
    base: Path = hosts["base"]
    masked = postgres.url.replace(f":{postgres.password}@", ":***@")
    assert f"database {masked} (PostgreSQL " in hosts["up"]
    assert "work pools 'pg-a', 'pg-b' (process)" in hosts["up"]
    assert "deployed: datagen/pg-a, datagen/pg-b" in hosts["up"]
    assert f"Prefect UI: http://{SERVER_HOST}:{hosts['port']}\n" in hosts["up"]
    assert postgres.password not in hosts["up"] + hosts["worker"]
    assert not (base / "prefect" / "prefect.db").exists()  # not SQLite

    runs = {name: api.run(f"datagen/{name}") for name in ("pg-a", "pg-b")}
    # Neither run can finish while its hold file exists: both are RUNNING, with requests waiting at
    # their servers, at once before either is let go.
    for run in runs.values():
        api.wait(run, {"RUNNING"}, 180)
    record_a = base / "state-a" / "runs" / f"{runs['pg-a']}.json"
    _wait_held(lambda: next((s["url"] for s in json.loads(record_a.read_text()).get("servers", []) if s.get("url")),
                            None) if record_a.exists() else None)
    _wait_held(lambda: hosts["emulator"].url)
    for hold in hosts["holds"].values():
        hold.unlink()
    states = {name: api.wait(run, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 240) for name, run in runs.items()}
    for name, st in states.items():
        assert st["type"] == "COMPLETED", f"{name}: {st.get('message')}\n{api.logs(runs[name])[-3000:]}"

    for name in runs:
        assert_exactly_once(hosts["out"][name], hosts["ids"][name])
    flow_runs = {name: api.http.get(f"/flow_runs/{run}").raise_for_status().json() for name, run in runs.items()}
    assert {n: fr["work_pool_name"] for n, fr in flow_runs.items()} == {"pg-a": "pg-a", "pg-b": "pg-b"}
    starts = [_when(fr["start_time"]) for fr in flow_runs.values()]
    ends = [_when(fr["end_time"]) for fr in flow_runs.values()]
    assert max(starts) < min(ends), (starts, ends)  # the two runs overlapped
    # Each ran on its own control host: the run record is in that host's state directory only.
    for name, host, other in (("pg-a", "a", "b"), ("pg-b", "b", "a")):
        assert (base / f"state-{host}" / "runs" / f"{runs[name]}.json").exists(), name
        assert not (base / f"state-{other}" / "runs" / f"{runs[name]}.json").exists(), name
    launched = json.loads((base / "state-a" / "runs" / f"{runs['pg-a']}.json").read_text())["servers"][0]["pid"]
    hosts["pids"]["emulator-a"] = launched

    rows = postgres.fetch("SELECT id, state_type::text AS state FROM flow_run WHERE id = ANY($1::uuid[])",
                          [UUID(r) for r in runs.values()])
    assert sorted((str(r["id"]), r["state"]) for r in rows) == sorted((r, "COMPLETED") for r in runs.values())

    assert not pid_alive(launched)  # the flow stopped the emulator it launched
    hosts["emulator"].stop()
    pids = hosts["pids"]
    tree = [c.pid for name in ("server", "worker-a", "worker-b") for c in psutil.Process(pids[name]).children(recursive=True)]
    for env_host in ("b", "a"):
        env = _env(base, env_host)
        down = _datagen(env, "down", timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
    assert [name for name, pid in pids.items() if pid_alive(pid)] == []
    assert [pid for pid in tree if pid_alive(pid)] == []
    assert sorted(p.name for p in (base / "run-a").glob("*.pid")) == sorted(p.name for p in (base / "run-b").glob("*.pid")) == []


def test_up_names_a_database_it_cannot_reach_and_starts_nothing(tmp_path: Path) -> None:
    secret = "s3cret-Pw"
    url = f"postgresql://datagen:{secret}@127.0.0.1:{free_port()}/prefect"
    env = _env(tmp_path, "a", DATAGEN_PREFECT_PORT=str(free_port()))
    up = _datagen(env, "up", "--database-url", url, timeout=120)
    assert up.returncode == 2, up.stdout + up.stderr
    masked = url.replace(secret, "***").replace("postgresql://", "postgresql+asyncpg://")
    assert f"datagen up: server database {masked}: cannot reach PostgreSQL at 127.0.0.1:" in up.stderr
    assert "start it, or fix the URL (--database-url or $PREFECT_SERVER_DATABASE_CONNECTION_URL)" in up.stderr
    assert secret not in up.stdout + up.stderr
    assert not list((tmp_path / "run-a").glob("*.pid"))

    bad = _datagen(env, "up", "--database-url", f"mysql://datagen:{secret}@127.0.0.1/prefect", timeout=120)
    assert bad.returncode == 2 and "scheme 'mysql' is not PostgreSQL" in bad.stderr, bad.stderr
    assert secret not in bad.stdout + bad.stderr


def test_up_names_a_refused_password_and_a_missing_database(tmp_path: Path, postgres: Postgres) -> None:
    env = _env(tmp_path, "a", DATAGEN_PREFECT_PORT=str(free_port()))
    wrong = postgres.url.replace(postgres.password, "not-the-password")
    # The documented variable is the default of --database-url.
    up = _datagen(dict(env, PREFECT_SERVER_DATABASE_CONNECTION_URL=wrong), "up", timeout=120)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "refused user 'datagen' (password authentication failed" in up.stderr, up.stderr
    assert "not-the-password" not in up.stdout + up.stderr
    missing = postgres.url.removesuffix("/prefect") + "/nope"
    up = _datagen(env, "up", "--database-url", missing, timeout=120)
    assert up.returncode == 2, up.stdout + up.stderr
    assert f"has no database 'nope': create it (createdb -h 127.0.0.1 -p {postgres.port} -U datagen nope)" in up.stderr
    assert postgres.password not in up.stdout + up.stderr
    assert not list((tmp_path / "run-a").glob("*.pid"))
