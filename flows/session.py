"""The server session: one object per inference server of a run, from clean GPUs to a stopped server.

``ServerSession(ctx)`` is a context manager. On entry it runs the before-launch GPU hygiene and
launches the server with the tuned memory fraction (or, for a shared server given as
``run.server_url``, does neither and asks the server who it is: the rows' fingerprint). ``run(work)`` calls ``work(endpoint)`` under the hang watchdog;
when the server dies or hangs (``ServerGone``) it diagnoses the log (a runtime OOM is recorded so
the relaunch starts lower), stops the server, cleans its GPUs, relaunches, and calls ``work``
again: inference resumes from the committed shards and journals. ``run.max_relaunches`` is one
budget for the whole session, shared by every dataset; once spent, the error propagates. On exit
the server is stopped whatever happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

from prefect import get_run_logger

from flows.context import RunContext
from flows.retry import needs_relaunch
from flows.stages import diagnose_server, hygiene, identify_server, launch_server, stop
from tasks.inference import Endpoint
from tasks.server import HangWatchdog, ServerHandle

__all__ = ["ServerSession"]

T = TypeVar("T")


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

    def __enter__(self) -> Self:
        self.start()
        return self

    def start(self) -> None:
        """Clean the GPUs and launch (or identify a shared server)."""
        if self.ctx.launches:
            hygiene(self.ctx, "before-launch")
            self.handle = launch_server(self.ctx)
        else:
            self.fingerprint = identify_server(self.ctx)

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

    def run(self, work: Callable[[Endpoint], T]) -> T:
        """``work(endpoint)`` until it returns, relaunching the server when it is gone.

        Raises:
            ServerGone: the server is gone and the relaunch budget is spent (or the server is shared).
            Exception: whatever ``work`` or a relaunch (hygiene, launch) raises.
        """
        while True:
            try:
                with self.watchdog():
                    return work(self.endpoint)
            except Exception as exc:
                if not (needs_relaunch(exc) and self.handle is not None
                        and self.relaunches < self.ctx.cfg.max_relaunches):
                    raise
            self.relaunch()

    def watchdog(self) -> contextlib.AbstractContextManager[HangWatchdog | None]:
        """The hang watchdog of the launched server (none for a shared server: not ours to kill)."""
        if self.handle is None:
            return contextlib.nullcontext()
        return HangWatchdog(self.handle, self.ctx.cfg.hang_timeout_s, get_run_logger())

    def relaunch(self, diagnose: bool = True) -> None:
        """Count a relaunch, diagnose the gone server's log (unless done), stop it, clean its GPUs
        and launch again.

        Raises:
            Exception: what the stop, hygiene or launch raises (the session then has no server).
        """
        assert self.handle is not None
        self.relaunches += 1
        if diagnose:
            diagnose_server(self.ctx, self.handle)
        self.stop()
        hygiene(self.ctx, f"relaunch-{self.relaunches}")
        self.handle = launch_server(self.ctx)

    def stop(self) -> None:
        """Stop the server, if there is one (idempotent)."""
        if self.handle is not None:
            stop(self.ctx, self.handle)
            self.handle = None
