"""SGLang server lifecycle: launch in its own session, readiness, and a clean stop.

Readiness is ``/health_generate`` answering 200 while the launched process lives; a stop is a
SIGTERM to the main process, then to its process group, then SIGKILL, followed by GPU hygiene. Why: docs/decisions/03-server-launch.md, 05-api-key.md.

Errors::

    ServerError
    ├── ServerConfigError   the config is invalid (raised by ServerConfig itself)
    ├── LaunchFailed        the server exited, hung past the deadline, or could not be started;
    │                       carries .failure, .log_tail, .exit_status, .attempts, .log_path
    └── StopFailed          the group was killed but hygiene did not verify the GPUs clean
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from tasks import http
from tasks.files import open_below
from tasks.hygiene import clean_gpus
from tasks.poll import Backoff
from tasks.procs import ProcessIdentity, group_pids, live_pids, same_process, terminate_group
from tasks.server import _remote as server_remote
from tasks.server._config import (
    API_KEY_ENV,
    BOOTSTRAP_ENV,
    SPECULATIVE_ALGORITHMS,
    ServerConfig,
    ServerConfigError,
    ServerError,
    build_command,
    flag_value,
    format_fraction,
    launch_argv,
    launch_env,
    log_file_name,
    redact,
    server_flags,
)
from tasks.server._leash import Leash, adopt, leash
from tasks.server._log import (
    Failure,
    FailureKind,
    LaunchFailed,
    StartupProgress,
    classify_failure,
    effective_fraction,
    explanation,
    log_tail,
    parse_progress,
)
from tasks.server._port import bind_refused, describe_holders, held_by, listeners_on
from tasks.targets import TargetUnreachable, host_of, on_each, parse_target, run_command, start_detached

__all__ = [
    "API_KEY_ENV",
    "BOOTSTRAP_ENV",
    "SPECULATIVE_ALGORITHMS",
    "Failure",
    "FailureKind",
    "HygieneFn",
    "LaunchFailed",
    "NodeRank",
    "ServerConfig",
    "ServerConfigError",
    "ServerError",
    "ServerHandle",
    "StartupProgress",
    "StopFailed",
    "build_command",
    "classify_failure",
    "effective_fraction",
    "format_fraction",
    "launch",
    "launch_argv",
    "launch_env",
    "parse_progress",
    "redact",
    "server_flags",
    "stop_server",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Handle and errors


@dataclass(eq=False)
class NodeRank:
    """Node ``rank`` (1..) of a server over several nodes: the same command as node 0 with its own
    ``--node-rank``, leading its own session on its node, on its own leash (tasks/server/_leash.py).
    It serves no HTTP: SGLang's node ranks >= 1 run their schedulers only."""

    rank: int
    target: str
    pid: int
    log_path: str
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _leash: Leash | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return host_of(self.target)

    def is_alive(self) -> bool:
        """Whether its main process runs. A node that cannot be reached reads as alive (unknown, as
        _remote.is_alive reads an SSH failure): node 0's hang watchdog and the host checks of the
        lifecycle handle a lost node; the rank watch acts only on a rank seen gone."""
        if self._popen is not None:
            return self._popen.poll() is None
        if not _is_local(self.target):
            try:
                return server_remote.is_alive(self.target, self.pid)
            except TargetUnreachable:
                return True
        return bool(live_pids([self.pid]))

    def read_log(self, max_bytes: int = 4 << 20) -> str:
        if not _is_local(self.target):
            return server_remote.read_log(self.target, self.log_path, max_bytes)
        return _tail(self.log_path, max_bytes)

    def kill(self, grace_s: float, leader_first_s: float) -> list[int]:
        """End its process group as a stop ends node 0's; returns the pids seen."""
        if _is_local(self.target):
            return list(terminate_group(self.pid, grace_s, leader=self._popen, leader_first_s=leader_first_s).seen)
        server_remote.kill_group(self.target, self.pid, grace_s, leader_first_s)
        return [self.pid]

    def release(self) -> None:
        if self._leash is not None:
            with contextlib.suppress(Exception):
                self._leash.release()
            self._leash = None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "target": self.target, "pid": self.pid, "log_path": self.log_path}


