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

Servers: each launch attempt's server is recorded (``servers``: target, pid, pgid, start time) the
moment its process exists (``tasks.server.launch``'s ``on_started``), not once it is ready, so a
flow SIGKILLed while its server loads still leaves a record. The next run on this machine ends
those of dead runs (:func:`end_dead_servers`) by process group, after checking that the pid is
still the recorded process (same start time); never by pattern. Only local servers: a remote
one's start time cannot be checked from here, so its GPUs are left to the before-launch hygiene.
A server whose leader is gone while members of its group live is also left to hygiene (the group
id alone could name another session by now).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from tasks.config import state_dir

__all__ = [
    "add_server",
    "clear",
    "dead_runs",
    "end_dead_servers",
    "end_server",
    "owner",
    "process_alive",
    "read",
    "records",
    "release_dead_leases",
    "update",
    "update_server",
]


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
    data = read(flow_run_id)
    servers = data.get("servers", [])
    for s in fields.pop("servers", []):
        servers.append(s)
    data.update(fields)
    data["servers"] = servers
    _write(flow_run_id, data)


def _write(flow_run_id: str, data: dict[str, Any]) -> None:
    path = _path(flow_run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def add_server(flow_run_id: str | None, target: str, pid: int, pgid: int) -> None:
    """Record a server process the moment it exists (``on_started``): target, pid, process group
    and, for a local one, its start time (what :func:`end_server` checks before signalling)."""
    started = process_started(pid) if target == "local" else None
    update(flow_run_id, servers=[{"target": target, "pid": pid, "pgid": pgid, "started": started,
                                  "host": socket.gethostname(), "state": "starting"}])


def update_server(flow_run_id: str | None, pid: int, **fields: Any) -> None:
    """Merge ``fields`` (url, log, state...) into the recorded server with this pid (appended when
    there is none, e.g. a record written before servers were recorded at start)."""
    if not flow_run_id:
        return
    data = read(flow_run_id)
    servers = data.setdefault("servers", [])
    for s in reversed(servers):
        if s.get("pid") == pid:
            s.update(fields)
            break
    else:
        servers.append({"pid": pid, **fields})
    _write(flow_run_id, data)


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


def records() -> list[tuple[str, dict[str, Any]]]:
    """Every run record of this state directory: ``(flow_run_id, record)``."""
    return list(_records())


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
    docstring); each one ``release`` really released is marked ``lease_released``, so it is not
    tried again. Returns the leases released. Never raises."""
    released = []
    for run_id, data in dead_runs(exclude):
        lease = data.get("lease")
        if not lease or data.get("lease_released"):
            continue
        try:
            ok = release(str(lease))
        except Exception:
            ok = False
        if ok:
            update(run_id, lease_released=True)
            released.append(str(lease))
    return released


def _group(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) members of process group ``pgid`` on this machine."""
    members = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def end_server(entry: dict[str, Any], grace_s: float = 5.0) -> bool:
    """End a recorded local server by process group: only when its pid is still the recorded
    process (same start time, checked just before each signal), SIGTERM the group, wait up to
    ``grace_s``, then SIGKILL it. Returns whether it was ended (False: not the recorded process
    any more, nothing to do). Raises nothing; a group it cannot signal is left to hygiene."""
    if entry.get("target", "local") != "local" or entry.get("started") is None:
        return False  # no start time: a reused pid cannot be told apart, so never signal it
    pid = int(entry["pid"])
    pgid = int(entry.get("pgid") or pid)
    if not process_alive(entry):
        return False
    try:
        if os.getpgid(pid) != pgid:  # the leader left its group: not the recorded server any more
            return False
    except OSError:
        return False
    # Verified once: from here the group id names the same group for as long as it has members
    # (a process group id is not reused while the group exists), even after its leader exited.
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if sig == signal.SIGKILL and not _group(pgid):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        delay = 0.02
        while _group(pgid) and time.monotonic() < deadline:
            time.sleep(delay)  # polling a group we do not parent: nothing to wait on
            delay = min(delay * 2, 0.25)
    return True


def end_dead_servers(exclude: str | None = None, grace_s: float = 5.0) -> list[tuple[str, dict[str, Any]]]:
    """End the recorded local servers of this machine's dead runs (see the module docstring), each
    marked ``state = "ended"`` (or ``"gone"`` when it was not running) so it is looked at once.
    Returns ``(run_id, entry)`` for each server ended. Never raises."""
    ended = []
    for run_id, data in dead_runs(exclude):
        servers = data.get("servers") or []
        changed = False
        for entry in servers:
            if entry.get("state") in ("ended", "gone", "stopped") or entry.get("target", "local") != "local":
                continue
            try:
                done = end_server(entry, grace_s)
            except Exception:
                continue
            entry["state"] = "ended" if done else "gone"
            changed = True
            if done:
                ended.append((run_id, entry))
        if changed:
            fresh = read(run_id)  # merge into the latest record: a hook may have written meanwhile
            fresh["servers"] = servers
            _write(run_id, fresh)
    return ended
