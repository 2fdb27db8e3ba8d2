"""A server over several nodes, as SGLang launches one: the same command on every node with
``--nnodes N --node-rank R --dist-init-addr HOST:PORT``; node 0 serves HTTP, the others run their
schedulers only.

What the emulator shows of it (docs/emulator.md, "Several nodes"):

- the refusals SGLang makes when it parses the flags (tp x pp not a multiple of the nodes, a node
  rank out of range, several nodes without ``--dist-init-addr``, data-parallel replicas over nodes),
  each an ``AssertionError`` or ``ValueError`` and exit 1;
- the join: node 0 listens on the dist-init address (a port taken there is torch's EADDRINUSE, exit
  1); every other node connects to it, retrying until ``--dist-timeout`` (default 1800 s) as a
  TCPStore client does, and gives up with torch's ``DistNetworkError``; node 0 loads nothing before
  every node joined (``Init parallel begin.`` is its last line while it waits, as SGLang 0.5.23's);
- a node lost after the join: the others block in their next collective, as NCCL does (no error,
  no exit): node 0 stops answering (``/health_generate`` fails, requests hang) and the other nodes
  keep running, holding their GPU memory, until something kills them;
- the other nodes as SGLang 0.5.23 runs them: no API, but a dummy health server on their
  ``--host:--port`` answering 200 to ``/ping``, ``/health`` and ``/health_generate`` whatever their
  schedulers do; a SIGTERM they log and ignore ("waiting for the rank-0 ShutdownReq broadcast"):
  they end when node 0 shuts down (its drain broadcasts the shutdown) or by SIGKILL;
- faults on one node only: ``--emu-node-fault R:never-join`` (node R never connects) and
  ``--emu-node-fault R:crash-after=S`` (node R's scheduler fails S seconds after the join).
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from collections.abc import Callable

from emulator.logs import log, raw

__all__ = ["NodeLink", "check_nodes", "dummy_health_server", "join", "node_fault"]

CONNECT_EVERY_S = 0.2


def check_nodes(args: argparse.Namespace) -> str | None:
    """SGLang's refusal of these flags (the exception line it dies with), else None."""
    if args.nnodes < 1:
        return "AssertionError: nnodes must be a positive integer"
    if not 0 <= args.node_rank < args.nnodes:
        return f"AssertionError: node_rank {args.node_rank} must be in [0, nnodes={args.nnodes})"
    if (args.tp_size * args.pp_size) % args.nnodes:
        return "AssertionError: tp_size must be divisible by number of nodes"
    if args.dp_size > 1 and args.nnodes != 1:
        return ("AssertionError: multi-node data-parallel replicas are not supported; use attention DP "
                "(--attn-dp-size) across nodes")
    if args.nnodes > 1 and not args.dist_init_addr:
        return "ValueError: --dist-init-addr is required when --nnodes > 1"
    if args.dist_init_addr:
        host, sep, port = args.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            return f"ValueError: invalid --dist-init-addr {args.dist_init_addr!r}: expected HOST:PORT"
    return None


def node_fault(args: argparse.Namespace) -> tuple[str, float]:
    """The ``--emu-node-fault`` for this node: ("never-join" | "crash-after" | "", seconds)."""
    for spec in args.emu_node_fault or []:
        rank, _, what = spec.partition(":")
        if rank.strip() != str(args.node_rank):
            continue
        kind, _, value = what.partition("=")
        return kind.strip(), float(value or 0)
    return "", 0.0


