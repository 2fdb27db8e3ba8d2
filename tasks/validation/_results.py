"""What validation produces: ``Check``, the shard/dataset/output results, their verdicts and summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tasks.validation._thresholds import Thresholds

REPORT_NAME = "_validation.json"
# Order in which the gate picks the one message to show: the most fundamental breach first, since a
# broken schema or a wrong parser usually trips the later checks too.
CHECK_ORDER = (
    "schema",
    "complete",
    "unique_ids",
    "fingerprint",
    "provenance",
    "reasoning_present",
    "tag_leak",
    "resplit",
    "empty_content",
    "truncation",
    "finish_reason",
    "token_counts",
)
# How many examples (ids, failing shards) a message or summary lists before it says "more".
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Check:
    """One check's outcome. ``value`` is usually the breaching rate, ``count`` of ``rows`` considered."""

    name: str
    status: str  # pass | warn | fail | unknown
    value: float | int | str | None
    threshold: float | int | str | None
    message: str
    count: int = 0
    rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Context:
    """What a table is: used in messages and for the manifest-based checks."""

    dataset: str
    shard_index: int | None = None
    out_dir: str = "OUT"
    rows_label: str | None = None  # what the rows are, when neither a shard nor a whole dataset
    committed: bool = True  # False: rows judged before any shard of theirs was committed (the canary)

    @property
    def label(self) -> str:
        if self.rows_label is not None:
            return self.rows_label
        if self.shard_index is None:
            return self.dataset
        return f"shard {self.shard_index} of {self.dataset}"


def verdict_of(checks: Iterable[Check]) -> str:
    """``fail`` if any check failed, else ``warn`` if any warned or was unknown, else ``pass``."""
    statuses = {c.status for c in checks}
    if "fail" in statuses:
        return "fail"
    if statuses & {"warn", "unknown"}:
        return "warn"
    return "pass"


def check_rank(c: Check) -> int:
    """Position of ``c`` in ``CHECK_ORDER`` (unknown names last)."""
    return CHECK_ORDER.index(c.name) if c.name in CHECK_ORDER else len(CHECK_ORDER)


def fmt_value(value: Any) -> str:
    """A check's value for people: rates as percentages, other floats with two decimals."""
    if isinstance(value, float):
        return f"{value:.2%}" if value <= 1.0 else f"{value:.2f}"
    return "" if value is None else str(value)


# What a rate check's value counts (a share of rows), and what a count check's value counts.
RATE_OF = {"reasoning_present": "without reasoning", "tag_leak": "with tags left", "empty_content": "empty",
           "truncation": "truncated", "finish_reason": "aborted", "volume": "rejected"}
COUNT_OF = {"unique_ids": "duplicate rows", "resplit": "rows differ", "finish_reason": "aborted rows"}


def _percent(rate: float) -> str:
    return f"{rate * 100:.3g}%"


def measured(c: Check) -> tuple[str, str]:
    """A check's value and limit for people, in one unit and saying what they count: ``0% without
    reasoning`` / ``at most 5%``; ``3 of 3 shards``; ``5.24 chars/token`` / ``0.25..16.0 chars/token``.
    Checks whose value is a yes/no (schema, fingerprint, provenance) leave both to the message."""
    v, t = c.value, c.threshold
    if v is None:
        return "", ""
    if c.name == "token_counts":
        return f"{float(v):.2f} chars/token", f"{t} chars/token" if t is not None else ""
    if isinstance(v, float) and c.name in RATE_OF:
        limit = f"at most {_percent(float(t))}" if isinstance(t, (int, float)) and not isinstance(t, bool) else ""
        return f"{_percent(v)} {RATE_OF[c.name]}", limit
    if c.name == "volume":  # a count of rows against min_rows
        return f"{v:,} rows", f"at least {t:,} rows" if isinstance(t, int) else ""
    if c.name == "complete":
        if isinstance(t, int) and t:
            return f"{v} of {t} shards", ""
        return (f"{v} shards" if t is None else f"{v} rows missing" if v else "none missing"), ""
    if c.name in COUNT_OF and isinstance(v, int):
        return (f"{v:,} {COUNT_OF[c.name]}" if v else "none"), ""
    return "", ""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class ShardValidation:
    """The checks of one committed shard."""

    dataset: str
    shard_index: int
    file: str
    rows: int
    checks: list[Check]
    validated_at: str = field(default_factory=_now)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    samples: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def verdict(self) -> str:
        return verdict_of(self.checks)

    def failed(self) -> list[Check]:
        return sorted((c for c in self.checks if c.status == "fail"), key=check_rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "shard": self.shard_index,
            "file": self.file,
            "rows": self.rows,
            "verdict": self.verdict,
            "validated_at": self.validated_at,
            "checks": [c.to_dict() for c in self.checks],
        }