@dataclass(eq=False)
class ServerHandle:
    """A server datagen started and saw ready. ``pid`` leads its own session: ``pgid == pid``."""

    pid: int
    pgid: int
    url: str
    log_path: str
    fraction: float | None
    target: str
    command: list[str]
    gpus: list[int]
    progress: StartupProgress
    ready_s: float
    _members: list[ProcessIdentity] = field(default_factory=list, repr=False)  # group members seen at readiness
    api_key: str | None = field(default=None, repr=False)
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tunnel: server_remote.Tunnel | None = field(default=None, repr=False)
    _leash: Leash | None = field(default=None, repr=False)  # ends the group if this process dies
    ranks: list[NodeRank] = field(default_factory=list)  # nodes 1.. of a server over several nodes
    lost_rank: NodeRank | None = None  # the node rank whose death took the server down (the watchdog's)

    def dead_rank(self) -> NodeRank | None:
        """The first node rank >= 1 whose process has ended (None: all run, or one host)."""
        return next((r for r in self.ranks if not r.is_alive()), None)

    @property
    def member_pids(self) -> list[int]:
        """The group's members seen at readiness (their start times in ``_members``)."""
        return [i.pid for i in self._members]

    @property
    def headroom_gib(self) -> float | None:
        return self.progress.headroom_gib

    @property
    def is_remote(self) -> bool:
        """Whether the server runs on another host (every query goes over SSH)."""
        return self._popen is None and not _is_local(self.target)

    def is_alive(self) -> bool:
        """Whether the server's main process still runs (a zombie counts as dead), and over several
        nodes every node's: one rank gone is the whole server gone (its collectives hang)."""
        return self._head_alive() and self.dead_rank() is None

    def _head_alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        if self.is_remote:
            return server_remote.is_alive(self.target, self.pid)
        return bool(live_pids([self.pid]))

    def route_open(self) -> bool:
        """Whether the way to the server is open: a remote server's SSH port forward still runs
        (always True for a local server)."""
        return self._tunnel is None or self._tunnel.proc.poll() is None

    def reachable_and_alive(self) -> bool:
        """Whether requests can reach a live server: its route is open and its process lives."""
        return self.route_open() and self.is_alive()

    def exit_status(self) -> int | None:
        """The main process's exit status (negative: killed by that signal); None while alive/unknown."""
        return self._popen.poll() if self._popen is not None else None

    def read_log(self, max_bytes: int = 4 << 20) -> str:
        """The server log (its last ``max_bytes``), from the target (node 0's over several nodes)."""
        if self.is_remote:
            return server_remote.read_log(self.target, self.log_path, max_bytes)
        return _tail(self.log_path, max_bytes)

    def failure(self) -> tuple[NodeRank | None, str, int | None]:
        """Where to read why the server ended: the node rank >= 1 whose death took it down (the
        watchdog's ``lost_rank``), else the first one gone (its log; its status is not known here),
        else node 0 (its log and exit status)."""
        dead = self.lost_rank or self.dead_rank()
        if dead is not None:
            try:
                return dead, dead.read_log(), None
            except Exception as exc:  # its node may be the one lost
                return dead, f"(log of node {dead.rank} unreadable: {exc})", None
        return None, self.read_log(), self.exit_status()

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "pgid": self.pgid, "url": self.url, "log_path": self.log_path,
            "fraction": self.fraction, "target": self.target, "headroom_gib": self.headroom_gib,
            "progress": self.progress.to_dict(), "ready_s": round(self.ready_s, 3), "gpus": self.gpus,
            "command": redact(self.command, self.api_key),
            **({"ranks": [r.to_dict() for r in self.ranks]} if self.ranks else {}),
        }


def _tail(path: str, max_bytes: int) -> str:
    try:
        with os.fdopen(open_below(path, os.O_RDONLY), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class StopFailed(ServerError):
    """The server's group was killed, but hygiene did not verify its GPUs clean. ``.report`` has why."""

    retryable = True  # the driver releases a killed process's memory late

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)


# --------------------------------------------------------------------------------------------------
# Launch


def _is_local(target: Any) -> bool:
    try:
        return parse_target(target).is_local
    except ValueError:  # not a target string: let the remote path report it
        return False


