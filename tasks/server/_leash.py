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
import select
import shlex
import socket
import subprocess
import sys

from tasks.gpus import _stat as proc_stat
from tasks.targets import Target, parse_target, remote_python, ssh_command

__all__ = ["ADOPT_SCRIPT", "LEASH_GRACE_S", "LEASH_SCRIPT", "Leash", "adopt", "guardian_state", "leash", "leash_socket"]

LEASH_GRACE_S = 20.0  # from the run's death to SIGKILL of what is left; the leader alone gets half

# The guardian (standard library only: it runs in the target's python3). argv: pgid, leader-first
# seconds, grace seconds, the leader's start time ("-": read it at start). It ignores the signals a
# terminal or a session end would send it. The group counts as gone once its leader's pid names a
# process with another start time (/proc stat field 22, in clock ticks): the kernel reuses a group's
# id only after its last member has exited. The start time is read here for a local server, while
# the leader is surely the server: the guardian's own start-up took over a second on a loaded host.
LEASH_SCRIPT = r"""import os, select, signal, socket, stat, sys, time
pgid, first, grace = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
keep = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
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
listener, path = None, None
if keep > 0:
    d = "/tmp/datagen-leash-%d" % os.getuid()
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        path = os.path.join(d, "leash-%d.sock" % pgid)
        try:
            os.unlink(path)
        except OSError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
owner, deadline = 0, None
while True:
    fds = ([owner] if owner is not None else []) + ([listener] if listener is not None else [])
    ready = select.select(fds, [], [], 1.0 if listener is not None else None)[0]
    if owner is not None and owner in ready:
        try:
            data = os.read(owner, 4096) if owner == 0 else owner.recv(4096)
        except OSError:
            data = b""
        if not data:
            if owner != 0:
                owner.close()
            owner = None
            if listener is None:
                break
            deadline = time.monotonic() + keep
    if listener is not None and listener in ready:
        conn = listener.accept()[0]
        conn.settimeout(5.0)
        try:
            ask = conn.recv(64)
        except OSError:
            ask = b""
        try:
            if ask.startswith(b"adopt") and owner is None and alive():
                conn.sendall(b"adopted\n")
                conn.settimeout(None)
                owner, deadline = conn, None
            else:
                left = "owned" if owner is not None else "waiting %.0f" % max(0.0, deadline - time.monotonic())
                conn.sendall(left.encode() + b"\n")
        except OSError:
            pass
        if owner is not conn:
            conn.close()
    if listener is not None and not alive():
        break
    if owner is None and deadline is not None and time.monotonic() >= deadline:
        break
if path is not None:
    try:
        os.unlink(path)
    except OSError:
        pass
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

# The adopter's side on a remote target (standard library only), run over SSH with the adopting run's
# pipe as its stdin: it asks the guardian of process group argv[1] to take it as the new owner, prints
# the answer, and holds the connection until its stdin ends (the adopting run died or let go) or the
# guardian closes it (the group ended). argv[2] "ping": only ask how the guardian stands.
ADOPT_SCRIPT = r"""import os, select, socket, sys
path = "/tmp/datagen-leash-%d/leash-%d.sock" % (os.getuid(), int(sys.argv[1]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10.0)
try:
    s.connect(path)
    s.sendall(b"ping\n" if sys.argv[2:] == ["ping"] else b"adopt\n")
    answer = s.recv(64).decode(errors="replace").strip()
except OSError as exc:
    answer = "none %s" % exc.__class__.__name__
sys.stdout.write(answer + "\n")
sys.stdout.flush()
if answer == "adopted":
    s.settimeout(None)
    while True:
        ready = select.select([0, s], [], [])[0]
        if s in ready and not s.recv(4096):
            break
        if 0 in ready and not os.read(0, 4096):
            break
"""


def leash_socket(pgid: int) -> str:
    """Where the guardian of process group ``pgid`` (with a grace) listens on its host."""
    return f"/tmp/datagen-leash-{os.getuid()}/leash-{pgid}.sock"


class Leash:
    """The guardian of one server's process group, held through a pipe (the launching run) or an
    adopted connection (``sock``: a run that took over a local server; a remote one holds the pipe
    of its ``ssh`` client). ``release()`` lets it go (after a stop)."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, write_fd: int | None, pgid: int, target: str,
                 sock: socket.socket | None = None) -> None:
        self.proc, self.pgid, self.target = proc, pgid, target
        self._fd: int | None = write_fd
        self._sock = sock

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def release(self, wait_s: float = 5.0) -> None:
        """Let go: the guardian ends the group if it still runs (after its grace, when it has one; a
        stop has ended the group already, so it just exits), and the local helper is reaped here.
        Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self.proc is not None:
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass  # still ending the group (a server that ignored the stop): it finishes on its own


def _start_ticks(pid: int) -> str:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot), or "-" when unreadable."""
    st = proc_stat(pid)
    return "-" if st is None else str(st[5])


