"""What a flow run started, on disk, so its state hooks and the next run on this host can clean it.

``$DATAGEN_STATE_DIR/runs/<flow_run_id>.json`` holds one :class:`RunRecord`: the run's targets and
GPUs, simulated-GPU file, slot lease, its own process (``owner``: host, pid, start time) and every
server it launched (:class:`ServerEntry`: target, pid, process group, start time, state), each
recorded the moment the process exists. A hook reads it to clean exactly those; a new run on the
same host releases the leases (:func:`release_dead_leases`) and ends the local servers
(:func:`end_dead_servers`) of recorded runs whose flow process is dead.

The record is written only by the named changes of this module (:func:`planned`,
:func:`lease_taken`, :func:`lease_released`, :func:`server_started`, :func:`server_ready`,
:func:`server_state`, :func:`cleaned`, :func:`summarised`), each a read-modify-write under one lock.
It holds what recovery needs and the run's summary (``datagen status``, a post-mortem); reports
live in artifacts, not here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import state_dir
from tasks.files import atomic_write_json
from tasks.procs import ProcessIdentity, process_started, same_process, terminate_group
from tasks.server._leash import LEASH_GRACE_S, guardian_state

__all__ = [
    "DEAD_SERVER_GRACE_S",
    "RECORD_KEEP_DAYS",
    "Owner",
    "RunRecord",
    "ServerEntry",
    "adoptable",
    "cleaned",
    "dead_runs",
    "end_dead_servers",
    "end_server",
    "lease_released",
    "lease_taken",
    "planned",
    "prune",
    "read",
    "records",
    "release_dead_leases",
    "server_ready",
    "server_started",
    "ServerState",
    "server_state",
    "summarised",
]

class ServerState(enum.StrEnum):
    """A recorded server's state (its JSON spelling)."""

    STARTING = "starting"  # its process exists, not yet ready
    READY = "ready"  # serving; a dead run's ready server may be adopted
    STOPPED = "stopped"  # by its run
    ENDED = "ended"  # by a hook or a later run
    GONE = "gone"  # found dead
    ADOPTED = "adopted"  # by a later run, whose own record has it from then on


# A server that needs nothing more.
DONE_STATES = frozenset({ServerState.STOPPED, ServerState.ENDED, ServerState.GONE, ServerState.ADOPTED})


@dataclass(frozen=True)
class Owner:
    """A process as recorded: host name, pid and start time (None: unknown)."""

    host: str
    pid: int
    started: float | None = None

    @classmethod
    def of(cls, pid: int | None = None) -> Owner:
        """This process (or ``pid``) on this host."""
        pid = os.getpid() if pid is None else pid
        return cls(socket.gethostname(), pid, process_started(pid))

    @classmethod
    def from_json(cls, data: Any) -> Owner | None:
        if not isinstance(data, Mapping):
            return None
        try:
            started = data.get("started")
            return cls(str(data.get("host", "")), int(data["pid"]), float(started) if started is not None else None)
        except (KeyError, TypeError, ValueError):
            return None

    def alive(self) -> bool:
        """Whether the process still runs: same pid and same start time (a reused pid is another
        process); without a start time it is judged by its pid alone."""
        return same_process(ProcessIdentity(self.pid, self.started))

    def here(self) -> bool:
        return self.host == socket.gethostname()


@dataclass
class ServerEntry:
    """A server process a run launched (or an API server a command started)."""

    pid: int
    target: str = "local"
    pgid: int | None = None
    started: float | None = None  # the local process's start time: what ``end_server`` checks
    host: str = ""
    state: str | None = None  # starting | ready | stopped | ended | gone (None: recorded before states were)
    url: str | None = None
    log: str | None = None
    # what a later run needs to adopt it (flows/fleet.py): its plan's key, port on its target, fraction
    plan: str | None = None
    port: int | None = None
    fraction: float | None = None

    @classmethod
    def from_json(cls, data: Any) -> ServerEntry | None:
        if not isinstance(data, Mapping):
            return None
        try:
            pgid, started = data.get("pgid"), data.get("started")
            return cls(pid=int(data["pid"]), target=str(data.get("target") or "local"),
                       pgid=int(pgid) if pgid is not None else None,
                       started=float(started) if started is not None else None,
                       host=str(data.get("host") or ""), state=data.get("state"), url=data.get("url"),
                       log=data.get("log"), plan=data.get("plan"),
                       port=int(data["port"]) if data.get("port") is not None else None,
                       fraction=float(data["fraction"]) if data.get("fraction") is not None else None)
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def local(self) -> bool:
        return self.target == "local"

    @property
    def done(self) -> bool:
        return self.state in DONE_STATES


