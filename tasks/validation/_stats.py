"""Shared pieces of the checks: Arrow reductions, rate verdicts, message fragments, the tag families.

A measure reduces a table to plain counts ("stats"); a judge turns stats into a Check. Per-shard stats
are summed into the dataset total (:func:`merge`), so the totals are judged by the same code as each
shard.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tasks.reasoning import PARSERS
from tasks.schema import ROW_SCHEMA
from tasks.validation._results import MAX_EXAMPLES, Check, Context
from tasks.validation._thresholds import Thresholds

Stats = dict[str, Any]
MeasureFn = Callable[[pa.Table, Context, Thresholds], Stats]
JudgeFn = Callable[[Stats, Context, Thresholds], Check]


# ------------------------------------------------------------------------------------- tags & parsers
def _tag_families() -> dict[tuple[str, str], list[str]]:
    """(start, end) tags -> parser names using them, from tasks.reasoning."""
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
    for (start, end), parsers in TAG_FAMILIES.items():
        for tag in (start, end):
            for token in re.findall(r"<\|[^|]+\|>", tag) or [tag]:
                markers.setdefault(token, ", ".join(parsers))
    return markers


TAG_FAMILIES = _tag_families()
LEAK_MARKERS = _leak_markers()
LEAK_REGEX = "|".join(re.escape(t) for t in LEAK_MARKERS)


# ------------------------------------------------------------------------------------------ measures
def merge(a: Stats, b: Stats) -> Stats:
    """Two tables' stats as one: counts add up, flags or, example lists concatenate (bounded)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out or out[k] is None:
            out[k] = v
        elif isinstance(v, bool) or isinstance(out[k], bool):
            out[k] = out[k] or v
        elif isinstance(v, int | float):
            out[k] = out[k] + v
        elif isinstance(v, dict):
            out[k] = merge(out[k], v)
        elif isinstance(v, list):
            out[k] = (out[k] + v)[:MAX_EXAMPLES * 4]
    return out


def needs(table: pa.Table, *names: str) -> str | None:
    """Why a measure cannot run on this table (a column missing or of the wrong type), else None."""
    for name in names:
        if name not in table.column_names:
            return f"column {name!r} missing"
        if not table.schema.field(name).type.equals(ROW_SCHEMA.field(name).type):
            return f"column {name!r} has type {table.schema.field(name).type}"
    return None


