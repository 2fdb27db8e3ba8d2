"""The `datagen` flow: config -> plan -> lock / GPU hosts / servers -> for each dataset: inference
(validation gate per committed shard) -> validate the output -> (nightly) promote `latest`.

The body reads as the pipeline: each line calls a stage task (tasks/<stage>/task.py), enters the run's
servers (flows/fleet.py: one lifecycle per server, launched at once, each request going to
whichever is free) or a guard (flows/pipeline.py: the output's lock and checks, the ``gpu:<host>``
slots, the published summary). The parameters are the fields of the run settings model
(tasks.config.RunSettings), each with the field's own type; flows/params.py checks that at import and
writes their descriptions for Prefect's custom-run form. Recovery, the run records and
the hygiene scope: docs/architecture.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import flow
from prefect.context import get_run_context
from prefect.runtime import flow_run

from flows import logs
from flows.fleet import Fleet
from flows.hooks import cleanup_hook
from flows.names import run_name
from flows.params import declared
from flows.pipeline import Outcome, gate_reported, gpu_hosts, opened_output, progress_of, published
from tasks.config import (
    Backend,
    Fraction,
    NonNegative,
    ParserName,
    Positive,
    RegenerateMode,
    RunSettings,
    Samples,
    ShardSize,
)
from tasks.config.task import load_config
from tasks.inference.task import infer_dataset, open_datasets
from tasks.run import RunContext
from tasks.shards.task import prepare_run, promote
from tasks.validation.task import validate

__all__ = ["datagen", "flow_run_name"]

logs.install()


def flow_run_name() -> str:
    """A person's name for the run as given, else ``<partition>[-<output>]-<YYYY-MM-DD>-<HHMM>``
    (UTC, the scheduled start): the run list says what ran where and when (flows/names.py)."""
    try:
        when: datetime | None = flow_run.scheduled_start_time
    except Exception:  # outside a run, or no time recorded: now
        when = None
    try:
        current = flow_run.name
    except Exception:
        current = None
    return run_name(current, dict(flow_run.parameters or {}), when)


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
def datagen(
    partition: str = "all",
    inputs: tuple[str, ...] | None = None,
    model_path: str | None = None,
    out: str | None = None,
    backend: Backend | None = None,
    server_url: str | tuple[str, ...] | None = None,
    shard_size: ShardSize | None = None,
    concurrency: Positive | None = None,
    tp_size: Positive | None = None,
    mem_fraction_static: Fraction | None = None,
    reasoning_parser: ParserName | None = None,
    truncation_retries: NonNegative | None = None,
    samples: Samples | None = None,
    regenerate: RegenerateMode | None = None,
) -> dict[str, Any]:
    """Generate a partition's datasets. An empty parameter keeps the partition's value.

    Raises:
        ConfigError, OutputLocked, LaunchFailed, ValidationFailed, InputChanged: as named.
        ServerGone: no server is left: each died, hung or became unreachable past its
            ``max_relaunches`` budget (the message says why each went).
    """
    settings = RunSettings(
        inputs=inputs, model_path=model_path, out=out, backend=backend, server_url=server_url,
        shard_size=shard_size, concurrency=concurrency, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
        reasoning_parser=reasoning_parser, truncation_retries=truncation_retries, samples=samples,
        regenerate=regenerate,
    )
    cfg = load_config(partition, settings)
    ctx = RunContext.build(cfg, prepare_run(cfg), _flow_run_id())
    progress = progress_of(ctx)
    outcome = Outcome(ctx, progress, fleet := Fleet(ctx, total_rows=sum(progress.datasets.values())))
    progress.ledger = fleet.ledger  # goodput, live in the progress line and artifact
    with opened_output(ctx, progress), published(outcome):
        datasets = open_datasets(ctx)  # every guard, once: a changed input stops the run before a GPU is touched
        if not all(d.complete for d in datasets.values()):  # a complete output touches no GPU
            with gate_reported(ctx), gpu_hosts(ctx), fleet:
                fleet.wait_ready()
                for dataset in datasets.values():
                    infer_dataset(ctx, dataset, fleet.pool, progress.shard_committed)
        outcome.validation = validate(ctx)
        outcome.latest = promote(ctx.plan)
    return outcome.result()


def _flow_run_id() -> str | None:
    try:
        ctx = get_run_context()
    except RuntimeError:
        return None
    fr = getattr(ctx, "flow_run", None)
    return str(fr.id) if fr is not None else None
