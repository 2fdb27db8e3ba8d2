"""The flow's stage tasks: thin ``@task`` wrappers over the plain functions in ``tasks/``.

Each task adds what Prefect is for: a run name saying which host/dataset it works on, retries
where a retry can help (chosen per error type by ``retry_condition_fn``), and artifacts. Results
are never cached or persisted (``cache_policy=NONE``): a rerun resumes from what is committed on
disk, which is the only source of truth.

Not retried: configuration errors, validation failures, a changed input, a locked output, a model
or flag the server rejects. Retried with backoff: GPUs not yet clean (the driver releases memory
late), a launch that failed for a transient reason, transport errors during inference. A server
that died or stopped answering (``ServerGone``) is not retried in place: the flow relaunches it
(lower, after a runtime OOM) and inference resumes from the shards and journals on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.tasks import exponential_backoff

from flows import runrecord
from flows.gpulimit import host_of
from flows.progress import Progress, artifact_key
from flows.retry import retry_launch, retry_transient
from flows.versions import choose_version, mark_failed, promote_latest
from tasks.config import ConfigError, PartitionConfig, load_partition
from tasks.hygiene import GpusNotClean

__all__ = [
    "GpusNotClean",
    "RunPlan",
    "diagnose_server",
    "health_check",
    "hygiene",
    "infer_dataset",
    "launch_server",
    "load_config",
    "prepare_run",
    "promote",
    "server_gpus",
    "stop",
    "validate",
]


@dataclass(frozen=True)
class RunPlan:
    out_dir: Path
    root: Path
    version: str | None
    sim_gpus: str | None
    log_dir: Path


@task(name="load-config", cache_policy=NONE)
def load_config(partition: str, overrides: dict[str, Any]) -> PartitionConfig:
    """Load ``deployments/<partition>.toml`` (or a path) and apply overrides. Not retried."""
    cfg = load_partition(partition).with_overrides(**overrides)
    get_run_logger().info("partition %s: %s", cfg.name, cfg.to_summary())
    return cfg


@task(name="prepare-output", cache_policy=NONE)
def prepare_run(cfg: PartitionConfig, flow_run_id: str | None) -> RunPlan:
    """Pick the output directory (a nightly version to resume or a new one) and, for the emulator
    with no ``DATAGEN_SIM_GPUS`` set, create the simulated GPUs under the output root."""
    logger = get_run_logger()
    root = cfg.output_root
    root.mkdir(parents=True, exist_ok=True)
    out = choose_version(root) if cfg.versioned else root
    sim = _ensure_sim_gpus(cfg, root)
    log_dir = root / "_logs"
    log_dir.mkdir(exist_ok=True)
    runrecord.update(
        flow_run_id, partition=cfg.name, targets=list(cfg.targets), out_dir=str(out),
        sim_gpus=sim, shared_server=cfg.server_url is not None, gpus=server_gpus(cfg),
    )
    logger.info("output %s%s", out, f" (version {out.name} of {root})" if cfg.versioned else "")
    return RunPlan(out_dir=out, root=root, version=out.name if cfg.versioned else None, sim_gpus=sim, log_dir=log_dir)


def _ensure_sim_gpus(cfg: PartitionConfig, root: Path) -> str | None:
    from emulator.simgpu import ENV_VAR, SimGpus

    current = os.environ.get(ENV_VAR)
    if current or cfg.server.backend != "emulator" or cfg.sim_gpus is None:
        return current or None
    path = root / "_sim-gpus.json"
    if not path.exists():
        s = cfg.sim_gpus
        kwargs: dict[str, Any] = {"count": s.count, "total_mib": s.total_mib, "release_delay_s": s.release_delay_s}
        if s.name:
            kwargs["name"] = s.name
        SimGpus.init(path, **kwargs)
    # The server, its schedulers and hygiene (all children of this process) read the same file.
    os.environ[ENV_VAR] = str(path)
    return str(path)


@task(task_run_name="hygiene-{phase}-{host}", retries=2,
      retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_condition_fn=retry_transient,
      cache_policy=NONE)
def hygiene(target: str, host: str, phase: str, grace_s: float, extra_pids: tuple[int, ...] = (),
            gpus: list[int] | None = None) -> dict[str, Any]:
    """Clean the target's ``gpus`` (the partition's server GPUs, see ``server_gpus``; None: every
    GPU of the host) and verify; processes holding only other GPUs are spared and listed so.
    Raises ``GpusNotClean`` (retried) when not verified."""
    from tasks.hygiene import clean_gpus

    report = clean_gpus(target=target, gpus=list(gpus) if gpus is not None else None, grace_s=grace_s,
                        extra_pids=tuple(extra_pids))
    summary = report.summary()
    get_run_logger().info("hygiene %s on %s: %s", phase, host, summary)
    _markdown(f"# GPU hygiene ({phase}) on `{host}`\n\nverdict: **{report.verdict}**\n\n```\n{summary}\n```\n",
              key=artifact_key("hygiene", phase, host), description=f"hygiene {phase} {host}: {report.verdict}")
    if not report.clean:
        raise GpusNotClean(f"GPUs on {host} not verified clean ({report.verdict}):\n{summary}")
    return report.to_dict()


def server_gpus(cfg: PartitionConfig) -> list[int]:
    """The GPUs the partition's server uses (``ServerConfig.gpu_indexes``: ``server.gpus``, else
    0..tp_size-1): the only GPUs the flow's hygiene touches, so that on a shared host another job
    on another GPU survives a run."""
    from tasks.server import ServerConfig

    s = cfg.server
    return ServerConfig(model_path=cfg.model_path, tp_size=s.tp_size, gpus=s.gpus).gpu_indexes()


def server_config(cfg: PartitionConfig, port: int, parser: str | None) -> Any:
    """The ``tasks.server.ServerConfig`` for a partition (the API key travels in its env only)."""
    from tasks.server import ServerConfig

    s = cfg.server
    env = dict(s.env)
    token = cfg.hub_token()
    if token:
        env["HF_TOKEN"] = token
    values: dict[str, Any] = {
        "model_path": cfg.model_path, "tp_size": s.tp_size, "host": s.host, "port": port,
        "mem_fraction_static": s.mem_fraction_static, "reasoning_parser": parser,
        "served_model_name": s.served_model_name, "context_length": s.context_length,
        "max_running_requests": s.max_running_requests, "chunked_prefill_size": s.chunked_prefill_size,
        "enable_hierarchical_cache": s.enable_hierarchical_cache, "hicache_size": s.hicache_size,
        "hicache_ratio": s.hicache_ratio, "api_key": cfg.api_key(), "extra_args": tuple(s.extra_args),
        "backend": s.backend, "gpus": s.gpus, "env": env,
    }
    if s.python:
        values["python"] = s.python
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in values.items() if k in known and v is not None})


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@task(task_run_name="launch-{host}", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=3),
      retry_condition_fn=retry_launch, cache_policy=NONE)
def launch_server(cfg: PartitionConfig, target: str, host: str, plan: RunPlan, parser: str | None,
                  flow_run_id: str | None) -> Any:
    """Launch SGLang (or the emulator) with the tuned ``--mem-fraction-static``; returns the handle."""
    from tasks.server import launch_tuned
    from tasks.targets import parse_target

    port = cfg.server.port or (_free_port(cfg.server.host) if target == "local" else 30000)
    scfg = server_config(cfg, port, parser)

    def on_started(pid: int, pgid: int) -> None:
        # Recorded before readiness: a flow SIGKILLed while this server loads leaves it running,
        # and the next run ends it from this record (runrecord.end_dead_servers).
        runrecord.add_server(flow_run_id, target, pid, pgid)

    handle, report = launch_tuned(scfg, parse_target(target), plan.log_dir, on_started=on_started)
    runrecord.update_server(flow_run_id, handle.pid, target=target, pgid=handle.pgid, url=handle.url,
                            log=str(handle.log_path), state="ready")
    headroom = handle.headroom_gib
    lines = [f"# Server launch on `{host}`", "", f"- url: {handle.url}", f"- pid {handle.pid}, log `{handle.log_path}`",
             f"- --mem-fraction-static: **{report.fraction}** (start: {report.start_source}, memory: {report.store})",
             f"- headroom after graph capture: {headroom if headroom is not None else '?'} GiB",
             f"- attempts ({len(report.attempts)}): {report.summary()}"]
    _markdown("\n".join(lines) + "\n", key=artifact_key("server-launch", host),
              description=f"launch {host}: fraction {report.fraction} after {len(report.attempts)} attempt(s)")
    get_run_logger().info("server up on %s at %s: %s (headroom %s GiB)", host, handle.url, report.summary(), headroom)
    return handle


@task(task_run_name="health-{host}", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1),
      cache_policy=NONE)
def health_check(url: str, host: str, api_key: str | None = None) -> None:
    """``/health_generate`` must answer 200 (a 1-token generation ran). Raises ``RuntimeError``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/health_generate", timeout=30.0, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/health_generate answered {r.status_code}")