def requires(*columns: str) -> Callable[[MeasureFn], MeasureFn]:
    """Decorate a measure: ``{"unknown": why}`` instead of running it when a column it reads is unusable."""

    def wrap(measure: MeasureFn) -> MeasureFn:
        @functools.wraps(measure)
        def checked(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
            why = needs(table, *columns)
            return {"unknown": why} if why else measure(table, ctx, thr)

        return checked

    return wrap


def count_true(x: pa.Array | pa.ChunkedArray | pa.Scalar) -> int:
    """Number of true values of a boolean array (nulls count as false)."""
    if isinstance(x, pa.Scalar):
        return int(bool(x.as_py()))
    return int(pc.sum(x.cast(pa.int64())).as_py() or 0) if len(x) else 0


def blank(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Null, empty or whitespace-only."""
    empty = pc.equal(pc.utf8_length(col), 0)
    return pc.fill_null(pc.or_(empty, pc.utf8_is_space(col)), True)


def no_parser(table: pa.Table) -> pa.ChunkedArray:
    """Rows split without a parser (null, or an empty name from a writer that used "")."""
    return pc.fill_null(pc.equal(table.column("reasoning_parser"), ""), True)


def first_id(table: pa.Table, mask: pa.ChunkedArray) -> str | None:
    ids = table.column("id").filter(mask)
    return str(ids[0].as_py()) if len(ids) else None


def counts(col: pa.ChunkedArray) -> dict[str, int]:
    """Value -> rows (a null value is counted as ``"none"``)."""
    vc = pc.value_counts(col)
    return {
        ("none" if v is None else str(v)): int(c)
        for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True)
    }


_KEY_SEP = "\x1f"  # between id and sample in a row key: a control character no id is expected to hold


def row_keys(table: pa.Table) -> pa.ChunkedArray:
    """Each row's key ``(id, sample)`` as one string: the id for sample 0 (and for a table without
    the ``sample`` column), else id and sample joined by a control character."""
    ids = table.column("id")
    if "sample" not in table.column_names:
        return ids
    sample = table.column("sample")
    if not pc.any(pc.fill_null(pc.not_equal(sample, 0), False)).as_py():
        return ids  # one sample: the ids are the keys (no string built per row)
    joined = pc.binary_join_element_wise(ids, pc.cast(sample, pa.string()), _KEY_SEP)
    return pc.if_else(pc.fill_null(pc.equal(sample, 0), True), ids, joined)


def duplicates(ids: pa.ChunkedArray | pa.Array) -> tuple[int, list[str]]:
    """(rows beyond the first per key, a few duplicated keys as ``id`` or ``id#sample``)."""
    distinct = pc.count_distinct(ids, mode="all").as_py()
    extra = len(ids) - int(distinct)
    if extra == 0:
        return 0, []
    vc = pc.value_counts(ids)
    dup = vc.field("values").filter(pc.greater(vc.field("counts"), 1))
    return extra, [str(v).replace(_KEY_SEP, "#") for v in dup.slice(0, MAX_EXAMPLES).to_pylist()]


# -------------------------------------------------------------------------------------------- judges
def enough_evidence(bad: int, total: int, thr: Thresholds) -> bool:
    """Whether ``bad`` breaching rows of ``total`` are evidence enough for a rate to fail: at least
    ``min_breaches`` of them, and every row when there are fewer than ``min_rows_for_rate``."""
    return bad >= thr.min_breaches and (total >= thr.min_rows_for_rate or bad == total)


def rate_status(bad: int, total: int, fail_rate: float, warn_rate: float, thr: Thresholds) -> str:
    if total == 0 or bad == 0:
        return "pass"
    rate = bad / total
    if rate > fail_rate:
        # Below the evidence bar a rate over a few rows says nothing: it warns (see Thresholds).
        return "fail" if enough_evidence(bad, total, thr) else "warn"
    return "warn" if rate > warn_rate else "pass"


# The [validation] setting that bounds each rate check (named in its failing and below-the-bar messages).
RATE_SETTINGS = {
    "reasoning_present": "reasoning_missing_max_rate",
    "tag_leak": "tag_leak_max_rate",
    "empty_content": "empty_content_max_rate",
    "truncation": "truncation_max_rate",
    "finish_reason": "abort_max_rate",
    "token_counts": "token_mismatch_max_rate",
}


def setting_note(name: str, status: str, bad: int, total: int, thr: Thresholds) -> str:
    """What a rate check's message adds: the setting and how to accept the output when it fails; the
    evidence bar when the rate is over the limit but too few rows breach."""
    setting = RATE_SETTINGS.get(name)
    if setting is None or status == "pass":
        return ""
    limit = getattr(thr, setting)
    if status == "fail":
        return (f"; the limit is [validation] {setting} = {limit:g}: to accept such rows raise it in the partition "
                f"and rerun `datagen run` (what is committed is kept; a complete output is judged again without "
                f"generating anything)")
    if bad / total > limit and not enough_evidence(bad, total, thr):
        return (f"; over [validation] {setting} = {limit:g}, but {bad} of {total} row(s) is below the evidence bar "
                f"(min_breaches {thr.min_breaches}, min_rows_for_rate {thr.min_rows_for_rate}): a warning, not a failure")
    return ""


def rate_check(name: str, bad: int, total: int, fail_rate: float, warn_rate: float, thr: Thresholds,
               message: str) -> Check:
    """A rate check with breaching rows: the rate is the value, the status from ``rate_status``; the
    message names the setting when it fails or is over its limit below the evidence bar."""
    status = rate_status(bad, total, fail_rate, warn_rate, thr)
    return Check(name, status, bad / total, fail_rate, message + setting_note(name, status, bad, total, thr),
                 bad, total)


def pct(bad: int, total: int) -> str:
    rate = 100.0 * bad / total if total else 0.0
    return f"{rate:.0f}%" if rate >= 10 or rate == 0 else f"{rate:.2g}%"


def majority(values: Mapping[str, int]) -> str:
    return max(values.items(), key=lambda kv: kv[1])[0] if values else "none"


def short(value: str, width: int = 60) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


def ranges(values: list[int]) -> str:
    """Sorted ints as ``0-3,7``."""
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def example_note(s: Stats) -> str:
    """`` (e.g. id X)`` for the first breaching row, or nothing."""
    return f" (e.g. id {s['example']})" if s["example"] else ""


def resplit_command(ctx: Context, parser: str = "NAME") -> str:
    """The command that re-splits the output (the user picks the parser NAME unless it is known);
    for rows not committed yet (the canary), to run again: there is nothing to re-split."""
    if not ctx.committed:
        return f"run again (nothing of {ctx.dataset} was committed, so nothing needs re-splitting)"
    out_dir = ctx.out_dir if " " not in ctx.out_dir else f"'{ctx.out_dir}'"
    return f"`datagen resplit {out_dir} --parser {parser}`"


def fix_parser(choices: str = "") -> str:
    """Advice to set the reasoning parser, naming each place to set it: the CLI flag, the flow
    parameter (a custom run in the Prefect UI) and the partition key; ``choices``: the parsers
    that fit, if known."""
    fits = f"one of {choices}; " if choices else ""
    return (f"fix the reasoning parser ({fits}set by --reasoning-parser, the reasoning_parser flow parameter in "
            "the Prefect UI or [model] reasoning_parser in the partition)")
