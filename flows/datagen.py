"""The `datagen` flow: clean GPUs -> launch (tuned) -> health -> inference per dataset (validation
gate per committed shard) -> validate the output -> (nightly) promote `latest`.

Thin by design: every line calls a stage task (flows/stages.py) or holds a lock. Recovery:
- a server that dies or hangs mid-run (``ServerGone``): its log is classified, a runtime OOM is
  recorded so the relaunch starts lower, the server is stopped and cleaned, relaunched, and
  inference resumes from the committed shards and journals. ``run.max_relaunches`` is a budget
  for the whole run, shared by all its datasets (not per dataset): a server that keeps dying fails
  the run after that many relaunches, however many datasets remain;
- transient errors inside a task: task retries with backoff (``retry_condition_fn`` keeps
  validation failures and configuration errors from being retried);
- the flow itself has no retries (Prefect retries a flow whatever the error, validation failures
  included); any new run resumes from disk instead: tasks are idempotent, results never cached;
- failure, crash (SIGKILL under a worker) or cancellation: ``cleanup_hook`` runs GPU hygiene on the
  partition's targets; the body's try/finally stops the server it started.

Locks: the output directory's ``_lock`` (one writer per output) is taken before anything touches
a GPU, then ``gpu:<host>`` (one server per host) while the server lives. The slot's lease id and
this flow process (host, pid, start time) go to the run record (flows/runrecord.py): the crash hook
releases the lease of a run SIGKILLed under a worker, and, since a SIGKILLed plain `datagen run`
gets no hook, every run first releases the leases of this machine's recorded runs whose flow
process is dead, instead of waiting 60-75 s for them to expire. Each server goes to the record as
soon as its process exists (before readiness), so the next run also ends, by process group, the
servers of dead runs (pid and start time checked) before its before-launch hygiene.

Hygiene scope: the before-launch and relaunch passes (and the hooks) clean only the GPUs the
partition's server uses (``server.gpus``, else 0..tp_size-1): on a shared host, another job on
another GPU is spared and listed as such in the hygiene artifact.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from prefect import flow
from prefect.context import get_run_context

from flows import runrecord
from flows.gpulimit import gpu_slots, host_of, slot_holders
from flows.hooks import cleanup_hook
from flows.progress import Progress
from flows.stages import (
    diagnose_server,
    health_check,
    hygiene,
    infer_dataset,
    launch_server,
    load_config,
    prepare_run,
    promote,
    server_gpus,
    stop,
    validate,
)

__all__ = ["datagen"]


@flow(
    name="datagen",
    on_failure=[cleanup_hook],
    on_crashed=[cleanup_hook],
    on_cancellation=[cleanup_hook],
    retries=0,
    validate_parameters=True,
)
def datagen(
    partition: str = "all",
    inputs: list[str] | None = None,
    model_path: str | None = None,
    out: str | None = None,
    backend: str | None = None,
    server_url: str | None = None,
    shard_size: int | None = None,
    concurrency: int | None = None,
    mem_fraction_static: float | None = None,
    reasoning_parser: str | None = None,
) -> dict[str, Any]:
    """Generate a partition's datasets. ``partition`` is a name in deployments/ or a TOML path;
    the other parameters override the partition config (see ``datagen run --help``).

    Raises: ConfigError, OutputLocked, LaunchFailed, ServerGone (the run's ``max_relaunches``
    budget, shared by all datasets, exhausted), ValidationFailed, InputChanged."""
    from tasks.shards import OutputDir

    run_id = _flow_run_id()
    overrides = {k: v for k, v in dict(
        inputs=inputs, model_path=model_path, out=out, backend=backend, server_url=server_url,
        shard_size=shard_size, concurrency=concurrency, mem_fraction_static=mem_fraction_static,
        reasoning_parser=reasoning_parser).items() if v is not None}
    cfg = load_config(partition, overrides)
    plan = prepare_run(cfg, run_id)
    parser = _parser(cfg)
    target = cfg.targets[0]  # one server per partition; several targets is issue-9 scale-out
    host = host_of(target)
    gpus = server_gpus(cfg)  # hygiene touches only these: another job on this host's other GPUs lives
    progress = _progress(cfg, run_id)
    output = OutputDir(plan.out_dir)
    with output.lock({"host": socket.gethostname(), "pid": os.getpid(), "flow_run": run_id}):
        progress.start(*_committed(output))
        server: Any = None  # tasks.server.ServerHandle while one runs
        relaunches = 0  # a budget per run, shared by every dataset
        try:
            if cfg.server_url is None:
                _release_dead_leases(run_id)
                _end_dead_servers(run_id, cfg.hygiene_grace_s)
            with gpu_slots([] if cfg.server_url else [target], on_lease=_record_lease(run_id),
                           on_release=lambda: runrecord.update(run_id, lease_released=True),
                           holders=lambda name: slot_holders(name, exclude=run_id)):
                if cfg.server_url is None:
                    hygiene(target, host, "before-launch", cfg.hygiene_grace_s, gpus=gpus)
                    server = launch_server(cfg, target, host, plan, parser, run_id)
                url = str(cfg.server_url or server.url)
                health_check(url, host, cfg.api_key())
                for name, path in cfg.datasets.items():
                    while True:
                        try:
                            infer_dataset(cfg, name, path, plan, url, host, parser, progress, _fingerprint(cfg, parser, url),
                                          server)
                            break
                        except Exception as exc:
                            if not _server_gone(exc) or server is None or relaunches >= cfg.max_relaunches:
                                raise
                            relaunches += 1
                            diagnose_server(cfg, target, host, server, parser)
                            stop(server, host, run_id)
                            server = None
                            hygiene(target, host, f"relaunch-{relaunches}", cfg.hygiene_grace_s, gpus=gpus)
                            server = launch_server(cfg, target, host, plan, parser, run_id)
                            url = server.url
                if server is not None:
                    stop(server, host, run_id)
                    server = None
        finally:
            progress.close()
            if server is not None:
                stop(server, host, run_id)
        report = validate(cfg, plan)
        latest = promote(plan)
    return {"partition": cfg.name, "out_dir": str(plan.out_dir), "latest": latest,
            "shards": progress.done_shards, "rows": progress.rows, "validation": report["summary"]}


def _record_lease(run_id: str | None) -> Any:
    """``on_lease`` of gpu_slots: the lease and the process holding it, in the run record."""
    def record(lease: str) -> None:
        runrecord.update(run_id, lease=lease, owner=runrecord.owner(), lease_released=False)

    return record


def _release_dead_leases(run_id: str | None) -> None:
    """Free the ``gpu:<host>`` leases of this machine's SIGKILLed runs (flows/runrecord.py)."""
    from prefect import get_run_logger

    from flows.gpulimit import release_lease

    for lease in runrecord.release_dead_leases(release_lease, exclude=run_id):
        get_run_logger().warning("released gpu slot lease %s of a dead run on this host", lease)