def launch(
    cfg: ServerConfig,
    target: Any = "local",
    fraction: float | None = None,
    log_dir: str | os.PathLike[str] = ".",
    deadline_s: float = 1800.0,
    *,
    on_progress: Callable[[StartupProgress], None] | None = None,
    health_timeout_s: float = 25.0,
    on_started: Callable[[int, int], None] | None = None,
    keep_s: float = 0.0,
) -> ServerHandle:
    """Start the server for ``cfg`` at ``fraction`` and return once ``/health_generate`` answers 200.

    ``target`` is "local" or a tasks.targets target (string or Target); a remote server is reached
    through an SSH port forward and its ``url`` is the forward's local end. With ``cfg.api_key`` the
    key is on no command line there either.
    Raises LaunchFailed (kind from classify_failure, or "timeout" after the whole group was
    killed when ``deadline_s`` passed, or "port_in_use": before starting anything when the port is
    already taken on the target, naming its holder when it can be seen; after killing the new group
    when the server could not bind it, or when the process answering ``/health_generate`` there is
    not the one started), ServerConfigError for an invalid config, TargetError/TargetUnreachable for
    a remote target that cannot be used.

    ``on_started(pid, pgid)`` is called as soon as the server process exists, before it is ready,
    so a caller can record it (a flow SIGKILLed while the server loads leaves it running, and only
    a record lets the next run end it). Whatever it raises is re-raised after the new process group
    was killed: a server nobody recorded must not outlive the launch.

    ``keep_s``: how long the server outlives this process, should it die, waiting for the next run to
    adopt it (:func:`adopt_running`); 0: its guardian ends it at once (tasks/server/_leash.py).
    """
    shown = build_command(cfg, fraction)
    if cfg.peer_nodes:
        keep_s = 0.0  # a server over several nodes is not adopted by a later run: it ends with its run
    if _is_local(target):
        handle = _start_local(cfg, fraction, Path(log_dir), shown)
        _put_on_leash(handle, lambda: _kill_group(handle, grace_s=5.0), keep_s)

        def kill_local() -> None:
            _kill_group(handle, grace_s=5.0)
            _release_leash(handle)

        _tell_started(on_started, handle.pid, handle.pgid, kill_local)
    else:
        t = parse_target(target)
        taken = listeners_on(t, cfg.host, cfg.port)
        if taken:
            _refuse_taken_port(cfg, taken, f"{log_dir}/{log_file_name(cfg, fraction)}", shown, fraction)

        def remote_started(pid: int) -> None:  # a remote server leads its own session: pgid == pid
            _tell_started(on_started, pid, pid, lambda: server_remote.kill_group(t, pid, grace_s=5.0))

        started = server_remote.start_remote(cfg, t, fraction, log_dir, on_started=remote_started)
        handle = ServerHandle(
            pid=started.pid, pgid=started.pid, url=f"http://127.0.0.1:{started.tunnel.local_port}",
            log_path=started.log_path, fraction=fraction, target=target if isinstance(target, str) else str(t),
            command=shown, gpus=cfg.gpu_indexes(), progress=StartupProgress(), ready_s=0.0,
            api_key=cfg.api_key, _tunnel=started.tunnel,
        )

        def kill_remote() -> None:
            server_remote.kill_group(t, started.pid, grace_s=5.0)
            _close_tunnel(handle)

        _put_on_leash(handle, kill_remote, keep_s)
    try:
        if cfg.peer_nodes:
            handle.ranks = _start_ranks(cfg, handle.target, fraction, log_dir, handle.log_path)
        _await_ready(handle, cfg, deadline_s, on_progress, health_timeout_s)
    except BaseException:
        if cfg.peer_nodes:  # whatever was started on any node ends with the failed launch
            with contextlib.suppress(Exception):
                _kill_group(handle, grace_s=5.0)
        _close_tunnel(handle)
        _release_leash(handle)
        raise
    if not handle.is_remote:
        handle._members = [i for i in map(ProcessIdentity.of, group_pids(handle.pgid)) if i is not None]
    return handle


