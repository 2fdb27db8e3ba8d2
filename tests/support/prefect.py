"""A real Prefect server for the session (``prefect server start`` on a free loopback port, SQLite under a
temporary PREFECT_HOME, analytics off), stopped by pid at the end: the ``prefect_server`` fixture.

``migrated_home(dest)``: a fresh PREFECT_HOME whose SQLite database is already at Prefect's schema
head, copied from one migrated once per test run (all xdist workers). A plain `datagen run` starts Prefect's
ephemeral API on its PREFECT_HOME, and on an empty one it first runs every database migration
(about 6 s here, more under load); the tests that give each run its own home copy this instead.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from datagen.cmd_up import _stop
from tests.support.common import free_port, scaled
from tests.support.paths import REPO_ROOT

VENV_BIN = Path(sys.executable).parent


@dataclass
class PrefectServer:
    api_url: str
    home: Path
    pid: int
    log: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=str(self.home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            DO_NOT_TRACK="1",
            PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        )
        env.update(extra)
        return env


_TEMPLATE: list[Path] = []  # the migrated home of this test run, made on first use
_TEMPLATE_ROOT: list[Path] = []  # where it is made: shared by the run's xdist workers


@pytest.fixture(scope="session", autouse=True)
def _template_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The run's temporary root (one level above an xdist worker's own): the migrated home is made
    there once for every worker, and pytest's retention of old runs' folders removes it."""
    base = tmp_path_factory.getbasetemp()
    _TEMPLATE_ROOT.append(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


def _template() -> Path:
    """The migrated home, made by the first worker to need it (``prefect server database upgrade -y``,
    under a lock the others wait on) and reused by the rest."""
    if _TEMPLATE:
        return _TEMPLATE[0]
    if _TEMPLATE_ROOT:
        root = _TEMPLATE_ROOT[0]
    else:  # outside a test session
        root = Path(tempfile.mkdtemp(prefix="datagen-prefect-home-"))
        atexit.register(shutil.rmtree, root, True)
    template = root / "prefect-home-template"
    with open(root / "prefect-home-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (template / "prefect.db").is_file():
            work = Path(tempfile.mkdtemp(prefix="prefect-home-", dir=root))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env.update(PREFECT_HOME=str(work), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
            done = subprocess.run([str(VENV_BIN / "prefect"), "server", "database", "upgrade", "-y"], env=env,
                                  capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            assert done.returncode == 0 and (work / "prefect.db").is_file(), done.stdout + done.stderr
            work.rename(template)
    _TEMPLATE.append(template)
    return template


def migrated_home(dest: Path) -> Path:
    """``dest`` made a PREFECT_HOME holding a migrated, empty SQLite database (what an empty home
    holds after its first run's migrations) unless it holds a database already; returns ``dest``. The
    template is made once per test run (``_template``)."""
    if not (dest / "prefect.db").exists():  # a home in use is left as it is
        shutil.copytree(_template(), dest, dirs_exist_ok=True)
    return dest


class PrefectApi:
    """The few REST calls the end-to-end tests make: deployment runs, their states and logs."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def run(self, deployment: str, name: str | None = None, **params: Any) -> str:
        dep = self.http.get(f"/deployments/name/{deployment}").raise_for_status().json()
        deadline = time.monotonic() + 30
        body: dict[str, Any] = {"parameters": params, **({"name": name} if name else {})}
        while True:  # SQLite under a loaded machine answers 503 now and then
            fr = self.http.post(f"/deployments/{dep['id']}/create_flow_run", json=body)
            if fr.status_code != 503 or time.monotonic() > deadline:
                return str(fr.raise_for_status().json()["id"])
            time.sleep(0.5)

    def state(self, run_id: str) -> dict[str, Any]:
        return self.http.get(f"/flow_runs/{run_id}").raise_for_status().json()["state"] or {}

    def wait(self, run_id: str, types: set[str], deadline_s: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + scaled(deadline_s, cap=3.0)  # a loaded machine runs flows slower
        while True:
            st = self.state(run_id)
            if st.get("type") in types:
                return st
            assert time.monotonic() < deadline, f"run {run_id} still {st.get('type')} {st.get('message')}"
            time.sleep(0.3)

    def logs(self, run_id: str) -> str:
        body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200, "sort": "TIMESTAMP_DESC"}
        return "\n".join(r["message"] for r in reversed(self.http.post("/logs/filter", json=body).json()))


def _stop_group(pid: int) -> None:
    """SIGTERM the tree led by ``pid``, SIGKILL what is left after 10 s (the same stop as `datagen down`)."""
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    _stop(proc, signal.SIGTERM, 10.0)


# Loop services no test of this server needs: they wake every few seconds for the whole session.
# No test here schedules a run for later, waits for a run to turn Late, watches a worker go offline
# or a pause expire; the deployment tests' runs are submitted and picked up at once. The repossessor
# stays on: it frees the GPU-slot lease of a run a test SIGKILLed once the lease expires, and the next
# test's run (with a state folder of its own, so it cannot know that run) waits for it. Event
# persistence and triggers stay on (the secrets test reads events; notifications are automations).
_IDLE_SERVICES_OFF = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS")}


def _start_server(home: Path, deadline_s: float) -> tuple[subprocess.Popen[bytes], PrefectServer]:
    """``prefect server start`` on a free port, healthy within ``deadline_s``; stopped again (by pid)
    when it is not."""
    port = free_port()
    log = home / "server.log"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               **_IDLE_SERVICES_OFF)
    env.pop("PREFECT_API_URL", None)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
    server = PrefectServer(f"http://127.0.0.1:{port}/api", home, proc.pid, log)
    deadline = time.monotonic() + deadline_s
    try:
        with httpx.Client(timeout=2) as http:  # one client: each new one builds a TLS context (35 ms of CPU)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"prefect server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    if http.get(f"{server.api_url}/health").status_code == 200:
                        return proc, server
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"prefect server not healthy in {deadline_s:.0f} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
    except BaseException:
        _stop_group(proc.pid)
        proc.wait(timeout=10)
        raise


_SHARED: list[tuple[subprocess.Popen[bytes], PrefectServer]] = []  # this worker's server, once started


def shared_server() -> PrefectServer:
    """This test session's (xdist worker's) Prefect server, started on first use and stopped by pid at
    the end of the session. Its start-up deadline scales with the machine's load, and a start that
    misses it is tried once more (on another port) before the tests that need it fail: one slow start
    must not turn every later test of this worker into an error. Outside a test session (a script
    using these helpers) it is stopped when the interpreter exits."""
    if not _SHARED:
        home = Path(tempfile.mkdtemp(prefix="datagen-prefect-server-"))
        atexit.register(shutil.rmtree, home, True)
        atexit.register(_stop_shared)  # after the session's own stop, this finds nothing left
        migrated_home(home)  # an empty home would first run every migration: about 10 s more
        try:
            _SHARED.append(_start_server(home, scaled(90)))
        except RuntimeError:
            _SHARED.append(_start_server(home, scaled(180)))
    return _SHARED[0][1]


def on_shared_server(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a `datagen` subprocess's) pointed at this session's Prefect server: the run uses it
    as it uses a `datagen up` server, instead of starting an API server of its own (about 8 s of CPU
    each). Tests of the run's own API server (no PREFECT_API_URL) do not use this."""
    env.update(PREFECT_API_URL=shared_server().api_url)
    return env


def _stop_shared() -> None:
    while _SHARED:
        proc, _ = _SHARED.pop()
        _stop_group(proc.pid)
        proc.wait(timeout=10)


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_server() -> Iterator[None]:
    yield
    _stop_shared()


@pytest.fixture(scope="session")
def prefect_server() -> PrefectServer:
    """The session's server (``shared_server``)."""
    return shared_server()


# --- `datagen up` on a spare port (tests/e2e/test_ui.py, test_zombie.py) --------------------------------

DATAGEN_BIN = str(Path(sys.executable).parent / "datagen")
# Settings of the caller's shell that would point `up` elsewhere or change what it keeps.
UP_UNSET = ("PREFECT_API_URL", "DATAGEN_SIM_GPUS", "DATAGEN_NOTIFY_BLOCK", "DATAGEN_SCHEDULE", "DATAGEN_HEARTBEAT_S",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY")


def up_env(base: Path, port: int, **extra: str) -> dict[str, str]:
    """The environment of `datagen up` with DATAGEN_PREFECT_PORT=``port`` and its Prefect home, state
    and run folders under ``base`` (the home pre-migrated: `up`'s server starts without running every
    migration first; an empty home's first start: tests/e2e/test_readme_production.py), workers that
    ask for runs every second, no PREFECT_API_URL; ``extra`` added."""
    env = dict(os.environ, PREFECT_HOME=str(migrated_home(base / "prefect")), DATAGEN_PREFECT_PORT=str(port),
               DATAGEN_HOME=str(REPO_ROOT), DATAGEN_STATE_DIR=str(base / "state"), DATAGEN_RUN_DIR=str(base / "run"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in UP_UNSET:
        env.pop(name, None)
    env.update(extra)
    return env


def datagen_up(env: dict[str, str], *args: str) -> str:
    """`datagen up ARGS` in ``env``; its output (it must exit 0)."""
    up = subprocess.run([DATAGEN_BIN, "up", *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    return up.stdout
