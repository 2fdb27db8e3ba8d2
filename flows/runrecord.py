"""What a flow run started, on disk, for its state hooks and for the next run on this host.

A hook may run in another process (the process worker runs ``on_crashed`` after the flow process
was SIGKILLed), so the flow writes ``$DATAGEN_STATE_DIR/runs/<flow_run_id>.json`` with its targets,
the simulated-GPU file it used, the pid/process group of every server it launched, its
``gpu:<host>`` slot lease and its own process (``owner``: host, pid, start time); the hook reads it
to clean exactly those.

A plain `datagen run` that is SIGKILLed gets no hook, and its lease would block the host until it
expires (``flows.gpulimit.LEASE_S`` plus the API's repossession loop: 60-75 s). So a new run on the
same machine first releases the leases of recorded runs whose flow process is dead
(:func:`release_dead_leases`): same host name, and the pid is gone, a zombie, or now another process
(its start time differs). Limits: only runs that share ``$DATAGEN_STATE_DIR`` are seen, and a run
killed between acquiring the lease and recording it still waits for the expiry.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from tasks.config import state_dir

__all__ = ["clear", "dead_runs", "owner", "process_alive", "read", "release_dead_leases", "update"]


def _path(flow_run_id: str) -> Path:
    return state_dir() / "runs" / f"{flow_run_id}.json"


def read(flow_run_id: str) -> dict[str, Any]:
    try:
        data = json.loads(_path(flow_run_id).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update(flow_run_id: str | None, **fields: Any) -> None:
    """Merge ``fields`` into the record (atomic rename). ``servers`` entries are appended."""
    if not flow_run_id:
        return
    path = _path(flow_run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read(flow_run_id)
    servers = data.get("servers", [])
    for s in fields.pop("servers", []):
        servers.append(s)
    data.update(fields)
    data["servers"] = servers
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def clear(flow_run_id: str | None) -> None:
    if flow_run_id:
        _path(flow_run_id).unlink(missing_ok=True)


def process_started(pid: int) -> float | None:
    """The start time of a live process (psutil's ``create_time``), None when it is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(p.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def owner(pid: int | None = None) -> dict[str, Any]:
    """This process (or ``pid``) as recorded: host name, pid and start time."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "started": process_started(pid)}


def process_alive(entry: dict[str, Any]) -> bool:
    """Whether the process an ``owner()`` entry names still runs: same pid and same start time (a
    reused pid is another process). An entry without a start time is judged by its pid alone."""
    try:
        pid = int(entry["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    started = process_started(pid)
    if started is None:
        return False
    recorded = entry.get("started")
    return recorded is None or abs(float(recorded) - started) < 0.05


def _records() -> Iterator[tuple[str, dict[str, Any]]]:
    folder = state_dir() / "runs"
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.json")):
        data = read(path.stem)
        if data:
            yield path.stem, data


def dead_runs(exclude: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Records of runs started on this machine whose flow process is dead (not ``exclude``)."""
    host = socket.gethostname()
    found = []
    for run_id, data in _records():
        own = data.get("owner")
        if run_id == exclude or not isinstance(own, dict) or own.get("host") != host:
            continue
        if not process_alive(own):
            found.append((run_id, data))
    return found


def release_dead_leases(release: Callable[[str], bool], exclude: str | None = None) -> list[str]:
    """Release the ``gpu:<host>`` slot leases held by dead runs of this machine (see the module
    docstring); each is marked ``lease_released`` so it is tried once. Returns the leases released
    (an already-expired one is not listed). Never raises: a lease it cannot release expires anyway."""
    released = []
    for run_id, data in dead_runs(exclude):
        lease = data.get("lease")
        if not lease or data.get("lease_released"):
            continue
        try:
            ok = release(str(lease))
        except Exception:
            ok = False
        update(run_id, lease_released=True)
        if ok:
            released.append(str(lease))
    return released
