"""The server stage's Prefect tasks: launch SGLang with the tuned ``--mem-fraction-static``, check its
health, identify a shared server, diagnose a dead one, stop it. Each writes what a person needs in
the UI (the launch artifact, rewritten when that server dies). The server's lifecycle
(flows/fleet.py) calls them in order and keeps the run record; flows/retry.py says which retry."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from tasks import http
from tasks.artifacts import artifact_key, gpu_label, markdown, run_name
from tasks.inference import Endpoint, external_fingerprint
from tasks.run import RunContext
from tasks.server import (
    DEFAULT_PORT,
    Failure,
    LaunchReport,
    ServerHandle,
    adopt_running,
    build_command,
    classify_failure,
    flag_value,
    launch,
    launch_tuned,
    on_node,
    record_runtime_oom,
    stop_server,
)
from tasks.server._port import free_port_on
from tasks.targets import host_of, parse_target

__all__ = ["LOW_HEADROOM_GIB", "adopt_server", "diagnose_server", "health_check", "identify_server", "launch_server",
           "plan_key", "stop"]

# The launch artifact of each server of this process's runs, ``(run id, pid) -> (artifact id, its
# markdown)``: rewritten to lead with the death when that server dies (server threads share it).
_LAUNCH_ARTIFACTS: dict[tuple[str | None, int], tuple[UUID, str]] = {}
_LAUNCH_ARTIFACTS_LOCK = threading.Lock()
LOW_HEADROOM_GIB = 1.0  # GPU memory left after graph capture below which a long prefill batch may OOM


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@task(task_run_name=run_name("launch-{host}-{gpus}-{attempt}{again}"), cache_policy=NONE)
def launch_server(ctx: RunContext, attempt: int = 1, reason: str = "",
                  on_started: Callable[[int, int], None] | None = None) -> ServerHandle:
    """Launch SGLang (or the emulator) with the tuned ``--mem-fraction-static``; returns the handle.

    The run's explicit ``mem_fraction_static`` (a run parameter or ``--mem-fraction-static``) wins
    over the remembered fraction on the first launch; a relaunch starts from memory, which a
    runtime OOM has just lowered.

    Args:
        ctx: the run.
        attempt: 1 for the run's first launch, k + 1 for relaunch k (named so in the run).
        reason: why the server is relaunched (e.g. "a runtime OOM at 0.93").
        on_started: called with the server's pid and process group as soon as it is started,
            before it is ready (the run record: a flow SIGKILLed while the server loads leaves it
            running, and the next run ends it).

    Raises:
        LaunchFailed: no fraction worked, or a failure no fraction fixes (retried when transient).
    """
    cfg = ctx.cfg
    port = cfg.server.port or (_free_port(cfg.server.launch.host) if ctx.target == "local" else DEFAULT_PORT)
    pinned = ctx.explicit_fraction if attempt == 1 else None
    server_cfg = cfg.server_config(port, ctx.parser)
    if server_cfg.peer_nodes:
        server_cfg = dataclasses.replace(server_cfg, dist_init_addr=dist_init_addr(ctx))
    handle, report = launch_tuned(server_cfg, parse_target(ctx.target), ctx.plan.log_dir,
                                  on_started=on_started, pinned=pinned,
                                  launcher=functools.partial(launch, keep_s=cfg.server_grace_s))
    relaunch = f"relaunch {attempt - 1}/{cfg.max_relaunches} after {reason}" if attempt > 1 else ""
    start = relaunch or _start_source(report)
    headroom = handle.headroom_gib
    low = headroom is not None and headroom < LOW_HEADROOM_GIB
    logger = get_run_logger()
    lines = [f"# Server launch {attempt} on `{ctx.host}` {gpu_label(ctx.gpus)}", "",
             f"- --mem-fraction-static: **{report.fraction}** (start: {start}; memory: {report.store})",
             f"- headroom after graph capture: {headroom if headroom is not None else '?'} GiB"
             + (f" **LOW**: under {LOW_HEADROOM_GIB:g} GiB left for activations, a long prefill batch may "
                "run out of memory (lower mem_fraction_static)" if low else ""),
             f"- relaunch budget: {attempt - 1} of {cfg.max_relaunches} used",
             f"- url: `{handle.url}` (this run's server: stopped when the run ends)",
             f"- pid {handle.pid}, log `{handle.log_path}`",
             *_node_lines(handle),
             f"- attempts ({len(report.attempts)}): {report.summary()}"]
    _launch_artifact(ctx, handle.pid, lines, f"{'WARN' if low else 'OK'}: launch {attempt} on {ctx.host} "
                                             f"{gpu_label(ctx.gpus)} at fraction {report.fraction}"
                                             + (f" ({relaunch})" if relaunch else ""))
    logger.info("server up on %s at %s: %s (headroom %s GiB; start: %s)", ctx.host, handle.url, report.summary(),
                headroom, start)
    if low:
        logger.warning("headroom after graph capture on %s is %s GiB, under %g GiB: a long prefill batch may run "
                       "out of memory; lower mem_fraction_static", ctx.host, headroom, LOW_HEADROOM_GIB)
    return handle


def _node_lines(handle: ServerHandle) -> list[str]:
    """The launch artifact's lines on the nodes of a server over several nodes (none on one host)."""
    if not handle.ranks:
        return []
    addr = flag_value(handle.command, "--dist-init-addr") or "?"
    lines = [f"- nodes: **{len(handle.ranks) + 1}**, joined at --dist-init-addr `{addr}`",
             f"  - node 0: `{host_of(handle.target)}` pid {handle.pid} (serves HTTP), log `{handle.log_path}`"]
    lines += [f"  - node {r.rank}: `{r.host}` pid {r.pid}, log `{r.log_path}`" for r in handle.ranks]
    return lines