def _start_ranks(cfg: ServerConfig, head: str, fraction: float | None, log_dir: str | os.PathLike[str],
                 head_log: str) -> list[NodeRank]:
    """Start nodes 1.. of a server over several nodes, each on its own leash: the same command with
    its own ``--node-rank``, its log beside node 0's (``...-node<R>.log``) on its node. A node that
    cannot be started or leashed ends the ones already started and raises.

    SGLang's nodes >= 1 serve a dummy health server on ``--host:--port`` (200 to /health_generate
    whatever their schedulers do): each binds ``cfg.host`` on its own machine, or its own address
    when ``cfg.host`` is node 0's address (a routable bind on every node)."""
    ranks: list[NodeRank] = []
    head_host = parse_target(head).host
    try:
        for rank, node in enumerate(cfg.peer_nodes, start=1):
            own = parse_target(node).host
            host = own if head_host and own and cfg.host == head_host else cfg.host
            ranks.append(_start_rank(replace(cfg.for_node(rank), host=host), rank, node, fraction, log_dir,
                                     f"{Path(head_log).name.removesuffix('.log')}-node{rank}.log"))
    except BaseException:
        on_each(lambda r: r.kill(5.0, 0.0), ranks)
        for r in ranks:
            r.release()
        raise
    return ranks


def _start_rank(cfg: ServerConfig, rank: int, node: str, fraction: float | None,
                log_dir: str | os.PathLike[str], name: str) -> NodeRank:
    argv = launch_argv(cfg, fraction)
    if _is_local(node):
        local_log = Path(log_dir) / name
        with os.fdopen(open_below(local_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, create_dir=True), "ab") as logf:
            logf.write(f"# datagen launch, node {rank}: {shlex.join(build_command(cfg, fraction))}\n".encode())
            logf.flush()
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                     env=launch_env(cfg), start_new_session=True, close_fds=True)
        r = NodeRank(rank, node, popen.pid, str(local_log), _popen=popen)
    else:
        t = parse_target(node)
        remote_log = f"{log_dir}/{name}"
        run_command(t, ["mkdir", "-p", str(log_dir)], timeout_s=30)
        r = NodeRank(rank, node, start_detached(t, argv, remote_log, env=launch_env(cfg, base={})), remote_log)
    log.info("launched node %d of %d on %s (pid %d, log %s)", rank, cfg.nnodes, node, r.pid, r.log_path)
    try:
        r._leash = leash(node, r.pid, keep_s=0.0)
    except BaseException:
        with contextlib.suppress(Exception):
            r.kill(5.0, 0.0)
        raise
    return r




def _put_on_leash(handle: ServerHandle, kill: Callable[[], Any], keep_s: float = 0.0) -> None:
    """Give ``handle`` its guardian (tasks.server._leash); a server that cannot be leashed is killed."""
    try:
        handle._leash = leash(handle.target, handle.pgid, keep_s=keep_s)
    except BaseException:
        with contextlib.suppress(Exception):
            kill()
        raise


def adopt_running(cfg: ServerConfig, target: Any, *, pid: int, started: float | None, fraction: float | None,
                  log_path: str) -> ServerHandle | None:
    """Take over a server a dead run launched with ``cfg`` (its port included) on ``target``, whose
    guardian still waits out its grace: the guardian is held by this process from now on (its death
    starts the grace again), and a remote server gets a new port forward. The server's readiness is
    the caller's to check (a health check): this only takes it.

    Returns None when it cannot be taken: a local pid that is not the recorded process any more (its
    start time ``started``; None: never taken), or no guardian accepts (gone, its grace over, owned).

    Raises:
        TargetError, TargetUnreachable, OSError: the port forward to a remote server cannot be opened
            (the guardian is let go again: its grace starts over).
    """
    t = parse_target(target)
    if t.is_local and (started is None or not same_process(ProcessIdentity(pid, started))):
        return None
    held = adopt(t, pid)
    if held is None:
        return None
    tunnel = None
    try:
        if not t.is_local:
            tunnel = server_remote.open_tunnel(t, cfg.host, cfg.port)
    except BaseException:
        held.release()
        raise
    handle = ServerHandle(
        pid=pid, pgid=pid, url=cfg.url if tunnel is None else f"http://127.0.0.1:{tunnel.local_port}",
        log_path=log_path, fraction=fraction, target=target if isinstance(target, str) else str(t),
        command=build_command(cfg, fraction), gpus=cfg.gpu_indexes(), progress=StartupProgress(phase="adopted"),
        ready_s=0.0, api_key=cfg.api_key, _tunnel=tunnel, _leash=held,
    )
    if t.is_local:
        handle._members = [i for i in map(ProcessIdentity.of, group_pids(pid)) if i is not None]
    return handle