@task(task_run_name="recover-{host}", cache_policy=NONE)
def diagnose_server(cfg: PartitionConfig, target: str, host: str, handle: Any, parser: str | None) -> str:
    """The server stopped answering: read its log, and on a runtime OOM (classified ``too_high``)
    record it so the relaunch starts lower. Returns the failure kind."""
    from tasks.server import classify_failure, record_runtime_oom
    from tasks.targets import parse_target

    logger = get_run_logger()
    try:
        text = handle.read_log()
    except Exception as exc:  # a log we cannot read classifies as unknown: relaunch at the same fraction
        text = f"(log unreadable: {exc})"
    status = handle.exit_status()
    failure = classify_failure(text, status)
    logger.warning("server on %s gone (exit %s): %s: %s", host, status, failure.kind,
                   getattr(failure, "explanation", ""))
    if failure.kind == "too_high":
        record_runtime_oom(server_config(cfg, _port_of(handle), parser), parse_target(target), handle.fraction)
        logger.warning("recorded runtime OOM at fraction %s on %s: the relaunch starts lower", handle.fraction, host)
    return str(failure.kind)


def _port_of(handle: Any) -> int:
    from urllib.parse import urlsplit

    return urlsplit(handle.url).port or 30000


@task(task_run_name="stop-server-{host}", cache_policy=NONE)
def stop(handle: Any, host: str, flow_run_id: str | None = None) -> None:
    """Stop the server's process group (SIGTERM, then SIGKILL) and wait for clean GPUs."""
    from tasks.server import stop_server

    stop_server(handle)
    with contextlib.suppress(OSError):  # the record is for recovery; a stopped server needs none
        runrecord.update_server(flow_run_id, handle.pid, state="stopped")
    get_run_logger().info("server on %s (pid %s) stopped", host, handle.pid)


