"""The servers of a run: one session per server, all launched at once, fed through one ServerPool.

``Fleet(ctx, total_rows)`` is a context manager around the run's inference. On entry it submits one
``serve-server`` task per server (a Prefect task run named ``server-<host>[gpu ...]``): the session
cleans its GPUs, launches with the tuned fraction (remembered per host), checks ``/health_generate``
and adds its server to ``fleet.pool``; a server someone else runs (``run.server_url``) is identified
and added with no launch and no hygiene. ``wait_ready()`` returns once one server serves and raises
the first launch error when none became ready (the others are reported and skipped).

A server the dispatcher drops (it died, hung and was killed by the hang watchdog, or its host became
unreachable) is diagnosed, then relaunched within ``run.max_relaunches`` (per server) once its host
answers, which is waited for at most ``run.host_wait_s``; otherwise it is given up and the run goes
on with the others. On exit every session stops its server, and ``report()`` (rows, tokens/s,
launches, what was lost and why) is logged and published as the ``servers-<partition>`` artifact;
while the run lasts, one progress artifact per server shows its rows and tokens/s.
"""

from __future__ import annotations

import contextvars
import threading
import time
from types import TracebackType
from typing import Any, Self
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NONE
from prefect.futures import PrefectFuture
from prefect.runtime import task_run

from flows.context import RunContext, unlinked
from flows.progress import artifact_key
from flows.session import ServerSession
from flows.stages import diagnose_server, health_check, hygiene
from tasks.inference import ServerPool
from tasks.targets import TargetUnreachable, parse_target, run_command

__all__ = ["Fleet", "serve_server"]

REPORT_EVERY_S = 10.0
_PROBE_TIMEOUT_S = 15.0


class Fleet:
    """The run's server sessions and their pool (see the module docstring).

    Args:
        ctx: the run (``ctx.cfg.servers()`` to launch, else ``ctx.cfg.server_urls`` to use).
        total_rows: the input records of the run, for each server's share in its progress artifact.
    """

    def __init__(self, ctx: RunContext, total_rows: int = 0) -> None:
        self.ctx = ctx
        self.total_rows = max(1, total_rows)
        self.pool = ServerPool()
        self.errors: dict[str, BaseException] = {}  # servers that never became ready
        self.left: dict[str, str] = {}  # servers that could not be stopped
        self.closing = threading.Event()
        self.relaunched: dict[str, int] = {}  # relaunches per server, once its session ended
        self.gpu_seconds: dict[str, float] = {}  # GPUs x time held per launched server
        self.members: list[tuple[str, RunContext]] = []
        cfg = ctx.cfg
        if ctx.launches:
            for slot in cfg.servers():
                server_ctx = ctx.for_server(cfg.for_server(slot))
                self.members.append((slot.label(server_ctx.gpus), server_ctx))
        else:
            self.members = [(url, ctx.for_server(cfg.for_url(url))) for url in cfg.server_urls]
        self._futures: list[PrefectFuture[Any]] = []
        self._artifacts: dict[str, UUID] = {}
        self._reporter: threading.Thread | None = None

    def __enter__(self) -> Self:
        for name, _ in self.members:
            self.pool.expect(name)
        for name, server_ctx in self.members:
            self._futures.append(serve_server.submit(unlinked(server_ctx), name, unlinked(self)))
        context = contextvars.copy_context()
        self._reporter = threading.Thread(target=context.run, args=(self._report_loop,),
                                          name="datagen-fleet-report", daemon=True)
        self._reporter.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.closing.set()
        self.pool.close()
        for future in self._futures:
            future.wait()
        if self._reporter is not None:
            self._reporter.join(timeout=30)
        self._publish(final=True)

    def wait_ready(self) -> None:
        """Wait for the first server to serve.

        Raises:
            Exception: the first server's launch error when none became ready (e.g. LaunchFailed).
        """
        if self.pool.wait_ready():
            return
        for name, _ in self.members:
            if name in self.errors:
                raise self.errors[name]
        raise RuntimeError(f"no server became ready: {self.pool.why_none()}")

    def report(self) -> list[dict[str, Any]]:
        """Per server: rows, tokens/s, launches, state, why it was dropped or lost, and whether it
        could not be stopped."""
        rows = self.pool.report()
        for r in rows:
            if r["server"] in self.left:
                r["left_running"] = self.left[r["server"]]
        return rows

    # -- artifacts ---------------------------------------------------------------------------------

    def _report_loop(self) -> None:
        while not self.closing.wait(REPORT_EVERY_S):
            self._publish(final=False)

    def _publish(self, final: bool) -> None:
        logger = get_run_logger()
        partition = self.ctx.cfg.name
        rows = self.report()
        for r in rows:
            text = (f"{r['server']}: {r['rows']} rows, {r['tokens_per_s']:.0f} tokens/s, {r['state']}"
                    + (f" ({r['lost']})" if r.get("lost") else ""))
            pct = min(100.0, 100.0 * r["rows"] / self.total_rows)
            try:
                artifact = self._artifacts.get(r["server"])
                if artifact is None:
                    created = create_progress_artifact(pct, key=artifact_key("server", partition, r["server"]),
                                                       description=text)
                    self._artifacts[r["server"]] = created  # type: ignore[assignment]
                else:
                    update_progress_artifact(artifact, pct, description=text)
            except Exception as exc:  # observability must never fail the run
                logger.warning("server progress artifact not updated: %s", exc)
        summary = "; ".join(f"{r['server']} {r['rows']} rows {r['tokens_per_s']:.0f} tok/s {r['state']}" for r in rows)
        logger.info("servers%s: %s", " (final)" if final else "", summary)
        if not final:
            return
        lines = [f"# Servers of {partition}", "", "| server | state | rows | tokens/s | launches | dropped / lost |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            why = "; ".join([*r["drops"], *([f"lost: {r['lost']}"] if r.get("lost") else []),
                             *([f"not stopped: {r['left_running']}"] if r.get("left_running") else [])])
            lines.append(f"| {r['server']} | {r['state']} | {r['rows']} | {r['tokens_per_s']:.0f} | "
                         f"{r['launches']} | {why.replace('|', '/')} |")
        try:
            create_markdown_artifact("\n".join(lines) + "\n", key=artifact_key("servers", partition),
                                     description=summary[:500])
        except Exception as exc:
            logger.warning("servers artifact not created: %s", exc)