@dataclass
class RunRecord:
    """One flow run's record (the module docstring); absent fields are None/empty."""

    partition: str | None = None
    targets: list[str] | None = None  # None: the run stopped before it planned its servers
    out_dir: str | None = None
    sim_gpus: str | None = None
    shared_server: bool = False
    gpus: list[int] | None = None
    target_gpus: dict[str, list[int]] = field(default_factory=dict)
    owner: Owner | None = None  # the flow process holding the lease
    lease: str | None = None
    lease_released: bool = False
    servers: list[ServerEntry] = field(default_factory=list)
    cleanup: str | None = None  # the state the cleanup hook ran for
    summary: dict[str, Any] | None = None  # flows.summary.RunSummary.to_dict()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        cleanup = data.get("cleanup")
        targets, gpus = data.get("targets"), data.get("gpus")
        return cls(
            partition=data.get("partition"),
            targets=[str(t) for t in targets] if isinstance(targets, list) else None,
            out_dir=data.get("out_dir"), sim_gpus=data.get("sim_gpus"),
            shared_server=bool(data.get("shared_server")),
            gpus=[int(g) for g in gpus] if isinstance(gpus, list) else None,
            target_gpus={str(t): [int(g) for g in gs] for t, gs in (data.get("target_gpus") or {}).items()},
            owner=Owner.from_json(data.get("owner")),
            lease=str(data["lease"]) if data.get("lease") else None,
            lease_released=bool(data.get("lease_released")),
            servers=[e for e in map(ServerEntry.from_json, data.get("servers") or []) if e is not None],
            cleanup=cleanup.get("state") if isinstance(cleanup, Mapping) else None,
            summary=data.get("summary") if isinstance(data.get("summary"), dict) else None,
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "partition": self.partition, "targets": self.targets, "out_dir": self.out_dir,
            "sim_gpus": self.sim_gpus, "shared_server": self.shared_server, "gpus": self.gpus,
            "target_gpus": self.target_gpus,
            "owner": dataclasses.asdict(self.owner) if self.owner is not None else None,
            "lease": self.lease, "lease_released": self.lease_released,
            "servers": [s.to_json() for s in self.servers],
            "cleanup": {"state": self.cleanup, "done": True} if self.cleanup is not None else None,
            "summary": self.summary,
        }
        return {k: v for k, v in data.items() if v is not None}

    def server(self, pid: int, target: str | None = None) -> ServerEntry | None:
        """The last recorded server with this pid (and target, when given: hosts may share pids)."""
        for s in reversed(self.servers):
            if s.pid == pid and (target is None or s.target == target):
                return s
        return None

    def finished(self) -> bool:
        """Whether it asks nothing more of anyone: its flow process is dead (or it names none), its
        slot lease was released (or it took none) and every local server it launched was stopped,
        ended or is gone."""
        if self.owner is not None and self.owner.here() and self.owner.alive():
            return False
        if self.lease and not self.lease_released:
            return False
        return all(s.done for s in self.servers if s.local)


# Server sessions run in threads of one flow process: each read-modify-write of a record holds this.
_LOCK = threading.RLock()


def _path(flow_run_id: str) -> Path:
    return state_dir() / "runs" / f"{flow_run_id}.json"


def read(flow_run_id: str) -> RunRecord:
    """The record of ``flow_run_id`` (an empty one when missing or unreadable)."""
    try:
        data = json.loads(_path(flow_run_id).read_text())
    except (OSError, ValueError):
        return RunRecord()
    return RunRecord.from_json(data) if isinstance(data, dict) else RunRecord()


def _write(flow_run_id: str, record: RunRecord) -> None:
    path = _path(flow_run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record.to_json(), indent=1)


