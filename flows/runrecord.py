"""What a flow run started, on disk, so its state hooks and the next run on this host can clean it.

``$DATAGEN_STATE_DIR/runs/<flow_run_id>.json`` holds the run's targets, simulated-GPU file, slot
lease, its own process (``owner``: host, pid, start time) and every server it launched (target,
pid, process group, start time), recorded the moment each process exists. A hook reads it to clean
exactly those; a new run on the same host releases the leases (:func:`release_dead_leases`) and ends
the local servers (:func:`end_dead_servers`) of recorded runs whose flow process is dead.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tasks.config import state_dir
from tasks.files import atomic_write_json
from tasks.procs import ProcessIdentity, process_started, same_process, terminate_group

__all__ = [
    "add_server",
    "dead_runs",
    "end_dead_servers",
    "end_server",
    "owner",
    "process_alive",
    "prune",
    "read",
    "records",
    "release_dead_leases",
    "update",
    "update_server",
]


# Server sessions run in threads of one flow process: each read-modify-write of a record holds this.
_LOCK = threading.RLock()


def _path(flow_run_id: str) -> Path:
    return state_dir() / "runs" / f"{flow_run_id}.json"


def read(flow_run_id: str) -> dict[str, Any]:
    """The record of ``flow_run_id`` ({} when missing or unreadable)."""
    try:
        data = json.loads(_path(flow_run_id).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update(flow_run_id: str | None, **fields: Any) -> None:
    """Merge ``fields`` into the record and write it durably. ``servers`` entries are appended.

    Args:
        flow_run_id: the run (None or "": nothing is recorded).
        fields: top-level keys to set.

    Raises:
        OSError: the record cannot be written.
    """
    if not flow_run_id:
        return
    with _LOCK:
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
    atomic_write_json(path, data, indent=1)


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
    with _LOCK:
        data = read(flow_run_id)
        servers = data.setdefault("servers", [])
        for s in reversed(servers):
            # Servers on several hosts may share a pid: the target tells them apart when given.
            if s.get("pid") == pid and ("target" not in fields or s.get("target") in (None, fields["target"])):
                s.update(fields)
                break
        else:
            servers.append({"pid": pid, **fields})
        _write(flow_run_id, data)


def owner(pid: int | None = None) -> dict[str, Any]:
    """This process (or ``pid``) as recorded: host name, pid and start time."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "started": process_started(pid)}


def process_alive(entry: dict[str, Any]) -> bool:
    """Whether the process an ``owner()`` entry names still runs: same pid and same start time (a
    reused pid is another process). An entry without a start time is judged by its pid alone."""
    try:
        identity = ProcessIdentity(int(entry["pid"]), entry.get("started"))
    except (KeyError, TypeError, ValueError):
        return False
    return same_process(identity)


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


def end_server(entry: dict[str, Any], grace_s: float = 5.0) -> bool:
    """End a recorded local server by process group (``tasks.procs.terminate_group``).

    Only when its pid is still the recorded process (same start time) and still leads the recorded
    group, both checked once before the first signal. Returns whether it was ended (False: not the
    recorded process any more, nothing to do). Raises nothing; a group it cannot signal is left to
    hygiene.

    Args:
        entry: a ``servers`` entry of a record (target, pid, pgid, started).
        grace_s: seconds between SIGTERM and SIGKILL.
    """
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
    terminate_group(pgid, grace_s)
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


RECORD_KEEP_DAYS = 14.0  # a finished run's record is kept this long (for `datagen status`, a post-mortem)
RECORD_KEEP_LAST = 100  # and the newest this many records are kept whatever their age


def finished(data: dict[str, Any]) -> bool:
    """Whether a record asks nothing more of anyone: its flow process is dead (or it names none), its
    slot lease was released (or it took none) and every local server it launched was stopped, ended
    or is gone."""
    own = data.get("owner")
    if isinstance(own, dict) and own.get("host") == socket.gethostname() and process_alive(own):
        return False
    if data.get("lease") and not data.get("lease_released"):
        return False
    return all(s.get("state") in ("ended", "gone", "stopped") for s in data.get("servers") or []
               if isinstance(s, dict) and s.get("target", "local") == "local")


def prune(exclude: str | None = None, *, keep_days: float = RECORD_KEEP_DAYS, keep_last: int = RECORD_KEEP_LAST,
          now: float | None = None) -> list[str]:
    """Delete the records of finished runs (``finished``) older than ``keep_days`` (by the record's
    modification time), beyond the newest ``keep_last``; ``exclude`` (this run) is never deleted.
    Returns the run ids deleted. Never raises."""
    folder = state_dir() / "runs"
    try:
        paths = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    cutoff = (time.time() if now is None else now) - keep_days * 86400
    deleted = []
    for path in paths[keep_last:]:
        try:
            if path.stem == exclude or path.stat().st_mtime >= cutoff:
                continue
            with _LOCK:
                if finished(read(path.stem)):
                    path.unlink()
                    deleted.append(path.stem)
        except OSError:
            continue
    return deleted
