"""tasks.procs on real child processes: identity by pid and start time, process-group termination."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tasks.procs import (
    ProcessIdentity,
    group_pids,
    live_pids,
    process_started,
    same_process,
    terminate_group,
)
from tests.support.common import TrackedPids, kill_trees, start_on_pid

# A process-group leader that forks a child; each prints its pid once its SIGTERM disposition is set.
_GROUP = r"""
import os, signal, sys, time
child_ignores, leader_ignores, child_setsid = (a == "1" for a in sys.argv[1:4])
pid = os.fork()
if pid == 0:
    if child_setsid:
        os.setsid()
    if child_ignores:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(1, b"%d\n" % os.getpid())
    while True:
        time.sleep(1)
if leader_ignores:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(1, b"%d\n" % os.getpid())
while True:
    time.sleep(1)
"""


@pytest.fixture
def spawned() -> Iterator[list[int]]:
    """Pids started by a test; SIGKILLed at the end whatever the test did (never a recycled pid)."""
    pids = TrackedPids()
    yield pids
    kill_trees(pids.procs)


def _group(spawned: list[int], *, child_ignores: bool = False, leader_ignores: bool = False,
           child_setsid: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    flags = [str(int(f)) for f in (child_ignores, leader_ignores, child_setsid)]
    leader = subprocess.Popen([sys.executable, "-c", _GROUP, *flags], stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout is not None
    with leader.stdout:
        pids = {int(leader.stdout.readline()), int(leader.stdout.readline())}
    assert leader.pid in pids
    child = (pids - {leader.pid}).pop()
    spawned.extend([leader.pid, child])
    return leader, child


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(spawned: list[int]) -> None:
    leader, child = _group(spawned, child_ignores=True)
    assert group_pids(leader.pid) == sorted([leader.pid, child])
    t0 = time.monotonic()
    end = terminate_group(leader.pid, 0.5, leader=leader)
    took = time.monotonic() - t0
    assert end.ended_by == "SIGKILL" and end.seen == tuple(sorted([leader.pid, child])) and end.survivors == ()
    assert took >= 0.5
    assert leader.returncode == -signal.SIGTERM  # the leader went on the SIGTERM, and was reaped
    assert live_pids([leader.pid, child]) == [] and group_pids(leader.pid) == []


def test_a_group_that_exits_on_sigterm_is_not_sent_sigkill(spawned: list[int]) -> None:
    leader, child = _group(spawned)
    t0 = time.monotonic()
    end = terminate_group(leader.pid, 30.0, leader=leader)
    assert end.ended_by == "SIGTERM" and set(end.seen) == {leader.pid, child}
    assert time.monotonic() - t0 < 10 and leader.returncode == -signal.SIGTERM
    assert terminate_group(leader.pid, 1.0).ended_by == "gone"


def test_first_signal_and_pids_outside_the_group(spawned: list[int]) -> None:
    # with_pids: the child left the group (setsid) but still gets the first signal and is awaited
    leader, child = _group(spawned, leader_ignores=True, child_setsid=True)
    assert group_pids(leader.pid) == [leader.pid]
    end = terminate_group(leader.pid, 5.0, first=signal.SIGINT, with_pids=[child], leader=leader)
    assert end.ended_by == "SIGINT" and live_pids([leader.pid, child]) == []

    # kill_pids: no first signal and not awaited, but SIGKILLed when the group outlives the grace
    leader, child = _group(spawned, leader_ignores=True, child_setsid=True)
    end = terminate_group(leader.pid, 0.3, kill_pids=[child], leader=leader)
    assert end.ended_by == "SIGKILL" and leader.returncode == -signal.SIGKILL
    assert live_pids([child]) == []

    # ...and left alone when the group ends within it
    leader, child = _group(spawned, child_setsid=True)
    end = terminate_group(leader.pid, 5.0, kill_pids=[child], leader=leader)
    assert end.ended_by == "SIGTERM" and live_pids([child]) == [child]


def test_identity_of_a_dead_or_reused_pid_is_not_the_same_process() -> None:
    me = ProcessIdentity.of(os.getpid())
    assert me is not None and same_process(me)
    assert same_process(ProcessIdentity(os.getpid(), None))  # no start time: the pid alone
    assert not same_process(ProcessIdentity(os.getpid(), me.started - 100.0))  # the pid, reused
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert ProcessIdentity.of(gone.pid) is None and process_started(gone.pid) is None
    assert not same_process(ProcessIdentity(gone.pid, None))


def test_a_zombie_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid(), flush=True)"],
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None
        with child.stdout:
            assert int(child.stdout.readline()) == child.pid
        identity = ProcessIdentity(child.pid, None)
        deadline = time.monotonic() + 10
        while same_process(identity) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # not reaped yet
        assert not same_process(identity) and ProcessIdentity.of(child.pid) is None
        assert group_pids(child.pid) == [] and live_pids([child.pid]) == []
        assert terminate_group(child.pid, 1.0).ended_by == "gone"
    finally:
        child.wait()


# A leader that, on SIGTERM, ends its child and exits 0 (a server draining); the child notes a SIGTERM.
_DRAINER = r"""
import os, signal, sys, time
mark = sys.argv[1]
pid = os.fork()
if pid == 0:
    def crash(n, f):
        open(mark, "w").write("child got SIGTERM")
        os._exit(1)
    signal.signal(signal.SIGTERM, crash)
    os.write(1, b"%d\n" % os.getpid())
    while True:
        time.sleep(1)
def drain(n, f):
    time.sleep(0.3)  # draining: a child signalled with the group has long taken its SIGTERM path
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os._exit(0)
signal.signal(signal.SIGTERM, drain)
os.write(1, b"%d\n" % os.getpid())
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("leader_first_s", [0.0, 5.0])
def test_leader_first_lets_the_leader_end_its_group(spawned: list[int], tmp_path, leader_first_s: float) -> None:  # type: ignore[no-untyped-def]
    mark = tmp_path / "mark"
    leader = subprocess.Popen([sys.executable, "-c", _DRAINER, str(mark)], stdout=subprocess.PIPE,
                              start_new_session=True)
    assert leader.stdout is not None
    with leader.stdout:
        pids = {int(leader.stdout.readline()), int(leader.stdout.readline())}
    spawned.extend(pids)
    end = terminate_group(leader.pid, 10.0, leader=leader, leader_first_s=leader_first_s)
    assert end.ended_by == "SIGTERM" and set(end.seen) == pids and live_pids(pids) == []
    if leader_first_s:
        assert leader.returncode == 0 and not mark.exists()
    else:  # the whole group at once: the child takes its SIGTERM path
        assert mark.exists()


def test_a_reaped_leaders_group_id_reused_by_another_process_is_never_signalled(spawned: list[int]) -> None:
    # Our server's group: its leader exits and is reaped (here alone: a member left as a zombie, which
    # this container's PID 1 may never reap, would keep the id in use); then the kernel gives the pid
    # to a stranger that leads its own session (as `datagen up`'s Prefect worker does), so the old
    # group id now names the stranger's group. A member recorded long ago is on that pid too.
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    ours.kill()
    ours.wait(10)
    stranger = start_on_pid(ours.pid, [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        spawned.append(stranger.pid)
        recorded = ProcessIdentity(stranger.pid, started=1.0)
        end = terminate_group(ours.pid, 0.5, leader=ours, kill_pids=[recorded], kill_wait_s=0.5)
        assert end.ended_by == "gone" and end.seen == ()
        assert stranger.poll() is None and group_pids(stranger.pid) == [stranger.pid]
    finally:
        stranger.kill()
        stranger.wait(10)
