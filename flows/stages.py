"""The flow's stage tasks: thin ``@task`` wrappers over the plain functions in ``tasks/``.

Each task adds what Prefect is for: a run name saying which host/dataset it works on, retries
where a retry can help (chosen per error type by ``retry_condition_fn``), and artifacts. Results
are never cached or persisted (``cache_policy=NONE``): a rerun resumes from what is committed on
disk, which is the only source of truth. The tasks after ``load_config`` and ``prepare_run`` take
the run's ``RunContext`` (``promote``: its plan).

Not retried: configuration errors, validation failures, a changed input, a locked output, a model
or flag the server rejects, a server that died or stopped answering (``ServerGone``: the server's
lifecycle relaunches it, flows/fleet.py). Retried with backoff: GPUs not yet clean (the driver releases memory late),
a launch that failed for a transient reason, transport errors during inference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote

from flows import runrecord
from flows.context import RunContext, RunPlan
from flows.progress import Progress, artifact_key
from flows.retry import retry_launch, retry_transient
from flows.versions import choose_version, mark_failed, promote_latest
from tasks.card import write_card
from tasks.config import ConfigError, Overrides, PartitionConfig, SimGpuSettings, load_partition
from tasks.files import checked_dir
from tasks.gpus import SIM_GPUS_ENV, SIM_GPUS_NOTE, sim_gpu_backend
from tasks.hygiene import GpusNotClean, NoGpus, clean_gpus
from tasks.inference import (
    DatasetSpec,
    Endpoint,
    OpenedDataset,
    ServerPool,
    ShardProgress,
    external_fingerprint,
    open_dataset,
    run_dataset,
)
from tasks.server import (
    LaunchReport,
    ServerHandle,
    classify_failure,
    launch_tuned,
    record_runtime_oom,
    stop_server,
)
from tasks.shards import OutputDir, ShardRecord
from tasks.targets import parse_target
from tasks.validation import (
    ShardValidation,
    ValidationFailed,
    ValidationReport,
    check_canary,
    gate_shard,
    publish_artifacts,
    validate_output,
    write_report,
)

__all__ = [
    "GpusNotClean",
    "diagnose_server",
    "health_check",
    "hygiene",
    "identify_server",
    "infer_dataset",
    "launch_server",
    "load_config",
    "prepare_run",
    "promote",
    "open_datasets",
    "stop",
    "validate",
]


# The launch artifact of each server of this process's runs, ``(run id, pid) -> (artifact id, its
# markdown)``: rewritten to lead with the death when that server dies (server threads share it).
_LAUNCH_ARTIFACTS: dict[tuple[str | None, int], tuple[UUID, str]] = {}
_LAUNCH_ARTIFACTS_LOCK = threading.Lock()
LOW_HEADROOM_GIB = 1.0  # GPU memory left after graph capture below which a long prefill batch may OOM


def gpu_label(gpus: tuple[int, ...] | list[int]) -> str:
    """``gpu0``, ``gpu0,1``, ``gpu0..7`` (a contiguous range of more than two): the GPUs in run
    names and artifact descriptions."""
    g = sorted(gpus)
    if len(g) > 2 and g == list(range(g[0], g[-1] + 1)):
        return f"gpu{g[0]}..{g[-1]}"
    return "gpu" + ",".join(map(str, g))


def _run_name(fmt: str) -> Callable[[], str]:
    """A task run name from ``fmt`` filled with the task's parameters, the context's host and
    GPUs (``gpus``), the dataset's name and, for a relaunch, `` (relaunch k/N)`` (``again``)."""
    def name() -> str:
        params = {k: v.unquote() if isinstance(v, quote) else v for k, v in task_run.parameters.items()}
        ctx = params.pop("ctx")
        dataset = params.pop("dataset", None)
        attempt = int(params.get("attempt", 1))
        again = f" (relaunch {attempt - 1}/{ctx.cfg.max_relaunches})" if attempt > 1 else ""
        return fmt.format(host=ctx.host, gpus=gpu_label(ctx.gpus), dataset=getattr(getattr(dataset, "spec", None), "name", ""),
                          again=again, **params)

    return name


@task(name="load-config", task_run_name="load-config", cache_policy=NONE)
def load_config(partition: str, overrides: Overrides) -> PartitionConfig:
    """Load ``deployments/<partition>.toml`` (or a path) and apply the overrides. Not retried.

    Raises:
        ConfigError: the file or an override is invalid, or the server would listen on a routable
            address without an API key.
    """
    cfg = load_partition(partition).with_overrides(overrides)
    cfg.check_bind()  # a routable server.host without a key: refused before any GPU work
    get_run_logger().info("partition %s:\n%s", cfg.name, _readable(cfg.to_summary()))
    return cfg