@dataclass
class DatasetValidation:
    """A dataset's shards and its totals (the same checks over all its shards together)."""

    name: str
    rows: int
    shards: list[ShardValidation]
    checks: list[Check]

    @property
    def verdict(self) -> str:
        return verdict_of(self.all_checks())

    def all_checks(self) -> list[Check]:
        """The totals, then every shard's checks."""
        return [*self.checks, *(c for s in self.shards for c in s.checks)]

    def failing_shards(self) -> list[ShardValidation]:
        return [s for s in self.shards if s.verdict == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "rows": self.rows,
            "total": [c.to_dict() for c in self.checks],
            "shards": {str(s.shard_index): s.to_dict() for s in self.shards},
        }


_MARK = {"pass": "ok  ", "warn": "WARN", "fail": "FAIL", "unknown": "??  "}


@dataclass
class ValidationReport:
    """The validation of a whole output directory (written as ``_validation.json``)."""

    out_dir: str
    datasets: list[DatasetValidation]
    thresholds: Thresholds
    validated_at: str = field(default_factory=_now)
    elapsed_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop: dict[str, Any] | None = None  # what stopped the run before it finished (``note_stop``)

    @property
    def verdict(self) -> str:
        return verdict_of([*self.all_checks(), *(self.stop or {}).get("checks", [])])

    def note_stop(self, stopped: ShardValidation, message: str, datasets: Iterable[str] = ()) -> None:
        """The run was stopped by the canary (``stopped.shard_index == -1``) or a shard's gate: say so
        first, with the checks that stopped it, and judge neither ``complete`` nor ``volume`` of the
        datasets the stop left unfinished (a "finish the run" or "check the input" would mislead);
        ``datasets``: all of the run's, so that one never started is listed too."""
        by = ("the canary on the first rows of " if stopped.shard_index < 0 else
              f"the gate of shard {stopped.shard_index} of ") + stopped.dataset
        self.stop = {"by": by, "dataset": stopped.dataset, "shard": stopped.shard_index, "message": message,
                     "checks": list(stopped.checks) if stopped.shard_index < 0 else []}
        known = {d.name for d in self.datasets}
        for name in datasets:
            if name not in known:
                self.datasets.append(DatasetValidation(name, 0, [], []))
        for d in self.datasets:
            d.checks = [Check(c.name, "unknown", None, None, f"not judged: {by} stopped the run first", 0, c.rows)
                        if c.name in ("complete", "volume") and c.status == "fail" else c for c in d.checks]
            if not d.checks and not d.shards:
                d.checks = [Check("complete", "unknown", None, None,
                                  f"not started: {by} stopped the run first")]

    @property
    def ok(self) -> bool:
        return self.verdict != "fail"

    @property
    def rows(self) -> int:
        return sum(d.rows for d in self.datasets)

    def all_checks(self) -> list[Check]:
        return [c for d in self.datasets for c in d.all_checks()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "kind": "output",
            "out_dir": self.out_dir,
            "verdict": self.verdict,
            "rows": self.rows,
            "validated_at": self.validated_at,
            "elapsed_s": round(self.elapsed_s, 3),
            "thresholds": self.thresholds.to_dict(),
            "datasets": {d.name: d.to_dict() for d in self.datasets},
            "samples": self.samples,
            **({"stop": {**self.stop, "checks": [c.to_dict() for c in self.stop["checks"]]}} if self.stop else {}),
        }

    def summary(self) -> str:
        """A readable terminal summary: the verdict, each dataset's totals, failing shards."""
        lines = [f"validation of {self.out_dir}: {self.verdict.upper()} ({self.rows:,} rows, {self.elapsed_s:.2f} s)"]
        if self.stop:
            lines.append(f"  STOPPED by {self.stop['by']}: {self.stop['message']}")
            lines += [f"    {_MARK[c.status]} {c.name:<18} {measured(c)[0]:<36} {c.message}" for c in self.stop["checks"]]
        for d in self.datasets:
            lines.append(f"  {d.name}: {d.verdict} - {d.rows:,} rows in {len(d.shards)} shards")
            for c in d.checks:
                value, limit = measured(c)
                shown = f"{value} ({limit})" if limit else value
                lines.append(f"    {_MARK[c.status]} {c.name:<18} {shown:<36} {c.message}")
            bad = d.failing_shards()
            for s in bad[:MAX_EXAMPLES]:
                first = s.failed()[0]
                lines.append(f"    shard {s.shard_index}: FAIL {first.name}: {first.message}")
            if len(bad) > MAX_EXAMPLES:
                lines.append(f"    ... {len(bad) - MAX_EXAMPLES} more failing shards (see {REPORT_NAME})")
            # a warning a shard alone raised (below the evidence bar, or judged with its dataset) is said too
            warned = [(s, c) for s in d.shards if s.verdict == "warn" for c in s.checks if c.status == "warn"
                      and not any(t.name == c.name and t.status != "pass" for t in d.checks)]
            for s, c in warned[:MAX_EXAMPLES]:
                lines.append(f"    shard {s.shard_index}: WARN {c.name}: {c.message}")
            if len(warned) > MAX_EXAMPLES:
                lines.append(f"    ... {len(warned) - MAX_EXAMPLES} more shard warnings (see {REPORT_NAME})")
        return "\n".join(lines)
