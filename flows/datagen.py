"""The `datagen` flow: clean GPUs -> launch (tuned) -> health -> inference per dataset (validation
gate per committed shard) -> validate the output -> (nightly) promote `latest`.

Each line of the body calls a stage task (flows/stages.py), enters the server session
(flows/session.py) or holds a lock: the output's `_lock`, then `gpu:<host>` while a server lives.
Recovery, the run records and the hygiene scope are in the README's Decisions (Flow, Run records,
GPU hygiene).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from functools import partial
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import get_run_context

from flows import runrecord
from flows.context import RunContext
from flows.gpulimit import gpu_slots, release_lease, slot_holders
from flows.hooks import cleanup_hook
from flows.progress import Progress
from flows.session import ServerSession
from flows.stages import (
    health_check,
    infer_dataset,
    load_config,
    prepare_run,
    promote,
    resume_check,
    validate,
)
from tasks.config import Overrides, PartitionConfig
from tasks.inference import DatasetSpec
from tasks.prompts import iter_dataset
from tasks.shards import OutputDir

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
    tp_size: int | None = None,
    mem_fraction_static: float | None = None,
    reasoning_parser: str | None = None,
    samples: int | None = None,
    regenerate: str | None = None,
) -> dict[str, Any]:
    """Generate a partition's datasets.

    Args:
        partition: a name in deployments/ or a TOML path.
        inputs, model_path, out, backend, server_url, shard_size, concurrency, tp_size,
            mem_fraction_static, reasoning_parser, samples, regenerate: override the partition config (``tasks.config.Overrides``; see
            ``datagen run --help``).

    Raises:
        ConfigError, OutputLocked, LaunchFailed, ValidationFailed, InputChanged: as named.
        ServerGone: the server kept dying: the run's ``max_relaunches`` budget is spent.
    """
    overrides = Overrides.from_mapping(locals())
    run_id = _flow_run_id()
    cfg = load_config(partition, overrides)
    ctx = RunContext.build(cfg, prepare_run(cfg, run_id), run_id)
    progress = _progress(cfg, run_id)
    output = OutputDir(ctx.plan.out_dir)
    with output.lock({"host": socket.gethostname(), "pid": os.getpid(), "flow_run": run_id}):
        output.check_intact()  # a missing or changed shard stops the run before a GPU is touched
        progress.start(*_committed(output))
        resume_check(ctx)
        try:
            if ctx.launches:
                _reclaim_dead_runs(ctx)
            with gpu_slots([ctx.target] if ctx.launches else [], on_lease=_record_lease(run_id),
                           on_release=lambda: runrecord.update(run_id, lease_released=True),
                           holders=lambda name: slot_holders(name, exclude=run_id)), \
                    ServerSession(ctx) as server:
                health_check(ctx, server.endpoint)
                for name, path in cfg.datasets.items():
                    server.run(partial(infer_dataset, ctx, DatasetSpec(name, path), progress=progress))
        finally:
            progress.close()
        report = validate(ctx)
        latest = promote(ctx.plan)
    return {"partition": cfg.name, "out_dir": str(ctx.plan.out_dir), "latest": latest,
            "shards": progress.done_shards, "rows": progress.rows, "validation": report["summary"]}


def _record_lease(run_id: str | None) -> Callable[[str], None]:
    """``on_lease`` of gpu_slots: the lease and the process holding it, in the run record."""
    def record(lease: str) -> None:
        runrecord.update(run_id, lease=lease, owner=runrecord.owner(), lease_released=False)

    return record


def _reclaim_dead_runs(ctx: RunContext) -> None:
    """Free what this machine's dead runs left (flows/runrecord.py): the ``gpu:<host>`` leases of
    SIGKILLed runs, and their servers (e.g. a flow SIGKILLed while its server was still loading),
    which would hold the port or GPU memory. Servers are ended by process group once their pid and
    start time are checked."""
    logger = get_run_logger()
    for lease in runrecord.release_dead_leases(release_lease, exclude=ctx.run_id):
        logger.warning("released gpu slot lease %s of a dead run on this host", lease)
    for dead_run, entry in runrecord.end_dead_servers(exclude=ctx.run_id, grace_s=ctx.cfg.hygiene_grace_s):
        logger.warning("ended server pid %s (process group %s) of dead run %s on this host",
                       entry["pid"], entry.get("pgid") or entry["pid"], dead_run)


def _flow_run_id() -> str | None:
    try:
        ctx = get_run_context()
    except RuntimeError:
        return None
    fr = getattr(ctx, "flow_run", None)
    return str(fr.id) if fr is not None else None


def _progress(cfg: PartitionConfig, run_id: str | None) -> Progress:
    total = 0
    for name, path in cfg.datasets.items():
        n = sum(1 for _ in iter_dataset(path, name))  # rejects count: shard k is a fixed input slice
        total += max(1, math.ceil(n / cfg.shard_size))
    return Progress(partition=cfg.name, total_shards=total, logger=get_run_logger(), flow_run_id=run_id)


def _committed(output: OutputDir) -> tuple[int, int]:
    shards = list(output.committed_shards()) if output.read_manifest() else []
    return len(shards), sum(int(getattr(s, "rows", 0)) for s in shards)
