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
import dataclasses
import importlib.util
import json
import logging
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
import psutil

from flows import runrecord
from flows.gpulimit import seconds_from_env
from tasks import http
from tasks.config import OWNED_API_ENV, state_dir
from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.procs import process_started, terminate_group

__all__ = [
    "LEASE_STORAGE", "START_TIMEOUT_ENV", "START_TIMEOUT_S", "ApiServerError", "OwnedApi", "end_orphans", "owned_api",
    "start_timeout_s",
]

LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
START_TIMEOUT_ENV = "DATAGEN_API_START_TIMEOUT_S"
START_TIMEOUT_S = 120.0  # a loaded machine needs far more than Prefect's 20 s to migrate and import
_PR_SET_PDEATHSIG = 1
_STALL_FACTOR = 10  # by the clock: a server that has not answered after 10x its CPU bound is stuck


class ApiServerError(DatagenError, RuntimeError):
    """The API server this run starts did not become healthy; the message carries its log tail."""


def start_timeout_s() -> float:
    """The CPU seconds the API server may spend starting before it answers /health:
    ``$DATAGEN_API_START_TIMEOUT_S``, default 120 s (by the clock a busy host waits longer).

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
            data = json.loads(path.read_text())
            entry, owner = runrecord.ServerEntry.from_json(data), runrecord.Owner.from_json(data.get("owner"))
            if entry is None or entry.host != socket.gethostname() or (owner is not None and owner.alive()):
                continue
            if runrecord.end_server(entry, grace_s):
                ended.append(entry.pid)
            path.unlink(missing_ok=True)
            if entry.log:
                Path(entry.log).unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ended


def _bound_socket() -> socket.socket:
    """A loopback socket bound to a free port and not yet listening: the server listens on it, so a
    health probe is refused (not left waiting) until the server is up, and no other process can take
    the port between choosing it and serving on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEADDR: nobody else may bind it
    sock.bind(("127.0.0.1", 0))
    return sock


def _die_with_parent(parent: int) -> Any:
    """``preexec_fn``: SIGTERM when the parent dies; exit at once if it already has."""
    def arm() -> None:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arm if sys.platform.startswith("linux") else None


def _spawn(sock: socket.socket, log: Path) -> subprocess.Popen[bytes]:
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise ApiServerError("prefect is not installed")
    env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
    env.pop("PREFECT_API_URL", None)
    fd = sock.fileno()
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
             "prefect.server.api.server:create_app", "--fd", str(fd), "--log-level", "error", "--lifespan", "on"],
            stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env, close_fds=True, pass_fds=(fd,),
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
        )


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _cpu_s(proc: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        t = proc.cpu_times()
        return float(t.user + t.system + t.children_user + t.children_system)
    return 0.0


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, bound_s: float, log: Path) -> None:
    """Return once ``url``/health answers 200.

    The bound is on the CPU time the server spends starting, not on the clock: on a busy host the
    start takes longer by the clock and the run waits for it; a server that keeps working without
    answering, or that makes no progress for ``_STALL_FACTOR`` x the bound by the clock, fails the run.

    Raises:
        ApiServerError: the server exited, or passed either bound (the message says which).
    """
    started = time.monotonic()
    watched = psutil.Process(proc.pid)
    with http.client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise ApiServerError(f"the Prefect API server exited with status {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            used, waited = _cpu_s(watched), time.monotonic() - started
            if used > bound_s:
                raise ApiServerError(f"the Prefect API server did not answer after {bound_s:g} s of its own CPU "
                                     f"time ({START_TIMEOUT_ENV} raises the bound)")
            if waited > _STALL_FACTOR * bound_s:
                raise ApiServerError(f"the Prefect API server did not answer within {waited:.0f} s, having used "
                                     f"{used:.1f} s of CPU ({START_TIMEOUT_ENV} raises the bound)")
            time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    terminate_group(proc.pid, grace_s, leader=proc)


# How long the end of a run waits for Prefect's queued logs and events to reach the API: seconds on
# an idle host, more on a loaded one (a CI host at load 8 needed more than the 5 s this once was).
DRAIN_S = 30.0


def _drain_prefect() -> None:
    """Send Prefect's queued logs and events while the API still answers, then quiet the workers'
    exit-time warnings ("Still processing items"): what is left cannot be sent any more, and the
    command's own last line (its verdict) must stay last."""
    if "prefect" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogWorker  # noqa: PLC0415  # Prefect is loaded already

        APILogWorker.drain_all(timeout=DRAIN_S)
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker  # noqa: PLC0415  # Prefect is loaded already

        EventsWorker.drain_all(timeout=DRAIN_S)
    for name in ("APILogWorker", "EventsWorker"):  # the services log under their class names
        logging.getLogger(name).setLevel(logging.ERROR)


class OwnedApi:
    """The API server a run uses: ``url`` is known at once (the environment names it before Prefect
    is imported), ``ready()`` waits for it, so a caller imports the flow while the server starts."""

    def __init__(self, url: str | None, proc: subprocess.Popen[bytes] | None = None, bound_s: float = 0.0,
                 log: Path | None = None) -> None:
        self.url, self._proc, self._bound_s, self._log = url, proc, bound_s, log

    def ready(self) -> None:
        """Wait for the server's ``/health`` (at once for a server this run does not own).

        Raises:
            ApiServerError: see ``_wait_healthy``.
        """
        if self._proc is not None and self.url is not None and self._log is not None:
            _wait_healthy(self._proc, self.url, self._bound_s, self._log)


@contextlib.contextmanager
def owned_api() -> Iterator[OwnedApi]:
    """The Prefect API this run uses: when PREFECT_API_URL is unset, one of its own, started here
    (PREFECT_API_URL then names it) and stopped at the end; else the one named (``url`` None).

    Also ends the API servers that dead runs left (``end_orphans``) and sets filesystem lease
    storage for the server it starts. The caller calls ``ready()`` before the first API call.

    Raises:
        ValueError: ``$DATAGEN_API_START_TIMEOUT_S`` is not a positive number.
    """
    end_orphans()
    if os.environ.get("PREFECT_API_URL"):
        try:
            yield OwnedApi(None)
        finally:
            _drain_prefect()
        return
    bound_s = start_timeout_s()
    os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASE_STORAGE)
    folder = _records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{os.getpid()}-{time.time_ns()}.log"
    proc: subprocess.Popen[bytes] | None = None
    record: Path | None = None
    try:
        with _bound_socket() as sock:
            proc = _spawn(sock, log)
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
        record = folder / f"{proc.pid}.json"
        entry = runrecord.ServerEntry(pid=proc.pid, pgid=proc.pid, started=process_started(proc.pid),
                                      host=socket.gethostname(), url=url, log=str(log))
        atomic_write_json(record, {**entry.to_json(), "owner": dataclasses.asdict(runrecord.Owner.of())})
        os.environ["PREFECT_API_URL"] = url
        os.environ[OWNED_API_ENV] = url  # flows/logs.py: its links live only as long as this command
        try:
            yield OwnedApi(url, proc, bound_s, log)
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
