"""The run's guards and its ending, as the context managers the flow body enters.

- :func:`opened_output`: the output's ``_lock`` and its committed shards checked intact, before any
  GPU is touched (the flow's next line is the resume check, inside :func:`published`).
- :func:`gpu_hosts`: what dead runs on this machine left is freed, then ``gpu:<host>`` of every host
  is held while the run's servers live (flows/gpulimit.py).
- :func:`gate_reported`: when a shard's validation gate stopped the run, the whole output's
  validation report is still published.
- :func:`published`: whatever the outcome, the progress artifact ends (done or failed) and the run
  summary is published (flows/summary.py, the run record).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger

from flows import runrecord
from flows.cancel import stop_cause
from flows.fleet import Fleet
from flows.gpulimit import gpu_slots, release_lease, slot_holders
from flows.heartbeats import check_heartbeats
from flows.progress import Progress
from flows.summary import LAST_RUN, RunSummary
from tasks.config import state_dir
from tasks.prompts import iter_dataset
from tasks.run import RunContext
from tasks.shards import OutputDir
from tasks.validation import ValidationFailed
from tasks.validation.task import validate

__all__ = ["Outcome", "gate_reported", "gpu_hosts", "opened_output", "progress_of", "published"]


@dataclass
class Outcome:
    """What the run produced, filled in as its stages end (the flow's return value)."""

    ctx: RunContext
    progress: Progress
    fleet: Fleet
    validation: dict[str, Any] | None = None
    latest: str | None = None
    ledger: dict[str, Any] | None = None  # the run's GPU-time ledger (RunLedger.to_dict), once published

    def result(self) -> dict[str, Any]:
        assert self.validation is not None
        return {"partition": self.ctx.cfg.name, "out_dir": str(self.ctx.plan.out_dir), "latest": self.latest,
                "shards": self.progress.done_shards, "rows": self.progress.rows,
                "validation": self.validation["summary"], "servers": [r.to_dict() for r in self.fleet.report()],
                "ledger": self.ledger}


def progress_of(ctx: RunContext) -> Progress:
    """The run's progress counter over its datasets' records (rejects count: shard k is a fixed
    input slice)."""
    cfg = ctx.cfg
    rows = {name: sum(1 for _ in iter_dataset(path, name)) for name, path in cfg.datasets.items()}
    return Progress(partition=cfg.name, datasets=rows, shard_size=cfg.shard_size, concurrency=cfg.concurrency,
                    logger=get_run_logger(), flow_run_id=ctx.run_id, samples=cfg.samples)


@contextmanager
def opened_output(ctx: RunContext, progress: Progress) -> Iterator[OutputDir]:
    """Record the run's plan (what recovery needs should the run die from here on), then hold the
    output's lock; a missing or changed shard stops the run here, before a GPU is touched."""
    _record_plan(ctx)
    output = OutputDir(ctx.plan.out_dir)
    with output.lock({"host": socket.gethostname(), "pid": os.getpid(), "flow_run": ctx.run_id}):
        output.check_intact()
        progress.start(committed(output))
        check_heartbeats()  # a deployment run the zombie automation would misjudge says so at once
        yield output


@contextmanager
def gpu_hosts(ctx: RunContext) -> Iterator[None]:
    """Free what this machine's dead runs left, then hold ``gpu:<host>`` of each host the run
    launches on (none for shared servers)."""
    targets = ctx.cfg.hosts() if ctx.launches else []
    if targets:
        _reclaim_dead_runs()
    with gpu_slots(targets, on_lease=_record_lease(ctx.run_id),
                   on_release=lambda: runrecord.lease_released(ctx.run_id),
                   holders=lambda name: slot_holders(name, exclude=ctx.run_id)):
        yield


@contextmanager
def gate_reported(ctx: RunContext) -> Iterator[None]:
    """The shard gate stopped the run (``ValidationFailed`` from inference): publish the whole
    output's validation report, then let the failure through."""
    try:
        yield
    except ValidationFailed as exc:
        validate(ctx, raise_on_failure=False, stopped=exc)
        raise


@contextmanager
def published(outcome: Outcome) -> Iterator[Outcome]:
    """End the progress artifact and publish the run summary, whatever the outcome; never hides
    the run's error."""
    try:
        yield outcome
    except BaseException as exc:
        _finish(outcome, exc)
        raise
    _finish(outcome, None)


def committed(output: OutputDir) -> dict[str, tuple[int, int, int]]:
    """Each dataset's committed shards, rows and rejects, as the output holds them."""
    if not output.read_manifest():
        return {}
    found: dict[str, tuple[int, int, int]] = {}
    for s in output.committed_shards():
        shards, rows, rejects = found.get(s.dataset, (0, 0, 0))
        found[s.dataset] = (shards + 1, rows + s.rows, rejects + s.rejects)
    return found


def _finish(outcome: Outcome, error: BaseException | None) -> None:
    """End the progress artifact (done or failed) and publish the run summary; never raises."""
    ctx, progress, fleet = outcome.ctx, outcome.progress, outcome.fleet
    logger = get_run_logger()
    name = type(error).__name__ if error is not None else ""
    try:
        progress.reconcile(committed(OutputDir(ctx.plan.out_dir)))
    except Exception as exc:  # the counts are for people; the run's outcome stands
        logger.warning("progress not reconciled with the output: %s", exc)
    cancelled = stop_cause(error, ctx.run_id)
    if cancelled:
        progress.close("cancelled", cancelled)
        verdict = "CANCELLED"
        reason = (f"{cancelled}; {progress.done_shards} of {progress.total_shards} shards were committed and are "
                  "kept: a rerun with the same parameters resumes after them")
    else:
        progress.close("failed" if error is not None else "done", name)
        verdict = "PASS" if error is None else "FAIL" if isinstance(error, ValidationFailed) else "ERROR"
        reason = f"{name}: {str(error).splitlines()[0] if str(error) else ''}" if error is not None else ""
    gpus = fleet.gpus  # held_s: their mean time held
    summary = RunSummary.of(progress, verdict=verdict, out_dir=str(ctx.plan.out_dir), latest=outcome.latest,
                            gpus=gpus, held_s=sum(r.gpu_seconds for r in fleet.results) / gpus if ctx.launches else None,
                            relaunches=sum(r.relaunches for r in fleet.results),
                            max_relaunches=ctx.cfg.max_relaunches * max(1, len(fleet.members)),
                            price=ctx.cfg.price_per_gpu_hour, reason=reason, ledger=fleet.ledger())
    outcome.ledger = summary.ledger
    try:
        runrecord.summarised(ctx.run_id, summary.to_dict())
        summary.publish()
    except Exception as exc:  # observability must never fail the run (nor hide its error)
        logger.warning("run summary artifact not created: %s", exc)
    try:
        OutputDir(ctx.plan.out_dir).write_file(LAST_RUN, json.dumps(summary.to_dict(), indent=1).encode())
    except Exception as exc:
        logger.warning("%s not written in %s: %s", LAST_RUN, ctx.plan.out_dir, exc)
    logger.info("%s", summary.headline())
    if summary.ledger is not None:
        logger.info("GPU-time ledger: %s", "; ".join(
            f"{b} {s:,.1f} s" for b, s in summary.ledger["gpu_seconds"].items() if s) + f"; {summary.ledger_headline()}")


def _record_plan(ctx: RunContext) -> None:
    """The run record's plan: the output, the simulated GPUs and the GPUs of each target."""
    cfg, plan = ctx.cfg, ctx.plan
    target_gpus: dict[str, list[int]] = {}
    for slot in cfg.servers():
        for node in slot.nodes or (slot.target,):
            target_gpus.setdefault(node, []).extend(cfg.for_server(slot).server_gpus())
    runrecord.planned(
        ctx.run_id, partition=cfg.name, targets=cfg.hosts(), out_dir=str(plan.out_dir),
        sim_gpus=plan.sim_gpus, shared_server=cfg.server_url is not None,
        gpus=sorted({g for gpus in target_gpus.values() for g in gpus}) or cfg.server_gpus(),
        target_gpus={t: sorted(set(g)) for t, g in target_gpus.items()},
    )


def _record_lease(run_id: str | None) -> Callable[[str], None]:
    """``on_lease`` of gpu_slots: the lease and the process holding it, in the run record."""
    def record(lease: str) -> None:
        runrecord.lease_taken(run_id, lease)

    return record


def _reclaim_dead_runs() -> None:
    """Free what this machine's dead runs left (flows/runrecord.py): the ``gpu:<host>`` leases of
    SIGKILLed runs, and their servers (e.g. a flow SIGKILLed while its server was still loading),
    which would hold the port or GPU memory. Servers are ended by process group once their pid and
    start time are checked, with the grace their guardian would give them. Nothing of this run's is
    needed: a run whose process lives is not dead, this one included."""
    logger = get_run_logger()
    for lease in runrecord.release_dead_leases(release_lease):
        logger.warning("released gpu slot lease %s of a dead run on this host", lease)
    for dead_run, entry in runrecord.end_dead_servers(grace_s=runrecord.DEAD_SERVER_GRACE_S):
        logger.warning("ended server pid %s (process group %s) of dead run %s on this host",
                       entry.pid, entry.pgid or entry.pid, dead_run)
    pruned = runrecord.prune()
    if pruned:
        logger.info("removed %d run record(s) of finished runs older than %g days from %s", len(pruned),
                    runrecord.RECORD_KEEP_DAYS, state_dir() / "runs")
