"""The servers of a partition: ``[server] targets`` entries expanded into one ``ServerSlot`` each.

An entry is a target string (one server on the GPUs of ``server.gpus``) or a table::

    { target = "ssh://gpu1", gpus = [[0, 1], [2, 3], [4, 5], [6, 7]], port = 31000,
      flags = { max_running_requests = 64, python = "/opt/sglang/bin/python" } }

``gpus`` is one GPU list (one server) or a list of GPU lists (one server per group); ``port`` is the
first server's port on that target (the next servers count up from it); ``flags`` are ``[server]``
launch keys for this target's servers only (e.g. ``python``, ``host``, ``env``,
``max_running_requests``, ``mem_fraction_static``), never one the rows' ``server`` fingerprint holds.

One server over several hosts (SGLang's ``--nnodes``) is a table with ``nodes`` instead of ``target``::

    { nodes = ["ssh://gpu1", "ssh://gpu2"], gpus = [0, 1, 2, 3, 4, 5, 6, 7], tp_size = 16,
      dist_init_host = "10.0.0.1", dist_init_port = 25000 }

``nodes[0]`` is node 0 (it serves HTTP); ``gpus`` is one list, the same on every node (default
0..tp_size x pp_size / nodes - 1); ``tp_size`` (also allowed on a one-host entry) is the
partition's: every server of a run generates alike. ``dist_init_host`` is the address the other
nodes reach node 0 at (default: node 0's host name); ``dist_init_port`` the port there (default: a
free one, picked at each launch). docs/configuration.md, "A server over several nodes".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.config._checks import ConfigError, check_target, no_unknown
from tasks.server import DEFAULT_PORT
from tasks.targets import parse_target

__all__ = ["FINGERPRINT_KEYS", "FLAG_EXCLUDED", "ServerSlot", "TargetServers", "parse_targets", "slots_of"]

# Launch keys a target's flags may not set: the partition's (model, backend) or the entry's own.
FLAG_EXCLUDED = frozenset({"backend", "gpus", "targets", "port", "api_key_secret", "hub_token_secret",
                           "launch_deadline_s", "allow_unauthenticated_bind"})
# ...nor what the rows' `server` fingerprint holds: every server of a run must generate alike, since
# a shard mixes rows of every server (and validation refuses mixed fingerprints).
FINGERPRINT_KEYS = frozenset({"tp_size", "served_model_name", "context_length", "extra_args"})
_ENTRY_KEYS = {"target", "gpus", "port", "flags", "nodes", "tp_size", "dist_init_host", "dist_init_port"}
MAX_NODES = 64  # nodes of one server (tasks.server._config.MAX_NODES)
REMOTE_PORT = DEFAULT_PORT  # a remote server's port when the partition names none (its host's loopback)


@dataclass(frozen=True)
class TargetServers:
    """One ``[server] targets`` entry: a target and the servers it runs.

    Args:
        target: the target string.
        gpu_groups: one GPU tuple per server; None: one server on ``server.gpus``.
        port: the first server's port (None: ``server.port``).
        flags: ``[server]`` launch keys for these servers (raw values; checked by the loader).
        nodes: the hosts of one server over several nodes (``target`` is ``nodes[0]``); () for one host.
        tp_size: the entry's ``tp_size`` (the partition's; None: not given here).
        dist_init_host: the address the other nodes reach node 0 at (None: node 0's host name).
        dist_init_port: the port of ``--dist-init-addr`` on node 0 (None: a free one per launch).
    """

    target: str
    gpu_groups: tuple[tuple[int, ...], ...] | None = None
    port: int | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    tp_size: int | None = None
    dist_init_host: str | None = None
    dist_init_port: int | None = None


@dataclass(frozen=True)
class ServerSlot:
    """One server of a run: its target, GPUs, port and launch flags.

    Args:
        target: where it runs.
        gpus: its GPUs (None: ``server.gpus``, else 0..tp_size-1).
        port: its port (0: a free one, picked at launch).
        flags: ``[server]`` launch keys that differ from the partition's.
        index: its position among its target's servers.
        nodes: every node of a server over several hosts, node 0 (``target``) first; () for one host.
        dist_init_host, dist_init_port: see ``TargetServers``.
    """

    target: str
    gpus: tuple[int, ...] | None
    port: int
    flags: Mapping[str, Any] = field(default_factory=dict)
    index: int = 0
    nodes: tuple[str, ...] = ()
    dist_init_host: str | None = None
    dist_init_port: int | None = None

    def label(self, gpus: tuple[int, ...] | list[int] | None = None) -> str:
        """``host[gpu 0,1]`` (``host1+host2[gpu 0,1]`` over several nodes): how logs, task runs and
        reports name this server."""
        host = "+".join(_host_label(t) for t in (self.nodes or (self.target,)))
        shown = self.gpus if gpus is None else gpus
        return f"{host}[gpu {','.join(str(g) for g in shown)}]" if shown else host


def _host_label(target: str) -> str:
    t = parse_target(target)
    return "local" if t.is_local else f"{t.host}" + (f"/{t.ctid}" if t.ctid is not None else "")


MAX_TARGETS = 256  # hosts of one partition; a fleet larger than this is several partitions
MAX_TARGET_CHARS = 512  # ssh://user@host:port with a DNS name fits many times over


def parse_targets(raw: Any, f: str) -> tuple[TargetServers, ...]:
    """The ``[server] targets`` value (a string, or a list of strings and tables), checked.

    Raises:
        ConfigError: names ``server.targets[i]`` and what is wrong.
    """
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{f}: server.targets: a non-empty list of target strings or tables")
    if len(raw) > MAX_TARGETS:
        raise ConfigError(f"{f}: server.targets: {len(raw)} targets; at most {MAX_TARGETS} (split the run "
                          "into partitions)")
    out: list[TargetServers] = []
    for i, item in enumerate(raw):
        key = f"server.targets[{i}]"
        target_text = item if isinstance(item, str) else item.get("target") if isinstance(item, dict) else None
        if isinstance(target_text, str) and len(target_text) > MAX_TARGET_CHARS:
            raise ConfigError(f"{f}: {key}: a target of {len(target_text)} characters; at most "
                              f"{MAX_TARGET_CHARS} (local, ssh://user@host:port or pct://host/CTID)")
        if isinstance(item, str):
            check_target(item, f)
            out.append(TargetServers(item))
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"{f}: {key}: a target string or a table with `target`")
        no_unknown(item, _ENTRY_KEYS, f, f"{key}.")
        nodes = _nodes(item, f, key)
        target = nodes[0] if nodes else item.get("target")
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{f}: {key}.target: required (local, ssh://host or pct://host/CTID), or "
                              "`nodes` for one server over several hosts")
        check_target(target, f)
        flags = item.get("flags", {})
        if not isinstance(flags, dict):
            raise ConfigError(f"{f}: {key}.flags: a table of [server] launch keys")
        bad = sorted(set(flags) & FLAG_EXCLUDED)
        if bad:
            raise ConfigError(f"{f}: {key}.flags.{bad[0]}: not a per-target flag (set it in [server] or on the entry)")
        alike = sorted(set(flags) & FINGERPRINT_KEYS)
        if alike:
            raise ConfigError(f"{f}: {key}.flags.{alike[0]}: not a per-target flag: it changes the rows' `server` "
                              "fingerprint, and every server of a run must generate alike; set it in [server]")
        port = item.get("port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535):
            raise ConfigError(f"{f}: {key}.port: {port!r} is not a TCP port")
        groups = _gpu_groups(item.get("gpus"), f, f"{key}.gpus")
        if nodes and groups is not None and len(groups) > 1:
            raise ConfigError(f"{f}: {key}.gpus: one server spans the nodes: one GPU list, the same on every "
                              "node (e.g. gpus = [0, 1, 2, 3, 4, 5, 6, 7])")
        tp = item.get("tp_size")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"{f}: {key}.tp_size: {tp!r} is not a positive integer")
        init_host, init_port = item.get("dist_init_host"), item.get("dist_init_port")
        if (init_host is not None or init_port is not None) and not nodes:
            raise ConfigError(f"{f}: {key}.{'dist_init_host' if init_host is not None else 'dist_init_port'}: "
                              "only a server over several `nodes` has a --dist-init-addr")
        if init_host is not None and (not isinstance(init_host, str) or not init_host.strip() or ":" in init_host
                                      or any(c.isspace() for c in init_host)):
            raise ConfigError(f"{f}: {key}.dist_init_host: {init_host!r} is not a host name or IPv4 address "
                              "(the address the other nodes reach node 0 at)")
        if init_port is not None and (isinstance(init_port, bool) or not isinstance(init_port, int)
                                      or not 0 < init_port <= 65535):
            raise ConfigError(f"{f}: {key}.dist_init_port: {init_port!r} is not a TCP port")
        out.append(TargetServers(target, groups, port, dict(flags), nodes, tp, init_host, init_port))
    seen = [str(parse_target(n)) for t in out for n in (t.nodes or (t.target,))]
    if len(set(seen)) != len(seen):
        twice = next(n for n in seen if seen.count(n) > 1)
        raise ConfigError(f"{f}: server.targets: {twice} is listed twice (list its servers' GPU groups "
                          "in one entry: gpus = [[0, 1], [2, 3]]; a node of a server over several hosts "
                          "serves that server only)")
    return tuple(out)


def _nodes(item: dict[str, Any], f: str, key: str) -> tuple[str, ...]:
    """The ``nodes`` of an entry, checked (() when it has none)."""
    raw = item.get("nodes")
    if raw is None:
        return ()
    if "target" in item:
        raise ConfigError(f"{f}: {key}: `target` or `nodes`, not both (nodes[0] is the server's node 0)")
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(n, str) and n for n in raw):
        raise ConfigError(f"{f}: {key}.nodes: a list of at least 2 target strings, node 0 first "
                          '(e.g. nodes = ["ssh://gpu1", "ssh://gpu2"]); one host is `target`')
    if len(raw) > MAX_NODES:
        raise ConfigError(f"{f}: {key}.nodes: {len(raw)} nodes; at most {MAX_NODES}")
    for i, node in enumerate(raw):
        if len(node) > MAX_TARGET_CHARS:
            raise ConfigError(f"{f}: {key}.nodes[{i}]: a target of {len(node)} characters; at most {MAX_TARGET_CHARS}")
        try:
            parse_target(node)
        except ValueError as exc:
            raise ConfigError(f"{f}: {key}.nodes[{i}]: {exc}") from exc
    return tuple(raw)


def _gpu_groups(value: Any, f: str, key: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{f}: {key}: a list of GPU indices, or a list of such lists (one server each)")
    groups = value if all(isinstance(g, list) for g in value) else [value]
    used: set[int] = set()
    out = []
    for g in groups:
        if not g or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in g):
            raise ConfigError(f"{f}: {key}: {g!r} is not a non-empty list of GPU indices")
        if used & set(g):
            raise ConfigError(f"{f}: {key}: GPU {sorted(used & set(g))[0]} is in two servers' groups")
        used |= set(g)
        out.append(tuple(g))
    return tuple(out)


def slots_of(entries: tuple[TargetServers, ...], targets: tuple[str, ...], port: int) -> list[ServerSlot]:
    """Every server of a partition, in config order.

    Args:
        entries: the parsed ``[server] targets`` (empty: one server per string of ``targets``).
        targets: the target strings (used when ``entries`` is empty).
        port: ``server.port`` (0: a free port for a local server, ``REMOTE_PORT`` on a remote host).
    """
    slots: list[ServerSlot] = []
    for entry in entries or tuple(TargetServers(t) for t in targets):
        groups: tuple[tuple[int, ...] | None, ...] = entry.gpu_groups or (None,)
        base = entry.port if entry.port is not None else port
        local = parse_target(entry.target).is_local
        for i, gpus in enumerate(groups):
            if base:
                p = base + i
            else:
                p = 0 if local else REMOTE_PORT + i
            slots.append(ServerSlot(entry.target, gpus, p, dict(entry.flags), i, entry.nodes,
                                    entry.dist_init_host, entry.dist_init_port))
    return slots
