"""The leash: a server's process group ends when the process that launched it dies (SIGKILL included),
with SIGKILL after the grace for a server that ignores SIGTERM; a released leash after a stop exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.procs import live_pids
from tasks.server._leash import adopt, guardian_state, leash, leash_socket
from tests.support.common import TrackedPids, kill_trees, past_start_tick, start_on_pid

# A stand-in for a launched server: a leader in its own session with a child, both sleeping; with
# IGNORE, both ignore SIGTERM (a server stuck in its drain).
SERVER = textwrap.dedent("""
    import os, signal, sys, time
    if sys.argv[1] == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(os.getpid(), child, flush=True)
    time.sleep(600)
""")

# The run: launches the server, leashes it, reports the pids, then waits to be killed.
CONTROLLER = textwrap.dedent("""
    import subprocess, sys, time
    from tasks.server._leash import adopt, guardian_state, leash, leash_socket
    server = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
    leader, child = server.stdout.readline().split()
    guard = leash("local", server.pid, grace_s=float(sys.argv[3]), keep_s=float(sys.argv[4]))
    print(leader, child, guard.pid, flush=True)
    time.sleep(600)
""")


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while live_pids(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _controller(mode: str, grace_s: float, keep_s: float = 0.0) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, SERVER, mode, str(grace_s), str(keep_s)],
                            stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[3], start_new_session=True)
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def _close(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _track(pids: list[int]) -> TrackedPids:
    """The processes as they are now, so the cleanup never kills a pid recycled since."""
    tracked = TrackedPids()
    tracked.extend(pids)
    return tracked


def _reap(tracked: TrackedPids) -> None:
    kill_trees(tracked.procs)


def test_the_server_group_ends_when_the_run_is_killed_with_sigkill() -> None:
    proc, (leader, child, guardian) = _controller("drain", grace_s=4.0)
    tracked = _track([leader, child, guardian])
    try:
        assert live_pids([leader, child, guardian]) == [leader, child, guardian]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone([leader, child], within_s=3.0), "SIGTERM to the leader ends a server that drains"
        assert _gone([guardian], within_s=3.0)
    finally:
        _reap(tracked)
        _close(proc)


def test_a_server_ignoring_sigterm_is_killed_after_the_grace() -> None:
    proc, (leader, child, guardian) = _controller("ignore", grace_s=2.0)
    tracked = _track([leader, child, guardian])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        assert _gone([leader, child], within_s=10.0)
        assert time.monotonic() - started >= 1.0  # the leader was given its half of the grace first
        assert _gone([guardian], within_s=3.0)
    finally:
        _reap(tracked)
        _close(proc)


def test_a_released_leash_after_a_stop_exits_and_leaves_nothing() -> None:
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    guard = leash("local", server.pid, grace_s=4.0)
    tracked = _track([server.pid, guard.pid])
    try:
        server.kill()
        server.wait(5)
        started = time.monotonic()
        guard.release()
        assert guard.proc.returncode == 0 and time.monotonic() - started < 3.0
    finally:
        _reap(tracked)


def test_a_leash_never_signals_a_group_id_the_kernel_gave_to_another_process() -> None:
    # The server exits on its own and is reaped; its pid (the group's id) goes to a stranger leading
    # its own session; then the run dies. The guardian must see the group as gone.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    guard = leash("local", server.pid, grace_s=2.0)
    tracked = _track([guard.pid])
    stranger = None
    try:
        # A process is known by pid and start time in clock ticks (10 ms). Real reuse of a pid comes
        # after the kernel has gone through the other 32,767, never within one tick of its first
        # owner's start; forced with ns_last_pid it can, so the stranger starts a tick later.
        past_start_tick()
        server.kill()  # the guardian may not even have started yet
        server.wait(5)
        stranger = start_on_pid(server.pid, [sys.executable, "-c", "import time; time.sleep(600)"],
                                start_new_session=True)
        guard.release()
        assert guard.proc.returncode == 0
        time.sleep(0.3)
        assert stranger.poll() is None, f"the stranger was signalled: exit {stranger.returncode}"
    finally:
        _reap(tracked)
        if stranger is not None:
            stranger.kill()
            stranger.wait(5)


@pytest.mark.slow  # about 15 s: a grace, held past it, then the grace again
def test_a_dead_owners_server_waits_out_its_grace_and_a_new_owner_keeps_it() -> None:
    proc, (leader, child, guardian) = _controller("drain", grace_s=4.0, keep_s=3.0)
    tracked = _track([leader, child, guardian])
    try:
        deadline = time.monotonic() + 5  # the guardian listens once it has started
        while guardian_state("local", leader) != "owned":
            assert time.monotonic() < deadline, guardian_state("local", leader)
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while not guardian_state("local", leader).startswith("waiting "):
            assert time.monotonic() < deadline, guardian_state("local", leader)
            time.sleep(0.05)
        held = adopt("local", leader)
        assert held is not None and guardian_state("local", leader) == "owned"
        assert adopt("local", leader) is None  # one owner at a time
        time.sleep(4.0)  # past the grace: owned, so kept
        assert live_pids([leader, child]) == [leader, child]
        held.release()  # the new owner lets go (or dies): the grace starts again, then the group ends
        assert guardian_state("local", leader).startswith("waiting ")
        assert live_pids([leader, child]) == [leader, child]
        assert _gone([leader, child], within_s=3.0 + 5.0)
        assert _gone([guardian], within_s=3.0)
        assert guardian_state("local", leader).startswith("none") and not Path(leash_socket(leader)).exists()
    finally:
        _reap(tracked)
        _close(proc)


def test_without_a_grace_nothing_listens_and_nothing_can_be_adopted() -> None:
    proc, (leader, child, guardian) = _controller("drain", grace_s=4.0)
    tracked = _track([leader, child, guardian])
    try:
        assert guardian_state("local", leader).startswith("none")
        assert adopt("local", leader) is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone([leader, child], within_s=3.0)
        assert _gone([guardian], within_s=3.0)
    finally:
        _reap(tracked)
        _close(proc)