def _release_leash(handle: ServerHandle) -> None:
    if handle._leash is not None:
        with contextlib.suppress(Exception):
            handle._leash.release()
        handle._leash = None
    for r in handle.ranks:
        r.release()


def _tell_started(on_started: Callable[[int, int], None] | None, pid: int, pgid: int,
                  kill: Callable[[], Any]) -> None:
    if on_started is None:
        return
    try:
        on_started(pid, pgid)
    except BaseException:
        with contextlib.suppress(Exception):
            kill()
        raise


def _start_local(cfg: ServerConfig, fraction: float | None, log_dir: Path, shown: list[str]) -> ServerHandle:
    log_path = Path(log_dir) / log_file_name(cfg, fraction)
    if bind_refused(cfg.host, cfg.port):
        # Never start next to a live listener: its /health_generate 200 would look like ours.
        _refuse_taken_port(cfg, listeners_on("local", cfg.host, cfg.port), str(log_path), shown, fraction)
    # through the log directory's handle, O_NOFOLLOW: a log or log directory planted as a symlink is
    # refused, never written through
    with os.fdopen(open_below(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, create_dir=True), "ab") as logf:
        logf.write(f"# datagen launch: {shlex.join(shown)}\n".encode())
        logf.flush()
        popen = subprocess.Popen(
            launch_argv(cfg, fraction), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            env=launch_env(cfg), start_new_session=True, close_fds=True,
        )
    log.info("launched %s (pid %d, log %s)", shlex.join(shown), popen.pid, log_path)
    return ServerHandle(
        pid=popen.pid, pgid=popen.pid, url=cfg.url, log_path=str(log_path), fraction=fraction,
        target="local", command=shown, gpus=cfg.gpu_indexes(), progress=StartupProgress(),
        ready_s=0.0, api_key=cfg.api_key, _popen=popen,
    )


def _refuse_taken_port(cfg: ServerConfig, taken: list[dict[str, Any]] | None, log_path: str,
                       shown: list[str], fraction: float | None) -> None:
    holders = describe_holders(taken)
    evidence = f"{cfg.host}:{cfg.port} is already in use" + (f" by {holders}" if holders else "")
    raise LaunchFailed(Failure("port_in_use", explanation("port_in_use"), evidence), "", exit_status=None,
                       log_path=log_path, command=shown, fraction=fraction)


# uvicorn's line when the HTTP port cannot be bound; SGLang 0.5.23 then hangs instead of exiting.
_BIND_FAILED = re.compile(r"error while attempting to bind on address .*", re.I)


def _await_ready(
    handle: ServerHandle,
    cfg: ServerConfig,
    deadline_s: float,
    on_progress: Callable[[StartupProgress], None] | None,
    health_timeout_s: float,
) -> None:
    """Poll until ready, exit or deadline. Raises LaunchFailed (after killing the group on timeout)."""
    start = time.monotonic()
    backoff = Backoff(deadline_s, 0.05, 1.0, factor=1.5)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    offset = 0
    last_phase = ""
    with http.client(headers=headers, trust_env=False) as client:
        while True:
            chunk, offset = _read_log_from(handle, offset)
            if chunk:
                if bound := _BIND_FAILED.search(chunk):
                    _raise_not_ours(handle, cfg, bound.group(0).strip())
                parse_progress(chunk, handle.progress)
                if handle.progress.phase != last_phase:
                    last_phase = handle.progress.phase
                    log.info("server %s: %s", handle.url, handle.progress.to_dict())
                    if on_progress is not None:
                        on_progress(handle.progress)
            if not handle.is_alive():
                _raise_exited(handle)
            if backoff.left <= 0:
                _raise_timeout(handle, deadline_s)
            try:
                timeout = httpx.Timeout(min(health_timeout_s, max(backoff.left, 0.1)), connect=1.0)
                r = client.get(handle.url + "/health_generate", timeout=timeout)
                # A 200 counts only if our process is alive and is the one holding the port.
                if r.status_code == 200 and handle.is_alive() and _holds_port(handle, cfg):
                    chunk, offset = _read_log_from(handle, offset)
                    parse_progress(chunk, handle.progress)
                    handle.progress.phase = "ready"
                    handle.ready_s = time.monotonic() - start
                    if on_progress is not None:
                        on_progress(handle.progress)
                    return
            except httpx.TransportError:
                pass  # connection refused while weights load; timeouts while warming up
            backoff.wait(lambda step: _wait_exit(handle, step))  # returns early when the server exits



