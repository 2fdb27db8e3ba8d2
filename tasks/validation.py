"""Validation of committed shards and whole outputs: catch bad data in the first shard, not hours later.

Every check is vectorised over Arrow (``pyarrow.compute``); only the ``resplit`` check calls Python per
row, on a bounded, evenly spaced sample (``Thresholds.resplit_sample_rows`` per shard).

Checks (names are stable; tests and the flow rely on them), in the order the gate reports them:

- ``schema``: columns, types and nullability against ``tasks.schema.ROW_SCHEMA`` (extra columns warn).
- ``complete``: rows + rejects of a shard equal its slice of the input (``shard_size``, ``total_rows``
  from the manifest), the manifest's row count matches the file; for a whole output every shard is
  committed.
- ``unique_ids``: one row per input id (per shard, then across all shards of a dataset).
- ``fingerprint``: one ``sampling``, ``server``, ``model`` and ``reasoning_parser`` value across the
  output (a mixed server fingerprint only warns with ``allow_mixed_server``).
- ``reasoning_present``: rows that should carry reasoning (a parser is set, or the prompt opened the
  think block) whose ``reasoning`` is null or blank. With no parser and no think block in the prompt,
  reasoning is not expected.
- ``tag_leak``: a think/channel tag of any parser family left in ``content`` or ``reasoning``.
- ``resplit``: ``raw`` re-split with ``tasks.reasoning.split_reasoning`` gives the stored
  reasoning/content (a sample); rows without a parser must have ``content == raw`` (every row), and
  reasoning + content can never be longer than raw (every row).
- ``empty_content``: blank ``content`` among rows that finished with ``stop`` (a truncated row has no
  content by design).
- ``truncation``: rate of ``finish_reason == "length"``.
- ``finish_reason``: values outside stop/length/abort, and the rate of ``abort``.
- ``token_counts``: counts are non-negative; ``completion_tokens > 0`` when ``raw`` is non-empty and
  ``prompt_tokens > 0`` when ``prompt`` is; characters per completion token within
  [``chars_per_token_min``, ``chars_per_token_max``] for the shard as a whole and for each row with at
  least ``token_ratio_min_tokens`` tokens. The default band 0.25..16 holds for real tokenizers (about 4
  for English, 1-1.5 for CJK, below 1 only for emoji/rare characters split into bytes, above 8 only
  for long whitespace or punctuation runs); a row outside it means counts from another row or field.

Rate checks fail above their ``*_max_rate`` and warn above their ``*_warn_rate`` (or above zero where no
warn rate exists). On fewer than ``min_rows_for_rate`` rows a rate check only fails when every row
breaches (a 3-row tail shard with one truncated row is noise, three of three is not).

Statuses: ``pass``, ``warn``, ``fail``, and ``unknown`` when a check could not run (e.g. a column it
needs is missing; ``schema`` then fails). A report's verdict is ``fail`` if any check failed, else
``warn`` if any warned or was unknown, else ``pass``.

Errors: ``ThresholdError`` (bad threshold key or value), ``BadOutput`` (not an output directory),
``ValidationFailed`` (raised by :func:`gate_shard`; carries one actionable message and the result).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.schema import ROW_SCHEMA

__all__ = [
    "BadOutput",
    "Check",
    "Context",
    "ShardValidation",
    "ThresholdError",
    "Thresholds",
    "ValidationFailed",
    "ValidationReport",
    "gate_shard",
    "publish_artifacts",
    "validate_output",
    "validate_shard",
    "validate_table",
]

REPORT_NAME = "_validation.json"
MANIFEST_NAME = "_manifest.json"
FINISH_REASONS = ("stop", "length", "abort")
# Order in which the gate picks the one message to show: the most fundamental breach first, since a
# broken schema or a wrong parser usually trips the later checks too.
CHECK_ORDER = (
    "schema",
    "complete",
    "unique_ids",
    "fingerprint",
    "reasoning_present",
    "tag_leak",
    "resplit",
    "empty_content",
    "truncation",
    "finish_reason",
    "token_counts",
)
_MAX_EXAMPLES = 5


# ---------------------------------------------------------------------------------------------- errors
class ThresholdError(ValueError):
    """A threshold key is unknown or its value is out of range; the message names the key."""


class BadOutput(Exception):
    """The path is not a datagen output directory (missing, no manifest, unreadable manifest)."""


class ValidationFailed(Exception):
    """A shard breached a threshold: the run must stop. ``message`` is the one actionable line."""

    def __init__(self, message: str, report: ShardValidation | ValidationReport) -> None:
        super().__init__(message)
        self.message = message
        self.report = report


# ------------------------------------------------------------------------------------------ thresholds
@dataclass(frozen=True)
class Thresholds:
    """Limits of the checks; the partition config's ``[validation]`` table overrides the defaults.

    ``*_max_rate`` fails a check above it, ``*_warn_rate`` warns above it (rates of rows in [0, 1]):
    reasoning missing among rows that expect it, tags left over, blank content among ``stop`` rows,
    ``length`` finishes, ``abort`` finishes, rows with token counts inconsistent with their text.
    ``chars_per_token_min/max``: the band of characters per completion token, for the shard as a whole
    and for rows with at least ``token_ratio_min_tokens`` tokens. ``resplit_sample_rows``: rows per
    shard re-split in Python (0 = all). ``min_rows_for_rate``: below it a rate check fails only when
    every row breaches. ``allow_mixed_server``: mixed server fingerprints only warn.
    """

    reasoning_missing_max_rate: float = 0.5
    reasoning_missing_warn_rate: float = 0.02
    tag_leak_max_rate: float = 0.01
    empty_content_max_rate: float = 0.2
    empty_content_warn_rate: float = 0.02
    truncation_max_rate: float = 0.1
    truncation_warn_rate: float = 0.02
    abort_max_rate: float = 0.01
    token_mismatch_max_rate: float = 0.01
    chars_per_token_min: float = 0.25
    chars_per_token_max: float = 16.0
    token_ratio_min_tokens: int = 16
    resplit_sample_rows: int = 64  # per shard; 0 = every row
    min_rows_for_rate: int = 20
    allow_mixed_server: bool = False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> Thresholds:
        """Defaults overridden by ``values`` (e.g. a partition's ``[validation]`` table).

        Raises:
            ThresholdError: an unknown key (named, with the valid ones) or a value of the wrong type
                or out of range.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in (values or {}).items():
            if key not in fields:
                raise ThresholdError(
                    f"unknown validation threshold {key!r}; valid keys: {', '.join(sorted(fields))}"
                )
            default = fields[key].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ThresholdError(f"validation threshold {key!r} must be true or false, not {value!r}")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ThresholdError(f"validation threshold {key!r} must be an integer >= 0, not {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ThresholdError(f"validation threshold {key!r} must be a number, not {value!r}")
            elif key.endswith("_rate") and not 0.0 <= float(value) <= 1.0:
                raise ThresholdError(f"validation threshold {key!r} is a rate in [0, 1], not {value!r}")
            elif float(value) < 0:
                raise ThresholdError(f"validation threshold {key!r} must be >= 0, not {value!r}")
            kwargs[key] = float(value) if isinstance(default, float) else value
        made = cls(**kwargs)
        if made.chars_per_token_min >= made.chars_per_token_max:
            raise ThresholdError(
                f"validation threshold 'chars_per_token_min' ({made.chars_per_token_min}) must be below "
                f"'chars_per_token_max' ({made.chars_per_token_max})"
            )
        return made

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------- results
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

    @property
    def label(self) -> str:
        if self.shard_index is None:
            return self.dataset
        return f"shard {self.shard_index} of {self.dataset}"


def _verdict(checks: Iterable[Check]) -> str:
    statuses = {c.status for c in checks}
    if "fail" in statuses:
        return "fail"
    if statuses & {"warn", "unknown"}:
        return "warn"
    return "pass"


@dataclass
class ShardValidation:
    """The checks of one committed shard."""

    dataset: str
    shard_index: int
    file: str
    rows: int
    checks: list[Check]
    validated_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    stats: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    samples: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def verdict(self) -> str:
        return _verdict(self.checks)

    def failed(self) -> list[Check]:
        return sorted((c for c in self.checks if c.status == "fail"), key=_check_rank)

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
        return _verdict([*self.checks, *(c for s in self.shards for c in s.checks)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "rows": self.rows,
            "total": [c.to_dict() for c in self.checks],
            "shards": {str(s.shard_index): s.to_dict() for s in self.shards},
        }


@dataclass
class ValidationReport:
    """The validation of a whole output directory (written as ``_validation.json``)."""

    out_dir: str
    datasets: list[DatasetValidation]
    thresholds: Thresholds
    validated_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    elapsed_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return _verdict(self.all_checks())

    @property
    def ok(self) -> bool:
        return self.verdict != "fail"

    @property
    def rows(self) -> int:
        return sum(d.rows for d in self.datasets)

    def all_checks(self) -> list[Check]:
        return [c for d in self.datasets for c in [*d.checks, *(c for s in d.shards for c in s.checks)]]

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
        }

    def summary(self) -> str:
        """A readable terminal summary: the verdict, each dataset's totals, failing shards."""
        lines = [f"validation of {self.out_dir}: {self.verdict.upper()} ({self.rows:,} rows, {self.elapsed_s:.2f} s)"]
        for d in self.datasets:
            lines.append(f"  {d.name}: {d.verdict} - {d.rows:,} rows in {len(d.shards)} shards")
            for c in d.checks:
                value = _fmt_value(c.value)
                lines.append(f"    {_MARK[c.status]} {c.name:<18} {value:>9}  {c.message}")
            bad = [s for s in d.shards if s.verdict == "fail"]
            for s in bad[:_MAX_EXAMPLES]:
                first = s.failed()[0]
                lines.append(f"    shard {s.shard_index}: FAIL {first.name}: {first.message}")
            if len(bad) > _MAX_EXAMPLES:
                lines.append(f"    ... {len(bad) - _MAX_EXAMPLES} more failing shards (see {REPORT_NAME})")
        return "\n".join(lines)


_MARK = {"pass": "ok  ", "warn": "WARN", "fail": "FAIL", "unknown": "??  "}


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2%}" if value <= 1.0 else f"{value:.2f}"
    return "" if value is None else str(value)


def _check_rank(c: Check) -> int:
    return CHECK_ORDER.index(c.name) if c.name in CHECK_ORDER else len(CHECK_ORDER)


# ------------------------------------------------------------------------------------- tags & parsers
def _tag_families() -> dict[tuple[str, str], list[str]]:
    """(start, end) tags -> parser names using them, from tasks.reasoning."""
    from tasks.reasoning import PARSERS

    families: dict[tuple[str, str], list[str]] = {}
    for name, spec in PARSERS.items():
        families.setdefault((spec.start, spec.end), []).append(name)
    return families


def _leak_markers() -> dict[str, str]:
    """Each tag that must not survive a split -> the parsers that emit it (for messages).

    Composite Harmony tags (``<|channel|>analysis<|message|>``) are split into their special tokens,
    since any one of them left over is a leak.
    """
    markers: dict[str, str] = {}
    for (start, end), parsers in _tag_families().items():
        for tag in (start, end):
            for token in re.findall(r"<\|[^|]+\|>", tag) or [tag]:
                markers.setdefault(token, ", ".join(parsers))
    return markers


_LEAK_MARKERS = _leak_markers()
_LEAK_REGEX = "|".join(re.escape(t) for t in _LEAK_MARKERS)


def _rel(out_dir: str) -> str:
    return out_dir if " " not in out_dir else f"'{out_dir}'"


# ------------------------------------------------------------------------------------------ measures
# A measure reduces a table to plain counts ("stats"); a judge turns stats into a Check. Per-shard stats
# are summed into the dataset total, so the totals are judged by the same code as each shard.
Stats = dict[str, Any]


def _merge(a: Stats, b: Stats) -> Stats:
    out = dict(a)
    for k, v in b.items():
        if k not in out or out[k] is None:
            out[k] = v
        elif isinstance(v, bool) or isinstance(out[k], bool):
            out[k] = out[k] or v
        elif isinstance(v, int | float):
            out[k] = out[k] + v
        elif isinstance(v, dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, list):
            out[k] = (out[k] + v)[:_MAX_EXAMPLES * 4]
    return out


def _n(x: pa.Array | pa.ChunkedArray | pa.Scalar) -> int:
    """Number of true values of a boolean array (nulls count as false)."""
    if isinstance(x, pa.Scalar):
        return int(bool(x.as_py()))
    return int(pc.sum(x.cast(pa.int64())).as_py() or 0) if len(x) else 0


def _blank(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Null, empty or whitespace-only."""
    empty = pc.equal(pc.utf8_length(col), 0)
    return pc.fill_null(pc.or_(empty, pc.utf8_is_space(col)), True)


def _no_parser(table: pa.Table) -> pa.ChunkedArray:
    """Rows split without a parser (null, or an empty name from a writer that used "")."""
    return pc.fill_null(pc.equal(table.column("reasoning_parser"), ""), True)


def _first_id(table: pa.Table, mask: pa.ChunkedArray) -> str | None:
    ids = table.column("id").filter(mask)
    return str(ids[0].as_py()) if len(ids) else None


def _counts(col: pa.ChunkedArray) -> dict[str, int]:
    vc = pc.value_counts(col)
    return {
        ("none" if v is None else str(v)): int(c)
        for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True)
    }


def _rate_status(bad: int, total: int, fail_rate: float, warn_rate: float, thr: Thresholds) -> str:
    if total == 0 or bad == 0:
        return "pass"
    rate = bad / total
    if rate > fail_rate:
        # A small sample only fails when every row breaches (see module docstring).
        if total >= thr.min_rows_for_rate or bad == total:
            return "fail"
        return "warn"
    return "warn" if rate > warn_rate else "pass"


def _pct(bad: int, total: int) -> str:
    rate = 100.0 * bad / total if total else 0.0
    return f"{rate:.0f}%" if rate >= 10 or rate == 0 else f"{rate:.2g}%"


def _majority(counts: Mapping[str, int]) -> str:
    return max(counts.items(), key=lambda kv: kv[1])[0] if counts else "none"


def _needs(table: pa.Table, *names: str) -> str | None:
    """Why a measure cannot run on this table (a column missing or of the wrong type), else None."""
    for name in names:
        if name not in table.column_names:
            return f"column {name!r} missing"
        if not table.schema.field(name).type.equals(ROW_SCHEMA.field(name).type):
            return f"column {name!r} has type {table.schema.field(name).type}"
    return None


def _unknown(name: str, stats: Stats) -> Check | None:
    if stats.get("unknown"):
        return Check(name, "unknown", None, None, f"cannot check: {stats['unknown']}")
    return None


# schema -------------------------------------------------------------------------------------------
def _measure_schema(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    problems: list[str] = []
    extra: list[str] = []
    for f in ROW_SCHEMA:
        if f.name not in table.column_names:
            problems.append(f"column {f.name!r} missing")
            continue
        got = table.schema.field(f.name).type
        if not got.equals(f.type):
            problems.append(f"column {f.name!r} is {got}, expected {f.type}")
        elif not f.nullable and table.column(f.name).null_count:
            problems.append(f"column {f.name!r} has {table.column(f.name).null_count} nulls")
    extra = [n for n in table.column_names if n not in ROW_SCHEMA.names]
    return {"bad_tables": int(bool(problems)), "tables": 1, "problems": problems, "extra": extra}


def _judge_schema(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if s["problems"]:
        shown = "; ".join(dict.fromkeys(s["problems"]))
        where = ctx.label if s["tables"] == 1 else f"{s['bad_tables']} of {s['tables']} shards of {ctx.label}"
        return Check(
            "schema", "fail", s["bad_tables"], 0,
            f"{where} does not match the row schema: {shown}; the shard was written by another "
            f"version of datagen or by hand: regenerate it (delete it from the manifest and rerun)",
        )
    if s["extra"]:
        cols = ", ".join(dict.fromkeys(s["extra"]))
        return Check("schema", "warn", 0, 0, f"{ctx.label} has columns outside the row schema: {cols}")
    return Check("schema", "pass", 0, 0, f"{len(ROW_SCHEMA)} columns match the row schema")


# unique ids ---------------------------------------------------------------------------------------
def _duplicates(ids: pa.ChunkedArray | pa.Array) -> tuple[int, list[str]]:
    """(rows beyond the first per id, a few duplicated ids)."""
    distinct = pc.count_distinct(ids, mode="all").as_py()
    extra = len(ids) - int(distinct)
    if extra == 0:
        return 0, []
    vc = pc.value_counts(ids)
    dup = vc.field("values").filter(pc.greater(vc.field("counts"), 1))
    return extra, [str(v) for v in dup.slice(0, _MAX_EXAMPLES).to_pylist()]


def _measure_unique(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "id")
    if why:
        return {"unknown": why}
    extra, examples = _duplicates(table.column("id"))
    return {"rows": table.num_rows, "duplicates": extra, "examples": examples}


def _judge_unique(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("unique_ids", s)) is not None:
        return u
    if s["duplicates"]:
        ids = ", ".join(s["examples"])
        return Check(
            "unique_ids", "fail", s["duplicates"], 0,
            f"{s['duplicates']} duplicate rows in {s['rows']} rows of {ctx.label} (ids {ids}); a resume "
            f"re-ran committed rows: keep one row per id (rerun the affected shards)",
            s["duplicates"], s["rows"],
        )
    return Check("unique_ids", "pass", 0, 0, f"{s['rows']} distinct ids", 0, s["rows"])


# fingerprint --------------------------------------------------------------------------------------
_FINGERPRINT_COLUMNS = ("sampling", "server", "model", "reasoning_parser")


def _measure_fingerprint(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    cols = [c for c in _FINGERPRINT_COLUMNS if _needs(table, c) is None]
    if not cols:
        return {"unknown": "fingerprint columns missing"}
    where = ctx.shard_index if ctx.shard_index is not None else -1
    values = {c: _counts(table.column(c)) for c in cols}
    return {"values": values, "shards": {c: {v: [where] for v in values[c]} for c in cols}}


def _judge_fingerprint(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("fingerprint", s)) is not None:
        return u
    mixed = {c: v for c, v in s["values"].items() if len(v) > 1}
    if not mixed:
        return Check("fingerprint", "pass", 1, 1, "one sampling/server/model/parser fingerprint")
    parts = []
    for col, counts in mixed.items():
        shown = []
        for value, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3]:
            shards = sorted(set(s["shards"][col][value]) - {-1})
            in_shards = f" in shards {_ranges(shards)}" if shards else ""
            shown.append(f"{_short(value)!r} ({n} rows{in_shards})")
        parts.append(f"{col}: {len(counts)} values: " + ", ".join(shown))
    status = "warn" if set(mixed) == {"server"} and thr.allow_mixed_server else "fail"
    return Check(
        "fingerprint", status, max(len(v) for v in mixed.values()), 1,
        f"mixed fingerprints in {ctx.label}: " + "; ".join(parts) + "; rows were generated under "
        "different settings (a resume with changed sampling, server flags or parser): rerun the "
        "minority shards with the settings of the rest, or `datagen resplit` for a parser mismatch",
    )


def _short(value: str, width: int = 60) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


# reasoning present --------------------------------------------------------------------------------
def _measure_reasoning(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "reasoning", "reasoning_parser", "think_in_prompt", "finish_reason", "raw", "id")
    if why:
        return {"unknown": why}
    has_parser = pc.invert(_no_parser(table))
    tip = pc.fill_null(table.column("think_in_prompt"), False)
    not_abort = pc.not_equal(table.column("finish_reason"), "abort")
    expected = pc.and_(pc.or_(has_parser, tip), pc.fill_null(not_abort, True))
    reasoning = table.column("reasoning")
    missing = pc.and_(expected, _blank(reasoning))
    n_missing = _n(missing)
    stats: Stats = {
        "rows": table.num_rows,
        "expected": _n(expected),
        "missing": n_missing,
        "missing_null": 0,
        "missing_think_in_prompt": 0,
        "parsers": _counts(table.column("reasoning_parser").filter(expected)) if n_missing else {},
        "tags_in_raw": {},
        "example": None,
    }
    if n_missing:
        # Diagnose only on breach: which tags the raw text carries tells which parser was needed.
        stats["missing_null"] = _n(pc.and_(missing, pc.is_null(reasoning)))
        stats["missing_think_in_prompt"] = _n(pc.and_(missing, tip))
        raw_missing = table.column("raw").filter(missing)
        for _start, end in _tag_families():
            hits = _n(pc.match_substring(raw_missing, end))
            if hits:
                stats["tags_in_raw"][end] = hits
        stats["example"] = _first_id(table, missing)
    return stats


def _judge_reasoning(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("reasoning_present", s)) is not None:
        return u
    bad, total = s["missing"], s["expected"]
    if total == 0:
        return Check("reasoning_present", "pass", 0.0, thr.reasoning_missing_max_rate,
                     "no reasoning parser and no think block in the prompt: reasoning not expected", 0, 0)
    status = _rate_status(bad, total, thr.reasoning_missing_max_rate, thr.reasoning_missing_warn_rate, thr)
    rate = bad / total
    if bad == 0:
        return Check("reasoning_present", "pass", 0.0, thr.reasoning_missing_max_rate,
                     f"reasoning present in all {total} rows that expect it", 0, total)
    parser = _majority(s["parsers"])
    head = f"reasoning empty in {_pct(bad, total)} of {total} rows of {ctx.label}"
    resplit = f"`datagen resplit {_rel(ctx.out_dir)} --parser NAME`"
    families = _tag_families()
    if s["tags_in_raw"]:
        end = max(s["tags_in_raw"].items(), key=lambda kv: kv[1])[0]
        start = next(st for (st, en) in families if en == end)
        fits = next(p for (st, en), p in families.items() if en == end)
        opener = ("the prompt opens the think block (chat template) and "
                  if s["missing_think_in_prompt"] * 2 > bad else "")
        cause = (f"{opener}the raw output holds {start}…{end} blocks but parser is {parser}; "
                 f"fix --reasoning-parser ({', '.join(fits[:3])}), then {resplit}")
        if parser != "none" and parser in fits:
            cause = (f"the raw output holds {end} but the split did not use it (parser {parser}, "
                     f"think_in_prompt taken into account?); run {resplit.replace('NAME', parser)}")
    elif s["missing_think_in_prompt"] * 2 > bad:
        cause = (f"the prompt opens the think block (chat template) but parser is {parser} and the "
                 f"output was not treated as reasoning; fix --reasoning-parser, then {resplit}")
    elif s["missing_null"] * 2 <= bad:
        cause = ("the model wrote empty think blocks (thinking disabled in the chat template?); if that is "
                 "intended raise reasoning_missing_max_rate in the partition's [validation]")
    else:
        cause = (f"parser is {parser} but the model wrote no reasoning block; if this model does not "
                 f"reason drop the parser (then {resplit}), else check its chat template")
    example = f" (e.g. id {s['example']})" if s["example"] else ""
    return Check("reasoning_present", status, rate, thr.reasoning_missing_max_rate,
                 f"{head}{example}: {cause}", bad, total)


# tag leak -----------------------------------------------------------------------------------------
def _measure_tags(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "content", "reasoning", "reasoning_parser", "id")
    if why:
        return {"unknown": why}
    in_content = pc.fill_null(pc.match_substring_regex(table.column("content"), _LEAK_REGEX), False)
    in_reasoning = pc.fill_null(pc.match_substring_regex(table.column("reasoning"), _LEAK_REGEX), False)
    leaked = pc.or_(in_content, in_reasoning)
    stats: Stats = {"rows": table.num_rows, "leaked": _n(leaked), "content": _n(in_content),
                    "reasoning": _n(in_reasoning), "tags": {}, "parsers": {}, "example": None}
    if stats["leaked"]:
        for column, mask in (("content", in_content), ("reasoning", in_reasoning)):
            texts = table.column(column).filter(mask)
            for tag in _LEAK_MARKERS:
                hits = _n(pc.match_substring(texts, tag)) if len(texts) else 0
                if hits:
                    stats["tags"][f"{column}:{tag}"] = hits
        stats["parsers"] = _counts(table.column("reasoning_parser").filter(leaked))
        stats["example"] = _first_id(table, leaked)
    return stats


def _judge_tags(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("tag_leak", s)) is not None:
        return u
    bad, total = s["leaked"], s["rows"]
    if bad == 0:
        return Check("tag_leak", "pass", 0.0, thr.tag_leak_max_rate, "no think/channel tags left", 0, total)
    status = _rate_status(bad, total, thr.tag_leak_max_rate, 0.0, thr)
    where, tag = max(s["tags"].items(), key=lambda kv: kv[1])[0].split(":", 1)
    parser = _majority(s["parsers"])
    fits = _LEAK_MARKERS[tag]
    example = f" (e.g. id {s['example']})" if s["example"] else ""
    if parser == "none":
        cause = (f"the model writes {tag} but no reasoning parser is set; fix --reasoning-parser "
                 f"(parsers writing {tag}: {fits}), then `datagen resplit {_rel(ctx.out_dir)} --parser NAME`")
    elif parser not in fits.split(", "):
        cause = (f"the model writes {tag} but parser is {parser}; fix --reasoning-parser ({fits}), then "
                 f"`datagen resplit {_rel(ctx.out_dir)} --parser NAME`")
    else:
        cause = (f"parser {parser} left its own tag in {where} (a second think block, or a start tag not at "
                 f"the beginning); inspect these rows; raise tag_leak_max_rate if they are legitimate")
    return Check("tag_leak", status, bad / total, thr.tag_leak_max_rate,
                 f"{tag} left in {where} of {_pct(bad, total)} of {total} rows of {ctx.label}{example}: {cause}",
                 bad, total)


# resplit ------------------------------------------------------------------------------------------
def _sample_indices(n: int, k: int) -> list[int]:
    if k <= 0 or k >= n:
        return list(range(n))
    return sorted({(i * n) // k for i in range(k)})


def _measure_resplit(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "raw", "reasoning", "content", "reasoning_parser", "think_in_prompt", "id")
    if why:
        return {"unknown": why}
    raw, reasoning, content = table.column("raw"), table.column("reasoning"), table.column("content")
    no_parser = _no_parser(table)
    # Every row: without a parser the content is the raw text and there is no reasoning.
    np_bad = pc.and_(no_parser, pc.or_(pc.is_valid(reasoning), pc.fill_null(pc.not_equal(content, raw), True)))
    # Every row: a split never adds text.
    parts = pc.add(pc.fill_null(pc.utf8_length(reasoning), 0), pc.fill_null(pc.utf8_length(content), 0))
    overlong = pc.fill_null(pc.greater(parts, pc.utf8_length(raw)), True)
    bad_rows = pc.or_(np_bad, overlong)
    stats: Stats = {"rows": table.num_rows, "checked": table.num_rows, "mismatch": _n(bad_rows),
                    "example": _first_id(table, bad_rows), "parser": None}
    # A sample of rows with a parser: the real split must give the stored columns.
    # Indices first, then take only the sampled rows (filtering the whole table would copy it).
    where = pc.indices_nonzero(pc.invert(no_parser))
    if len(where):
        from tasks.reasoning import split_reasoning

        picked = where.take(_sample_indices(len(where), thr.resplit_sample_rows))
        sample = table.select(["id", "raw", "reasoning", "content", "reasoning_parser", "think_in_prompt"]
                              ).take(picked).to_pylist()
        for row in sample:
            try:
                got = split_reasoning(row["raw"], row["reasoning_parser"],
                                      force_reasoning=True if row["think_in_prompt"] else None)
            except ValueError:
                got = None  # unknown parser name: cannot be what the split came from
            if got != (row["reasoning"], row["content"]):
                stats["mismatch"] += 1
                stats["example"] = stats["example"] or row["id"]
                stats["parser"] = stats["parser"] or row["reasoning_parser"]
        stats["checked"] = table.num_rows - len(where) + len(sample)
    return stats


def _judge_resplit(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("resplit", s)) is not None:
        return u
    bad, total = s["mismatch"], s["checked"]
    if bad == 0:
        return Check("resplit", "pass", 0, 0, f"raw re-splits to the stored reasoning/content ({total} rows checked)",
                     0, total)
    parser = s["parser"] or "none"
    return Check(
        "resplit", "fail", bad, 0,
        f"raw does not re-split to the stored reasoning/content in {bad} of {total} checked rows of "
        f"{ctx.label} (parser {parser}, e.g. id {s['example']}): the split used other settings or raw and "
        f"content belong to different rows; run `datagen resplit {_rel(ctx.out_dir)} --parser NAME`",
        bad, total,
    )


# empty content ------------------------------------------------------------------------------------
def _measure_content(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "content", "reasoning", "finish_reason", "id")
    if why:
        return {"unknown": why}
    finished = pc.fill_null(pc.equal(table.column("finish_reason"), "stop"), False)
    empty = pc.and_(finished, _blank(table.column("content")))
    n = _n(empty)
    return {
        "finished": _n(finished),
        "empty": n,
        "all_reasoning": _n(pc.and_(empty, pc.invert(_blank(table.column("reasoning"))))) if n else 0,
        "example": _first_id(table, empty) if n else None,
    }


def _judge_content(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("empty_content", s)) is not None:
        return u
    bad, total = s["empty"], s["finished"]
    status = _rate_status(bad, total, thr.empty_content_max_rate, thr.empty_content_warn_rate, thr)
    if bad == 0:
        return Check("empty_content", "pass", 0.0, thr.empty_content_max_rate,
                     f"content present in all {total} finished rows", 0, total)
    if s["all_reasoning"] * 2 > bad:
        cause = ("the split put the whole answer into reasoning (no end tag found: the parser is forced or "
                 "think_in_prompt is set while the model did not think); fix --reasoning-parser, then "
                 f"`datagen resplit {_rel(ctx.out_dir)} --parser NAME`")
    else:
        cause = "the model stopped without an answer; check the prompts and stop strings"
    return Check("empty_content", status, bad / total, thr.empty_content_max_rate,
                 f"content empty in {_pct(bad, total)} of {total} finished rows of {ctx.label} "
                 f"(e.g. id {s['example']}): {cause}", bad, total)


# finish reasons -----------------------------------------------------------------------------------
def _measure_finish(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "finish_reason")
    if why:
        return {"unknown": why}
    fr = table.column("finish_reason")
    counts = _counts(fr)
    return {"rows": table.num_rows, "length": counts.get("length", 0), "abort": counts.get("abort", 0),
            "invalid": {k: v for k, v in counts.items() if k not in FINISH_REASONS}}


def _judge_truncation(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("truncation", s)) is not None:
        return u
    bad, total = s["length"], s["rows"]
    status = _rate_status(bad, total, thr.truncation_max_rate, thr.truncation_warn_rate, thr)
    if bad == 0:
        return Check("truncation", "pass", 0.0, thr.truncation_max_rate, "no row hit max_new_tokens", 0, total)
    return Check("truncation", status, bad / total, thr.truncation_max_rate,
                 f"finish_reason length in {_pct(bad, total)} of {total} rows of {ctx.label}: outputs hit "
                 f"max_new_tokens; raise [sampling] max_new_tokens (within the context length) or accept "
                 f"by raising truncation_max_rate", bad, total)


def _judge_finish(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("finish_reason", s)) is not None:
        return u
    total = s["rows"]
    if s["invalid"]:
        shown = ", ".join(f"{k!r} ({v})" for k, v in s["invalid"].items())
        n = sum(s["invalid"].values())
        return Check("finish_reason", "fail", n, 0,
                     f"finish_reason outside stop/length/abort in {ctx.label}: {shown}; the writer "
                     f"stored something else than meta_info.finish_reason.type", n, total)
    bad = s["abort"]
    status = _rate_status(bad, total, thr.abort_max_rate, 0.0, thr)
    if bad == 0:
        return Check("finish_reason", "pass", 0.0, thr.abort_max_rate, "no aborted rows", 0, total)
    return Check("finish_reason", status, bad / total, thr.abort_max_rate,
                 f"finish_reason abort in {_pct(bad, total)} of {total} rows of {ctx.label}: the server "
                 f"aborted requests (overload, OOM or shutdown); see the server log", bad, total)


# token counts -------------------------------------------------------------------------------------
def _measure_tokens(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    why = _needs(table, "raw", "prompt", "prompt_tokens", "completion_tokens", "id")
    if why:
        return {"unknown": why}
    ct = pc.fill_null(table.column("completion_tokens"), 0).cast(pa.int64())
    pt = pc.fill_null(table.column("prompt_tokens"), 0).cast(pa.int64())
    raw_len = pc.fill_null(pc.utf8_length(table.column("raw")), 0).cast(pa.int64())
    prompt_len = pc.fill_null(pc.utf8_length(table.column("prompt")), 0)
    negative = pc.or_(pc.less(ct, 0), pc.less(pt, 0))
    zero_ct = pc.and_(pc.greater(raw_len, 0), pc.equal(ct, 0))
    zero_pt = pc.and_(pc.greater(prompt_len, 0), pc.equal(pt, 0))
    # Per-row band, only on rows long enough for the ratio to mean something.
    long_rows = pc.greater_equal(ct, thr.token_ratio_min_tokens)
    low = pc.less(raw_len, pc.multiply(ct, thr.chars_per_token_min))
    high = pc.greater(raw_len, pc.multiply(ct, thr.chars_per_token_max))
    out_band = pc.and_(long_rows, pc.or_(low, high))
    bad = pc.or_(pc.or_(negative, zero_ct), pc.or_(zero_pt, out_band))
    n_bad = _n(bad)
    return {
        "rows": table.num_rows,
        "bad": n_bad,
        "negative": _n(negative) if n_bad else 0,
        "zero_completion": _n(zero_ct) if n_bad else 0,
        "zero_prompt": _n(zero_pt) if n_bad else 0,
        "out_of_band": _n(out_band) if n_bad else 0,
        "chars": int(pc.sum(raw_len).as_py() or 0),
        "tokens": int(pc.sum(pc.max_element_wise(ct, 0)).as_py() or 0),
        "example": _first_id(table, bad) if n_bad else None,
    }


def _judge_tokens(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if (u := _unknown("token_counts", s)) is not None:
        return u
    bad, total = s["bad"], s["rows"]
    ratio = s["chars"] / s["tokens"] if s["tokens"] else 0.0
    band = f"{thr.chars_per_token_min}..{thr.chars_per_token_max}"
    problems = []
    if s["negative"]:
        problems.append(f"{s['negative']} negative counts")
    if s["zero_completion"]:
        problems.append(f"{s['zero_completion']} rows with text but completion_tokens 0")
    if s["zero_prompt"]:
        problems.append(f"{s['zero_prompt']} rows with a prompt but prompt_tokens 0")
    if s["out_of_band"]:
        problems.append(f"{s['out_of_band']} rows outside {band} chars/token")
    agg_bad = s["tokens"] >= thr.token_ratio_min_tokens and not (
        thr.chars_per_token_min <= ratio <= thr.chars_per_token_max)
    if agg_bad:
        problems.insert(0, f"{ratio:.2f} chars per completion token overall (band {band})")
    status = _rate_status(bad, total, thr.token_mismatch_max_rate, 0.0, thr)
    if agg_bad:
        status = "fail"
    if not problems:
        return Check("token_counts", "pass", round(ratio, 3), band,
                     f"token counts consistent with the text ({ratio:.2f} chars/token)", 0, total)
    example = f" (e.g. id {s['example']})" if s["example"] else ""
    return Check("token_counts", status, round(ratio, 3), band,
                 f"token counts inconsistent with the text in {ctx.label}{example}: " + "; ".join(problems)
                 + "; the writer took counts from another field or row (meta_info.prompt_tokens/"
                 "completion_tokens of the same response)", bad, total)


Measure = tuple[str, Callable[[pa.Table, Context, Thresholds], Stats], Callable[[Stats, Context, Thresholds], Check]]

_MEASURES: tuple[Measure, ...] = (
    ("schema", _measure_schema, _judge_schema),
    ("unique_ids", _measure_unique, _judge_unique),
    ("fingerprint", _measure_fingerprint, _judge_fingerprint),
    ("reasoning_present", _measure_reasoning, _judge_reasoning),
    ("tag_leak", _measure_tags, _judge_tags),
    ("resplit", _measure_resplit, _judge_resplit),
    ("empty_content", _measure_content, _judge_content),
    ("truncation", _measure_finish, _judge_truncation),
    ("finish_reason", _measure_finish, _judge_finish),
    ("token_counts", _measure_tokens, _judge_tokens),
)


def _measure_all(table: pa.Table, ctx: Context, thr: Thresholds) -> dict[str, Stats]:
    stats: dict[str, Stats] = {}
    cache: dict[Callable[..., Stats], Stats] = {}
    for name, measure, _judge in _MEASURES:
        if measure not in cache:
            cache[measure] = measure(table, ctx, thr)
        stats[name] = cache[measure]
    return stats


def _judge_all(stats: Mapping[str, Stats], ctx: Context, thr: Thresholds) -> list[Check]:
    return [judge(stats[name], ctx, thr) for name, _m, judge in _MEASURES if name in stats]


def validate_table(table: pa.Table, thresholds: Thresholds | None = None,
                   context: Context | None = None) -> list[Check]:
    """Run the row-level checks (all but ``complete``) on one table of rows.

    Raises nothing for bad data: a breach is a failing Check. A column a check needs that is missing or
    mistyped makes that check ``unknown`` (and ``schema`` fail).
    """
    thr = thresholds or Thresholds()
    ctx = context or Context(dataset="table")
    return _judge_all(_measure_all(table, ctx, thr), ctx, thr)


# ------------------------------------------------------------------------------------ output layout
def _load_manifest(out_dir: Path) -> dict[str, Any]:
    if not out_dir.is_dir():
        raise BadOutput(f"{out_dir}: no such directory")
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        raise BadOutput(f"{out_dir}: not a datagen output (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadOutput(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("datasets"), dict):
        raise BadOutput(f"{path}: not a datagen manifest (no 'datasets' table)")
    return manifest


def _dataset_entry(manifest: Mapping[str, Any], dataset: str, out_dir: Path) -> dict[str, Any]:
    entry = manifest["datasets"].get(dataset)
    if not isinstance(entry, dict):
        raise BadOutput(f"{out_dir}: dataset {dataset!r} not in the manifest "
                        f"(has {', '.join(manifest['datasets']) or 'none'})")
    return entry


def _shard_file(out_dir: Path, dataset: str, index: int, info: Mapping[str, Any]) -> Path:
    name = info.get("file") or f"shard-{index:05d}.parquet"
    path = Path(name)
    if path.is_absolute():
        return path
    direct = out_dir / path
    return direct if direct.exists() or len(path.parts) > 1 else out_dir / dataset / path


def _slice_size(manifest: Mapping[str, Any], entry: Mapping[str, Any], index: int) -> int | None:
    size = manifest.get("shard_size")
    total = entry.get("total_rows")
    if not isinstance(size, int) or not isinstance(total, int):
        return None
    return max(0, min(size, total - index * size))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _complete_check(rows: int, info: Mapping[str, Any], expected: int | None, file_hash_ok: bool | None,
                    ctx: Context) -> Check:
    rejects = int(info.get("rejects") or 0)
    problems = []
    if isinstance(info.get("rows"), int) and info["rows"] != rows:
        problems.append(f"manifest says {info['rows']} rows, the file holds {rows}")
    if file_hash_ok is False:
        problems.append("the file's sha256 differs from the manifest (changed after commit)")
    size = info.get("_shard_size")
    if expected is None and isinstance(size, int) and rows + rejects >= size:
        # Input not read to the end yet (total_rows unknown): a full slice is still provably complete.
        expected = size
    missing = None if expected is None else expected - rows - rejects
    if missing:
        word = "missing from" if missing > 0 else "too many in"
        problems.insert(0, f"{abs(missing)} input rows {word} {ctx.label}: {rows} rows + {rejects} rejects, "
                           f"the slice holds {expected}")
    if problems:
        return Check("complete", "fail", missing or 0, 0, "; ".join(problems) +
                     "; the shard was committed incomplete or edited: rerun it (the journal resumes by id)",
                     abs(missing or 0), rows)
    if expected is None:
        return Check("complete", "unknown", None, None,
                     f"cannot check yet: {rows} rows + {rejects} rejects, a short slice, and the manifest does "
                     f"not know the input's total_rows", 0, rows)
    return Check("complete", "pass", 0, 0, f"{rows} rows + {rejects} rejects = slice of {expected}", 0, rows)


_SAMPLE_COLUMNS = ("id", "finish_reason", "reasoning", "content")


def _samples(table: pa.Table, ctx: Context, k: int = 3, width: int = 160) -> list[dict[str, Any]]:
    cols = [c for c in _SAMPLE_COLUMNS if c in table.column_names]
    rows = table.select(cols).slice(0, k).to_pylist()
    out = []
    for row in rows:
        trimmed = {c: (_short(v.replace("\n", " "), width) if isinstance(v, str) else v) for c, v in row.items()}
        out.append({"dataset": ctx.dataset, "shard": ctx.shard_index, **trimmed})
    return out


def _validate_shard(out_dir: Path, manifest: Mapping[str, Any], dataset: str, index: int,
                    thr: Thresholds, *, with_samples: bool = False) -> ShardValidation:
    entry = _dataset_entry(manifest, dataset, out_dir)
    info = (entry.get("shards") or {}).get(str(index))
    if not isinstance(info, dict):
        raise BadOutput(f"{out_dir}: shard {index} of {dataset!r} is not committed in the manifest")
    path = _shard_file(out_dir, dataset, index, info)
    ctx = Context(dataset=dataset, shard_index=index, out_dir=str(out_dir))
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        check = Check("schema", "fail", None, None, f"{ctx.label}: cannot read {path}: {exc}; rerun the shard")
        return ShardValidation(dataset, index, str(path), 0, [check])
    stats = _measure_all(table, ctx, thr)
    checks = _judge_all(stats, ctx, thr)
    hash_ok = None
    if isinstance(info.get("sha256"), str):
        hash_ok = _sha256(path) == info["sha256"]
    info = {**info, "_shard_size": manifest.get("shard_size")}
    checks.insert(1, _complete_check(table.num_rows, info, _slice_size(manifest, entry, index), hash_ok, ctx))
    result = ShardValidation(dataset, index, str(path), table.num_rows, checks, stats=stats)
    if with_samples:
        result.samples = _samples(table, ctx)
    result.stats["_ids"] = {"ids": table.column("id")} if _needs(table, "id") is None else {}
    return result


def validate_shard(out_dir: str | os.PathLike[str], dataset: str, shard_index: int,
                   thresholds: Thresholds | None = None) -> ShardValidation:
    """Validate one committed shard (row checks plus ``complete`` against the manifest).

    Raises:
        BadOutput: ``out_dir`` is not an output, or the dataset/shard is not in its manifest.
    """
    out = Path(out_dir)
    result = _validate_shard(out, _load_manifest(out), dataset, shard_index, thresholds or Thresholds())
    result.stats.pop("_ids", None)
    return result


def _dataset_totals(name: str, entry: Mapping[str, Any], manifest: Mapping[str, Any],
                    shards: list[ShardValidation], ids: list[pa.ChunkedArray], thr: Thresholds,
                    out_dir: Path) -> list[Check]:
    ctx = Context(dataset=name, out_dir=str(out_dir))
    merged: dict[str, Stats] = {}
    for s in shards:
        for key, st in s.stats.items():
            if key.startswith("_"):
                continue
            merged[key] = _merge(merged[key], st) if key in merged else st
    checks = _judge_all(merged, ctx, thr) if merged else []
    # Duplicates across shards: judged on all ids together, not on summed per-shard counts.
    if ids:
        extra, examples = _duplicates(pa.chunked_array([c for a in ids for c in a.chunks], type=pa.string()))
        stats = {"rows": sum(len(a) for a in ids), "duplicates": extra, "examples": examples}
        checks = [_judge_unique(stats, ctx, thr) if c.name == "unique_ids" else c for c in checks]
    # Completeness of the dataset: every shard committed, rows + rejects = input rows.
    num_shards = entry.get("num_shards")
    total_rows = entry.get("total_rows")
    committed = len(shards)
    rows = sum(s.rows for s in shards)
    rejects = sum(int(((entry.get("shards") or {}).get(str(s.shard_index)) or {}).get("rejects") or 0)
                  for s in shards)
    problems = []
    if isinstance(num_shards, int) and committed < num_shards:
        pending = sorted(set(range(num_shards)) - {s.shard_index for s in shards})
        problems.append(f"{num_shards - committed} of {num_shards} shards of {name} not committed "
                        f"(shards {_ranges(pending[:20])}); finish the run (`datagen run` resumes)")
    if isinstance(total_rows, int) and committed == num_shards and rows + rejects != total_rows:
        problems.append(f"{rows} rows + {rejects} rejects in {name}, the input has {total_rows}")
    bad_shards = [s.shard_index for s in shards if any(c.name == "complete" and c.status == "fail" for c in s.checks)]
    if bad_shards:
        problems.append(f"shards {_ranges(bad_shards)} incomplete")
    if problems:
        complete = Check("complete", "fail", committed, num_shards, "; ".join(problems), committed, rows)
    elif not isinstance(num_shards, int):
        complete = Check("complete", "unknown", committed, None, "cannot check: manifest lacks num_shards",
                         committed, rows)
    else:
        complete = Check("complete", "pass", committed, num_shards,
                         f"{committed} of {num_shards} shards, {rows} rows + {rejects} rejects", committed, rows)
    checks.insert(1 if checks else 0, complete)
    return checks


def validate_output(out_dir: str | os.PathLike[str], thresholds: Thresholds | None = None,
                    *, write: bool = True) -> ValidationReport:
    """Validate every committed shard and each dataset as a whole; write ``OUT/_validation.json``.

    Raises:
        BadOutput: ``out_dir`` is missing or not a datagen output.
    """
    import time

    started = time.perf_counter()
    out = Path(out_dir)
    thr = thresholds or Thresholds()
    manifest = _load_manifest(out)
    datasets: list[DatasetValidation] = []
    samples: list[dict[str, Any]] = []
    for name in sorted(manifest["datasets"]):
        entry = _dataset_entry(manifest, name, out)
        shards: list[ShardValidation] = []
        ids: list[pa.ChunkedArray] = []
        for key in sorted((entry.get("shards") or {}), key=int):
            result = _validate_shard(out, manifest, name, int(key), thr, with_samples=not shards)
            idcol = result.stats.pop("_ids", {}).get("ids")
            if idcol is not None:
                ids.append(idcol)
            samples.extend(result.samples)
            shards.append(result)
        checks = _dataset_totals(name, entry, manifest, shards, ids, thr, out)
        for s in shards:
            s.stats = {}  # the totals are judged; free the per-shard counts
        datasets.append(DatasetValidation(name, sum(s.rows for s in shards), shards, checks))
    report = ValidationReport(str(out), datasets, thr, samples=samples)
    report.elapsed_s = time.perf_counter() - started
    if write:
        _write_json(out / REPORT_NAME, report.to_dict())
    return report


# --------------------------------------------------------------------------------------------- gate
def gate_shard(out_dir: str | os.PathLike[str], dataset: str, shard_index: int,
               thresholds: Thresholds | None = None) -> ShardValidation:
    """Validate a shard that just committed, record it in ``_validation.json``, stop the run on a breach.

    Every failing check stops the run; the message is that of the most fundamental one (``CHECK_ORDER``),
    naming the others. Warnings are recorded, not raised.

    Raises:
        ValidationFailed: a check failed; ``.message`` says what broke and what to do.
        BadOutput: ``out_dir`` is not an output, or the shard is not committed.
    """
    result = validate_shard(out_dir, dataset, shard_index, thresholds)
    _record_shard(Path(out_dir), result)
    failed = result.failed()
    if failed:
        message = failed[0].message
        if len(failed) > 1:
            message += f" (also failing: {', '.join(c.name for c in failed[1:])})"
        raise ValidationFailed(message, result)
    return result


def _record_shard(out_dir: Path, result: ShardValidation) -> None:
    # Gates of datasets running side by side read-modify-write the same report: serialise them with a
    # flock on the output directory itself (no extra file; distinct from the run's OUT/_lock).
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _record_shard_locked(out_dir, result)
    finally:
        os.close(fd)  # closing releases the lock


def _record_shard_locked(out_dir: Path, result: ShardValidation) -> None:
    path = out_dir / REPORT_NAME
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), dict):
            raise ValueError("not a report")
    except (OSError, ValueError):
        doc = {"version": 1, "kind": "shards", "out_dir": str(out_dir), "datasets": {}}
    ds = doc["datasets"].setdefault(result.dataset, {"shards": {}})
    ds.setdefault("shards", {})[str(result.shard_index)] = result.to_dict()
    verdicts = [s.get("verdict") for d in doc["datasets"].values() for s in d.get("shards", {}).values()]
    ds["verdict"] = _worst(s.get("verdict") for s in ds["shards"].values())
    doc["verdict"] = _worst(verdicts)
    doc["validated_at"] = result.validated_at
    _write_json(path, doc)


def _worst(verdicts: Iterable[Any]) -> str:
    seen = set(verdicts)
    return "fail" if "fail" in seen else "warn" if "warn" in seen else "pass"


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Atomic: a temp file in the same directory, fsynced, renamed over the target."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------- prefect
def _artifact_key(prefix: str, suffix: str) -> str:
    key = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{suffix}".lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)


def report_table(report: ValidationReport) -> list[dict[str, Any]]:
    """One row per dataset total check (the table artifact)."""
    return [
        {"dataset": d.name, "check": c.name, "status": c.status, "value": _fmt_value(c.value),
         "threshold": "" if c.threshold is None else str(c.threshold), "rows": c.rows, "message": c.message}
        for d in report.datasets for c in d.checks
    ]


def report_markdown(report: ValidationReport) -> str:
    """Checks, rates, failing shards and a few sample rows (reasoning/content trimmed) as markdown."""
    out = [f"# Validation: {report.verdict.upper()}", "",
           f"`{report.out_dir}`: {report.rows:,} rows, validated {report.validated_at}", ""]
    for d in report.datasets:
        out += [f"## {d.name}: {d.verdict} ({d.rows:,} rows, {len(d.shards)} shards)", "",
                "| check | status | value | threshold | message |", "|---|---|---|---|---|"]
        for c in d.checks:
            msg = c.message.replace("|", "\\|")
            out.append(f"| {c.name} | {c.status} | {_fmt_value(c.value)} | {c.threshold} | {msg} |")
        bad = [s for s in d.shards if s.verdict == "fail"]
        if bad:
            out += ["", "Failing shards: " + ", ".join(str(s.shard_index) for s in bad)]
        out.append("")
    if report.samples:
        out += ["## Sample rows", "", "| dataset | id | finish | reasoning | content |", "|---|---|---|---|---|"]
        for r in report.samples:
            cells = [str(r.get(k) or "").replace("|", "\\|") for k in ("dataset", "id", "finish_reason",
                                                                       "reasoning", "content")]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def publish_artifacts(report: ValidationReport, key_prefix: str = "validation") -> list[str]:
    """Create a table and a markdown artifact for ``report`` in the current Prefect run.

    Outside a flow or task run this does nothing and returns []; inside, it returns the artifact ids.
    Keys are ``<prefix>-checks`` and ``<prefix>-summary`` (lowercase letters, digits, dashes).
    """
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    description = f"datagen validation of {report.out_dir}: {report.verdict}"
    ids = [
        create_table_artifact(table=report_table(report), key=_artifact_key(key_prefix, "checks"),
                              description=description),
        create_markdown_artifact(markdown=report_markdown(report), key=_artifact_key(key_prefix, "summary"),
                                 description=description),
    ]
    return [str(i) for i in ids]
