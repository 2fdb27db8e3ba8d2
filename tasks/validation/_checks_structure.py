"""Checks of a table's structure: ``schema``, ``unique_ids``, ``fingerprint`` and ``provenance``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tasks.schema import ROW_SCHEMA
from tasks.validation._results import Check, Context
from tasks.validation._stats import Stats, counts, duplicates, needs, ranges, requires, row_keys, short
from tasks.validation._thresholds import Thresholds


# schema -------------------------------------------------------------------------------------------
def measure_schema(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    problems: list[str] = []
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


def judge_schema(s: Stats, ctx: Context, thr: Thresholds) -> Check:
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
@requires("id")
def measure_unique(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    extra, examples = duplicates(row_keys(table))
    return {"rows": table.num_rows, "duplicates": extra, "examples": examples}


def judge_unique(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    if s["duplicates"]:
        ids = ", ".join(s["examples"])
        return Check(
            "unique_ids", "fail", s["duplicates"], 0,
            f"{s['duplicates']} duplicate rows in {s['rows']} rows of {ctx.label} (ids {ids}); a resume "
            f"re-ran committed rows: keep one row per id and sample (rerun the affected shards)",
            s["duplicates"], s["rows"],
        )
    return Check("unique_ids", "pass", 0, 0, f"{s['rows']} distinct (id, sample) keys", 0, s["rows"])


# fingerprint --------------------------------------------------------------------------------------
_FINGERPRINT_COLUMNS = ("sampling", "server", "model", "reasoning_parser")


def measure_fingerprint(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    cols = [c for c in _FINGERPRINT_COLUMNS if needs(table, c) is None]
    if not cols:
        return {"unknown": "fingerprint columns missing"}
    where = ctx.shard_index if ctx.shard_index is not None else -1
    values = {c: counts(table.column(c)) for c in cols}
    return {"values": values, "shards": {c: {v: [where] for v in values[c]} for c in cols}}


def judge_fingerprint(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    mixed = {c: v for c, v in s["values"].items() if len(v) > 1}
    if not mixed:
        return Check("fingerprint", "pass", 1, 1, "one sampling/server/model/parser fingerprint")
    parts = []
    for col, by_value in mixed.items():
        shown = []
        for value, n in sorted(by_value.items(), key=lambda kv: -kv[1])[:3]:
            shards = sorted(set(s["shards"][col][value]) - {-1})
            in_shards = f" in shards {ranges(shards)}" if shards else ""
            shown.append(f"{short(value)!r} ({n} rows{in_shards})")
        parts.append(f"{col}: {len(by_value)} values: " + ", ".join(shown))
    status = "warn" if set(mixed) == {"server"} and thr.allow_mixed_server else "fail"
    return Check(
        "fingerprint", status, max(len(v) for v in mixed.values()), 1,
        f"mixed fingerprints in {ctx.label}: " + "; ".join(parts) + "; rows were generated under "
        "different settings (a resume with changed sampling, server flags or parser): rerun the "
        "minority shards with the settings of the rest, or `datagen resplit` for a parser mismatch",
    )


# provenance ---------------------------------------------------------------------------------------
# Columns whose mix in one output is a silent quality bug (a drafter trained on two templates or two
# checkpoints); null values (pre-rendered prompts, a model directory not readable) are not a value.
PROVENANCE_COLUMNS = ("model_revision", "chat_template_hash")
_PROVENANCE_WHAT = {"model_revision": "model revisions", "chat_template_hash": "chat templates"}


def measure_provenance(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    cols = [c for c in PROVENANCE_COLUMNS if needs(table, c) is None]
    if not cols:
        return {"unknown": "provenance columns missing (written by an older datagen)"}
    where = ctx.shard_index if ctx.shard_index is not None else -1
    values = {c: counts(pc.drop_null(table.column(c))) for c in cols}
    return {"values": values, "shards": {c: {v: {ctx.dataset: [where]} for v in values[c]} for c in cols}}


def _where(by_dataset: dict[str, list[int]], label_datasets: bool) -> str:
    parts = []
    for dataset, shards in sorted(by_dataset.items()):
        known = sorted(set(shards) - {-1})
        in_shards = f"shards {ranges(known)}" if known else ""
        parts.append(" ".join(p for p in (dataset if label_datasets else "", in_shards) if p))
    shown = ", ".join(p for p in parts if p)
    return f" in {shown}" if shown else ""


def judge_provenance(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    mixed = {c: v for c, v in s["values"].items() if len(v) > 1}
    if not mixed:
        return Check("provenance", "pass", 1, 1, "one model revision and chat template")
    many = len({d for col in mixed for by in s["shards"][col].values() for d in by}) > 1
    parts = []
    for col, by_value in mixed.items():
        shown = []
        for value, n in sorted(by_value.items(), key=lambda kv: (-kv[1], kv[0]))[:3]:
            shown.append(f"{value!r} ({n} rows{_where(s['shards'][col][value], many)})")
        parts.append(f"{col}: {len(by_value)} values: " + ", ".join(shown))
    what = " and ".join(_PROVENANCE_WHAT[c] for c in mixed)
    status = "warn" if thr.allow_mixed_provenance else "fail"
    advice = ("allowed by allow_mixed_provenance" if thr.allow_mixed_provenance else
              "rerun the minority shards with the model and template of the rest, or accept the mix with "
              "[validation] allow_mixed_provenance = true (`datagen validate --threshold "
              "allow_mixed_provenance=true`)")
    return Check(
        "provenance", status, max(len(v) for v in mixed.values()), 1,
        f"mixed provenance in {ctx.label}: " + "; ".join(parts) + f"; rows were generated with different "
        f"{what} (a resume after the model directory changed): {advice}",
    )