def _holds_port(handle: ServerHandle, cfg: ServerConfig) -> bool:
    """Whether the launched server holds its port (True when the target cannot tell); raises
    LaunchFailed "port_in_use", after killing the group, when another process holds it."""
    listeners = listeners_on(handle.target, cfg.host, cfg.port)
    if listeners is None:
        return True
    members = group_pids(handle.pgid) if not handle.is_remote else []
    if held_by(listeners, handle.pgid, members):
        return True
    _raise_not_ours(handle, cfg, "")
    return False


def _raise_not_ours(handle: ServerHandle, cfg: ServerConfig, line: str) -> None:
    holders = describe_holders(listeners_on(handle.target, cfg.host, cfg.port))
    _kill_group(handle, grace_s=5.0)
    what = f"{cfg.host}:{cfg.port} is held by {holders or 'another process'}, not by the launched server " \
           f"(pid {handle.pid})"
    failure = Failure("port_in_use", explanation("port_in_use"), f"{what}: {line}" if line else what)
    _raise(handle, failure, handle.read_log(), handle.exit_status())


def _wait_exit(handle: ServerHandle, timeout: float) -> None:
    """Wait up to ``timeout`` s, returning early if the local server exits (no blind sleep)."""
    if handle._popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            handle._popen.wait(timeout=timeout)
    else:
        time.sleep(timeout)


