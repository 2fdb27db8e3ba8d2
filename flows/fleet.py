"""The servers of a run: one lifecycle per server, all started at once, fed through one ServerPool.

``Fleet(ctx, total_rows)`` is a context manager around the run's inference. On entry it submits one
``serve-server`` task per server (a Prefect task run named ``server-<host>[gpu ...]``), which runs
that server's whole lifecycle (:func:`serve_server`): hygiene -> launch (tuned, the fraction
remembered per host) -> health -> serve -> (relaunch within ``run.max_relaunches``) -> stop. A
server someone else runs (``run.server_url``) is identified and served, with no hygiene, launch or
stop. ``wait_ready()`` returns once one server serves and raises the first launch error when none
became ready (the others are reported and skipped).

A server the dispatcher drops (it died, hung and was killed by the hang watchdog, or its host became
unreachable) is diagnosed, then relaunched within its budget once its host answers, which is waited
for at most ``run.host_wait_s``; otherwise it is given up and the run goes on with the others. Each
lifecycle returns one :class:`ServerResult`; on exit ``results`` holds them all, ``report()`` (rows,
tokens/s, launches, what was lost and why) is logged and published as the ``servers-<partition>``
artifact; while the run lasts, one progress artifact per server shows its rows and tokens/s.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.events import emit_event
from prefect.futures import PrefectFuture
from prefect.runtime import task_run
from prefect.utilities.annotations import quote

from flows import runrecord
from flows.lifecycle import Drop, DropKind, Lifecycle, Move, Phase
from flows.progress import fmt_duration
from flows.retry import health_check, hygiene, identify_server, launch_server
from tasks.artifacts import artifact_key
from tasks.inference import (
    Bucket,
    Endpoint,
    Ledger,
    LedgerView,
    RunLedger,
    ServerPool,
    ServerReport,
    measure_capacity,
    probe_prompts,
)
from tasks.poll import Backoff, poll_until
from tasks.run import RunContext
from tasks.server import HangWatchdog, ServerHandle, flag_value
from tasks.server.task import adopt_server, diagnose_server, plan_key, stop
from tasks.targets import TargetUnreachable, parse_target, run_command

__all__ = ["RELAUNCHED_TAG", "Fleet", "GoodputWatch", "ServerResult", "serve_server"]

RELAUNCHED_TAG = "relaunched"  # on the flow run: the run list tells a relaunched run from a clean one

REPORT_EVERY_S = 10.0
_PROBE_TIMEOUT_S = 15.0


@dataclass
class ServerResult:
    """How one server's lifecycle ended.

    Args:
        name: the server (``host[gpu ...]`` or its URL).
        phase: its terminal phase (flows.lifecycle.Phase): stopped (served until the run ended),
            never ready, refused (it would generate other rows than the run's other servers) or lost.
        relaunches: relaunches used.
        gpu_seconds: GPUs x seconds the lifecycle held them (hygiene to stop); 0 for a shared server.
        error: why it never became ready or was refused, else None.
        left_running: what could not be stopped ("" when all was).
        ledger: where its GPU-time went (tasks/inference/_ledger.py), None when it crashed.
    """

    name: str
    phase: Phase = Phase.STOPPED
    relaunches: int = 0
    gpu_seconds: float = 0.0
    error: BaseException | None = None
    left_running: str = ""
    ledger: LedgerView | None = None


class Fleet:
    """The run's server lifecycles and their pool (see the module docstring).

    Args:
        ctx: the run (``ctx.cfg.servers()`` to launch, else ``ctx.cfg.server_urls`` to use).
        total_rows: the input records of the run, for each server's share in its progress artifact.
    """

    def __init__(self, ctx: RunContext, total_rows: int = 0) -> None:
        self.ctx = ctx
        self.total_rows = max(1, total_rows)
        self.pool = ServerPool()
        self.closing = threading.Event()
        self.results: list[ServerResult] = []  # one per server, once the fleet has exited
        self.members: list[tuple[str, RunContext]] = []
        cfg = ctx.cfg
        if ctx.launches:
            for slot in cfg.servers():
                server_ctx = ctx.for_server(cfg.for_server(slot))
                self.members.append((slot.label(server_ctx.gpus), server_ctx))
        else:
            self.members = [(url, ctx.for_server(cfg.for_url(url))) for url in cfg.server_urls]
        # one GPU-time ledger per server lifecycle (a shared server's counts its seconds, no GPUs)
        self.ledgers = {name: Ledger(member.gpu_count if member.launches else 0) for name, member in self.members}
        self.goodput = GoodputWatch(cfg.goodput_warn_below, cfg.goodput_window_s)
        self._futures: list[PrefectFuture[ServerResult]] = []
        self._artifacts: dict[str, UUID] = {}
        self._reporter: threading.Thread | None = None

    def __enter__(self) -> Self:
        for name, _ in self.members:
            self.pool.expect(name)
        for name, server_ctx in self.members:
            self._futures.append(serve_server.submit(server_ctx, name, self.pool,
                                                     self.closing, self.ledgers[name]))
        context = contextvars.copy_context()
        self._reporter = threading.Thread(target=context.run, args=(self._report_loop,),
                                          name="datagen-fleet-report", daemon=True)
        self._reporter.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.closing.set()
        self.pool.close()
        self.results = [self._result(f, name) for f, (name, _) in zip(self._futures, self.members, strict=True)]
        if self._reporter is not None:
            self._reporter.join(timeout=30)
        self._publish(final=True)

    @staticmethod
    def _result(future: PrefectFuture[ServerResult], name: str) -> ServerResult:
        future.wait()
        try:
            return future.result()
        except BaseException as exc:  # the lifecycle never raises for its server; a crash is reported
            return ServerResult(name, Phase.LOST, error=exc)

    def wait_ready(self) -> None:
        """Wait for the first server to serve.

        Raises:
            Exception: the first server's launch error when none became ready (e.g. LaunchFailed).
        """
        if self.pool.wait_ready():
            return
        for future, (name, _) in zip(self._futures, self.members, strict=True):
            error = self._result(future, name).error
            if error is not None:
                raise error
        raise RuntimeError(f"no server became ready: {self.pool.why_none()}")

    @property
    def gpus(self) -> int:
        """The GPUs of the run's launched servers (at least 1)."""
        return max(1, sum(member.gpu_count for _, member in self.members))

    def ledger(self) -> RunLedger:
        """Where the run's GPU-time went so far, per server and in all (tasks/inference/_ledger.py)."""
        return RunLedger({name: ledger.view() for name, ledger in self.ledgers.items()})

    def report(self) -> list[ServerReport]:
        """Per server: rows, tokens/s, launches, state, why it was dropped or lost, and whether it
        could not be stopped."""
        left = {r.name: r.left_running for r in self.results if r.left_running}
        return [dataclasses.replace(r, left_running=left[r.server]) if r.server in left else r
                for r in self.pool.report()]

    # -- artifacts ---------------------------------------------------------------------------------

    def _report_loop(self) -> None:
        """Publish the servers' progress every REPORT_EVERY_S; watch goodput more often when its
        window is short (a quarter of it, at least every half second)."""
        every = min(REPORT_EVERY_S, max(0.5, self.goodput.window_s / 4)) if self.goodput.on else REPORT_EVERY_S
        published = time.monotonic()
        while not self.closing.wait(every):
            self._watch_goodput()
            if time.monotonic() - published >= REPORT_EVERY_S - 1e-3:
                published = time.monotonic()
                self._publish(final=False)

    def _watch_goodput(self) -> None:
        """Warn (the log, and a ``datagen.goodput.low`` event `datagen up`'s automation can notify on)
        once goodput has stayed below ``run.goodput_warn_below`` for ``run.goodput_window_s``."""
        ledger = self.ledger()
        warning = self.goodput.observe(ledger)
        if warning:
            get_run_logger().warning("%s", warning)
            _emit_goodput_low(self.ctx.run_id, self.ctx.cfg.name, warning, ledger)

    def _publish(self, final: bool) -> None:
        logger = get_run_logger()
        partition = self.ctx.cfg.name
        rows = self.report()
        for r in rows:
            text = f"{r.server}: {r.rows} rows, {r.tokens_per_s:.0f} tokens/s, {r.state}" + (f" ({r.lost})" if r.lost else "")
            pct = min(100.0, 100.0 * r.rows / self.total_rows)
            try:
                artifact = self._artifacts.get(r.server)
                if artifact is None:
                    created = create_progress_artifact(pct, key=artifact_key("server", partition, r.server),
                                                       description=text)
                    self._artifacts[r.server] = created  # type: ignore[assignment]
                else:
                    update_progress_artifact(artifact, pct, description=text)
            except Exception as exc:  # observability must never fail the run
                logger.warning("server progress artifact not updated: %s", exc)
        ledger = self.ledger()
        good = {name: f" goodput {100 * g:.0f}%" for name, v in ledger.servers.items()
                if (g := v.goodput) is not None}
        summary = "; ".join(f"{r.server} {r.rows} rows {r.tokens_per_s:.0f} tok/s {r.state}{good.get(r.server, '')}"
                            for r in rows)
        logger.info("servers%s: %s; %s", " (final)" if final else "", summary, ledger.headline())
        if not final:
            return
        lines = [f"# Servers of {partition}", "", "| server | state | rows | tokens/s | launches | dropped / lost |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r.server} | {r.state} | {r.rows} | {r.tokens_per_s:.0f} | "
                         f"{r.launches} | {r.why().replace('|', '/')} |")
        try:
            create_markdown_artifact("\n".join(lines) + "\n", key=artifact_key("servers", partition),
                                     description=summary[:500])
        except Exception as exc:
            logger.warning("servers artifact not created: %s", exc)


class GoodputWatch:
    """Whether a run's goodput has stayed low: ``observe`` the run's ledger now and then; goodput
    over the last ``window_s`` (the change of the ledger since, so the launch weighs only while it
    is in the window) below ``below`` gives one warning naming the biggest loss, again only after it
    rose above once. ``below`` 0: never."""

    def __init__(self, below: float, window_s: float) -> None:
        self.below, self.window_s = below, window_s
        self._seen: list[tuple[float, RunLedger]] = []
        self._warned = False

    @property
    def on(self) -> bool:
        return self.below > 0 and self.window_s > 0

    def observe(self, ledger: RunLedger, now: float | None = None) -> str | None:
        """The warning to give now, if any."""
        if not self.on:
            return None
        now = time.monotonic() if now is None else now
        self._seen.append((now, ledger))
        while len(self._seen) > 1 and now - self._seen[1][0] >= self.window_s:
            self._seen.pop(0)
        then, earlier = self._seen[0]
        if now - then < self.window_s:
            return None  # not a whole window yet
        window = RunLedger({name: v.minus(earlier.servers[name]) if name in earlier.servers else v
                            for name, v in ledger.servers.items()})
        good = window.goodput
        if good is None:
            return None
        if good >= self.below:
            self._warned = False
            return None
        if self._warned:
            return None
        self._warned = True
        worst = window.biggest_loss()
        where = (f"; the biggest loss is {Bucket(worst[0]).label}: {100 * worst[1] / window.total_gpu_s:.0f}% "
                 "of the GPU-time" if worst and window.total_gpu_s > 0 else "")
        return (f"goodput {100 * good:.0f}% over the last {fmt_duration(now - then)}, below "
                f"run.goodput_warn_below {100 * self.below:.0f}%{where}")


def _emit_goodput_low(run_id: str | None, partition: str, warning: str, ledger: RunLedger) -> None:
    """The ``datagen.goodput.low`` event of the flow run (never raises: observability)."""
    if not run_id:
        return
    worst = ledger.biggest_loss()
    try:
        emit_event("datagen.goodput.low", resource={"prefect.resource.id": f"prefect.flow-run.{run_id}"},
                   payload={"message": warning, "partition": partition, "goodput": ledger.goodput,
                            "biggest_loss": worst[0] if worst else None})
    except Exception as exc:
        get_run_logger().warning("goodput event not emitted: %s", exc)


def _lifecycle_name() -> str:
    return f"server-{task_run.parameters['name']}"


class _Server:
    """The state of one lifecycle: its phase (``life``), the server now running (if any), GPU time held."""

    def __init__(self, ctx: RunContext, ledger: Ledger | None = None) -> None:
        self.ctx = ctx
        self.life = Lifecycle(budget=ctx.cfg.max_relaunches if ctx.launches else 0)
        self.ledger = ledger if ledger is not None else Ledger(ctx.gpu_count if ctx.launches else 0)
        self.handle: ServerHandle | None = None
        self.fingerprint = ctx.fingerprint
        self.error: BaseException | None = None  # why it never became ready, or was refused
        # the pid of a server a launch started and has not handed back as its handle: when the launch
        # then fails, that server may still run (its host was lost between the start and the leash)
        self.unowned: int | None = None
        self.stray_launch = False  # a launch failed and may have left a server running: clean its GPUs at the end

    @property
    def endpoint(self) -> Endpoint:
        """Where to send requests now (it changes with a relaunch). A closed port forward reads as
        gone at once: the server cannot be reached through it."""
        cfg = self.ctx.cfg
        if self.handle is None:
            assert cfg.server_url is not None, "a launched server's endpoint before its launch"
            return Endpoint(cfg.server_url, self.fingerprint, cfg.api_key())
        return Endpoint(self.handle.url, self.fingerprint, cfg.api_key(), alive=self.handle.reachable_and_alive)

    def watchdog(self) -> contextlib.AbstractContextManager[HangWatchdog | None]:
        """The hang watchdog of a launched server (none for a shared one: not ours to kill)."""
        if self.handle is None:
            return contextlib.nullcontext()
        return HangWatchdog(self.handle, self.ctx.cfg.hang_timeout_s, get_run_logger())

    def result(self, name: str, left_running: str) -> ServerResult:
        view = self.ledger.view()
        held = view.total_s if self.ctx.launches else 0.0  # hygiene to the end of the stop
        return ServerResult(name, self.life.phase, self.life.relaunches, held * self.ctx.gpu_count, self.error,
                            left_running, view)


@task(name="serve-server", task_run_name=_lifecycle_name, cache_policy=NONE)
def serve_server(ctx: RunContext, name: str, pool: ServerPool, closing: threading.Event,
                 ledger: Ledger | None = None) -> ServerResult:
    """One server's lifecycle for the whole run (flows.lifecycle): serve once, again after each
    relaunch, until it reaches a terminal phase; then stop. A shared server (``run.server_url``)
    is identified, checked and served only. Never raises for the server's sake: a server that never
    becomes ready or is lost is reported and the run goes on with the others. ``ledger`` counts
    its GPU-time from the start of its hygiene to the end of its stop (None: one of its own)."""
    server = _Server(ctx, ledger)
    server.life.move(Move.START)
    get_run_logger().info("server %s lifecycle begins: its GPU-time ledger counts from here", name)
    server.ledger.step(Bucket.HYGIENE if ctx.launches else Bucket.HEALTH)
    try:
        while not server.life.phase.terminal:
            _serve_once(server, name, pool, closing)
    finally:
        server.ledger.step(Bucket.STOP)
        left = _end(server, name)
        server.ledger.end()
        get_run_logger().info("server %s lifecycle: %s", name, server.life.path())
    return server.result(name, left)


def _serve_once(server: _Server, name: str, pool: ServerPool, closing: threading.Event) -> None:
    """One bring-up and, when it serves, one serving spell, each outcome a move of the lifecycle."""
    ctx, life, logger = server.ctx, server.life, get_run_logger()
    try:
        _bring_up(server)
    except Exception as exc:
        _bring_up_failed(server, name, exc, pool, closing)
        return
    try:
        lane = pool.add(name, server.endpoint, recoverable=ctx.launches, ledger=server.ledger,
                        slots=server.ledger.capacity.slots if server.ledger.capacity is not None else None)
    except ValueError as exc:  # it would generate other rows than the run's other servers
        pool.give_up(name, f"refused: {exc}")
        logger.error("server %s refused (skipped): %s", name, exc)
        server.error = exc
        life.move(Move.REFUSE)
        return
    life.move(Move.READY)
    logger.info("server %s serving at %s", name, lane.endpoint.url)
    with server.watchdog() as dog:
        lane.dropped.wait()
    if pool.closed:
        life.move(Move.STOP)
        return
    life.dropped(_why_dropped(server, dog))
    lane.reason = f"{life.drop}: {lane.reason}"
    _relaunch_or_lose(server, name, lane.reason, pool, closing)


def _bring_up_failed(server: _Server, name: str, exc: Exception, pool: ServerPool, closing: threading.Event) -> None:
    """A bring-up raised: try again once its lost host answers (within the budget), else the server
    never became ready (first bring-up) or is lost (a relaunch)."""
    ctx, life, logger = server.ctx, server.life, get_run_logger()
    lost_host = ctx.launches and not nodes_reachable(ctx)
    unowned, server.unowned = server.unowned, None
    if unowned is not None:
        logger.warning("a failed launch on %s had started pid %s: its GPUs are cleaned when this "
                       "server's lifecycle ends", ctx.host, unowned)
    server.stray_launch = server.stray_launch or lost_host or unowned is not None
    if lost_host and life.budget_left and _wait_reachable(ctx, closing):
        life.move(Move.RETRY)
        pool.expect(name, "relaunching")
        return
    reason = f"{type(exc).__name__}: {_short(exc)}"
    if life.phase is Phase.STARTING:
        pool.give_up(name, f"never ready: {reason}")
        logger.error("server %s never became ready (skipped): %s", name, reason)
        server.error = exc
    else:
        pool.give_up(name, f"{life.drop}; relaunch failed: {reason}")
        logger.error("server %s lost: relaunch failed: %s", name, reason)
    life.move(Move.FAIL)


def _relaunch_or_lose(server: _Server, name: str, reason: str, pool: ServerPool, closing: threading.Event) -> None:
    """After a drop: relaunch within the budget once the host answers, else give the server up."""
    ctx, life = server.ctx, server.life
    drop = life.drop
    assert drop is not None
    nxt = (f"its lifecycle relaunches it (relaunch {life.relaunches + 1}/{life.budget})" if life.budget_left
           else "not relaunched")
    get_run_logger().warning("server %s dropped: %s; rows done are safe on disk; %s", name, reason, nxt)
    if not ctx.launches:
        life.move(Move.GIVE_UP)  # someone else's server: not ours to relaunch
        return
    if not life.budget_left:
        pool.give_up(name, f"{drop}; relaunch budget spent ({life.budget})")
        life.move(Move.GIVE_UP)
        return
    if not _wait_reachable(ctx, closing):
        waited = f"{ctx.cfg.host_wait_s:g} s"
        pool.give_up(name, f"host unreachable for {waited}" if drop.kind is DropKind.HOST_UNREACHABLE
                     else f"{drop}; then its host was unreachable for {waited}")
        life.move(Move.GIVE_UP)
        return
    pool.expect(name, "relaunching")
    life.move(Move.RELAUNCH)


def _bring_up(server: _Server) -> None:
    """The lifecycle's first stages: hygiene -> launch -> health (a shared server: identify ->
    health). A relaunch stops the dropped server first, and after a runtime OOM starts lower."""
    ctx, life, ledger = server.ctx, server.life, server.ledger
    # a relaunch's bring-up is all the relaunch's time in the ledger; the first is step by step
    again = life.relaunches > 0 or life.phase is Phase.RELAUNCHING
    steps = (lambda b: ledger.step(Bucket.RELAUNCH)) if again else ledger.step
    if not ctx.launches:
        steps(Bucket.HEALTH)
        server.fingerprint = identify_server(ctx)
    elif life.phase is Phase.STARTING and server.handle is None and len(ctx.nodes) == 1 and _adopted(server):
        _probe(server)
        return  # a dead run's server, kept by its guardian for this run: no hygiene, no launch
    else:
        phase, reason = "before-launch", ""
        steps(Bucket.HYGIENE)
        if server.handle is not None:  # the dropped server, to replace
            _tag_run(ctx.run_id, RELAUNCHED_TAG)
            drop = life.drop
            reason = (f"a runtime OOM at {server.handle.fraction}" if drop is not None and drop.runtime_oom
                      else str(drop or "the server was dropped"))
            _stop(server)
            phase = f"relaunch-{life.relaunches}"
        hygiene(ctx, phase)
        steps(Bucket.LAUNCH)
        server.handle = launch_server(ctx, attempt=life.relaunches + 1, reason=reason,
                                      on_started=_record_started(server))
        server.unowned = None  # the handle owns it now
        _record_ready(server)
    steps(Bucket.HEALTH)
    health_check(ctx, server.endpoint)
    _probe(server)


def _probe(server: _Server) -> None:
    """Measure the server's capacity (tasks/inference/_capacity.py) on the run's prompts, unless
    ``run.capacity_probe_tokens`` is 0; a probe that fails leaves the capacity unknown (goodput is
    then not given) and the run goes on."""
    ctx = server.ctx
    tokens = ctx.cfg.capacity_probe_tokens
    if tokens <= 0:
        return
    logger = get_run_logger()
    endpoint = server.endpoint
    try:
        prompts = probe_prompts(ctx.cfg.datasets, ctx.cfg.model_path, 64)
        # a hung server fails its probe within the run's own bound of a hang (at least 30 s)
        cap = measure_capacity(endpoint, prompts, tokens=tokens, timeout_s=max(30.0, ctx.cfg.hang_timeout_s))
    except Exception as exc:
        logger.warning("capacity probe of %s failed (%s): its goodput is not measured", endpoint.url, _short(exc))
        return
    server.ledger.capacity = cap
    others = f", {cap.others_running} other request(s) running on it" if cap.others_running else ""
    logger.info("capacity of %s: %.0f output tokens/s at full batch (%d slots x %d tokens in %.1f s%s)",
                endpoint.url, cap.tokens_per_s, cap.slots, tokens, cap.seconds, others)


def _record_ready(server: _Server) -> None:
    """The run record's entry of the ready server: what the next run needs to adopt it should this
    run die (its plan, port and fraction)."""
    ctx, handle = server.ctx, server.handle
    assert handle is not None
    runrecord.server_ready(ctx.run_id, handle.pid, target=ctx.target, pgid=handle.pgid, url=handle.url,
                           log=str(handle.log_path), plan=plan_key(ctx), port=_server_port(handle),
                           fraction=handle.fraction)
    for rank in handle.ranks:  # nodes 1..: recorded too, each ended by its own leash should the run die
        # a new entry first: another host's server may have the same pid, and must keep its own
        runrecord.server_started(ctx.run_id, rank.target, rank.pid, rank.pid)
        runrecord.server_ready(ctx.run_id, rank.pid, target=rank.target, pgid=rank.pid, url="",
                               log=rank.log_path)


def _server_port(handle: ServerHandle) -> int | None:
    """The port the server listens on, on its target (a remote server's URL is its forward's local end):
    the ``--port N`` its command was built with (tasks.server.build_command)."""
    port = flag_value(handle.command, "--port")
    return int(port) if port is not None else None


def _adopted(server: _Server) -> bool:
    """Take over a server a dead run of this machine launched for the same plan, if its guardian
    still waits out its grace (tasks/server/_leash.py), and check that it generates. True when it
    serves this run now; False (after stopping it again when it failed its check) when the lifecycle
    must clean and launch as usual."""
    ctx = server.ctx
    logger = get_run_logger()
    for dead_run, entry in runrecord.adoptable(ctx.run_id, ctx.target, plan_key(ctx)):
        if ctx.explicit_fraction is not None and entry.fraction != ctx.explicit_fraction:
            continue  # the user asked for another fraction than it runs with
        assert entry.port is not None
        try:
            handle = adopt_server(ctx, pid=entry.pid, started=entry.started, port=entry.port,
                                  fraction=entry.fraction, log_path=entry.log or "", from_run=dead_run)
        except Exception as exc:
            logger.warning("server pid %s of dead run %s not adopted: %s", entry.pid, dead_run, _short(exc))
            continue
        if handle is None:
            continue
        runrecord.server_state(dead_run, entry.pid, runrecord.ServerState.ADOPTED, entry.target)
        runrecord.server_started(ctx.run_id, ctx.target, handle.pid, handle.pgid)
        server.handle = handle
        _record_ready(server)
        try:
            health_check(ctx, server.endpoint)
        except Exception as exc:
            logger.warning("adopted server pid %s failed its health check (%s): stopped, launching anew",
                           handle.pid, _short(exc))
            _stop(server)
            return False
        return True
    return False


def _unlinked(handle: ServerHandle) -> ServerHandle:
    """``handle`` as a task argument the run's graph draws no edge for (Prefect's ``quote``): it holds
    the config's strings, which Prefect would trace to load-config (decision 83)."""
    return cast(ServerHandle, quote(handle))


def _record_started(server: _Server) -> Callable[[int, int], None]:
    """``on_started`` of the launch: the server's pid in the run record before it is ready (a flow
    SIGKILLed while its server loads leaves it running, and the next run ends it from this record:
    runrecord.end_dead_servers), and in ``server.unowned`` until the launch returns its handle."""
    ctx = server.ctx

    def started(pid: int, pgid: int) -> None:
        server.unowned = pid
        runrecord.server_started(ctx.run_id, ctx.target, pid, pgid)

    return started


def _stop(server: _Server) -> None:
    if server.handle is not None:
        handle = server.handle
        stop(server.ctx, _unlinked(handle))
        server.handle = None
        with contextlib.suppress(OSError):  # the record is for recovery; a stopped server needs none
            runrecord.server_state(server.ctx.run_id, handle.pid, runrecord.ServerState.STOPPED, server.ctx.target)
            for rank in handle.ranks:
                runrecord.server_state(server.ctx.run_id, rank.pid, runrecord.ServerState.STOPPED, rank.target)


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


def _end(server: _Server, name: str) -> str:
    """The last stage: stop the server; when its host does not answer, wait for it (at most
    ``run.host_wait_s``) so that nothing is left running: stop it then, or clean its GPUs when a
    launch failed there with its host unreachable or after it had started a server (a host lost
    between the start and the server's leash leaves it running, and the launch's retry then finds
    its port taken). Returns what still could not be stopped ("" when nothing)."""
    ctx = server.ctx
    logger = get_run_logger()
    host_wait = Backoff(ctx.cfg.host_wait_s, 1.0, 15.0)
    while True:
        try:
            if server.handle is not None:
                _stop(server)
            elif server.stray_launch:
                hygiene(ctx, "after-failed-launch")
            return ""
        except Exception as exc:
            if ctx.launches and host_wait.left > 0 and not nodes_reachable(ctx) and host_wait.wait():
                continue
            handle = server.handle
            logger.error("server %s could not be stopped (%s): clean its GPUs once %s answers "
                         "(%s)", name, _short(exc), ctx.host,
                         "; ".join(f"datagen clean-gpus --host {node}" for node in ctx.nodes))
            return f"pid {handle.pid if handle else '?'} on {ctx.host}: {type(exc).__name__}: {_short(exc)}"


def _why_dropped(server: _Server, dog: HangWatchdog | None) -> Drop:
    """Why a server was dropped: hung (the watchdog killed it), host unreachable, its port forward
    ended, or died (the log's classification; a runtime OOM is recorded so the relaunch starts
    lower); a server that is not ours is just gone."""
    ctx = server.ctx
    if dog is not None and dog.fired:
        return Drop(DropKind.HUNG, hang_s=ctx.cfg.hang_timeout_s)
    if server.handle is None:
        return Drop(DropKind.GONE)
    if not nodes_reachable(ctx):
        return Drop(DropKind.HOST_UNREACHABLE)
    if not server.handle.route_open():
        return Drop(DropKind.ROUTE_LOST)
    lost = server.handle.lost_rank  # set by the watchdog when a rank's death took the server down
    return Drop(DropKind.DIED, diagnose_server(ctx, _unlinked(server.handle)),
                node=f"node {lost.rank} ({lost.host})" if lost is not None else "")


def reachable(target: str) -> bool:
    """Whether commands run on ``target`` now (local always does)."""
    if parse_target(target).is_local:
        return True
    try:
        return run_command(target, ["true"], timeout_s=_PROBE_TIMEOUT_S).ok
    except TargetUnreachable:
        return False


def nodes_reachable(ctx: RunContext) -> bool:
    """Whether commands run on every host of the server (node 0 alone for a server on one host)."""
    return all(reachable(node) for node in ctx.nodes)


def _wait_reachable(ctx: RunContext, closing: threading.Event) -> bool:
    """Wait (backing off to 15 s between probes) until the server's host answers; False when the
    run ends first or ``run.host_wait_s`` passes."""
    answered = poll_until(lambda: closing.is_set() or nodes_reachable(ctx), ctx.cfg.host_wait_s, 1.0, 15.0,
                          closing.wait)
    return answered and not closing.is_set()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
