"""The validation stage's Prefect task: validate the whole output, publish its report as artifacts,
write the dataset card, and mark a failed nightly version so that it is never resumed."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.card import write_card
from tasks.run import RunContext
from tasks.shards import mark_failed
from tasks.validation import (
    ShardValidation,
    ValidationFailed,
    ValidationReport,
    publish_artifacts,
    validate_output,
    write_report,
)

__all__ = ["validate"]


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