def _change(flow_run_id: str | None, change: Callable[[RunRecord], object]) -> None:
    """Apply ``change`` to the record and write it durably (None or "": nothing is recorded).

    Raises:
        OSError: the record cannot be written.
    """
    if not flow_run_id:
        return
    with _LOCK:
        record = read(flow_run_id)
        change(record)
        _write(flow_run_id, record)


# -- the changes ------------------------------------------------------------------------------------

def planned(flow_run_id: str | None, *, partition: str, targets: list[str], out_dir: str, sim_gpus: str | None,
            shared_server: bool, gpus: list[int], target_gpus: dict[str, list[int]]) -> None:
    """The run's plan: where it writes and which targets and GPUs it may use (the hook cleans those)."""
    def change(r: RunRecord) -> None:
        r.partition, r.targets, r.out_dir, r.sim_gpus = partition, list(targets), out_dir, sim_gpus
        r.shared_server, r.gpus, r.target_gpus = shared_server, list(gpus), dict(target_gpus)
    _change(flow_run_id, change)


def lease_taken(flow_run_id: str | None, lease: str, owner: Owner | None = None) -> None:
    """The run holds the ``gpu:<host>`` slots under ``lease``, from this process (or ``owner``)."""
    def change(r: RunRecord) -> None:
        r.lease, r.owner, r.lease_released = lease, owner or Owner.of(), False
    _change(flow_run_id, change)


def lease_released(flow_run_id: str | None) -> None:
    """The lease was released: nobody need try again."""
    _change(flow_run_id, lambda r: setattr(r, "lease_released", True))


def server_started(flow_run_id: str | None, target: str, pid: int, pgid: int) -> None:
    """A server process exists (``on_started``): recorded before it is ready, with its process group
    and, for a local one, its start time (what :func:`end_server` checks before signalling)."""
    entry = ServerEntry(pid=pid, target=target, pgid=pgid, started=process_started(pid) if target == "local" else None,
                        host=socket.gethostname(), state=ServerState.STARTING)
    _change(flow_run_id, lambda r: r.servers.append(entry))


def server_ready(flow_run_id: str | None, pid: int, *, target: str, pgid: int, url: str, log: str,
                 plan: str | None = None, port: int | None = None, fraction: float | None = None) -> None:
    """The server answers at ``url`` (appended when not recorded at start); ``plan``, ``port`` and
    ``fraction`` let a later run adopt it should this one die (:func:`adoptable`)."""
    def change(r: RunRecord) -> None:
        entry = r.server(pid, target) or r.server(pid)
        if entry is None:
            entry = ServerEntry(pid=pid, target=target, host=socket.gethostname())
            r.servers.append(entry)
        entry.target, entry.pgid, entry.url, entry.log, entry.state = target, pgid, url, log, ServerState.READY
        entry.plan, entry.port, entry.fraction = plan, port, fraction
    _change(flow_run_id, change)


def server_state(flow_run_id: str | None, pid: int, state: ServerState, target: str | None = None) -> None:
    """The recorded server with this pid (and target) is ``state`` now: stopped, ended or gone."""
    def change(r: RunRecord) -> None:
        entry = r.server(pid, target)
        if entry is not None:
            entry.state = state
    _change(flow_run_id, change)


def cleaned(flow_run_id: str | None, state: str, released: bool) -> None:
    """The cleanup hook ran for the run's final ``state``; ``released``: it released the lease."""
    def change(r: RunRecord) -> None:
        r.cleanup = state
        r.lease_released = r.lease_released or released
    _change(flow_run_id, change)


def summarised(flow_run_id: str | None, summary: dict[str, Any]) -> None:
    """The run's summary (``RunSummary.to_dict()``)."""
    _change(flow_run_id, lambda r: setattr(r, "summary", summary))


# -- readers and recovery ---------------------------------------------------------------------------

def records() -> list[tuple[str, RunRecord]]:
    """Every run record of this state directory: ``(flow_run_id, record)``."""
    folder = state_dir() / "runs"
    if not folder.is_dir():
        return []
    return [(path.stem, read(path.stem)) for path in sorted(folder.glob("*.json"))]


def dead_runs(exclude: str | None = None) -> list[tuple[str, RunRecord]]:
    """Records of runs started on this machine whose flow process is dead (not ``exclude``)."""
    return [(run_id, r) for run_id, r in records()
            if run_id != exclude and r.owner is not None and r.owner.here() and not r.owner.alive()]