class NodeLink:
    """This node's connections to the others after the join: node 0 holds one per other node, the
    others one to node 0. ``on_lost(text)`` is called once, from a thread, when one ends."""

    def __init__(self, socks: list[tuple[int, socket.socket]]) -> None:
        self.socks = socks
        self.lost = threading.Event()
        self.on_lost: Callable[[str], None] | None = None
        self.on_shutdown: Callable[[], None] | None = None

    def broadcast_shutdown(self) -> None:
        """Node 0's ShutdownReq to every other node (its drain ends them all)."""
        for _, sock in self.socks:
            try:
                sock.sendall(b"shutdown\n")
            except OSError:
                pass

    def watch(self) -> None:
        for rank, sock in self.socks:
            threading.Thread(target=self._read, args=(rank, sock), name=f"node-link-{rank}", daemon=True).start()

    def _read(self, rank: int, sock: socket.socket) -> None:
        data = b""
        try:
            while chunk := sock.recv(4096):
                data += chunk
                if b"shutdown\n" in data and self.on_shutdown is not None:
                    self.lost.set()  # an orderly end, not a lost node
                    self.on_shutdown()
                    return
        except OSError:
            pass
        if self.lost.is_set():
            return
        self.lost.set()
        # NCCL's view of a peer that vanished: the next collective never completes
        text = (f"[node link] node {rank} is gone: the next collective will not complete "
                "(NCCL: remote process exited or there was a network error); waiting")
        log(text)
        if self.on_lost is not None:
            self.on_lost(text)


def join(args: argparse.Namespace) -> NodeLink:
    """Join the nodes at ``--dist-init-addr``: node 0 waits for every other node, the others connect
    to node 0. Exits (status 1) as torch does when it cannot."""
    host, _, port_text = args.dist_init_addr.rpartition(":")
    port = int(port_text)
    tp = args.node_rank * (args.tp_size * args.pp_size // args.nnodes)  # this node's first rank
    log("Init parallel begin.", tp=tp)  # SGLang 0.5.23's line; it waits here until every node joined
    t0 = time.monotonic()
    fault, _ = node_fault(args)
    if args.node_rank == 0:
        link = _accept_all(host, port, args.nnodes)
    else:
        if fault == "never-join":
            log(f"[emulator] node {args.node_rank} never joins (--emu-node-fault)")
            while True:
                time.sleep(3600)
        link = _connect(host, port, args.node_rank, float(args.dist_timeout or 1800))
    log(f"Init parallel ends. elapsed={time.monotonic() - t0:.2f} s", tp=tp)
    return link


def _accept_all(host: str, port: int, nnodes: int) -> NodeLink:
    try:
        server = socket.create_server((host, port), backlog=nnodes)
    except OSError as exc:
        raw("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            f"address. port: {port}, useIpv6: false, code: -{exc.errno}, name: EADDRINUSE, message: "
            f"{(exc.strerror or str(exc)).lower()}")
        os._exit(1)
    socks: list[tuple[int, socket.socket]] = []
    while len(socks) < nnodes - 1:
        conn, addr = server.accept()
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                break
            line += chunk
        words = line.decode("ascii", "replace").split()
        if len(words) != 2 or words[0] != "node" or not words[1].isdigit():
            conn.close()
            continue
        socks.append((int(words[1]), conn))
        log(f"[node link] node {words[1]} joined from {addr[0]}")
    server.close()
    return NodeLink(socks)


def _connect(host: str, port: int, rank: int, timeout_s: float) -> NodeLink:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raw(f"torch.distributed.DistNetworkError: The client socket has timed out after {timeout_s:g}s "
                    f"while trying to connect to ({host}, {port}).")
                os._exit(1)
            time.sleep(CONNECT_EVERY_S)
    sock.settimeout(None)
    sock.sendall(f"node {rank}\n".encode())
    log(f"[node link] joined node 0 at {host}:{port}")
    return NodeLink([(0, sock)])


def dummy_health_server(host: str, port: int) -> None:
    """What SGLang's node ranks >= 1 serve on ``--host:--port``: 200 to /ping, /health and
    /health_generate, whatever their schedulers do (a thread; a port it cannot bind is logged)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path.split("?", 1)[0] in ("/ping", "/health", "/health_generate")
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", "0" if ok else "22")
            self.end_headers()
            if not ok:
                self.wfile.write(b'{"detail":"Not Found"}')

        def log_message(self, *args: object) -> None:
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        log(f"Dummy health check server failed to start: [Errno {exc.errno}] error while attempting to bind on "
            f"address ('{host}', {port}): {(exc.strerror or str(exc)).lower()}")
        return
    threading.Thread(target=server.serve_forever, name="health-check-server", daemon=True).start()
    log(f"Dummy health check server started in background thread at {host}:{port}")