@task(task_run_name="infer-{dataset}@{host}", retries=2,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5,
      retry_condition_fn=retry_transient, cache_policy=NONE)
def infer_dataset(cfg: PartitionConfig, dataset: str, path: Path, plan: RunPlan, server_url: str, host: str,
                  parser: str | None, progress: Progress, server_fingerprint: str,
                  server: Any = None) -> dict[str, Any]:
    """Generate one dataset into ``plan.out_dir``, resuming committed shards and journals; each
    committed shard passes the validation gate (``ValidationFailed`` stops the run, not retried)."""
    from tasks.inference import DatasetSpec, run_dataset
    from tasks.validation import gate_shard

    logger = get_run_logger()
    thresholds = _thresholds(cfg)

    def on_shard_committed(record: Any) -> None:
        # Stop at the first bad shard, not hours later (ValidationFailed propagates, not retried).
        gate_shard(plan.out_dir, dataset, record.index, thresholds)

    def on_progress(p: Any) -> None:
        progress.shard_committed(p.dataset, p.shard, p.rows, p.completion_tokens)

    t0 = time.monotonic()
    watchdog = HangWatchdog(server, cfg.hang_timeout_s, logger) if server is not None else None
    try:
        result = _run(run_dataset, DatasetSpec, dataset, path, plan, server_url, cfg, parser, server_fingerprint,
                      on_shard_committed, on_progress, progress, host, server_liveness(server))
    finally:
        if watchdog is not None:
            watchdog.stop()
    summary = result.to_dict()
    logger.info("dataset %s on %s: %d shards committed (%d now, %d resumed), %d rows generated in %.1f s",
                dataset, host, summary["shards_committed"], summary["shards_committed_now"],
                summary["shards_skipped"], summary["rows_generated"], time.monotonic() - t0)
    return summary


def _run(run_dataset: Any, DatasetSpec: Any, dataset: str, path: Path, plan: RunPlan, server_url: str,
         cfg: PartitionConfig, parser: str | None, server_fingerprint: str, on_shard_committed: Any,
         on_progress: Any, progress: Progress, host: str, server_alive: Any = None) -> Any:
    return run_dataset(
        DatasetSpec(name=dataset, path=Path(path)), plan.out_dir, server_url, model_dir=cfg.model_path,
        shard_size=cfg.shard_size, concurrency=cfg.concurrency, sampling=dict(cfg.sampling),
        reasoning_parser=parser, server_fingerprint=server_fingerprint,
        model_name=cfg.server.served_model_name or Path(cfg.model_path).name,
        on_shard_committed=on_shard_committed, progress=on_progress, api_key=cfg.api_key(),
        run_info={"flow_run": progress.flow_run_id, "host": host}, server_alive=server_alive,
    )


