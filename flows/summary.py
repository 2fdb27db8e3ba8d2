"""The run summary: what a finished run made and what it cost, as one markdown artifact per
partition (key ``run-summary-<partition>``), written whether the run passed or failed.

Rows per dataset, tokens in and out, throughput, wall time, GPU-hours (the server's GPUs times how
long the run held them, hygiene to stop), relaunches and the verdict; with ``[run]
price_per_gpu_hour`` set, the cost of the run and per 1,000 rows. Then the GPU-time ledger
(tasks/inference/_ledger.py): goodput, each server's measured capacity, and every GPU-second in one
bucket, as a table with a bar per bucket. The summary is also kept in the output as
``_last_run.json`` (``datagen status OUT`` prints its ledger).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact

from flows.progress import Progress, fmt_duration
from tasks.artifacts import artifact_key
from tasks.inference import RunLedger
from tasks.validation import md_text

__all__ = ["LAST_RUN", "RunSummary"]

LAST_RUN = "_last_run.json"  # the last run's summary, in the output


@dataclass
class RunSummary:
    """One run's outcome and cost. ``verdict``: PASS, FAIL (validation), CANCELLED (a person stopped
    it: flows/cancel.py) or ERROR (anything else)."""

    partition: str
    verdict: str
    out_dir: str
    latest: str | None
    rows: dict[str, int]
    rows_new: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    gpus: int
    gpu_hours: float | None  # None: a shared server's GPUs are not this run's
    relaunches: int
    max_relaunches: int
    price_per_gpu_hour: float | None = None
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    ledger: dict[str, Any] | None = None  # RunLedger.to_dict(); None: no server ran

    @classmethod
    def of(cls, progress: Progress, *, verdict: str, out_dir: str, latest: str | None, gpus: int,
           held_s: float | None, relaunches: int, max_relaunches: int, price: float | None,
           reason: str = "", ledger: RunLedger | None = None) -> RunSummary:
        """The summary of a run from its progress counts and its server's hold time."""
        return cls(partition=progress.partition, verdict=verdict, out_dir=out_dir, latest=latest,
                   rows={n: c.rows for n, c in progress.counts.items()}, rows_new=progress.rows_new,
                   prompt_tokens=progress.prompt_tokens, completion_tokens=progress.completion_tokens,
                   wall_s=progress.elapsed_s, gpus=gpus,
                   gpu_hours=None if held_s is None else gpus * held_s / 3600.0, relaunches=relaunches,
                   max_relaunches=max_relaunches, price_per_gpu_hour=price, reason=reason,
                   ledger=ledger.to_dict() if ledger is not None and ledger.total_gpu_s > 0 else None)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def rows_per_s(self) -> float:
        return self.rows_new / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost(self) -> float | None:
        if self.price_per_gpu_hour is None or self.gpu_hours is None:
            return None
        return self.gpu_hours * self.price_per_gpu_hour

    @property
    def cost_per_1k_rows(self) -> float | None:
        """Cost of the run per 1,000 rows it generated (None: no price, or no rows)."""
        cost = self.cost
        return None if cost is None or not self.rows_new else cost * 1000.0 / self.rows_new

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total_rows=self.total_rows, rows_per_s=self.rows_per_s, tokens_per_s=self.tokens_per_s,
                 cost=self.cost, cost_per_1k_rows=self.cost_per_1k_rows)
        return d

    def ledger_headline(self) -> str:
        """The ledger's one line (goodput, capacity, biggest loss); "" without a ledger."""
        ledger = RunLedger.from_dict(self.ledger)
        return ledger.headline() if ledger is not None else ""

    def headline(self) -> str:
        """One line, verdict first: the artifact's description and the run's last log line."""
        relaunch = f", {self.relaunches} relaunch{'es' if self.relaunches != 1 else ''}"
        line = (f"{self.verdict}: {self.partition}: {self.total_rows:,} rows -> {self.out_dir}"
                f"{f', latest -> {self.latest}' if self.latest else ''}, {fmt_duration(self.wall_s)}{relaunch}")
        return f"{line}; {self.reason}" if self.verdict == "CANCELLED" and self.reason else line

    def markdown(self) -> str:
        gpu_h = "shared server (not counted)" if self.gpu_hours is None else \
            f"{self.gpu_hours:.3f} ({self.gpus} GPU(s))"
        lines = [f"# Run summary: {self.verdict}", "", f"**{self.headline()}**", ""]
        if self.reason:
            lines += [f"Why: {md_text(self.reason)}", ""]
        lines += ["| | |", "|---|---|",
                  f"| output | `{self.out_dir}` |",
                  f"| latest | {f'`{self.latest}`' if self.latest else '-'} |",
                  f"| rows | {self.total_rows:,} ({', '.join(f'{k} {v:,}' for k, v in self.rows.items())}) |",
                  f"| rows generated by this run | {self.rows_new:,} |",
                  f"| tokens in / out | {self.prompt_tokens:,} / {self.completion_tokens:,} |",
                  f"| throughput | {self.rows_per_s:,.2f} rows/s, {self.tokens_per_s:,.0f} tokens/s out |",
                  f"| wall time | {fmt_duration(self.wall_s)} ({self.wall_s:,.1f} s) |",
                  f"| GPU-hours | {gpu_h} |",
                  f"| relaunches | {self.relaunches} of {self.max_relaunches} |"]
        if self.cost is not None:
            per_k = "-" if self.cost_per_1k_rows is None else f"{self.cost_per_1k_rows:,.4f}"
            lines += [f"| cost ({self.price_per_gpu_hour:g} per GPU-hour) | {self.cost:,.4f} |",
                      f"| cost per 1,000 rows | {per_k} |"]
        ledger = RunLedger.from_dict(self.ledger)
        if ledger is not None:
            lines += ["", *ledger.markdown()]
        return "\n".join(lines) + "\n"

    def publish(self) -> UUID:
        """The ``run-summary-<partition>`` artifact of the current run.

        Raises:
            Exception: what Prefect raises when the artifact cannot be created.
        """
        return create_markdown_artifact(  # type: ignore[return-value]  # sync in a flow run
            self.markdown(), key=artifact_key("run-summary", self.partition), description=self.headline()[:500])

