"""The inference stage's Prefect tasks: open every dataset (each guard once, before a GPU is touched)
and generate one dataset against the run's servers, judging the first rows (the canary) and each
committed shard (the gate) as they come."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.artifacts import run_name
from tasks.inference import (
    DatasetSpec,
    OpenedDataset,
    ServerPool,
    ShardProgress,
    open_dataset,
    run_dataset,
)
from tasks.run import RunContext
from tasks.shards import OutputDir, ShardRecord
from tasks.validation import check_canary, gate_shard

__all__ = ["infer_dataset", "open_datasets"]


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
    logger = get_run_logger()
    for d in opened.values():
        for problem in d.problems[:10]:
            logger.warning("dataset %s: skipped journal %s; that row is generated again", d.spec.name, problem)
        if len(d.problems) > 10:
            logger.warning("dataset %s: %d more unusable journal lines skipped", d.spec.name, len(d.problems) - 10)
        if d.complete:
            logger.info("dataset %s: %d shards committed (0 now, %d resumed), 0 rows generated: "
                        "complete in %s, no server needed", d.spec.name, d.shards, d.shards, out.path)
    return opened


@task(task_run_name=run_name("infer-{dataset}@{host}"), cache_policy=NONE)
def infer_dataset(ctx: RunContext, dataset: OpenedDataset, servers: ServerPool,
                  on_progress: Callable[[ShardProgress], None] | None = None) -> dict[str, Any]:
    """Generate one opened dataset into the run's output, resuming committed shards and journals,
    through the run's servers (each request to whichever has a free slot). Not
    retried: a lost server is its lifecycle's to relaunch, a failed request the client's to retry
    (docs/architecture.md, "Retries").

    Args:
        on_progress: called after each committed shard (the run's progress artifact).

    Raises:
        ValidationFailed: the first rows (the canary) or a committed shard failed validation (not
            retried).
        ServerGone: no server is left and none is coming back (each server's lifecycle relaunches
            its own within its budget first).
        Exception: what ``tasks.inference.run_dataset`` raises.
    """
    spec = dataset.spec
    logger = get_run_logger()
    thresholds = ctx.cfg.validation
    out_dir = ctx.plan.out_dir

    def on_shard_committed(record: ShardRecord) -> None:
        # Stop at the first bad shard, not hours later (ValidationFailed propagates, not retried).
        gate_shard(out_dir, spec.name, record.index, thresholds)

    def on_canary(rows: list[dict[str, Any]]) -> None:
        # The first rows judged as they arrive: a gross failure stops the run in seconds.
        checks = check_canary(rows, spec.name, thresholds, out_dir)
        logger.info("canary of %s on %s: %d rows, %s", spec.name, ctx.host, len(rows),
                    ", ".join(f"{c.name} {c.status}" for c in checks))

    t0 = time.monotonic()
    settings = dataclasses.replace(ctx.inference(), canary_rows=thresholds.canary_rows)
    result = run_dataset(spec, out_dir, servers, settings, opened=dataset,
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