def _session_name() -> str:
    return f"server-{task_run.parameters['name']}"


@task(name="serve-server", task_run_name=_session_name, cache_policy=NONE)
def serve_server(ctx: RunContext, name: str, fleet: Fleet) -> dict[str, Any]:
    """One server's session for the whole run: launch (or identify), serve until the run ends,
    relaunch when dropped within the budget, stop. Never raises for the server's sake: a server that
    never becomes ready or is lost is reported and the run goes on with the others."""
    logger = get_run_logger()
    pool = fleet.pool
    session = ServerSession(ctx)
    unreachable_launch = False  # a launch failed with its host unreachable: a server may run there
    why = ""  # why the last server was dropped ("" until one served)
    try:
        while True:
            try:
                _bring_up(ctx, session, why)
            except Exception as exc:
                lost_host = ctx.launches and not reachable(ctx.target)
                unreachable_launch = unreachable_launch or lost_host
                if lost_host and session.relaunches < ctx.cfg.max_relaunches and _wait_reachable(ctx, fleet):
                    if session.handle is None:
                        session.relaunches += 1  # a relaunch() counts its own
                    pool.expect(name, "relaunching")
                    continue
                reason = f"{type(exc).__name__}: {_short(exc)}"
                if not why:
                    fleet.errors[name] = exc
                    pool.give_up(name, f"never ready: {reason}")
                    logger.error("server %s never became ready (skipped): %s", name, reason)
                    return {"server": name, "state": "never ready"}
                pool.give_up(name, f"{why}; relaunch failed: {reason}")
                logger.error("server %s lost: relaunch failed: %s", name, reason)
                return {"server": name, "state": "lost"}
            try:
                lane = pool.add(name, session.endpoint, recoverable=ctx.launches)
            except ValueError as exc:  # it would generate other rows than the run's other servers
                fleet.errors[name] = exc
                pool.give_up(name, f"refused: {exc}")
                logger.error("server %s refused (skipped): %s", name, exc)
                return {"server": name, "state": "refused"}
            logger.info("server %s serving at %s", name, lane.endpoint.url)
            with session.watchdog() as dog:
                lane.dropped.wait()
            if pool.closed:
                return {"server": name, "state": "stopped", "relaunches": session.relaunches}
            why = _why_dropped(ctx, session, dog)
            lane.reason = f"{why}: {lane.reason}"
            budget = ctx.cfg.max_relaunches
            nxt = (f"the flow relaunches the server (relaunch {session.relaunches + 1}/{budget})"
                   if ctx.launches and session.relaunches < budget else "not relaunched")
            logger.warning("server %s dropped: %s; rows done are safe on disk; %s", name, lane.reason, nxt)
            if not ctx.launches:
                return {"server": name, "state": "lost"}  # someone else's server: not ours to relaunch
            if session.relaunches >= ctx.cfg.max_relaunches:
                pool.give_up(name, f"{why}; relaunch budget spent ({ctx.cfg.max_relaunches})")
                return {"server": name, "state": "lost"}
            if not _wait_reachable(ctx, fleet):
                pool.give_up(name, f"host unreachable for {ctx.cfg.host_wait_s:g} s" if why == "host unreachable"
                             else f"{why}; then its host was unreachable for {ctx.cfg.host_wait_s:g} s")
                return {"server": name, "state": "lost"}
            pool.expect(name, "relaunching")
    finally:
        _end(ctx, name, session, fleet, unreachable_launch)
        fleet.relaunched[name] = session.relaunches
        if session.held_s is not None:
            fleet.gpu_seconds[name] = session.held_s * len(ctx.gpus)


