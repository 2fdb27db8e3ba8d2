"""A launched server dies with the run that launched it, however the run ends (``kill -9`` included).

Each server datagen launches gets a leash: a small guardian process that reads a pipe whose only
write end this process holds (not inherited by any child: ``os.pipe`` descriptors are
close-on-exec, and every ``subprocess`` call closes the others). When this process ends in any way,
the kernel closes that end; the guardian reads end-of-file and ends the server's process group as
a stop does: SIGTERM to the leader (SGLang's main process drains and ends its children), then to the
group, SIGKILL to whatever is left after the grace. A normal stop ends the group first and then
lets go of the leash; the guardian finds the group gone and exits at once.

A remote server's guardian runs on its target, its stdin the SSH channel of a local ``ssh``
client whose stdin is the pipe: the run's death closes the client's stdin, ssh passes the EOF on,
and the guardian ends the group there. When the control host loses the target instead, sshd
closes the channel: the same EOF, the same end (datagen had lost that server anyway and relaunches
it elsewhere). Either way no server outlives its run by more than the grace (``LEASH_GRACE_S``).

Unlike a parent-death signal (``PR_SET_PDEATHSIG``, which fires when the *thread* that started the
child ends: Prefect runs tasks in worker threads), the pipe follows the process, works over SSH and
escalates to SIGKILL on its own.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys

from tasks.gpus import _stat as proc_stat
from tasks.targets import Target, parse_target, remote_python, ssh_command

__all__ = ["LEASH_GRACE_S", "LEASH_SCRIPT", "Leash", "leash"]

LEASH_GRACE_S = 20.0  # from the run's death to SIGKILL of what is left; the leader alone gets half

# The guardian (standard library only: it runs in the target's python3). argv: pgid, leader-first
# seconds, grace seconds, the leader's start time ("-": read it at start). It ignores the signals a
# terminal or a session end would send it. The group counts as gone once its leader's pid names a
# process with another start time (/proc stat field 22, in clock ticks): the kernel reuses a group's
# id only after its last member has exited. The start time is read here for a local server, while
# the leader is surely the server: the guardian's own start-up took over a second on a loaded host.
LEASH_SCRIPT = r"""import os, signal, sys, time
pgid, first, grace = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
try:
    while os.read(0, 4096):
        pass
except OSError:
    pass
def started(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
leader = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else started(pgid)
def alive():
    now = started(pgid)
    if now is not None and now != leader:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
def gone_within(t):
    end = time.monotonic() + t
    while time.monotonic() < end:
        if not alive():
            return True
        time.sleep(0.1)
    return not alive()
def send(pid, sig, group):
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except OSError:
        pass
if alive():
    send(pgid, signal.SIGTERM, False)
    if not gone_within(first):
        send(pgid, signal.SIGTERM, True)
        if not gone_within(max(0.0, grace - first)):
            send(pgid, signal.SIGKILL, True)
"""


class Leash:
    """The guardian of one server's process group; ``release()`` lets it go (after a stop)."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int, pgid: int, target: str) -> None:
        self.proc, self.pgid, self.target = proc, pgid, target
        self._fd: int | None = write_fd

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self, wait_s: float = 5.0) -> None:
        """Close the pipe: the guardian ends the group if it still runs (a stop has ended it already,
        so it just exits), and is reaped here. Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass  # still ending the group (a server that ignored the stop): it finishes on its own


def _start_ticks(pid: int) -> str:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot), or "-" when unreadable."""
    st = proc_stat(pid)
    return "-" if st is None else str(st[5])


def leash(target: str | Target, pgid: int, grace_s: float = LEASH_GRACE_S) -> Leash:
    """Put a guardian on process group ``pgid`` on ``target`` (see the module docstring).

    Raises:
        OSError: the guardian (or the local ssh client) cannot be started.
        TargetError: a bad target.
    """
    t = parse_target(target)
    args = [str(pgid), f"{min(grace_s / 2, 10.0):g}", f"{grace_s:g}", _start_ticks(pgid) if t.is_local else "-"]
    if t.is_local:
        argv = [sys.executable, "-c", LEASH_SCRIPT, *args]
    else:
        inner = shlex.join([remote_python(t), "-c", LEASH_SCRIPT, *args])
        line = shlex.join(["pct", "exec", str(t.ctid), "--", "bash", "-c", inner]) if t.kind == "pct" else inner
        argv = [*ssh_command(t, "-T", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"), line]
    read_fd, write_fd = os.pipe()  # both close-on-exec: the guardian gets the read end as its stdin only
    try:
        proc = subprocess.Popen(argv, stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return Leash(proc, write_fd, pgid, str(t))
