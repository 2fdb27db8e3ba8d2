"""Local processes: who a recorded pid is, and how a process group is ended.

A pid alone does not name a process for long (the kernel reuses pids), so a process this package
records is kept as a ``ProcessIdentity``: pid plus start time. ``same_process`` says whether that
process still runs; a zombie counts as dead, since it holds no memory and runs no code.

``terminate_group`` ends a process group the one way this package does it: SIGTERM, wait up to a
grace period, SIGKILL whatever is left, wait again. It signals pids outside the group only when the
caller names them, and only while each is still the process it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from tasks.poll import poll_until

__all__ = [
    "START_TOLERANCE_S",
    "GroupEnd",
    "ProcessIdentity",
    "group_pids",
    "live_pids",
    "process_started",
    "same_process",
    "terminate_group",
]

# psutil derives start times from clock ticks since boot: two readings of one process can differ
# by a tick, two different processes on one pid differ by far more.
START_TOLERANCE_S = 0.05


def process_started(pid: int) -> float | None:
    """The start time (seconds since the epoch) of the live local process ``pid``.

    None when there is no such process, it is a zombie, or it cannot be inspected.
    """
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(p.create_time())
    except (psutil.Error, ProcessLookupError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """One local process as recorded: its pid and start time (None: unknown, judged by pid alone)."""

    pid: int
    started: float | None

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of the live process ``pid`` now; None when it is gone or a zombie."""
        started = process_started(pid)
        return None if started is None else cls(pid, started)


def same_process(identity: ProcessIdentity) -> bool:
    """Whether the process ``identity`` names still runs (and is not a zombie).

    A pid now used by a process with another start time is another process: False.

    Args:
        identity: the recorded process; without a start time only the pid is checked.
    """
    started = process_started(identity.pid)
    if started is None:
        return False
    return identity.started is None or abs(float(identity.started) - started) < START_TOLERANCE_S


