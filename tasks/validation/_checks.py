"""The row-level checks in the order they run and report, and ``validate_table`` over them."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pyarrow as pa

from tasks.validation._checks_reasoning import (
    judge_reasoning,
    judge_resplit,
    judge_tags,
    measure_reasoning,
    measure_resplit,
    measure_tags,
)
from tasks.validation._checks_rows import (
    judge_content,
    judge_finish,
    judge_tokens,
    judge_truncation,
    measure_content,
    measure_finish,
    measure_tokens,
)
from tasks.validation._checks_structure import (
    judge_fingerprint,
    judge_provenance,
    judge_schema,
    judge_unique,
    measure_fingerprint,
    measure_provenance,
    measure_schema,
    measure_unique,
)
from tasks.validation._results import Check, Context
from tasks.validation._stats import JudgeFn, MeasureFn, Stats
from tasks.validation._thresholds import Thresholds

# (check name, measure, judge). Checks sharing a measure (truncation, finish_reason) measure once.
_MEASURES: tuple[tuple[str, MeasureFn, JudgeFn], ...] = (
    ("schema", measure_schema, judge_schema),
    ("unique_ids", measure_unique, judge_unique),
    ("fingerprint", measure_fingerprint, judge_fingerprint),
    ("provenance", measure_provenance, judge_provenance),
    ("reasoning_present", measure_reasoning, judge_reasoning),
    ("tag_leak", measure_tags, judge_tags),
    ("resplit", measure_resplit, judge_resplit),
    ("empty_content", measure_content, judge_content),
    ("truncation", measure_finish, judge_truncation),
    ("finish_reason", measure_finish, judge_finish),
    ("token_counts", measure_tokens, judge_tokens),
)


def measure_all(table: pa.Table, ctx: Context, thr: Thresholds,
                only: Collection[str] | None = None) -> dict[str, Stats]:
    """Check name -> the stats of ``table`` its judge needs (of the checks in ``only``, else all)."""
    stats: dict[str, Stats] = {}
    cache: dict[MeasureFn, Stats] = {}
    for name, measure, _judge in _MEASURES:
        if only is not None and name not in only:
            continue
        if measure not in cache:
            cache[measure] = measure(table, ctx, thr)
        stats[name] = cache[measure]
    return stats


def judge_all(stats: Mapping[str, Stats], ctx: Context, thr: Thresholds) -> list[Check]:
    """The Checks of ``stats`` (one table's, or several merged); unknown where a measure could not run."""
    checks = []
    for name, _measure, judge in _MEASURES:
        if name not in stats:
            continue
        s = stats[name]
        if s.get("unknown"):
            checks.append(Check(name, "unknown", None, None, f"cannot check: {s['unknown']}"))
        else:
            checks.append(judge(s, ctx, thr))
    return checks


def validate_table(table: pa.Table, thresholds: Thresholds | None = None,
                   context: Context | None = None) -> list[Check]:
    """Run the row-level checks (all but ``complete``) on one table of rows.

    Raises nothing for bad data: a breach is a failing Check. A column a check needs that is missing or
    mistyped makes that check ``unknown`` (and ``schema`` fail).

    Args:
        table: rows in the ``tasks.schema.ROW_SCHEMA`` layout.
        thresholds: limits of the checks (default: ``Thresholds()``).
        context: the dataset, shard and parser expectations the checks need.
    """
    thr = thresholds or Thresholds()
    ctx = context or Context(dataset="table")
    return judge_all(measure_all(table, ctx, thr), ctx, thr)