def _remote_argv(t: Target, script: str, args: list[str], *ssh_opts: str) -> list[str]:
    inner = shlex.join([remote_python(t), "-c", script, *args])
    line = shlex.join(["pct", "exec", str(t.ctid), "--", "bash", "-c", inner]) if t.kind == "pct" else inner
    return [*ssh_command(t, "-T", *ssh_opts), line]


def leash(target: str | Target, pgid: int, grace_s: float = LEASH_GRACE_S, keep_s: float = 0.0) -> Leash:
    """Put a guardian on process group ``pgid`` on ``target`` (see the module docstring). ``keep_s``:
    how long the group outlives its owner, waiting to be adopted (0: it is ended at once).

    Raises:
        OSError: the guardian (or the local ssh client) cannot be started.
        TargetError: a bad target.
    """
    t = parse_target(target)
    args = [str(pgid), f"{min(grace_s / 2, 10.0):g}", f"{grace_s:g}", _start_ticks(pgid) if t.is_local else "-",
            f"{max(0.0, keep_s):g}"]
    if t.is_local:
        argv = [sys.executable, "-c", LEASH_SCRIPT, *args]
    else:
        argv = _remote_argv(t, LEASH_SCRIPT, args, "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")
    proc, write_fd = _start_held(argv, subprocess.DEVNULL)
    return Leash(proc, write_fd, pgid, str(t))


def _start_held(argv: list[str], stdout: int) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` in a session of its own with a pipe as its stdin; returns it and the pipe's write
    end, held by this process alone (both ends are close-on-exec: the child gets the read end as its
    stdin only), so that the child reads end-of-file when this process dies."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdin=read_fd, stdout=stdout, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return proc, write_fd


def _ask_local(pgid: int, ask: bytes, timeout_s: float) -> tuple[str, socket.socket | None]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(leash_socket(pgid))
        sock.sendall(ask)
        answer = sock.recv(64).decode(errors="replace").strip()
    except OSError as exc:
        sock.close()
        return f"none {type(exc).__name__}", None
    if answer != "adopted":
        sock.close()
        return answer, None
    sock.settimeout(None)
    return answer, sock


def guardian_state(target: str | Target, pgid: int, timeout_s: float = 10.0) -> str:
    """How the guardian of ``pgid`` on ``target`` stands: ``owned``, ``waiting N`` (its owner died;
    it ends the group in N s unless a run adopts it) or ``none ...`` (no guardian with a grace
    listens: gone, or it had none). Never raises."""
    try:
        t = parse_target(target)
        if t.is_local:
            return _ask_local(pgid, b"ping\n", timeout_s)[0]
        out = subprocess.run(_remote_argv(t, ADOPT_SCRIPT, [str(pgid), "ping"]), stdin=subprocess.DEVNULL,
                             capture_output=True, timeout=timeout_s + 20)
        return out.stdout.decode(errors="replace").strip().splitlines()[0] if out.stdout.strip() else "none"
    except Exception as exc:
        return f"none {type(exc).__name__}"


def adopt(target: str | Target, pgid: int, timeout_s: float = 10.0) -> Leash | None:
    """Take over the guardian of ``pgid`` on ``target`` while it waits for a new owner: from now on
    this process's death (or ``release()``) starts its grace again. None when no guardian there
    accepts (gone, owned, or the group ended). Never raises."""
    try:
        t = parse_target(target)
        if t.is_local:
            answer, sock = _ask_local(pgid, b"adopt\n", timeout_s)
            return Leash(None, None, pgid, str(t), sock=sock) if sock is not None else None
        proc, write_fd = _start_held(_remote_argv(t, ADOPT_SCRIPT, [str(pgid)], "-o", "ServerAliveInterval=15",
                                                  "-o", "ServerAliveCountMax=4"), subprocess.PIPE)
        held = Leash(proc, write_fd, pgid, str(t))
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], timeout_s + 20)[0]
        answer = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        proc.stdout.close()
        if answer == "adopted":
            return held
        held.release(wait_s=2.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        return None
    except Exception:
        return None