def release_dead_leases(release: Callable[[str], bool], exclude: str | None = None) -> list[str]:
    """Release the ``gpu:<host>`` slot leases held by dead runs of this machine (see the module
    docstring); each one ``release`` really released is marked released, so it is not tried again.
    Returns the leases released. Never raises."""
    released = []
    for run_id, record in dead_runs(exclude):
        if not record.lease or record.lease_released:
            continue
        try:
            ok = release(record.lease)
        except Exception:
            ok = False
        if ok:
            lease_released(run_id)
            released.append(record.lease)
    return released


def end_server(entry: ServerEntry, grace_s: float = 5.0) -> bool:
    """End a recorded local server by process group (``tasks.procs.terminate_group``).

    Only when its pid is still the recorded process (same start time) and still leads the recorded
    group, both checked once before the first signal. Returns whether it was ended (False: not the
    recorded process any more, nothing to do). Raises nothing; a group it cannot signal is left to
    hygiene.
    """
    if not entry.local or entry.started is None:
        return False  # no start time: a reused pid cannot be told apart, so never signal it
    pgid = entry.pgid or entry.pid
    if not same_process(ProcessIdentity(entry.pid, entry.started)):
        return False
    try:
        if os.getpgid(entry.pid) != pgid:  # the leader left its group: not the recorded server any more
            return False
    except OSError:
        return False
    # Verified once: from here the group id names the same group for as long as it has members
    # (a process group id is not reused while the group exists), even after its leader exited.
    terminate_group(pgid, grace_s)
    return True


def adoptable(exclude: str | None, target: str, plan: str) -> list[tuple[str, ServerEntry]]:
    """The ready servers of this machine's dead runs on ``target`` launched for ``plan`` (the same
    model, flags, GPUs and row fingerprint: tasks.server.task.plan_key), newest run first: what a new
    run may adopt while their guardians wait out their grace."""
    found = [(run_id, e) for run_id, r in dead_runs(exclude) for e in r.servers
             if e.state == ServerState.READY and e.target == target and e.plan == plan and e.port is not None]
    return list(reversed(found))


def end_dead_servers(exclude: str | None = None, grace_s: float = 5.0) -> list[tuple[str, ServerEntry]]:
    """End the recorded local servers of this machine's dead runs (see the module docstring), each
    marked ended (or gone when it was not running) so it is looked at once; a server whose guardian
    still waits out its grace is left to the run that adopts it, or to its guardian. Returns
    ``(run_id, entry)`` for each server ended. Never raises."""
    ended = []
    for run_id, record in dead_runs(exclude):
        for entry in record.servers:
            if entry.done or not entry.local:
                continue
            if entry.state == ServerState.READY and guardian_state(entry.target, entry.pgid or entry.pid).startswith("waiting"):
                continue
            try:
                done = end_server(entry, grace_s)
            except Exception:
                continue
            # Into the latest record: a hook may have written meanwhile.
            server_state(run_id, entry.pid, ServerState.ENDED if done else ServerState.GONE, entry.target)
            if done:
                ended.append((run_id, entry))
    return ended


# A dead run's server is ended with the grace its guardian gives it (tasks.server._leash): what the new
# run's partition says about its own servers does not apply to another run's.
DEAD_SERVER_GRACE_S = LEASH_GRACE_S
RECORD_KEEP_DAYS = 14.0  # a finished run's record is kept this long (for `datagen status`, a post-mortem)
RECORD_KEEP_LAST = 100  # and the newest this many records are kept whatever their age


def prune(exclude: str | None = None, *, keep_days: float = RECORD_KEEP_DAYS, keep_last: int = RECORD_KEEP_LAST,
          now: float | None = None) -> list[str]:
    """Delete the records of finished runs (``RunRecord.finished``) older than ``keep_days`` (by the
    record's modification time), beyond the newest ``keep_last``; ``exclude`` (this run) is never
    deleted. Returns the run ids deleted. Never raises."""
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
                if read(path.stem).finished():
                    path.unlink()
                    deleted.append(path.stem)
        except OSError:
            continue
    return deleted