def live_pids(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that name a live, non-zombie process (sorted)."""
    return sorted(pid for pid in set(pids) if process_started(pid) is not None)


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) members of process group ``pgid`` on this machine (sorted)."""
    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return sorted(pids)


@dataclass(frozen=True)
class GroupEnd:
    """What ``terminate_group`` did.

    ``ended_by`` is "gone" (nothing of the group was alive), the first signal's name (the group
    exited within the grace period) or "SIGKILL". ``seen`` is every pid seen in the group plus the
    caller's ``with_pids``/``kill_pids``; ``survivors`` those still alive after the SIGKILL wait.
    """

    ended_by: str
    seen: tuple[int, ...]
    survivors: tuple[int, ...] = ()


def _signal(pgid: int, procs: Iterable[ProcessIdentity], sig: int) -> None:
    """``sig`` to the group and to each of ``procs`` outside it that is still the recorded process."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) != pgid and same_process(proc):  # never a recycled pid
                os.kill(proc.pid, sig)


def _note(members: Iterable[int], seen: dict[int, ProcessIdentity | None]) -> None:
    """Record each member not seen before as the process it is now (a later SIGKILL goes to that one)."""
    for pid in members:
        if pid not in seen:
            seen[pid] = ProcessIdentity.of(pid)


def _wait(pgid: int, timeout_s: float, seen: dict[int, ProcessIdentity | None], outside: Iterable[ProcessIdentity],
          leader: subprocess.Popen[bytes] | None) -> bool:
    """Poll until no member of ``pgid`` nor of ``outside`` lives and ``leader`` is reaped; True when
    that happened within ``timeout_s``. Members are noted in ``seen``."""
    def gone() -> bool:
        if leader is not None:
            leader.poll()  # reap our own child so it does not linger as a zombie
        members = group_pids(pgid)
        _note(members, seen)
        return (not members and not any(same_process(p) for p in outside)
                and (leader is None or leader.returncode is not None))

    def wait(step: float) -> None:
        if leader is not None and leader.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                leader.wait(timeout=step)  # returns at once when the leader exits
        else:
            time.sleep(step)  # processes we do not parent: nothing to wait on

    return poll_until(gone, timeout_s, 0.02, 0.25, wait)


def _identities(pids: Iterable[int]) -> list[ProcessIdentity]:
    return [i for i in (ProcessIdentity.of(pid) for pid in set(pids)) if i is not None]


def terminate_group(pgid: int, grace_s: float, *, first: int = signal.SIGTERM, kill_wait_s: float = 10.0,
                    with_pids: Iterable[int] = (), kill_pids: Iterable[int | ProcessIdentity] = (),
                    leader: subprocess.Popen[bytes] | None = None, leader_first_s: float = 0.0) -> GroupEnd:
    """End process group ``pgid``: ``first`` to the group, wait up to ``grace_s``, then SIGKILL.

    A pid is signalled only while it is the process it was when the call began (never a recycled
    one). Waiting polls the group; ``leader``, when given, is reaped too.

    Args:
        pgid: the process group id; the caller has checked it still names its group.
        grace_s: seconds the group gets to exit after ``first``.
        first: the first signal (SIGTERM; SIGINT for a process that ignores SIGTERM).
        kill_wait_s: seconds to wait after SIGKILL.
        with_pids: processes treated as members although they may be outside the group (a process
            tree whose children started their own sessions): each gets every signal and is waited on.
        kill_pids: processes SIGKILLed with the group if it outlives ``grace_s``, but neither sent
            ``first`` nor waited on during the grace (members seen earlier that left the group are still
            the caller's); after the SIGKILL they are waited on too, within ``kill_wait_s``. Give
            identities recorded when they were seen: a bare pid is taken as whoever holds it now.
        leader: the ``Popen`` of the group's leader, when this process started it. Once it is reaped
            and its pid names a live process again, the group is gone and that pid is another
            process's (the kernel reuses a group's id only after its last member): the group is then
            not signalled at all, only ``kill_pids`` that are still the processes recorded.
        leader_first_s: when > 0, ``first`` goes to the group's leader alone (pid ``pgid``) and the
            group gets up to this much of ``grace_s`` to exit before ``first`` goes to every member.
            A server whose main process drains on the signal and then ends its children exits
            cleanly that way; children signalled together with it take their crash path.

    Raises nothing: a group that is gone or cannot be signalled counts as ended.
    """
    outside = _identities(with_pids)
    stray_ids = [k if isinstance(k, ProcessIdentity) else ProcessIdentity.of(k) for k in kill_pids]
    strays = [k for k in stray_ids if k is not None]
    if _recycled(pgid, leader):
        return _kill_strays(strays, kill_wait_s)
    members = group_pids(pgid)
    seen: dict[int, ProcessIdentity | None] = {k.pid: k for k in [*outside, *strays]}
    _note(members, seen)
    if not seen and (leader is None or leader.poll() is not None):
        return GroupEnd("gone", ())
    deadline = time.monotonic() + grace_s
    if leader_first_s > 0 and pgid in members:  # still alive and leading its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, first)
        if _wait(pgid, min(leader_first_s, grace_s), seen, outside, leader):
            return GroupEnd(signal.Signals(first).name, tuple(sorted(seen)))
    _signal(pgid, outside, first)
    if _wait(pgid, max(deadline - time.monotonic(), 0.0), seen, outside, leader):
        return GroupEnd(signal.Signals(first).name, tuple(sorted(seen)))
    _note(group_pids(pgid), seen)
    _signal(pgid, [k for k in seen.values() if k is not None], signal.SIGKILL)
    killed_at = time.monotonic()
    _wait(pgid, kill_wait_s, seen, outside, leader)
    # SIGKILL is delivered, not instant: on a loaded host a killed pid outside the group (``kill_pids``)
    # was still alive a moment later. Wait for those too, within the same bound.
    while any(same_process(k) for k in strays) and time.monotonic() - killed_at < kill_wait_s:
        time.sleep(0.02)
    survivors = sorted(k.pid for k in seen.values() if k is not None and same_process(k))
    return GroupEnd("SIGKILL", tuple(sorted(seen)), tuple(survivors))


def _recycled(pgid: int, leader: subprocess.Popen[bytes] | None) -> bool:
    """Whether ``leader`` (the group's reaped leader) no longer owns ``pgid``: a live process holds its pid."""
    return leader is not None and leader.poll() is not None and process_started(pgid) is not None


def _kill_strays(strays: list[ProcessIdentity], wait_s: float) -> GroupEnd:
    """SIGKILL those of ``strays`` still the processes recorded; the group itself is gone."""
    live = [k for k in strays if same_process(k)]
    for k in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(k.pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(same_process(k) for k in live) and time.monotonic() < deadline:
        time.sleep(0.02)
    return GroupEnd("SIGKILL" if live else "gone", tuple(sorted(k.pid for k in live)),
                    tuple(sorted(k.pid for k in live if same_process(k))))
