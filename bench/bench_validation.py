"""`validate_output` over 1,000,000 rows in 100 zstd shards in at most 5 s (quick: 200,000 rows, 1 s).

Only the one `validate_output` call is timed (every shard read, every check, the re-split sample,
the report written), not the generation of the output.

Run alone: ``.venv/bin/python bench/bench_validation.py [--quick]``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tasks.schema import PARQUET_COMPRESSION, ROW_SCHEMA  # noqa: E402
from tasks.validation import validate_output  # noqa: E402
from tests.support.outputs import make_row  # noqa: E402

SHARD_ROWS = 10_000
POOL = 2_000


def _raw(i: int) -> str:
    steps = " ".join(f"Step {j}: consider case {i * 31 + j} and check the bound again." for j in range(5))
    return f"<think>Let me think about question {i}. {steps}</think>\n\nThe answer to {i} is {i % 97}."


def _generate(out: Path, shards: int) -> int:
    """Write ``shards`` shards of SHARD_ROWS rows from a pool of distinct rows with fresh ids."""
    pool = pa.Table.from_pylist([make_row("bench", i, raw=_raw(i)) for i in range(POOL)], schema=ROW_SCHEMA)
    (out / "bench").mkdir(parents=True)
    entry: dict = {"input": "/data/bench.jsonl", "input_fingerprint": "sha256:bench", "shards": {}}
    id_at = ROW_SCHEMA.get_field_index("id")
    for k in range(shards):
        take = pa.array([(k * 7 + i) % POOL for i in range(SHARD_ROWS)], type=pa.int64())
        table = pool.take(take)
        start = k * SHARD_ROWS
        ids = pc.binary_join_element_wise(
            "bench-", pc.cast(pa.array(range(start, start + SHARD_ROWS), type=pa.int64()), pa.string()), "")
        table = table.set_column(id_at, ROW_SCHEMA.field("id"), ids)
        # A per-row suffix after the end tag keeps raw/content unique (no dictionary pages) and the
        # split consistent: it belongs to the content.
        for name in ("raw", "content"):
            at = ROW_SCHEMA.get_field_index(name)
            table = table.set_column(at, ROW_SCHEMA.field(name),
                                     pc.binary_join_element_wise(table.column(name), ids, " #"))
        path = out / "bench" / f"shard-{k:05d}.parquet"
        pq.write_table(table, path, compression=PARQUET_COMPRESSION,
                       use_dictionary=["dataset", "model", "sampling", "server", "reasoning_parser",
                                       "finish_reason"])
        entry["shards"][str(k)] = {"file": f"bench/{path.name}", "rows": SHARD_ROWS, "rejects": 0,
                                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                   "committed_at": "2026-01-01T00:00:00+00:00"}
    entry["total_rows"] = shards * SHARD_ROWS
    entry["num_shards"] = shards
    (out / "_manifest.json").write_text(json.dumps({"shard_size": SHARD_ROWS, "datasets": {"bench": entry}}))
    return shards * SHARD_ROWS


def run(quick: bool) -> list[dict]:
    shards = 20 if quick else 100
    target_s = 1.0 if quick else 5.0
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as tmp:
        out = Path(tmp) / "out"
        rows = _generate(out, shards)
        size_mib = sum(p.stat().st_size for p in out.rglob("*.parquet")) / 2**20
        started = time.perf_counter()
        report = validate_output(out)
        elapsed = time.perf_counter() - started
    if report.verdict != "pass":
        raise RuntimeError(f"benchmark output did not validate: {report.summary()}")
    return [
        {"metric": f"validate_output {rows:,} rows ({shards} shards, {size_mib:.0f} MiB zstd)",
         "value": round(elapsed, 3), "unit": "s", "target": f"<= {target_s:g} s", "ok": elapsed <= target_s},
        {"metric": "validation throughput", "value": round(rows / elapsed), "unit": "rows/s",
         "target": f">= {rows / target_s:,.0f}", "ok": elapsed <= target_s},
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv[1:]):
        print(json.dumps(row))
