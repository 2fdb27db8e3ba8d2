"""The server session: one object per inference server of a run, from clean GPUs to a stopped server.

``ServerSession(ctx)`` is a context manager. On entry it runs the before-launch GPU hygiene and
launches the server with the tuned memory fraction (or, for a shared server given as
``run.server_url``, does neither and asks the server who it is: the rows' fingerprint). ``run(work)`` calls ``work(endpoint, next_relaunch)`` under the hang watchdog;
when the server dies or hangs (``ServerGone``) it diagnoses the log (a runtime OOM is recorded so
the relaunch starts lower), stops the server, cleans its GPUs, relaunches, and calls ``work``
again: inference resumes from the committed shards and journals. ``run.max_relaunches`` is one
budget for the whole session, shared by every dataset; once spent, the error propagates. On exit
the server is stopped whatever happened.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client

from flows.context import RunContext, unlinked
from flows.retry import needs_relaunch
from flows.stages import diagnose_server, hygiene, identify_server, launch_server, stop
from tasks.inference import Endpoint, ServerGone
from tasks.server import HangWatchdog, ServerHandle

__all__ = ["RELAUNCHED_TAG", "ServerSession"]

T = TypeVar("T")
RELAUNCHED_TAG = "relaunched"  # on the flow run: the run list tells a relaunched run from a clean one


def _tag_run(run_id: str | None, tag: str) -> None:
    """Add ``tag`` to the flow run's tags (never raises: observability must not fail the run)."""
    if not run_id:
        return
    try:
        with get_client(sync_client=True) as client:
            tags = list(client.read_flow_run(UUID(run_id)).tags or [])
            if tag not in tags:
                client.update_flow_run(UUID(run_id), tags=[*tags, tag])
    except Exception as exc:
        get_run_logger().warning("flow run not tagged %r: %s", tag, exc)


class ServerSession:
    """One server of a run: launched on entry, relaunched within the run's budget, stopped on exit.

    Args:
        ctx: the run; ``ctx.cfg.max_relaunches`` is the relaunch budget of the session.
    """

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.handle: ServerHandle | None = None
        self.relaunches = 0
        self.fingerprint = ctx.fingerprint
        self._entered: float | None = None
        self._exited: float | None = None

    @property
    def held_s(self) -> float | None:
        """How long the session held its GPUs (hygiene, launches, relaunches, stop); None for a
        shared server, whose GPUs are not the run's."""
        if not self.ctx.launches or self._entered is None:
            return None
        return (self._exited or time.monotonic()) - self._entered

    def __enter__(self) -> Self:
        self.start()
        return self

    def start(self) -> None:
        """Clean the GPUs and launch (or identify a shared server)."""
        if self._entered is None:
            self._entered = time.monotonic()
        # unlinked(): the run's context (and a handle, whose fields hold the config's strings) is
        # no upstream result of each task: the run's graph shows the launch feeding the endpoint's
        # users (health check, inference) and nothing that crosses it.
        if self.ctx.launches:
            hygiene(unlinked(self.ctx), "before-launch")
            self.handle = launch_server(unlinked(self.ctx))
        else:
            self.fingerprint = identify_server(unlinked(self.ctx))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def endpoint(self) -> Endpoint:
        """Where to send requests now (it changes with a relaunch)."""
        cfg = self.ctx.cfg
        if self.handle is None:
            if cfg.server_url is None:
                raise RuntimeError("the server session has no server (not entered, or stopped)")
            return Endpoint(cfg.server_url, self.fingerprint, cfg.api_key())
        # A closed port forward reads as gone at once: the server cannot be reached through it.
        return Endpoint(self.handle.url, self.fingerprint, cfg.api_key(), alive=self.handle.reachable_and_alive)

    @property
    def next_relaunch(self) -> str:
        """What follows if the server dies now: "relaunch k/N", or "" (no budget left, or shared)."""
        budget = self.ctx.cfg.max_relaunches
        if self.handle is None or self.relaunches >= budget:
            return ""
        return f"relaunch {self.relaunches + 1}/{budget}"

    def run(self, work: Callable[[Endpoint, str], T]) -> T:
        """``work(endpoint, next_relaunch)`` until it returns, relaunching the server when it is gone.

        Raises:
            ServerGone: the server is gone and the relaunch budget is spent (or the server is shared).
            Exception: whatever ``work`` or a relaunch (hygiene, launch) raises.
        """
        while True:
            try:
                with self.watchdog():
                    return work(self.endpoint, self.next_relaunch)
            except Exception as exc:
                if not (needs_relaunch(exc) and self.next_relaunch):
                    if isinstance(exc, ServerGone) and self.handle is not None:
                        get_run_logger().warning("relaunch budget spent: %d of %d used (run.max_relaunches)",
                                                 self.relaunches, self.ctx.cfg.max_relaunches)
                    raise
            self.relaunch()

    def watchdog(self) -> contextlib.AbstractContextManager[HangWatchdog | None]:
        """The hang watchdog of the launched server (none for a shared server: not ours to kill)."""
        if self.handle is None:
            return contextlib.nullcontext()
        return HangWatchdog(self.handle, self.ctx.cfg.hang_timeout_s, get_run_logger())

    def relaunch(self, diagnose: bool = True, reason: str = "") -> None:
        """Count a relaunch, diagnose the gone server's log (unless done: then ``reason`` says why it
        went), stop it, clean its GPUs and launch again.

        Raises:
            Exception: what the stop, hygiene or launch raises (the session then has no server).
        """
        assert self.handle is not None
        self.relaunches += 1
        _tag_run(self.ctx.run_id, RELAUNCHED_TAG)
        gone = self.handle
        if diagnose:
            kind = diagnose_server(unlinked(self.ctx), unlinked(gone))
            reason = f"a runtime OOM at {gone.fraction}" if kind == "too_high" else f"the server died ({kind})"
        self.stop()
        hygiene(unlinked(self.ctx), f"relaunch-{self.relaunches}")
        self.handle = launch_server(unlinked(self.ctx), attempt=self.relaunches + 1,
                                    reason=reason or "the server was dropped")

    def stop(self) -> None:
        """Stop the server, if there is one (idempotent)."""
        if self.handle is not None:
            stop(unlinked(self.ctx), unlinked(self.handle))
            self.handle = None
        self._exited = time.monotonic()
