"""The Prefect API server a `datagen run` owns when no other is in use (no PREFECT_API_URL, no
`datagen up` server).

Prefect's own ephemeral API is a child in the caller's process group: a terminal Ctrl-C kills it
before the run can stop cleanly, and a SIGKILLed run leaves it running with parent pid 1. This one
runs the same ASGI app under uvicorn, in its own session (a terminal's SIGINT does not reach it),
with a parent-death signal (Linux: it ends with its run, SIGKILL included), and a record
``$DATAGEN_STATE_DIR/api/<pid>.json`` (server pid and start time, owner run); the next start ends
the servers of dead owners it finds there, pid and start time checked, never by name. Slot leases
go to Prefect's filesystem lease storage under PREFECT_HOME, so an API server started later still
knows (and can release) the lease of a run that died.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from flows import runrecord
from flows.gpulimit import seconds_from_env
from tasks.config import OWNED_API_ENV, state_dir
from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.procs import process_started, terminate_group

__all__ = [
    "LEASE_STORAGE", "START_TIMEOUT_ENV", "START_TIMEOUT_S", "ApiServerError", "end_orphans", "owned_api",
    "start_timeout_s",
]

LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
START_TIMEOUT_ENV = "DATAGEN_API_START_TIMEOUT_S"
START_TIMEOUT_S = 120.0  # a loaded machine needs far more than Prefect's 20 s to migrate and import
_PR_SET_PDEATHSIG = 1
_ADDRESS_IN_USE = 3  # uvicorn's exit status when the port was taken between choosing and binding


class ApiServerError(DatagenError, RuntimeError):
    """The API server this run starts did not become healthy; the message carries its log tail."""


def start_timeout_s() -> float:
    """How long to wait for the API server's /health: ``$DATAGEN_API_START_TIMEOUT_S``, default 120 s.

    Raises:
        ValueError: the variable is not a positive number.
    """
    return seconds_from_env(START_TIMEOUT_ENV, START_TIMEOUT_S)


def _records_dir() -> Path:
    return state_dir() / "api"


def end_orphans(grace_s: float = 5.0) -> list[int]:
    """End the API servers recorded by runs of this machine that are dead (pid and start time of
    both checked); forget records whose server is gone. Returns the pids ended. Never raises."""
    ended = []
    folder = _records_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            if entry.get("host") != socket.gethostname() or runrecord.process_alive(entry.get("owner") or {}):
                continue
            if runrecord.end_server(entry, grace_s):
                ended.append(int(entry["pid"]))
            path.unlink(missing_ok=True)
            Path(str(entry.get("log", ""))).unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ended


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int) -> Any:
    """``preexec_fn``: SIGTERM when the parent dies; exit at once if it already has."""
    def arm() -> None:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arm if sys.platform.startswith("linux") else None


def _spawn(port: int, log: Path) -> subprocess.Popen[bytes]:
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise ApiServerError("prefect is not installed")
    env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
    env.pop("PREFECT_API_URL", None)
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env, close_fds=True,
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
        )


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> int | None:
    """None once ``url``/health answers 200, else the server's exit status.

    Raises:
        ApiServerError: not healthy within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return proc.returncode
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return None
            time.sleep(0.1)
    raise ApiServerError(f"the Prefect API server did not answer within {timeout_s:g} s "
                         f"({START_TIMEOUT_ENV} raises the bound)")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    terminate_group(proc.pid, grace_s, leader=proc)


def _drain_prefect() -> None:
    """Send Prefect's queued logs and events while the API still answers."""
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=5)


@contextlib.contextmanager
def owned_api() -> Iterator[str | None]:
    """Yield the Prefect API this run uses, starting (and at the end stopping) one of its own
    when PREFECT_API_URL is unset; yields None when another server is in use.

    Also ends the API servers that dead runs left (``end_orphans``) and sets filesystem lease
    storage for the server it starts.

    Raises:
        ApiServerError: the server did not become healthy within ``start_timeout_s()``.
    """
    end_orphans()
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    timeout_s = start_timeout_s()
    os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASE_STORAGE)
    folder = _records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{os.getpid()}-{time.time_ns()}.log"
    proc: subprocess.Popen[bytes] | None = None
    record: Path | None = None
    try:
        for _ in range(5):
            port = _free_port()
            proc = _spawn(port, log)
            record = folder / f"{proc.pid}.json"
            url = f"http://127.0.0.1:{port}/api"
            entry = {"target": "local", "host": socket.gethostname(), "pid": proc.pid, "pgid": proc.pid,
                     "started": process_started(proc.pid), "owner": runrecord.owner(), "url": url, "log": str(log)}
            atomic_write_json(record, entry)
            status = _wait_healthy(proc, url, timeout_s)
            if status is None:
                break
            record.unlink(missing_ok=True)
            if status != _ADDRESS_IN_USE:
                raise ApiServerError(f"the Prefect API server exited with status {status}:\n{_tail(log)}")
        else:
            raise ApiServerError(f"the Prefect API server found no free port:\n{_tail(log)}")
        os.environ["PREFECT_API_URL"] = url
        os.environ[OWNED_API_ENV] = url  # flows/logs.py: its links live only as long as this command
        try:
            yield url
        finally:
            _drain_prefect()
            os.environ.pop("PREFECT_API_URL", None)
            os.environ.pop(OWNED_API_ENV, None)
    finally:
        if proc is not None:
            _stop(proc)
        if record is not None:
            record.unlink(missing_ok=True)
        if proc is not None and proc.returncode in (0, -signal.SIGTERM, -signal.SIGKILL):
            log.unlink(missing_ok=True)
