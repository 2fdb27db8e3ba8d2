"""A minimal ``/generate`` server: the least work a server can do per request, so that a client's
own cost per row shows (the emulator's HTTP stack hides part of it).

    python -m emulator.minimal --port N [--host H] [--latency-ms L] [--slots S] [--tokens T]
                               [--die-after N] [--think]

Raw asyncio protocol, HTTP/1.1 keep-alive, no pipelining. ``POST /generate`` answers SGLang's shape
(text, meta_info with id, finish_reason, prompt and completion tokens) after ``latency_ms`` with at
most ``slots`` requests in service at once (0: no wait, no limit), its text a ``<think>`` block
and an answer with ``--think`` (a reasoning model's output); ``--die-after N`` closes the
listener and every connection at request N+1 (a server that died). GET ``/health``,
``/health_generate``, ``/server_info``, ``/model_info`` answer 200; GET ``/occupancy`` answers the
slot-seconds spent serving, the wall-clock times of the first slot taken and the last answer, and
the slots (a fleet benchmark's slot occupancy, measured at the servers). ``MinimalServer`` runs in the
caller's event loop (tests); ``requests`` counts the /generate requests each rid arrived in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import orjson

__all__ = ["MinimalServer", "main"]

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class MinimalServer:
    """The server (see the module docstring); ``await start()``, ``await stop()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, latency_ms: float = 0.0, slots: int = 0,
                 tokens: int = 16, die_after: int | None = None, think: bool = False) -> None:
        self.host, self.port = host, port
        self.latency_s = latency_ms / 1000.0
        self.slots = slots
        self.tokens = tokens
        self.die_after = die_after
        self.requests: Counter[str] = Counter()
        self.count = 0
        self.dead = False
        self.busy_s = 0.0  # slot-seconds spent serving (latency held per request)
        self.first_at: float | None = None  # time.time() of the first slot taken
        self.last_at: float | None = None  # of the last answer
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Transport] = set()
        self._sem: asyncio.Semaphore | None = None
        # a reasoning model's answer ends by itself; the plain text fills max_new_tokens
        self._finish = {"type": "stop", "matched": 151645} if think else {"type": "length", "length": tokens}
        self._text = f"<think>{'r ' * (tokens // 2)}</think>{'x ' * (tokens - tokens // 2)}" if think else "x " * tokens

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> MinimalServer:
        loop = asyncio.get_running_loop()
        self._sem = asyncio.Semaphore(self.slots) if self.slots else None
        self._server = await loop.create_server(lambda: _Conn(self), self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        self.die()
        if self._server is not None:
            await self._server.wait_closed()

    def die(self) -> None:
        """Stop listening and drop every connection, as a killed process would."""
        self.dead = True
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.abort()
        self._conns.clear()

    def info(self, path: str) -> bytes | None:
        if path in ("/health", "/health_generate"):
            return b"{}"
        if path in ("/server_info", "/get_server_info"):
            return orjson.dumps({"max_running_requests": self.slots or 64, "model_path": "minimal"})
        if path == "/occupancy":
            return orjson.dumps({"busy_slot_s": self.busy_s, "first_at": self.first_at, "last_at": self.last_at,
                                 "slots": self.slots, "served": self.count})
        if path == "/model_info":
            return orjson.dumps({"model_path": "minimal"})
        return None

    def answer(self, body: bytes) -> bytes:
        req: dict[str, Any] = orjson.loads(body)
        rid = str(req.get("rid"))
        return orjson.dumps({"text": self._text, "meta_info": {
            "id": rid, "finish_reason": self._finish,
            "prompt_tokens": len(str(req.get("text", ""))) // 4 + 1, "completion_tokens": self.tokens}})

    async def delayed(self, conn: _Conn, body: bytes) -> None:
        assert self._sem is not None or not self.slots
        async with self._sem if self._sem is not None else contextlib.nullcontext():
            t0 = time.time()
            if self.first_at is None:
                self.first_at = t0
            await asyncio.sleep(self.latency_s)
            self.last_at = time.time()
            self.busy_s += self.last_at - t0
        conn.send(self.answer(body))


class _Conn(asyncio.Protocol):
    def __init__(self, server: MinimalServer) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.server.dead:
            transport.abort()
            return
        self.server._conns.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server._conns.discard(self.transport)

    def send(self, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write((_OK % len(payload)) + payload)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.handle(head.split(" ", 2), body)

    def handle(self, request_line: list[str], body: bytes) -> None:
        srv = self.server
        method, path = request_line[0], request_line[1] if len(request_line) > 1 else "/"
        if method == "POST" and path == "/generate":
            srv.count += 1
            if srv.die_after is not None and srv.count > srv.die_after:
                srv.die()
                return
            with contextlib.suppress(orjson.JSONDecodeError):
                srv.requests[str(orjson.loads(body).get("rid"))] += 1
            if srv.latency_s > 0 or srv.slots:
                asyncio.ensure_future(srv.delayed(self, body))
            else:
                self.send(srv.answer(body))
            return
        payload = srv.info(path.split("?", 1)[0]) if method == "GET" else None
        if payload is None:
            if self.transport is not None:
                self.transport.write(_NOT_FOUND)
            return
        self.send(payload)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m emulator.minimal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--slots", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--think", action="store_true")
    a = ap.parse_args(argv)

    async def serve() -> None:
        srv = await MinimalServer(a.host, a.port, latency_ms=a.latency_ms, slots=a.slots, tokens=a.tokens,
                                  die_after=a.die_after, think=a.think).start()
        print(f"minimal server on {srv.url}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
