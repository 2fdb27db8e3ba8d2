"""Prefect artifacts of a report: a table of the dataset totals and a markdown summary."""

from __future__ import annotations

import re
from typing import Any

from tasks.validation._results import ValidationReport, measured


def _artifact_key(prefix: str, suffix: str) -> str:
    key = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{suffix}".lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)


def md_text(value: Any) -> str:
    """``value`` as markdown text that shows as written: ``<think>`` is not an HTML tag for the UI
    to swallow (it would show ``the **...** format``)."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cell(value: Any) -> str:
    return md_text(value).replace("|", "\\|")


def report_table(report: ValidationReport) -> list[dict[str, Any]]:
    """One row per dataset total check (the table artifact): the measured value and its limit in
    one unit (``measured``)."""
    return [
        {"dataset": d.name, "check": c.name, "status": c.status, "measured": measured(c)[0], "limit": measured(c)[1],
         "rows": c.rows, "message": c.message}
        for d in report.datasets for c in d.checks
    ]


def report_markdown(report: ValidationReport) -> str:
    """Checks, rates, failing shards and a few sample rows (reasoning/content trimmed) as markdown."""
    out = [f"# Validation: {report.verdict.upper()}", "",
           f"`{report.out_dir}`: {report.rows:,} rows, validated {report.validated_at}", ""]
    if report.stop:
        out += [f"**Stopped by {md_text(report.stop['by'])}:** {md_text(report.stop['message'])}", ""]
        if report.stop["checks"]:
            out += ["| check | status | measured | limit | message |", "|---|---|---|---|---|"]
            for c in report.stop["checks"]:
                value, limit = measured(c)
                out.append(f"| {c.name} | {c.status} | {value} | {limit} | {_cell(c.message)} |")
            out.append("")
    for d in report.datasets:
        out += [f"## {d.name}: {d.verdict} ({d.rows:,} rows, {len(d.shards)} shards)", "",
                "| check | status | measured | limit | message |", "|---|---|---|---|---|"]
        for c in d.checks:
            value, limit = measured(c)
            out.append(f"| {c.name} | {c.status} | {value} | {limit} | {_cell(c.message)} |")
        bad = d.failing_shards()
        if bad:
            out += ["", "Failing shards: " + ", ".join(str(s.shard_index) for s in bad)]
        out.append("")
    if report.samples:
        out += ["## Sample rows", "", "| dataset | id | finish | reasoning | content |", "|---|---|---|---|---|"]
        for r in report.samples:
            cells = [_cell(r.get(k) or "") for k in ("dataset", "id", "finish_reason", "reasoning", "content")]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def publish_artifacts(report: ValidationReport, key_prefix: str = "validation", partition: str | None = None) -> list[str]:
    """Create a table and a markdown artifact for ``report`` in the current Prefect run.

    Outside a flow or task run this does nothing and returns []; inside, it returns the artifact ids.
    Keys are ``<prefix>-checks[-<partition>]`` and ``<prefix>-summary[-<partition>]`` (lowercase
    letters, digits, dashes): one history per partition. Descriptions lead with the verdict.

    Args:
        report: the validation report to publish.
        key_prefix: start of both artifact keys (normalised to lowercase letters, digits, dashes).
        partition: the run's partition, the end of both keys.
    """
    # Prefect is imported only when artifacts are published: `datagen validate`, resplit and the
    # benchmarks use this package without paying Prefect's import (seconds).
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    tail = f"-{partition}" if partition else ""
    description = f"{report.verdict.upper()}: validation of {report.out_dir} ({report.rows:,} rows)"
    ids = [
        create_table_artifact(table=report_table(report), key=_artifact_key(key_prefix, "checks" + tail),
                              description=description),
        create_markdown_artifact(markdown=report_markdown(report), key=_artifact_key(key_prefix, "summary" + tail),
                                 description=description),
    ]
    return [str(i) for i in ids]
