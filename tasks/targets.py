"""Where commands run: ``local``, ``ssh://[user@]host[:port]`` or ``pct://[user@]host[:port]/CTID``.

Commands are argv lists, never shell lines; for remote targets this module builds the one quoted
line sshd needs, with a remote ``timeout`` and a closed stdin. Values passed as ``env=`` travel over
the SSH channel's stdin, never on a command line. Settings: ``DATAGEN_SSH_KEY``,
``DATAGEN_SSH_KNOWN_HOSTS`` (when set, unknown or changed host keys are refused),
``DATAGEN_SSH_CONNECT_TIMEOUT`` (seconds, default 10) and ``DATAGEN_REMOTE_ENV`` (see
``remote_env``). A command that runs and fails is not an error: ``CommandResult.exited`` says how it
ended (124 for the timeout).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlsplit

from tasks.errors import DatagenError
from tasks.files import open_below

__all__ = [
    "host_of",
    "on_each",
    "Target",
    "TargetError",
    "TargetUnreachable",
    "CommandResult",
    "parse_target",
    "run_command",
    "start_detached",
    "detached_exit_status",
    "env_script",
    "remote_command_line",
    "remote_env",
    "remote_python",
    "ssh_command",
    "LOCAL",
]

TIMEOUT_EXIT = 124
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TargetError(DatagenError, ValueError):
    """A target string or setting that cannot be used; the message names the offending input."""


class TargetUnreachable(DatagenError, ConnectionError):
    """The target could not be reached or refused us; the message names the target."""

    retryable = True

    def __init__(self, target: Target, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"cannot reach {target}: {reason}")


@dataclass(frozen=True)
class Target:
    """A place to run commands. ``kind`` is "local", "ssh" or "pct"; ``ctid`` only for pct."""

    kind: str = "local"
    host: str | None = None
    user: str | None = None
    port: int = 22
    ctid: int | None = None

    def __str__(self) -> str:
        if self.kind == "local":
            return "local"
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != 22 else ""
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        tail = f"/{self.ctid}" if self.kind == "pct" else ""
        return f"{self.kind}://{user}{host}{port}{tail}"

    @property
    def is_local(self) -> bool:
        return self.kind == "local"


LOCAL = Target()


@dataclass(frozen=True)
class CommandResult:
    exited: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exited == 0


def parse_target(text: str | Target) -> Target:
    """Parse ``local``, ``ssh://[user@]host[:port]`` or ``pct://[user@]host[:port]/CTID``.

    Users, hosts and CTIDs are checked against strict patterns, so no shell metacharacter can hide
    in them.

    Args:
        text: the target string (a ``Target`` is returned as it is).

    Raises:
        TargetError: the text does not parse (the message names it).
    """
    if isinstance(text, Target):
        return text
    raw = text.strip()
    if raw in ("", "local", "localhost"):
        return LOCAL
    m = re.match(r"^(ssh|pct)://(?:([^@/]*)@)?(\[[^\]]*\]|[^:/]*)(?::([^/]*))?(?:/(.*))?$", raw)
    if not m:
        raise TargetError(f"bad target {text!r}: expected local, ssh://[user@]host[:port] or "
                          f"pct://[user@]host[:port]/CTID")
    kind, user, host, port, path = m.groups()
    if user is not None and not _USER_RE.match(user):
        raise TargetError(f"bad target {text!r}: user {user!r} is not a valid user name")
    if host.startswith("["):
        host = host[1:-1]
        try:
            socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            raise TargetError(f"bad target {text!r}: {host!r} is not an IPv6 address") from None
    elif not _HOST_RE.match(host):
        raise TargetError(f"bad target {text!r}: host {host!r} is not a valid host name or address")
    port_no = 22
    if port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise TargetError(f"bad target {text!r}: port {port!r} is not a number in 1-65535")
        port_no = int(port)
    ctid = None
    if kind == "pct":
        if path is None or not path.isdigit() or int(path) <= 0:
            raise TargetError(f"bad target {text!r}: pct targets end in /CTID (a container number)")
        ctid = int(path)
    elif path not in (None, ""):
        raise TargetError(f"bad target {text!r}: ssh targets take no path")
    return Target(kind=kind, host=host, user=user or None, port=port_no, ctid=ctid)


# --------------------------------------------------------------------------- settings


def remote_env() -> dict[str, str]:
    """The ``DATAGEN_REMOTE_ENV`` settings (``NAME=VALUE ...``, shell words) as a dict.

    They are set for every remote command through an ``env`` prefix on the target (inside the
    container for pct), the one place that reliably sets e.g. PATH or DATAGEN_PYTHON remotely
    (sshd refuses most client variables and ``bash -lc`` resets PATH). They are visible on the
    remote command line: settings, never secrets.

    Raises:
        TargetError: the variable does not parse or an entry is not ``NAME=VALUE``.
    """
    raw = os.environ.get("DATAGEN_REMOTE_ENV", "")
    out: dict[str, str] = {}
    try:
        words = shlex.split(raw)
    except ValueError as exc:
        raise TargetError(f"bad DATAGEN_REMOTE_ENV {raw!r}: {exc}") from exc
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or not _ENV_NAME_RE.match(name):
            raise TargetError(f"bad DATAGEN_REMOTE_ENV entry {word!r}: expected NAME=VALUE")
        out[name] = value
    return out


def remote_python(target: Target) -> str:
    """The Python interpreter to use on ``target`` (local: this one)."""
    if target.is_local:
        return sys.executable
    return remote_env().get("DATAGEN_PYTHON") or "python3"


def _connect_timeout() -> int:
    raw = os.environ.get("DATAGEN_SSH_CONNECT_TIMEOUT", "10")
    try:
        value = math.ceil(float(raw))
    except ValueError:
        raise TargetError(f"bad DATAGEN_SSH_CONNECT_TIMEOUT {raw!r}: expected seconds") from None
    return max(1, value)


# --------------------------------------------------------------------------- command lines


def _env_words() -> list[str]:
    """The ``env NAME=VALUE ...`` prefix for DATAGEN_REMOTE_ENV (settings, visible on the line)."""
    settings = remote_env()
    return ["env", *(f"{k}={v}" for k, v in settings.items())] if settings else []


def env_script(env: dict[str, str] | None) -> str:
    """The stdin payload that sets ``env`` on the remote side: one ``export NAME='value'`` line each.

    Raises:
        TargetError: a name is not a shell variable name.
    """
    lines = []
    for name, value in (env or {}).items():
        if not _ENV_NAME_RE.match(name):
            raise TargetError(f"bad environment variable name {name!r}")
        lines.append(f"export {name}={shlex.quote(value)}\n")
    return "".join(lines)


# Reads the export lines from stdin (to EOF), then runs the command with stdin closed. The values
# live only in this shell's memory and the command's environment, never in an argv.
_ENV_FROM_STDIN = 'eval "$(cat)"; exec "$@" </dev/null'


def remote_command_line(target: Target, argv: list[str], timeout_s: float,
                        env: dict[str, str] | None = None) -> str:
    """The exact shell line sent to the SSH host for ``argv`` (exposed for tests and logs).

    With ``env`` the line reads it from stdin (see ``env_script``): no value of ``env`` is in it.
    """
    if not argv:
        raise ValueError("empty command")
    secs = str(max(1, math.ceil(timeout_s)))
    if env:
        env_script(env)  # validate the names before anything runs
        argv = ["sh", "-c", _ENV_FROM_STDIN, "sh", *argv]
    # Without env the command's stdin is closed right here; with it, the wrapper closes it.
    stdin = "" if env else " </dev/null"
    inner = shlex.join(["timeout", "-k", "5", secs, *_env_words(), *argv])
    if target.kind == "pct":
        outer = ["timeout", "-k", "5", str(int(secs) + 10), "pct", "exec", str(target.ctid), "--",
                 "bash", "-lc", inner + stdin]
        return shlex.join(outer) + stdin
    return inner + stdin


def ssh_command(target: Target, *options: str) -> list[str]:
    """An OpenSSH client argv (``ssh [options] -p PORT ... [user@]host``) for ``target`` that
    authenticates as ``run_command`` does: DATAGEN_SSH_KEY, DATAGEN_SSH_KNOWN_HOSTS,
    DATAGEN_SSH_CONNECT_TIMEOUT. Used for what paramiko does not do for us (port forwards).

    Args:
        target: an ``ssh://`` or ``pct://`` target.
        options: further ``ssh`` options, placed before the host.

    Raises:
        TargetError: a local target, or a bad setting.
    """
    if target.is_local:
        raise TargetError("ssh_command needs an ssh:// or pct:// target, not local")
    argv = ["ssh", *options, "-p", str(target.port), "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={_connect_timeout()}"]
    key = os.environ.get("DATAGEN_SSH_KEY")
    if key:
        argv += ["-i", key, "-o", "IdentitiesOnly=yes"]
    known = os.environ.get("DATAGEN_SSH_KNOWN_HOSTS")
    if known:
        argv += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
    return [*argv, f"{target.user}@{target.host}" if target.user else str(target.host)]


def _connection(target: Target) -> Any:
    # fabric, paramiko and invoke are slow to import: only when a remote target is used
    from fabric import Connection  # noqa: PLC0415
    from paramiko import RejectPolicy  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    key = os.environ.get("DATAGEN_SSH_KEY")
    if key:
        kwargs = {"key_filename": key, "allow_agent": False, "look_for_keys": False}
    conn = Connection(target.host, user=target.user, port=target.port,
                      connect_timeout=_connect_timeout(), connect_kwargs=kwargs)
    known = os.environ.get("DATAGEN_SSH_KNOWN_HOSTS")
    if known:
        conn.client.load_host_keys(known)
        conn.client.set_missing_host_key_policy(RejectPolicy())
    return conn


def _open(conn: Any, target: Target) -> None:
    import paramiko  # noqa: PLC0415 (only for remote targets, see _connection)

    try:
        conn.open()
    except paramiko.AuthenticationException as exc:
        raise TargetUnreachable(target, f"authentication failed ({exc})") from exc
    except (paramiko.SSHException, OSError, EOFError) as exc:  # NoValidConnectionsError is an OSError
        raise TargetUnreachable(target, f"{type(exc).__name__}: {exc}") from exc


class _Payload(io.StringIO):
    """stdin for fabric: invoke asks for one byte per 10 ms tick (a 2 KB environment would take
    20 s), so every read hands over all that is left; the final empty read is EOF, which invoke turns
    into the channel's shutdown_write."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


