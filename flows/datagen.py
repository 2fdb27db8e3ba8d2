"""The `datagen` flow: clean GPUs -> launch (tuned) -> health -> inference per dataset (validation
gate per committed shard) -> validate the output -> (nightly) promote `latest`.

Each line of the body calls a stage task (flows/stages.py), enters the run's servers (flows/fleet.py:
one session per server, launched at once, each request going to whichever is free) or holds a
lock: the output's `_lock`, then `gpu:<host>` of every host while its servers live.
Recovery, the run records and the hygiene scope are in the README's Decisions (Flow, Run records,
GPU hygiene). Whatever the outcome, the run ends its progress artifact (done or failed) and
publishes its summary (flows/summary.py); the flow's parameters are typed and described for
Prefect's custom-run form in flows/params.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.runtime import flow_run

from flows import logs, runrecord
from flows.context import RunContext, unlinked
from flows.fleet import Fleet
from flows.gpulimit import gpu_slots, release_lease, slot_holders
from flows.hooks import cleanup_hook
from flows.params import declared
from flows.progress import Progress
from flows.stages import (
    infer_dataset,
    load_config,
    prepare_run,
    promote,
    resume_check,
    validate,
)
from flows.summary import RunSummary
from tasks.config import Overrides, PartitionConfig
from tasks.inference import DatasetSpec
from tasks.prompts import iter_dataset
from tasks.shards import OutputDir
from tasks.validation import ValidationFailed

__all__ = ["datagen", "flow_run_name"]

logs.install()


def flow_run_name() -> str:
    """``<partition>-<YYYY-MM-DD>-<HHMM>`` (UTC, the scheduled start): the run list says what ran when."""
    partition = str(flow_run.parameters.get("partition") or "all")
    if partition.endswith(".toml"):
        partition = Path(partition).stem
    try:
        when = flow_run.scheduled_start_time.astimezone(UTC)
    except Exception:  # outside a run, or no time recorded: now
        when = datetime.now(UTC)
    return f"{partition}-{when:%Y-%m-%d-%H%M}"


@flow(
    name="datagen",
    flow_run_name=flow_run_name,
    on_failure=[cleanup_hook],
    on_crashed=[cleanup_hook],
    on_cancellation=[cleanup_hook],
    retries=0,
    validate_parameters=True,
)
@declared
def datagen(partition: str = "all", **settings: Any) -> dict[str, Any]:
    """Generate a partition's datasets. An empty parameter keeps the partition's value.

    Raises:
        ConfigError, OutputLocked, LaunchFailed, ValidationFailed, InputChanged: as named.
        ServerGone: no server is left: each died, hung or became unreachable past its
            ``max_relaunches`` budget (the message says why each went).
    """
    overrides = Overrides.from_mapping(settings)
    run_id = _flow_run_id()
    cfg = load_config(partition, overrides)
    ctx = RunContext.build(cfg, prepare_run(cfg, run_id), run_id, explicit_fraction=overrides.mem_fraction_static)
    progress = _progress(cfg, run_id)
    output = OutputDir(ctx.plan.out_dir)
    fleet = Fleet(ctx, total_rows=sum(progress.datasets.values()))
    # unlinked(): every task gets the run's context (and the progress counter) as a constant, not as
    # an upstream result: the run's graph shows only the data each task depends on.
    with output.lock({"host": socket.gethostname(), "pid": os.getpid(), "flow_run": run_id}):
        output.check_intact()  # a missing or changed shard stops the run before a GPU is touched
        progress.start(_committed(output))
        try:
            resume_check(unlinked(ctx))
            try:
                if ctx.launches:
                    _reclaim_dead_runs(ctx)
                with gpu_slots([s.target for s in cfg.servers()] if ctx.launches else [],
                               on_lease=_record_lease(run_id),
                               on_release=lambda: runrecord.update(run_id, lease_released=True),
                               holders=lambda name: slot_holders(name, exclude=run_id)), fleet:
                    fleet.wait_ready()
                    for name, path in cfg.datasets.items():
                        infer_dataset(unlinked(ctx), DatasetSpec(name, path), fleet.pool, unlinked(progress))
            except ValidationFailed:
                validate(unlinked(ctx), raise_on_failure=False)  # the gate stopped the run: publish the report
                raise
            report = validate(unlinked(ctx))
            latest = promote(unlinked(ctx.plan))
        except BaseException as exc:
            _finish(ctx, progress, fleet, None, exc)
            raise
    _finish(ctx, progress, fleet, latest, None)
    return {"partition": cfg.name, "out_dir": str(ctx.plan.out_dir), "latest": latest,
            "shards": progress.done_shards, "rows": progress.rows, "validation": report["summary"],
            "servers": fleet.report()}


def _finish(ctx: RunContext, progress: Progress, fleet: Fleet, latest: str | None,
            error: BaseException | None) -> None:
    """End the progress artifact (done or failed) and publish the run summary; never raises."""
    logger = get_run_logger()
    name = type(error).__name__ if error is not None else ""
    try:
        progress.reconcile(_committed(OutputDir(ctx.plan.out_dir)))
    except Exception as exc:  # the counts are for people; the run's outcome stands
        logger.warning("progress not reconciled with the output: %s", exc)
    progress.close("failed" if error is not None else "done", name)
    verdict = "PASS" if error is None else "FAIL" if isinstance(error, ValidationFailed) else "ERROR"
    reason = f"{name}: {str(error).splitlines()[0] if str(error) else ''}" if error is not None else ""
    gpus = max(1, sum(len(member.gpus) for _, member in fleet.members))  # held_s: their mean time held
    summary = RunSummary.of(progress, verdict=verdict, out_dir=str(ctx.plan.out_dir), latest=latest,
                            gpus=gpus, held_s=sum(fleet.gpu_seconds.values()) / gpus if ctx.launches else None,
                            relaunches=sum(fleet.relaunched.values()),
                            max_relaunches=ctx.cfg.max_relaunches * max(1, len(fleet.members)),
                            price=ctx.cfg.price_per_gpu_hour, reason=reason)
    try:
        runrecord.update(ctx.run_id, summary=summary.to_dict())
        summary.publish()
    except Exception as exc:  # observability must never fail the run (nor hide its error)
        logger.warning("run summary artifact not created: %s", exc)
    logger.info("%s", summary.headline())


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
    # rejects count: shard k is a fixed input slice
    rows = {name: sum(1 for _ in iter_dataset(path, name)) for name, path in cfg.datasets.items()}
    return Progress(partition=cfg.name, datasets=rows, shard_size=cfg.shard_size, concurrency=cfg.concurrency,
                    logger=get_run_logger(), flow_run_id=run_id)


def _committed(output: OutputDir) -> dict[str, tuple[int, int, int]]:
    """Each dataset's committed shards, rows and rejects, as the output holds them."""
    if not output.read_manifest():
        return {}
    found: dict[str, tuple[int, int, int]] = {}
    for s in output.committed_shards():
        shards, rows, rejects = found.get(s.dataset, (0, 0, 0))
        found[s.dataset] = (shards + 1, rows + s.rows, rejects + s.rejects)
    return found