def _bring_up(ctx: RunContext, session: ServerSession, why: str) -> None:
    """Launch the session's server (clean GPUs first), or relaunch it when one is known (``why``:
    why it was dropped), and check that it generates."""
    if session.handle is None:
        session.start()
    else:
        oom = why == "died (too_high)"
        session.relaunch(diagnose=False, reason=f"a runtime OOM at {session.handle.fraction}" if oom else why)
    health_check(unlinked(ctx), session.endpoint)


def _end(ctx: RunContext, name: str, session: ServerSession, fleet: Fleet, unreachable_launch: bool) -> None:
    """Stop the session's server; when its host does not answer, wait for it (at most
    ``run.host_wait_s``) so that nothing is left running: stop it then, or clean its GPUs when a
    launch failed there. What still cannot be stopped is reported (``fleet.left``)."""
    logger = get_run_logger()
    deadline = time.monotonic() + ctx.cfg.host_wait_s
    delay = 1.0
    while True:
        try:
            if session.handle is not None:
                session.stop()
            elif unreachable_launch:
                hygiene(unlinked(ctx), "after-unreachable")
            return
        except Exception as exc:
            left = deadline - time.monotonic()
            if ctx.launches and left > 0 and not reachable(ctx.target):
                time.sleep(min(delay, left))
                delay = min(delay * 2, 15.0)
                continue
            handle = session.handle
            fleet.left[name] = f"pid {handle.pid if handle else '?'} on {ctx.host}: {type(exc).__name__}: {_short(exc)}"
            logger.error("server %s could not be stopped (%s): clean its GPUs once %s answers "
                         "(datagen clean-gpus --host %s)", name, _short(exc), ctx.host, ctx.target)
            return


def _why_dropped(ctx: RunContext, session: ServerSession, dog: Any) -> str:
    """Why a launched server was dropped: hung (the watchdog killed it), host unreachable, its port
    forward ended, or died (the log's classification; a runtime OOM is recorded so the relaunch
    starts lower)."""
    if getattr(dog, "fired", False):
        return f"hung (/health_generate failed for {ctx.cfg.hang_timeout_s:g} s while it ran; killed)"
    if session.handle is None:
        return "gone"
    if not reachable(ctx.target):
        return "host unreachable"
    if not session.handle.route_open():
        return "connection to its host lost (the SSH port forward ended)"
    return f"died ({diagnose_server(unlinked(ctx), unlinked(session.handle))})"


def reachable(target: str) -> bool:
    """Whether commands run on ``target`` now (local always does)."""
    if parse_target(target).is_local:
        return True
    try:
        return run_command(target, ["true"], timeout_s=_PROBE_TIMEOUT_S).ok
    except TargetUnreachable:
        return False


def _wait_reachable(ctx: RunContext, fleet: Fleet) -> bool:
    """Wait (backing off to 15 s between probes) until the server's host answers; False when the
    run ends first or ``run.host_wait_s`` passes."""
    deadline = time.monotonic() + ctx.cfg.host_wait_s
    delay = 1.0
    while not fleet.closing.is_set():
        if reachable(ctx.target):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        fleet.closing.wait(min(delay, left))
        delay = min(delay * 2, 15.0)
    return False


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