def _read_log_from(handle: ServerHandle, offset: int) -> tuple[str, int]:
    if handle.is_remote:
        text = handle.read_log()
        return text[offset:], len(text)
    try:
        with os.fdopen(open_below(handle.log_path, os.O_RDONLY), "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    # Only complete lines: a half-written line would be parsed twice otherwise.
    cut = data.rfind(b"\n") + 1
    return data[:cut].decode("utf-8", "replace"), offset + cut


def _raise_exited(handle: ServerHandle) -> None:
    dead, text, status = handle.failure()
    # The group may still hold children (an orphaned scheduler): never leave them behind; over
    # several nodes, every node's ranks end with the one that exited.
    _kill_group(handle, grace_s=5.0)
    failure = classify_failure(text, status)
    if dead is not None:
        failure = on_node(failure, dead)
    _raise(handle, failure, text, status)


def on_node(failure: Failure, rank: NodeRank) -> Failure:
    """``failure`` read from node ``rank``'s log, saying so."""
    return replace(failure, explanation=f"node {rank.rank} ({rank.host}) of the server ended: {failure.explanation}")


def _raise_timeout(handle: ServerHandle, deadline_s: float) -> None:
    _kill_group(handle, grace_s=5.0)
    text = handle.read_log()
    nodes = (f"; over {len(handle.ranks) + 1} nodes every node must join node 0 at --dist-init-addr "
             f"{flag_value(handle.command, '--dist-init-addr') or '?'} (reachable from each node, the same command): "
             "check each node's log" if handle.ranks else "")
    failure = Failure(
        "timeout",
        f"not ready within {deadline_s:g} s (last phase: {handle.progress.phase}); the process group was "
        f"killed{' on every node' if handle.ranks else ''}: check the log for a hang, or raise the launch "
        f"deadline for a large model{nodes}",
        next((ln for ln in reversed(text.splitlines()) if ln.strip()), "").strip()[:500],
    )
    _raise(handle, failure, text, handle.exit_status())


def _raise(handle: ServerHandle, failure: Failure, text: str, status: int | None) -> None:
    raise LaunchFailed(failure, log_tail(text), exit_status=status, log_path=handle.log_path,
                       command=handle.command, fraction=handle.fraction, effective=effective_fraction(text))


# --------------------------------------------------------------------------------------------------
# Process groups


# SGLang drains and ends its children when its main process gets SIGTERM (about 1 s idle); a
# SIGTERM to the whole group reaches the children too, which take their crash path, and the server
# dies by SIGKILL seconds later without draining. So the leader is asked first, for half the grace
# and at most this: SGLang's SIGTERM watchdog looks every 5 s, and on a loaded 2-core host its drain
# and teardown took more than 10 s (the leader then died by the group's SIGTERM, exit -15).
LEADER_FIRST_S = 20.0
RANK_GRACE_S = 5.0  # a node rank >= 1 after node 0 stopped: its group's SIGTERM to SIGKILL


def _kill_group(handle: ServerHandle, grace_s: float) -> list[int]:
    """SIGTERM the leader, then the group, within ``grace_s``; SIGKILL survivors. Returns every pid
    seen. Over several nodes node 0 goes first, then every other node's group at once."""
    if not handle.ranks:
        return _kill_head(handle, grace_s)
    # Node 0 first: its drain broadcasts the shutdown to every node's schedulers (SGLang's nodes >= 1
    # log a SIGTERM and wait for that broadcast). Then each other node's group, all at once: SIGTERM
    # to the group, SIGKILL after a short grace (node 0 dead, nothing else would end them).
    try:
        head = _kill_head(handle, grace_s)
    finally:
        rest = on_each(lambda r: r.kill(min(grace_s, RANK_GRACE_S), 0.0), handle.ranks)
    return head + [p for pids in rest for p in pids]


def _kill_head(handle: ServerHandle, grace_s: float) -> list[int]:
    leader_first_s = min(grace_s / 2, LEADER_FIRST_S)
    if handle.is_remote:
        server_remote.kill_group(handle.target, handle.pgid, grace_s, leader_first_s)
        return list(handle.member_pids)
    # Members that left the group (setsid) are still ours: they were seen in it.
    end = terminate_group(handle.pgid, grace_s, kill_pids=handle._members, leader=handle._popen,
                          leader_first_s=leader_first_s)
    return list(end.seen)


# --------------------------------------------------------------------------------------------------
# Stop


HygieneFn = Callable[..., Any]


def _default_hygiene(target: str, gpus: list[int], extra_pids: list[int], grace_s: float) -> Any:
    """Narrow seam to tasks.hygiene, so that tests and flows can plug another in."""
    return clean_gpus(target, gpus=gpus, grace_s=grace_s, extra_pids=tuple(extra_pids))


def stop_server(
    handle: ServerHandle,
    grace_s: float = 30.0,
    *,
    hygiene: HygieneFn | None = _default_hygiene,
    verify: bool = True,
) -> Any:
    """Stop a server datagen started: SIGTERM its main process (it drains and ends its children),
    then its group, within ``grace_s``; SIGKILL the group, then run hygiene on its GPUs with its
    pids as ``extra_pids`` (orphans that left the group included).

    Idempotent. Returns the hygiene report (None when ``hygiene`` is None). Raises StopFailed when
    ``verify`` and the report's verdict is not "clean".
    """
    try:
        pids = _kill_group(handle, grace_s)
    finally:
        _close_tunnel(handle)  # local: closable even when the server's host no longer answers
        _release_leash(handle)  # after the kill: a guardian let go early would race the stop
    log.info("server %s (pgid %d) stopped; pids %s", handle.url, handle.pgid, pids)
    if hygiene is None:
        return None
    # every node's GPUs, each verified (a rank's memory is on its own node)
    nodes = [(handle.target, sorted(set(pids) | set(handle.member_pids))), *((r.target, [r.pid]) for r in handle.ranks)]
    reports = on_each(lambda node: hygiene(node[0], handle.gpus, node[1], min(grace_s, 10.0)), nodes)
    for (node, _), report in zip(nodes, reports, strict=True):
        verdict = getattr(report, "verdict", "clean" if getattr(report, "clean", False) else "unknown")
        if verify and verdict != "clean":
            summary = report.summary() if hasattr(report, "summary") else str(report)
            where = f" on {host_of(node)}" if handle.ranks else ""
            raise StopFailed(f"server {handle.url} stopped but GPUs {handle.gpus}{where} are {verdict}:\n{summary}",
                             report)
    return reports[0]


def _close_tunnel(handle: ServerHandle) -> None:
    if handle._tunnel is not None:
        with contextlib.suppress(Exception):
            handle._tunnel.close()
        handle._tunnel = None
