"""The canary: judge the first rows a run generates, before a shard commits.

A shard is judged when it commits, which at a high concurrency comes after hundreds of answers. The
gross failures (a parser that does not match the model or its chat template, a model that writes no
answer) show in every row, so the first few rows that finish tell them apart from a good run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from tasks.shards import rows_to_table
from tasks.validation._checks import judge_all, measure_all
from tasks.validation._errors import ValidationFailed
from tasks.validation._results import Check, Context, ShardValidation, check_rank
from tasks.validation._thresholds import Thresholds

__all__ = ["CANARY_CHECKS", "check_canary"]

CANARY_CHECKS = ("reasoning_present", "tag_leak", "empty_content")


def check_canary(rows: Iterable[Mapping[str, Any]], dataset: str, thresholds: Thresholds | None = None,
                 out_dir: str | os.PathLike[str] = "OUT") -> list[Check]:
    """Judge a dataset's first generated rows; stop the run when they show a gross failure.

    A canary check fails when it fails under ``thresholds`` and more than half of the rows it
    considers breach it: a few odd rows in a small sample are left to the shard gate, which judges
    a whole shard at the configured rates.

    Args:
        rows: journal rows (``tasks.inference`` records) of one dataset.
        dataset: their dataset, for the message.
        thresholds: limits of the checks (default: ``Thresholds()``).
        out_dir: the output directory, for the messages.

    Raises:
        ValidationFailed: a canary check failed; the message names the check, the rows and the fix.
    """
    thr = thresholds or Thresholds()
    table = rows_to_table(dict(r) for r in rows)
    ctx = Context(dataset=dataset, out_dir=str(out_dir), rows_label=f"the first rows of {dataset}", committed=False)
    checks = judge_all(measure_all(table, ctx, thr, only=CANARY_CHECKS), ctx, thr)
    failed = sorted((c for c in checks if c.status == "fail" and c.count * 2 > c.rows), key=check_rank)
    if failed:
        message = failed[0].message
        if len(failed) > 1:
            message += f" (also failing: {', '.join(c.name for c in failed[1:])})"
        message += "; stopped by the canary on the first rows ([validation] canary_rows)"
        report = ShardValidation(dataset, -1, "", table.num_rows, checks)
        raise ValidationFailed(message, report)
    return checks