def dist_init_addr(ctx: RunContext) -> str:
    """``--dist-init-addr`` of a server over several nodes: node 0's address as the others reach it
    (``dist_init_host``, else node 0's host name; 127.0.0.1 for a local node 0) and a port there
    (``dist_init_port``, else one free on node 0 now)."""
    server = ctx.cfg.server
    t = parse_target(ctx.target)
    host = server.dist_init_host or ("127.0.0.1" if t.is_local else t.host or "127.0.0.1")
    port = server.dist_init_port or free_port_on(t, host)
    return f"{host}:{port}"


def _launch_artifact(ctx: RunContext, pid: int, lines: list[str], description: str) -> None:
    """Publish a server's launch artifact, kept to be rewritten should that server die
    (_mark_launch_died)."""
    artifact = markdown("\n".join(lines) + "\n", key=artifact_key("server-launch", ctx.cfg.name, ctx.host),
                        description=description)
    if artifact is not None:
        with _LAUNCH_ARTIFACTS_LOCK:
            _LAUNCH_ARTIFACTS[(ctx.run_id, pid)] = (artifact, "\n".join(lines))


def _start_source(report: LaunchReport) -> str:
    """Where the first fraction came from, the remembered one named when it was not used."""
    if report.start_source == "explicit":
        kept = f"; remembered {report.remembered}" if report.remembered is not None else ""
        return f"explicit run parameter{kept}"
    return report.start_source


def plan_key(ctx: RunContext) -> str:
    """What makes a running server this run's server: its target, GPUs, the command it was launched
    with less the port and the memory fraction (the tuner picks those per launch) and the rows'
    fingerprint (validation allows one per shard). A later run adopts a dead run's server only when
    its own key is the same (flows/fleet.py)."""
    cfg = dataclasses.replace(ctx.cfg.server_config(1, ctx.parser), mem_fraction_static=None)  # any port: the same
    ident = [ctx.target, list(ctx.gpus), build_command(cfg, None), dict(cfg.env), ctx.fingerprint]
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


@task(task_run_name=run_name("adopt-{host}-{gpus}"), cache_policy=NONE)
def adopt_server(ctx: RunContext, *, pid: int, started: float | None, port: int, fraction: float | None,
                 log_path: str, from_run: str) -> ServerHandle | None:
    """Take over the server run ``from_run`` launched for this plan (pid ``pid`` on this server's
    target, listening on ``port``), whose guardian waits out its grace after that run died: no
    hygiene, no launch. Says so in the launch artifact. None when it cannot be taken (then the
    lifecycle cleans and launches as usual).

    Raises:
        TargetUnreachable, OSError: a remote server's port forward cannot be opened.
    """
    cfg = ctx.cfg
    handle = adopt_running(cfg.server_config(port, ctx.parser), parse_target(ctx.target), pid=pid, started=started,
                           fraction=fraction, log_path=log_path)
    if handle is None:
        return None
    lines = [f"# Server launch 1 on `{ctx.host}` {gpu_label(ctx.gpus)}: adopted", "",
             f"- **adopted**: the server run `{from_run}` launched (pid {pid}), still running after that run "
             f"died; relaunched 0 times, its GPUs kept as they were",
             f"- --mem-fraction-static: **{fraction}** (as launched)",
             f"- relaunch budget: 0 of {cfg.max_relaunches} used",
             f"- url: `{handle.url}` (this run's server now: stopped when the run ends)",
             f"- pid {pid}, log `{log_path}`"]
    _launch_artifact(ctx, pid, lines, f"OK: adopted the server of run {from_run} on {ctx.host} "
                                      f"{gpu_label(ctx.gpus)} (pid {pid}, fraction {fraction})")
    get_run_logger().info("server on %s adopted: pid %s of dead run %s at %s (fraction %s); no hygiene, no launch",
                          ctx.host, pid, from_run, handle.url, fraction)
    return handle