def run_command(target: Target | str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
                stdin_closed: bool = True) -> CommandResult:
    """Run ``argv`` on ``target`` and wait at most ``timeout_s`` for it.

    A command stopped by the timeout returns exited=124.

    Args:
        target: where to run.
        argv: the command, one word per item (never a shell line).
        timeout_s: seconds the command may run.
        env: environment variables to add (locally over ours; remotely over DATAGEN_REMOTE_ENV, sent
            over the channel's stdin, never on a command line).
        stdin_closed: must stay True: commands here never read input.

    Raises:
        TargetError: a bad target or setting.
        TargetUnreachable: the target cannot be connected to.
        ValueError: ``stdin_closed`` is False.
    """
    target = parse_target(target)
    if not stdin_closed:
        raise ValueError("run_command only runs commands with stdin closed")
    if target.is_local:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return CommandResult(TIMEOUT_EXIT, out, err + f"\ntimed out after {timeout_s} s")
        except OSError as exc:  # not found / not executable, as a shell would report it
            return CommandResult(127, "", f"{argv[0]}: {exc}")
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)
    line = remote_command_line(target, argv, timeout_s, env)
    from invoke.exceptions import CommandTimedOut  # noqa: PLC0415 (only for remote targets)

    conn = _connection(target)
    try:
        _open(conn, target)
        try:
            stdin = _Payload(env_script(env)) if env else False
            res = conn.run(line, hide=True, warn=True, in_stream=stdin, echo_stdin=False,
                           timeout=timeout_s + 30)
        except CommandTimedOut as exc:
            return CommandResult(TIMEOUT_EXIT, exc.result.stdout, exc.result.stderr)
        except (OSError, EOFError) as exc:
            raise TargetUnreachable(target, f"connection lost: {exc}") from exc
        # exited == -1: the channel closed without an exit status (connection dropped).
        if res.exited == -1:
            raise TargetUnreachable(target, "connection closed before the command finished")
        return CommandResult(int(res.exited), res.stdout, res.stderr)
    finally:
        conn.close()


