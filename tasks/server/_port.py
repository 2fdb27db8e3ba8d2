"""Who holds a server's port: the check before a launch, and the proof at readiness that the process
answering on the port is the one datagen started.

A taken port must be refused before SGLang starts: SGLang 0.5.23 does not exit when it cannot bind
(it hangs in shutdown while its warm-up polls the port), and if another server answers there, a
``/health_generate`` 200 from it would pass for ours. The sockets are read on the target by the
stdlib probe (``tasks.gpus.port_listeners``, through ``tasks.hygiene.port_listeners``).
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import Any

from tasks.hygiene import ProbeFailed, port_listeners
from tasks.server._log import Failure, LaunchFailed
from tasks.targets import Target, parse_target, remote_python, run_command

__all__ = ["bind_refused", "conflicting", "describe_holders", "free_port_on", "listeners_on", "held_by"]

log = logging.getLogger(__name__)

_LOOPBACK_NAMES = {"localhost": ("127.0.0.1", "::1")}


def _addresses(host: str) -> set[str] | None:
    """The addresses ``host`` stands for; None when it is a name this module cannot resolve
    for the target (then every listener on the port counts)."""
    if host in _LOOPBACK_NAMES:
        return set(_LOOPBACK_NAMES[host])
    try:
        return {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        return None


def _wildcard(address: str) -> bool:
    return address in ("0.0.0.0", "::")


def conflicting(listeners: Iterable[dict[str, Any]], host: str) -> list[dict[str, Any]]:
    """The ``listeners`` (as ``tasks.gpus.port_listeners`` reports them) that stop a server from
    binding ``host`` on their port: the same address, a wildcard on either side, or any address when
    ``host`` is a name."""
    wanted = _addresses(host)
    out = []
    for item in listeners:
        address = str(item.get("address", ""))
        if wanted is None or _wildcard(address) or any(_wildcard(w) for w in wanted) or address in wanted:
            out.append(item)
    return out


def listeners_on(target: str | Target, host: str, port: int) -> list[dict[str, Any]] | None:
    """The listeners on ``target`` that hold ``host:port``; None when the probe could not tell."""
    try:
        return conflicting(port_listeners(target, port), host)
    except ProbeFailed as exc:
        log.warning("cannot read the listening sockets of port %d on %s: %s", port, target, exc)
        return None


def bind_refused(host: str, port: int) -> bool:
    """Whether a local bind of ``host:port`` fails, i.e. something here holds it. The bind is the
    honest local test: it also sees sockets whose holders /proc does not show (other users')."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def describe_holders(listeners: list[dict[str, Any]] | None) -> str:
    """Who holds the port, for a message: ``pid 123 (python -m http.server)``, or the socket's user
    when its process cannot be seen; "" when nothing is known."""
    parts = []
    for item in listeners or []:
        holders = item.get("holders") or []
        if holders:
            parts += [f"pid {h['pid']} ({_short(h.get('cmdline', ''))})" for h in holders]
        else:
            parts.append(f"a process of user {item.get('user', '?')} that cannot be inspected")
    return ", ".join(dict.fromkeys(parts))


def held_by(listeners: list[dict[str, Any]], pgid: int, pids: Iterable[int] = ()) -> bool:
    """Whether one of ``listeners`` is held by the server started as process group (and session)
    ``pgid``, or by one of ``pids`` (its members seen earlier)."""
    known = set(pids) | {pgid}
    for item in listeners:
        for h in item.get("holders") or []:
            if h["pid"] in known or h.get("pgid") == pgid or h.get("sid") == pgid:
                return True
    return False


def _short(cmdline: str, width: int = 120) -> str:
    line = " ".join(cmdline.split())
    return line if len(line) <= width else line[: width - 3] + "..."


# SGLang takes the ports just above --dist-init-addr's on node 0 too (its derived ZMQ and NCCL ports,
# six in 0.5.23: server_args.py, NUM_DERIVED_PORTS), waiting when one is taken: the port picked is
# the first of a free block this long.
DIST_INIT_BLOCK = 8
FREE_PORT_TIMEOUT_S = 60.0


def _free_block(host: str, n: int) -> int:
    """A port P free on this machine with P+1..P+n-1 free too (bound on ``host`` when it is one of
    this machine's addresses, else on all of them). Runs here or, shipped as source, on a target."""
    import socket as _s  # noqa: PLC0415 (shipped alone as source to a target)

    for _ in range(64):
        with _s.socket() as first:
            try:
                first.bind((host, 0))
                where = host
            except OSError:
                first.bind(("", 0))
                where = ""
            port = first.getsockname()[1]
        if port + n > 65536:
            continue
        ok = True
        for q in range(port, port + n):
            with _s.socket() as probe:
                try:
                    probe.bind((where, q))
                except OSError:
                    ok = False
                    break
        if ok:
            return int(port)
    raise OSError(f"no block of {n} free ports found for {host}")


_FREE_PORT = inspect.getsource(_free_block) + "import sys\nprint(_free_block(sys.argv[1], int(sys.argv[2])))\n"


def free_port_on(target: str | Target, host: str) -> int:
    """A TCP port free on ``target`` now (for ``host``), with the ports SGLang derives from it free
    too: what a launch names in ``--dist-init-addr``.

    Raises:
        TargetUnreachable: the target cannot be reached.
        LaunchFailed: the probe did not answer a port (kind "unknown": the launch stage retries it;
            on a loaded host its Python took over 30 s to start).
    """
    t = parse_target(target)
    if t.is_local:
        return _free_block(host, DIST_INIT_BLOCK)
    argv = [remote_python(t), "-c", _FREE_PORT, host, str(DIST_INIT_BLOCK)]
    res = run_command(t, argv, timeout_s=FREE_PORT_TIMEOUT_S)
    text = res.stdout.strip()
    if not res.ok or not text.isdigit():
        evidence = (res.stderr or text).strip()[-300:]
        raise LaunchFailed(Failure("unknown", f"no free port found on {t} for --dist-init-addr (exit {res.exited}); "
                                              "set dist_init_port in the targets entry to name one", evidence),
                           evidence, command=argv[:1])
    return int(text)