def _readable(summary: dict[str, Any], indent: str = "  ") -> str:
    """One ``key: value`` line per setting; a mapping's items indented under its key."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += [f"{indent}  {k}: {v}" for k, v in value.items()]
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)


@task(name="prepare-output", task_run_name="prepare-output", cache_policy=NONE)
def prepare_run(cfg: PartitionConfig, flow_run_id: str | None) -> RunPlan:
    """Pick the output directory (a nightly version to resume or a new one) and, for the emulator
    with no ``DATAGEN_SIM_GPUS`` set, create the simulated GPUs under the output root."""
    root = cfg.output_root
    root.mkdir(parents=True, exist_ok=True)
    out = choose_version(root) if cfg.versioned else root
    sim = _sim_gpus(cfg, root)
    log_dir = checked_dir(root, root / "_logs", create=True)
    target_gpus: dict[str, list[int]] = {}
    for slot in cfg.servers():
        target_gpus.setdefault(slot.target, []).extend(cfg.for_server(slot).server_gpus())
    runrecord.planned(
        flow_run_id, partition=cfg.name, targets=list(cfg.targets), out_dir=str(out),
        sim_gpus=sim, shared_server=cfg.server_url is not None,
        gpus=sorted({g for gpus in target_gpus.values() for g in gpus}) or cfg.server_gpus(),
        target_gpus={t: sorted(set(g)) for t, g in target_gpus.items()},
    )
    logger = get_run_logger()
    logger.info("output %s%s", out, f" (version {out.name} of {root})" if cfg.versioned else "")
    if sim:  # said once here; the hygiene reports of the run leave it out
        logger.info("simulated GPUs %s: %s", sim, SIM_GPUS_NOTE)
    return RunPlan(out_dir=out, root=root, version=out.name if cfg.versioned else None, sim_gpus=sim, log_dir=log_dir)


@task(name="open-datasets", task_run_name="open-datasets", cache_policy=NONE)
def open_datasets(ctx: RunContext) -> dict[str, OpenedDataset]:
    """Every guard of every dataset, once, under the output's lock and before a GPU is touched:
    each dataset is bound to its input and shard size, half-done commits are undone and its rows'
    sampling, samples, regeneration mode and parser must match this run's (the whole output was
    checked intact when the lock was taken). A complete dataset is said so here: when every one
    is, the run launches nothing. Not retried.

    Raises:
        InputChanged: the input, shard size, sampling or parser changed (exit 2; the message names
            old and new values).
        UnrecordedShards, OSError: as ``tasks.inference.open_dataset`` raises them.
    """
    out, settings = OutputDir(ctx.plan.out_dir), ctx.inference()
    opened = {name: open_dataset(DatasetSpec(name, path), out, settings, check_intact=False)
              for name, path in ctx.cfg.datasets.items()}
    for d in opened.values():
        for problem in d.problems[:10]:
            get_run_logger().warning("dataset %s: skipped journal %s; that row is generated again",
                                     d.spec.name, problem)
        if len(d.problems) > 10:
            get_run_logger().warning("dataset %s: %d more unusable journal lines skipped", d.spec.name,
                                     len(d.problems) - 10)
        if d.complete:
            get_run_logger().info("dataset %s: %d shards committed (0 now, %d resumed), 0 rows generated: "
                                  "complete in %s, no server needed", d.spec.name, d.shards, d.shards, out.path)
    return opened


def _sim_gpus(cfg: PartitionConfig, root: Path) -> str | None:
    """The simulated GPUs of the run: those already set in the environment, else, for the emulator
    backend, the partition's ``[sim_gpus]`` (its defaults when the table is absent: the emulator
    never uses a real GPU) under the output root; else none."""
    current = os.environ.get(SIM_GPUS_ENV)
    if current or cfg.server.launch.backend != "emulator":
        return current or None
    s = cfg.sim_gpus or SimGpuSettings()
    try:
        backend = sim_gpu_backend()
    except LookupError as exc:
        raise ConfigError(f"{cfg.source or cfg.name}: [sim_gpus]: {exc}") from exc
    return str(backend.create(root / "_sim-gpus.json", count=s.count, total_mib=s.total_mib, name=s.name,
                              release_delay_s=s.release_delay_s))


@task(task_run_name=_run_name("hygiene-{phase}-{host}-{gpus}"), retries=2,
      retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_condition_fn=retry_transient,
      cache_policy=NONE)
def hygiene(ctx: RunContext, phase: str) -> dict[str, Any]:
    """Clean the server's GPUs on the run's target and verify; processes holding only other GPUs
    are spared and listed so.

    Raises:
        NoGpus: no GPU can be read on the target (not retried: the message says what to run instead).
        GpusNotClean: not verified clean (retried).
    """
    report = clean_gpus(target=ctx.target, gpus=list(ctx.gpus), grace_s=ctx.cfg.hygiene_grace_s)
    report.notes = [n for n in report.notes if n != SIM_GPUS_NOTE]  # said once per run (prepare-output)
    summary = report.summary()
    verdict = report.verdict.upper().replace("_", " ")
    get_run_logger().info("hygiene %s on %s: %s", phase, ctx.host, summary)
    _markdown(f"# GPU hygiene ({phase}) on `{ctx.host}`\n\nverdict: **{verdict}**\n\n```\n{summary}\n```\n",
              key=artifact_key("hygiene", phase, ctx.cfg.name, ctx.host),
              description=f"{verdict}: hygiene {phase} on {ctx.host} {gpu_label(ctx.gpus)}")
    if report.backend == "none":
        emulator = ctx.cfg.server.launch.backend == "emulator"
        raise NoGpus(f"no GPU can be read on {ctx.host} ({report.error}); "
                     + ("set [sim_gpus] in the partition or DATAGEN_SIM_GPUS to simulated GPUs for the emulator"
                        if emulator else
                        "on a machine without GPUs try the pipeline on the emulator: add --backend emulator "
                        "(simulated GPUs are created under the output)"), report)
    if not report.clean:
        raise GpusNotClean(f"GPUs on {ctx.host} not verified clean ({report.verdict}):\n{summary}")
    return report.to_dict()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@task(task_run_name=_run_name("launch-{host}-{gpus}-{attempt}{again}"), retries=2,
      retry_delay_seconds=exponential_backoff(backoff_factor=3), retry_condition_fn=retry_launch, cache_policy=NONE)
def launch_server(ctx: RunContext, attempt: int = 1, reason: str = "") -> ServerHandle:
    """Launch SGLang (or the emulator) with the tuned ``--mem-fraction-static``; returns the handle.

    The run's explicit ``mem_fraction_static`` (a run parameter or ``--mem-fraction-static``) wins
    over the remembered fraction on the first launch; a relaunch starts from memory, which a
    runtime OOM has just lowered.

    Args:
        ctx: the run.
        attempt: 1 for the run's first launch, k + 1 for relaunch k (named so in the run).
        reason: why the server is relaunched (e.g. "a runtime OOM at 0.93").

    Raises:
        LaunchFailed: no fraction worked, or a failure no fraction fixes (retried when transient).
    """
    cfg = ctx.cfg
    port = cfg.server.port or (_free_port(cfg.server.launch.host) if ctx.target == "local" else 30000)

    def on_started(pid: int, pgid: int) -> None:
        # Recorded before readiness: a flow SIGKILLed while this server loads leaves it running,
        # and the next run ends it from this record (runrecord.end_dead_servers).
        runrecord.server_started(ctx.run_id, ctx.target, pid, pgid)

    pinned = ctx.explicit_fraction if attempt == 1 else None
    handle, report = launch_tuned(cfg.server_config(port, ctx.parser), parse_target(ctx.target), ctx.plan.log_dir,
                                  on_started=on_started, pinned=pinned)
    runrecord.server_ready(ctx.run_id, handle.pid, target=ctx.target, pgid=handle.pgid, url=handle.url,
                           log=str(handle.log_path))
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
             f"- attempts ({len(report.attempts)}): {report.summary()}"]
    artifact = _markdown("\n".join(lines) + "\n", key=artifact_key("server-launch", cfg.name, ctx.host),
                         description=f"{'WARN' if low else 'OK'}: launch {attempt} on {ctx.host} "
                                     f"{gpu_label(ctx.gpus)} at fraction {report.fraction}"
                                     + (f" ({relaunch})" if relaunch else ""))
    if artifact is not None:  # kept to be rewritten should this server die (_mark_launch_died)
        with _LAUNCH_ARTIFACTS_LOCK:
            _LAUNCH_ARTIFACTS[(ctx.run_id, handle.pid)] = (artifact, "\n".join(lines))
    logger.info("server up on %s at %s: %s (headroom %s GiB; start: %s)", ctx.host, handle.url, report.summary(),
                headroom, start)
    if low:
        logger.warning("headroom after graph capture on %s is %s GiB, under %g GiB: a long prefill batch may run "
                       "out of memory; lower mem_fraction_static", ctx.host, headroom, LOW_HEADROOM_GIB)
    return handle


def _start_source(report: LaunchReport) -> str:
    """Where the first fraction came from, the remembered one named when it was not used."""
    if report.start_source == "explicit":
        kept = f"; remembered {report.remembered}" if report.remembered is not None else ""
        return f"explicit run parameter{kept}"
    return report.start_source


@task(task_run_name=_run_name("health-{host}-{gpus}"), retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1),
      cache_policy=NONE)
def health_check(ctx: RunContext, endpoint: Endpoint) -> None:
    """``/health_generate`` must answer 200 (a 1-token generation ran).

    Raises:
        RuntimeError: another status (retried).
    """
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    r = httpx.get(f"{endpoint.url}/health_generate", timeout=30.0, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{endpoint.url}/health_generate answered {r.status_code}")


@task(name="identify-server", task_run_name="identify-server", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1),
      cache_policy=NONE)
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


@task(task_run_name=_run_name("recover-{host}-{gpus}"), cache_policy=NONE)
def diagnose_server(ctx: RunContext, handle: ServerHandle) -> str:
    """The server stopped answering: read its log, and on a runtime OOM (classified ``too_high``)
    record it so that the relaunch starts lower; the server's launch artifact is updated to say
    it died. Returns the failure kind."""
    logger = get_run_logger()
    try:
        text = handle.read_log()
    except Exception as exc:  # a log we cannot read classifies as unknown: relaunch at the same fraction
        text = f"(log unreadable: {exc})"
    status = handle.exit_status()
    failure = classify_failure(text, status)
    logger.warning("server on %s gone (exit %s): %s: %s", ctx.host, status, failure.kind, failure.explanation)
    if failure.kind == "too_high":
        port = urlsplit(handle.url).port or 30000
        entry = record_runtime_oom(ctx.cfg.server_config(port, ctx.parser), parse_target(ctx.target),
                                   handle.fraction, log_text=text)
        if entry is not None:
            logger.warning("recorded runtime OOM at fraction %s on %s: the relaunch starts lower",
                           entry.runtime_oom_at, ctx.host)
    run_id = getattr(ctx, "run_id", None)
    if run_id:
        _mark_launch_died(run_id, handle.pid, f"exit {status}: {failure.kind}: {failure.explanation}")
    return str(failure.kind)


def _mark_launch_died(run_id: str, pid: int, why: str) -> None:
    """Rewrite the launch artifact of the server ``pid`` to lead with its death (the run record
    keeps the artifact's id and text)."""
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


@task(task_run_name=_run_name("stop-server-{host}-{gpus}"), cache_policy=NONE)
def stop(ctx: RunContext, handle: ServerHandle) -> None:
    """Stop the server's process group (SIGTERM, then SIGKILL) and wait for clean GPUs.

    Raises:
        StopFailed: the GPUs were not verified clean after the stop.
    """
    stop_server(handle)
    with contextlib.suppress(OSError):  # the record is for recovery; a stopped server needs none
        runrecord.server_state(ctx.run_id, handle.pid, "stopped", ctx.target)
    get_run_logger().info("server on %s (pid %s) stopped", ctx.host, handle.pid)


@task(task_run_name=_run_name("infer-{dataset}@{host}"), retries=2,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NONE)
def infer_dataset(ctx: RunContext, dataset: OpenedDataset, endpoint: Endpoint | ServerPool,
                  progress: Progress) -> dict[str, Any]:
    """Generate one opened dataset into the run's output, resuming committed shards and journals,
    against one server or the run's pool of servers (each request to whichever is free). A retry
    opens the dataset again (its guards run on what the failed attempt left).

    Raises:
        ValidationFailed: the first rows (the canary) or a committed shard failed validation (not
            retried).
        ServerGone: no server is left and none is coming back (each server's lifecycle relaunches
            its own within its budget first).
        Exception: what ``tasks.inference.run_dataset`` raises; transport errors are retried.
    """
    spec = dataset.spec
    logger = get_run_logger()
    thresholds = ctx.cfg.validation
    out_dir = ctx.plan.out_dir

    def on_shard_committed(record: ShardRecord) -> None:
        # Stop at the first bad shard, not hours later (ValidationFailed propagates, not retried).
        gate_shard(out_dir, spec.name, record.index, thresholds)

    def on_progress(p: ShardProgress) -> None:
        progress.shard_committed(p)

    def on_canary(rows: list[dict[str, Any]]) -> None:
        # The first rows judged as they arrive: a gross failure stops the run in seconds.
        checks = check_canary(rows, spec.name, thresholds, out_dir)
        logger.info("canary of %s on %s: %d rows, %s", spec.name, ctx.host, len(rows),
                    ", ".join(f"{c.name} {c.status}" for c in checks))

    t0 = time.monotonic()
    settings = dataclasses.replace(ctx.inference(), canary_rows=thresholds.canary_rows)
    result = run_dataset(spec, out_dir, endpoint, settings, opened=dataset if task_run.run_count <= 1 else None,
                         on_shard_committed=on_shard_committed, progress=on_progress, on_canary=on_canary)
    summary = result.to_dict()
    if result.recovered.get("rebuilt_shards"):
        logger.warning("dataset %s: no manifest recorded its %d shard files in %s; each matched its input "
                       "slice and was recorded again", spec.name, result.recovered["rebuilt_shards"], out_dir)
    logger.info("dataset %s on %s: %d shards committed (%d now, %d resumed), %d rows generated in %.1f s "
                "(%d with max_new_tokens capped to the context, %d generations again after a length finish)",
                spec.name, ctx.host, summary["shards_committed"], summary["shards_committed_now"],
                summary["shards_skipped"], summary["rows_generated"], time.monotonic() - t0,
                summary["rows_capped"], summary["truncation_retries"])
    return summary


@task(name="validate-output", task_run_name="validate-output", cache_policy=NONE)
def validate(ctx: RunContext, raise_on_failure: bool = True, stopped: ValidationFailed | None = None) -> dict[str, Any]:
    """Validate the whole output and publish the validation artifacts (pass or fail).

    Args:
        raise_on_failure: False after the shard gate already stopped the run: publish the report
            (and mark a nightly version failed) without raising again.
        stopped: the canary's or a shard gate's failure that stopped the run: the report leads
            with it and leaves unjudged what the stop left unfinished.

    Raises:
        ValidationFailed: the output fails a threshold (a nightly version is marked failed).
    """
    plan = ctx.plan
    report = validate_output(plan.out_dir, ctx.cfg.validation, write=stopped is None)
    if stopped is not None and isinstance(stopped.report, ShardValidation):
        report.note_stop(stopped.report, stopped.message, ctx.cfg.datasets)
        write_report(plan.out_dir, report)
    _publish(report, ctx.cfg.name)
    try:
        name = plan.out_dir.name
        write_card(plan.out_dir, report.to_dict(), title=ctx.cfg.name if name == ctx.cfg.name else f"{ctx.cfg.name}: {name}")
    except (OSError, ValueError) as exc:  # the card describes the output; its rows are what matters
        get_run_logger().warning("dataset card not written: %s", exc)
    summary = report.summary()
    get_run_logger().info("%s", summary)
    if not report.ok:
        if plan.version:
            mark_failed(plan.out_dir, summary)
        if raise_on_failure:
            raise ValidationFailed(f"validation of {plan.out_dir} failed:\n{summary}", report)
    return {"passed": report.ok, "verdict": report.verdict, "summary": summary}


def _publish(report: ValidationReport, partition: str) -> None:
    try:
        publish_artifacts(report, partition=partition)
    except Exception as exc:  # observability must never fail the run
        get_run_logger().warning("validation artifacts not published: %s", exc)


@task(name="promote-latest", task_run_name="promote-latest", cache_policy=NONE)
def promote(plan: RunPlan) -> str | None:
    """Nightly: point ``ROOT/latest`` at this validated version (atomic rename)."""
    if plan.version is None:
        return None
    link = promote_latest(plan.root, plan.out_dir)
    get_run_logger().info("%s -> %s", link, plan.out_dir)
    return str(link)


def _markdown(text: str, key: str, description: str) -> UUID | None:
    """A markdown artifact of the current run; its id, or None when it could not be created."""
    try:
        return create_markdown_artifact(text, key=key, description=description)  # type: ignore[return-value]
    except Exception as exc:  # observability must never fail the run
        get_run_logger().warning("artifact %s not created: %s", key, exc)
        return None
