"""The hang watchdog: kill a server that lives but answers nothing, so that it can be relaunched.

SGLang can hang alive (``/health_generate`` answers 503 or times out) and would then hold every
request until the client's hour-long timeout. While inference runs, the watchdog probes
``/health_generate``; when that has failed for ``timeout_s`` while the process lives, it kills the
server's process group. The client then raises ``ServerGone`` and the caller relaunches.

A server over several nodes is also watched rank by rank: when the process of a node rank >= 1 has
ended, node 0 would hang in its next collective (no error, no exit), so the watchdog ends the whole
server on every node at once (the handle's ``lost_rank`` says which died) and the relaunch path takes over.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

from tasks import http
from tasks.server._launch import ServerHandle, stop_server

__all__ = ["HangWatchdog"]

RANK_EVERY_S = 1.0  # how often the process of each node rank >= 1 is looked at


class HangWatchdog:
    """A daemon thread watching one server; ``stop()`` ends it (also usable as a context manager).

    Args:
        server: the server to watch.
        timeout_s: how long /health_generate may fail while the process lives (0: not watched).
        logger: where the kill is reported.
    """

    def __init__(self, server: ServerHandle, timeout_s: float,
                 logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.server, self.timeout_s, self.logger = server, timeout_s, logger
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._loop, name="datagen-hang-watchdog", daemon=True)
        if timeout_s > 0 or server.ranks:
            self._thread.start()

    def __enter__(self) -> HangWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        interval = max(0.5, min(10.0, self.timeout_s / 4)) if self.timeout_s > 0 else RANK_EVERY_S
        if self.server.ranks:
            interval = min(interval, RANK_EVERY_S)
        # One client for the whole watch, as the launcher's readiness probe (a client per probe cost
        # 35 ms of CPU, against 2 ms for the probe itself: tasks/http.py). No proxy from the
        # environment: the server is on this host or behind this host's SSH tunnel.
        with http.client(timeout=interval, trust_env=False) as c:
            self._watch(c, interval)

    def _watch(self, probe: httpx.Client, interval: float) -> None:
        failing_since: float | None = None
        while not self._stop.wait(interval):
            if self.server.ranks and self._rank_lost():
                return
            if self.timeout_s <= 0:
                continue
            try:
                ok = probe.get(f"{self.server.url}/health_generate").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok or not self._alive():
                failing_since = None  # a dead server is the client's to notice (connection refused)
                continue
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= self.timeout_s:
                self.logger.error("server %s alive but not answering /health_generate for %.0f s: "
                                  "killing its process group %s to relaunch", self.server.url,
                                  self.timeout_s, self.server.pgid)
                self.fired = True
                self._kill()
                return

    def _alive(self) -> bool:
        """Whether the server lives; unknown (its host does not answer) reads as alive: the watch goes on."""
        try:
            return self.server.is_alive()
        except Exception:
            return True

    def _rank_lost(self) -> bool:
        """A node rank >= 1 has ended: end the whole server (True)."""
        dead = self.server.dead_rank()
        if dead is None:
            return False
        self.logger.error("server %s: node %d (%s, pid %d) has ended: node 0 would hang in its next collective; "
                          "ending the server on every node to relaunch it", self.server.url, dead.rank,
                          dead.host, dead.pid)
        self.server.lost_rank = dead
        self._kill()
        return True

    def _kill(self) -> None:
        """Kill only (no hygiene here): the relaunch path diagnoses, stops and cleans. A node that
        cannot be reached is left to its rank's guardian (its SSH channel closes with the node) and
        to the stop, which waits for the node."""
        try:
            stop_server(self.server, grace_s=1.0, hygiene=None, verify=False)
        except Exception as exc:
            self.logger.warning("server %s: not every node could be reached to kill it (%s); what runs there "
                                "is ended by the stop or by its guardian", self.server.url, exc)

    def stop(self) -> None:
        """End the watch (waits for the thread, at most 15 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)