@task(task_run_name=run_name("health-{host}-{gpus}"), cache_policy=NONE)
def health_check(ctx: RunContext, endpoint: Endpoint) -> None:
    """``/health_generate`` must answer 200 (a 1-token generation ran).

    Raises:
        RuntimeError: another status (retried).
    """
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    with http.client(timeout=30.0, headers=headers) as c:
        r = c.get(f"{endpoint.url}/health_generate")
    if r.status_code != 200:
        raise RuntimeError(f"{endpoint.url}/health_generate answered {r.status_code}")


@task(name="identify-server", task_run_name="identify-server", cache_policy=NONE)
def identify_server(ctx: RunContext) -> str:
    """The fingerprint of the shared server ``run.server_url``: the rows' ``server`` column, from
    what the server reports about itself, so that it survives a restart on another port.

    Raises:
        httpx.TransportError: the server cannot be reached (retried).
    """
    url = ctx.cfg.server_url
    assert url is not None, "identify_server is for a shared server"
    fingerprint, facts = external_fingerprint(url, ctx.cfg.api_key())
    logger = get_run_logger()
    if facts:
        logger.info("shared server %s is %s (%s)", url, fingerprint,
                    ", ".join(f"{k}={v}" for k, v in sorted(facts.items())))
    else:
        logger.warning("shared server %s reports neither /model_info nor /server_info: its rows are "
                       "fingerprinted by its URL, and a restart on another port will not match them", url)
    return fingerprint


@task(task_run_name=run_name("recover-{host}-{gpus}"), cache_policy=NONE)
def diagnose_server(ctx: RunContext, handle: ServerHandle) -> Failure:
    """The server stopped answering: read its log, and on a runtime OOM (classified ``too_high``)
    record it so that the relaunch starts lower; the server's launch artifact is updated to say
    it died. Returns the log's classification."""
    logger = get_run_logger()
    try:
        rank, text, status = handle.failure()
    except Exception as exc:  # a log we cannot read classifies as unknown: relaunch at the same fraction
        rank, text, status = None, f"(log unreadable: {exc})", handle.exit_status()
    failure = classify_failure(text, status)
    if rank is not None:
        failure = on_node(failure, rank)
    logger.warning("server on %s gone (exit %s): %s: %s", ctx.host, status, failure.kind, failure.explanation)
    if failure.kind == "too_high":
        port = urlsplit(handle.url).port or DEFAULT_PORT
        entry = record_runtime_oom(ctx.cfg.server_config(port, ctx.parser), parse_target(ctx.target),
                                   handle.fraction, log_text=text)
        if entry is not None:
            logger.warning("recorded runtime OOM at fraction %s on %s: the relaunch starts lower",
                           entry.runtime_oom_at, ctx.host)
    if ctx.run_id:
        _mark_launch_died(ctx.run_id, handle.pid, f"exit {status}: {failure.kind}: {failure.explanation}")
    return failure


def _mark_launch_died(run_id: str, pid: int, why: str) -> None:
    """Rewrite the launch artifact of the server ``pid`` to lead with its death."""
    with _LAUNCH_ARTIFACTS_LOCK:
        known = _LAUNCH_ARTIFACTS.pop((run_id, pid), None)
    if known is None:
        return
    artifact, lines = known
    text = f"**DIED** during the run ({why}); the server was relaunched or the run stopped.\n\n" + lines
    try:
        with get_client(sync_client=True) as client:
            client.update_artifact(artifact, ArtifactUpdate(data=text, description=f"DIED: {why}"[:200]))
    except Exception as exc:  # observability must never fail the run
        get_run_logger().warning("launch artifact of pid %s not updated: %s", pid, exc)


@task(task_run_name=run_name("stop-server-{host}-{gpus}"), cache_policy=NONE)
def stop(ctx: RunContext, handle: ServerHandle) -> None:
    """Stop the server's process group (SIGTERM, then SIGKILL) and wait for clean GPUs.

    Raises:
        StopFailed: the GPUs were not verified clean after the stop.
    """
    stop_server(handle)
    get_run_logger().info("server on %s (pid %s) stopped", ctx.host, handle.pid)