def _end_dead_servers(run_id: str | None, grace_s: float) -> None:
    """End, by process group, the servers recorded by this machine's dead runs (e.g. a flow
    SIGKILLed while its server was still loading): they would hold the port or, once loaded, GPU
    memory. Each is checked by pid and start time first (flows/runrecord.py)."""
    from prefect import get_run_logger

    for dead_run, entry in runrecord.end_dead_servers(exclude=run_id, grace_s=grace_s):
        get_run_logger().warning("ended server pid %s (process group %s) of dead run %s on this host",
                                 entry["pid"], entry.get("pgid") or entry["pid"], dead_run)


def _flow_run_id() -> str | None:
    try:
        ctx = get_run_context()
    except RuntimeError:
        return None
    fr = getattr(ctx, "flow_run", None)
    return str(fr.id) if fr is not None else None


def _parser(cfg: Any) -> str | None:
    if cfg.reasoning_parser:
        return str(cfg.reasoning_parser)
    from tasks.reasoning import parser_for_model

    try:
        return parser_for_model(cfg.model_path)
    except Exception:  # a remote model dir cannot be read here: the partition must name the parser
        return None


def _progress(cfg: Any, run_id: str | None) -> Progress:
    import math

    from prefect import get_run_logger

    from tasks.prompts import iter_dataset

    total = 0
    for name, path in cfg.datasets.items():
        n = sum(1 for _ in iter_dataset(path, name))  # rejects count: shard k is a fixed input slice
        total += max(1, math.ceil(n / cfg.shard_size))
    return Progress(partition=cfg.name, total_shards=total, logger=get_run_logger(), flow_run_id=run_id)


def _committed(output: Any) -> tuple[int, int]:
    shards = list(output.committed_shards()) if output.read_manifest() else []
    return len(shards), sum(int(getattr(s, "rows", 0)) for s in shards)


def _server_gone(exc: BaseException) -> bool:
    return any(c.__name__ == "ServerGone" for c in type(exc).__mro__)


def _fingerprint(cfg: Any, parser: str | None, url: str) -> str:
    """What the generated text depends on: model, backend, parallelism and flags, not the port, pid
    or memory fraction (a relaunch at a lower fraction produces the same rows), nor the reasoning
    parser: /generate returns the raw text whatever the parser, and the split is recorded per row
    (``reasoning_parser``), so a rerun with a fixed ``--reasoning-parser`` continues the output."""
    import hashlib
    import json

    if cfg.server_url is not None:
        return f"external:{url}"
    s = cfg.server
    doc = [cfg.model_path, s.backend, s.tp_size, s.served_model_name, s.context_length, list(s.extra_args)]
    return f"{s.backend}:{hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:12]}"