# --------------------------------------------------------------------------- detached processes

# Local detached children are kept so they can be reaped (no zombies, no ResourceWarning).
_DETACHED: dict[int, subprocess.Popen[bytes]] = {}

# Runs on the target with `env` already in its environment (sent over stdin by run_command).
_SPAWN = (
    "import json,subprocess,sys\n"
    "a=json.loads(sys.argv[1])\n"
    "log=open(a['log'],'ab')\n"
    "p=subprocess.Popen(a['argv'],stdin=subprocess.DEVNULL,stdout=log,stderr=subprocess.STDOUT,"
    "start_new_session=True)\n"
    "print(p.pid)\n"
)


def start_detached(target: Target | str, argv: list[str], log_path: str,
                   env: dict[str, str] | None = None) -> int:
    """Start ``argv`` on ``target`` as a new session leader (its pid is its process group id),
    stdout+stderr appended to ``log_path`` on the target, stdin closed. Returns its pid.

    Args:
        target: where to run.
        argv: the command (visible in the target's ``ps`` while the spawner runs).
        log_path: the log file on the target (appended to).
        env: added to its environment; remotely it travels over stdin, so secrets may go there.

    Raises:
        TargetError: a bad target or setting.
        TargetUnreachable: the target cannot be connected to.
        ValueError: ``argv`` is empty.
        OSError: locally, the command cannot be executed.
        RuntimeError: remotely, the spawner failed (the message has its output).
    """
    target = parse_target(target)
    if not argv:
        raise ValueError("empty command")
    if target.is_local:
        # handed to the child, closed below; through the log directory's handle, O_NOFOLLOW: a log or
        # log directory planted as a symlink is refused
        log: IO[bytes] = os.fdopen(open_below(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, create_dir=True),
                                   "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        finally:
            log.close()
        _DETACHED[proc.pid] = proc
        return proc.pid
    spec = json.dumps({"argv": argv, "log": log_path})
    res = run_command(target, [remote_python(target), "-c", _SPAWN, spec], timeout_s=60, env=env)
    lines = res.stdout.strip().splitlines()
    if res.exited != 0 or not lines or not lines[-1].isdigit():
        raise RuntimeError(f"starting {shlex.join(argv)} on {target} failed (exit {res.exited}): "
                           f"{(res.stdout + res.stderr).strip()[-2000:]}")
    return int(lines[-1])


def detached_exit_status(pid: int) -> int | None:
    """Exit status of a local process started by `start_detached` (reaping it), None while running
    or when it was not started here. A negative value is the signal that ended it."""
    proc = _DETACHED.get(pid)
    if proc is None:
        return None
    return proc.poll()


def host_of(target: str) -> str:
    """The physical GPU host of a target string (``local`` is this machine; a pct container's
    GPUs belong to its Proxmox host)."""
    if target == "local":
        return socket.gethostname()
    parts = urlsplit(target)
    return parts.hostname or target


def on_each(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``fn`` on every item (a target, a node of a server) at once, each in its own thread: one
    host's SSH round trips do not wait for another's. Returns the results in order, raising the first error once all
    have ended."""
    ranks = list(items)
    results: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(i: int, r: Any) -> None:
        try:
            results[i] = fn(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, r), name=f"datagen-node-{i}", daemon=True)
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