def server_liveness(server: Any) -> Any:
    """The client's ``server_alive`` check for a server this run launched (None: a shared server,
    whose process is not ours to watch). Local: the process itself. Remote: ``ps`` over SSH, and only
    an answer from ``ps`` (exit 1, no such process) counts as dead; an SSH failure says nothing, so
    it reads as alive and the client keeps its retry path."""
    if server is None:
        return None
    if not getattr(server, "is_remote", False):
        return server.is_alive

    def remote_alive() -> bool:
        from tasks.targets import parse_target, run_command

        res = run_command(parse_target(server.target), ["ps", "-o", "stat=", "-p", str(server.pid)], timeout_s=10.0)
        stat = res.stdout.strip()
        if res.exited == 1 and not stat:
            return False
        return not stat.startswith("Z") if stat else True

    return remote_alive


class HangWatchdog:
    """A server that is alive but answers nothing (SGLang's /health_generate gives 503 or times out)
    would hold every request until its hour-long timeout. While inference runs, probe
    /health_generate; when it has failed for ``timeout_s`` while the process lives, kill the
    server's process group: the client then raises ``ServerGone`` and the flow relaunches."""

    def __init__(self, server: Any, timeout_s: float, logger: Any) -> None:
        import threading

        self.server, self.timeout_s, self.logger = server, timeout_s, logger
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._loop, name="datagen-hang-watchdog", daemon=True)
        if timeout_s > 0:
            self._thread.start()

    def _loop(self) -> None:
        interval = max(0.5, min(10.0, self.timeout_s / 4))
        failing_since: float | None = None
        while not self._stop.wait(interval):
            try:
                ok = httpx.get(f"{self.server.url}/health_generate", timeout=interval).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok or not self.server.is_alive():
                failing_since = None  # a dead server is the client's to notice (connection refused)
                continue
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= self.timeout_s:
                self.logger.error("server %s alive but not answering /health_generate for %.0f s: "
                                  "killing its process group %s to relaunch", self.server.url,
                                  self.timeout_s, self.server.pgid)
                self.fired = True
                from tasks.server import stop_server

                # Kill only (no hygiene here): the flow's relaunch path diagnoses, stops and cleans.
                stop_server(self.server, grace_s=1.0, hygiene=None, verify=False)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def _thresholds(cfg: PartitionConfig) -> Any:
    from tasks.validation import ThresholdError, Thresholds

    try:
        return Thresholds.from_dict(dict(cfg.validation))
    except ThresholdError as exc:
        raise ConfigError(f"{cfg.source or 'override'}: [validation]: {exc}") from exc


@task(name="validate-output", cache_policy=NONE)
def validate(cfg: PartitionConfig, plan: RunPlan) -> dict[str, Any]:
    """Validate the whole output, publish the validation artifacts; raises ``ValidationFailed``."""
    from tasks.validation import ValidationFailed, publish_artifacts, validate_output

    report = validate_output(plan.out_dir, _thresholds(cfg))
    try:
        publish_artifacts(report)
    except Exception as exc:  # observability must never fail the run
        get_run_logger().warning("validation artifacts not published: %s", exc)
    passed = bool(report.ok)
    summary = report.summary()
    get_run_logger().info("%s", summary)
    if not passed:
        if plan.version:
            mark_failed(plan.out_dir, summary)
        raise ValidationFailed(f"validation of {plan.out_dir} failed:\n{summary}", report)
    return {"passed": True, "summary": summary}


@task(name="promote-latest", cache_policy=NONE)
def promote(plan: RunPlan) -> str | None:
    """Nightly: point ``ROOT/latest`` at this validated version (atomic rename)."""
    if plan.version is None:
        return None
    link = promote_latest(plan.root, plan.out_dir)
    get_run_logger().info("%s -> %s", link, plan.out_dir)
    return str(link)


def _markdown(text: str, key: str, description: str) -> None:
    try:
        create_markdown_artifact(text, key=key, description=description)
    except Exception as exc:  # observability must never fail the run
        get_run_logger().warning("artifact %s not created: %s", key, exc)


def local_host(target: str) -> str:
    return host_of(target)
