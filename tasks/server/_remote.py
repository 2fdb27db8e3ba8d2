"""Servers on remote targets (``ssh://``, ``pct://``): start detached, forward a port, poll, stop.

The server is started through ``tasks.targets.start_detached`` with its log on the target, still
bound to the target's loopback; datagen reaches it through an SSH local port forward (``ssh -N -L``,
authenticating as tasks.targets does). Binding SGLang to a routable address would expose an API that
is unauthenticated by default to the whole network. The server's environment (the API key and its
bootstrap included) travels over the SSH channel's stdin, so no secret is on any command line of the
target.

For ``pct://`` the server runs in the container, whose loopback is not the Proxmox host's: there
``cfg.host`` must be the container's address as the Proxmox host sees it; the forward goes there.

Errors: ``LaunchFailed`` (kind "unknown") when the port forward does not come up (the started
server's group is killed first); ``TargetError``/``TargetUnreachable`` from tasks.targets;
``RuntimeError`` when the remote spawner fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.poll import Backoff, poll_until
from tasks.server._config import ServerConfig, launch_argv, launch_env, log_file_name
from tasks.server._log import Failure, LaunchFailed
from tasks.targets import Target, parse_target, run_command, ssh_command, start_detached

__all__ = ["RemoteStart", "Tunnel", "is_alive", "kill_group", "open_tunnel", "read_log", "start_remote"]

_CMD_TIMEOUT_S = 30
_ALIVE_TIMEOUT_S = 10.0  # asked on every connection error of the client: answer fast
TUNNEL_DEADLINE_S = 15.0


class Tunnel:
    """A running ``ssh -N -L 127.0.0.1:local_port:host:port`` to a target."""

    def __init__(self, proc: subprocess.Popen[bytes], local_port: int) -> None:
        self.proc = proc
        self.local_port = local_port

    def close(self) -> None:
        """Stop the forward (SIGTERM, SIGKILL after 5 s) and reap it. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@dataclass
class RemoteStart:
    """A server started on a target: its pid (= pgid), its log there, the forward to its port."""

    pid: int
    log_path: str
    tunnel: Tunnel


def start_remote(cfg: ServerConfig, target: Target, fraction: float | None,
                 log_dir: str | os.PathLike[str],
                 on_started: Callable[[int], None] | None = None) -> RemoteStart:
    """Start ``cfg`` detached on ``target`` (log under ``log_dir`` there) and forward a local port
    to it. Does not wait for readiness. ``on_started(pid)`` is called once the server's pid (its
    process group) is known, before the forward is opened; it kills the server if it must.

    Raises TargetError, TargetUnreachable, RuntimeError (the spawner failed), LaunchFailed (the
    forward did not come up; the server's group was killed).
    """
    log_path = f"{log_dir}/{log_file_name(cfg, fraction)}"
    run_command(target, ["mkdir", "-p", str(log_dir)], timeout_s=_CMD_TIMEOUT_S)
    pid = start_detached(target, launch_argv(cfg, fraction), log_path, env=launch_env(cfg, base={}))
    if on_started is not None:
        on_started(pid)
    try:
        tunnel = open_tunnel(target, cfg.host, cfg.port)
    except BaseException:
        with contextlib.suppress(Exception):
            kill_group(target, pid, grace_s=5.0)  # unreachable through us: never leave it running
        raise
    return RemoteStart(pid, log_path, tunnel)


def read_log(target: str | Target, log_path: str, max_bytes: int) -> str:
    """The last ``max_bytes`` of ``log_path`` on ``target`` ("" when unreadable)."""
    res = run_command(parse_target(target), ["tail", "-c", str(max_bytes), log_path], timeout_s=_CMD_TIMEOUT_S)
    return res.stdout


def is_alive(target: str | Target, pid: int) -> bool:
    """Whether ``pid`` runs on ``target``. Dead only when ``ps`` itself says so: no such process
    (exit 1, no output) or a zombie. An SSH failure says nothing about the server, so it reads as
    alive: callers (the inference client, readiness, the hang watchdog) then keep their own retry
    and deadline paths instead of giving a live server up."""
    # `ps -o stat=` tells a zombie apart from a live process; kill -0 would not.
    res = run_command(parse_target(target), ["ps", "-o", "stat=", "-p", str(pid)], timeout_s=_ALIVE_TIMEOUT_S)
    stat = res.stdout.strip()
    if not stat:
        return res.exited != 1
    return not stat.startswith("Z")


def kill_group(target: str | Target, pgid: int, grace_s: float, leader_first_s: float = 0.0) -> None:
    """SIGTERM process group ``pgid`` on ``target``, poll until empty for ``grace_s``, then SIGKILL.

    With ``leader_first_s`` > 0 the leader alone gets the SIGTERM first and the group up to that
    much of ``grace_s`` to exit (as tasks.procs.terminate_group does locally).
    """
    t = parse_target(target)
    deadline = time.monotonic() + grace_s
    if leader_first_s > 0:
        run_command(t, ["kill", "-TERM", "--", str(pgid)], timeout_s=_CMD_TIMEOUT_S)
        if _group_gone(t, pgid, min(leader_first_s, grace_s)):
            return
    run_command(t, ["kill", "-TERM", "--", f"-{pgid}"], timeout_s=_CMD_TIMEOUT_S)
    if not _group_gone(t, pgid, max(0.0, deadline - time.monotonic())):
        run_command(t, ["kill", "-KILL", "--", f"-{pgid}"], timeout_s=_CMD_TIMEOUT_S)


def _group_gone(t: Target, pgid: int, timeout_s: float) -> bool:
    """Poll ``pgrep -g`` until the group is empty (True) or ``timeout_s`` passes."""
    return poll_until(lambda: not run_command(t, ["pgrep", "-g", str(pgid)], timeout_s=_CMD_TIMEOUT_S).stdout.strip(),
                      timeout_s, 0.1, 1.0)


def open_tunnel(target: Target, host: str, port: int) -> Tunnel:
    """Forward a free local loopback port to ``host:port`` as seen from ``target``; returns once the
    local port accepts connections. Raises LaunchFailed (kind "unknown") with ssh's stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local_port = int(s.getsockname()[1])
    argv = ssh_command(target, "-N", "-o", "ExitOnForwardFailure=yes",
                       "-L", f"127.0.0.1:{local_port}:{host}:{port}")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    tunnel = Tunnel(proc, local_port)
    backoff = Backoff(TUNNEL_DEADLINE_S, 0.02, 0.5)

    def wait(step: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(step)  # returns at once when ssh exits

    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
            tunnel.close()
            raise LaunchFailed(Failure("unknown", f"SSH port forward to {target} failed (exit {proc.returncode})",
                                       err.strip()[-300:]), err, command=argv)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", local_port)) == 0:
                return tunnel
        if not backoff.wait(wait):
            break
    tunnel.close()
    raise LaunchFailed(Failure("unknown", f"SSH port forward to {target} not up within {TUNNEL_DEADLINE_S:g} s"),
                       "", command=argv)
