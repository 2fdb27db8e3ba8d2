"""What a shard commit writes: the Parquet file (ROW_SCHEMA, atomic) and the dataset's reject lines.

``tasks.shards.OutputDir.commit_shard`` calls these in the documented order (rejects, Parquet,
manifest, journal removal); each call is durable when it returns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.files import Dir
from tasks.schema import ADDED_DEFAULTS, PARQUET_COMPRESSION, ROW_SCHEMA, added_value

__all__ = ["append_rejects", "parquet_bytes", "read_rejects", "reject_units", "rows_to_table", "write_parquet"]

_NULLABLE = {f.name: f.nullable for f in ROW_SCHEMA}


def rows_to_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    """Build a ROW_SCHEMA table from row dicts (journal form: ``generated_at`` as ISO text); a column
    of ``ADDED_DEFAULTS`` that a row lacks (journaled by an older datagen) takes its default.

    A nullable column a row lacks is null: a journal row written before that column existed (a
    datagen upgrade between a crash and the resume) commits with it unknown instead of failing.

    Raises:
        KeyError: a row lacks a column that has no default and is not nullable.
        pyarrow.ArrowInvalid: a value has the wrong type.
    """
    rows = rows if isinstance(rows, list) else list(rows)
    cols: dict[str, list[Any]] = {}
    for name in ROW_SCHEMA.names:  # column by column: a shard's commit spends its time here
        if name == "generated_at":
            cols[name] = [_parse_ts(row[name]) for row in rows]
        elif name in ADDED_DEFAULTS:
            cols[name] = [row[name] if name in row else added_value(name, row.get("sampling")) for row in rows]
        elif _NULLABLE[name]:
            cols[name] = [row.get(name) for row in rows]
        else:
            cols[name] = [row[name] for row in rows]
    return pa.table(cols, schema=ROW_SCHEMA)


def _parse_ts(value: Any) -> Any:
    if isinstance(value, str):
        return dt.datetime.fromisoformat(value)
    return value


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` (cast to ROW_SCHEMA) as the bytes of a shard file.

    Raises:
        pyarrow.ArrowInvalid: the table cannot be cast to ROW_SCHEMA.
    """
    if table.schema != ROW_SCHEMA:
        table = table.select(list(ROW_SCHEMA.names)).cast(ROW_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=PARQUET_COMPRESSION)
    return sink.getvalue().to_pybytes()


def write_parquet(directory: Dir, name: str, table: pa.Table) -> str:
    """Write ``table`` (cast to ROW_SCHEMA) to file ``name`` of ``directory`` atomically; returns the
    file's sha256.

    Raises:
        OSError: the file cannot be written (it keeps its old content).
        pyarrow.ArrowInvalid: the table cannot be cast to ROW_SCHEMA.
    """
    data = parquet_bytes(table)
    directory.write(name, data)
    return hashlib.sha256(data).hexdigest()


def append_rejects(directory: Dir, name: str, index: int, rejects: list[dict[str, Any]]) -> None:
    """Append ``rejects`` to the dataset's reject file ``name`` in ``directory`` (``OUT/_rejects``), tagged
    with shard ``index``, and fsync.

    Raises:
        OSError: the file cannot be written.
    """
    directory.append(name, b"".join(orjson.dumps({**r, "shard": index}) + b"\n" for r in rejects))


def read_rejects(directory: Dir | None, name: str) -> list[dict[str, Any]]:
    """The reject records in ``directory/name`` (none when missing; torn lines skipped)."""
    if directory is None:
        return []
    try:
        data = directory.read(name)
    except FileNotFoundError:
        return []
    out = []
    for line in data.split(b"\n"):
        if line.strip():
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
    return out


def reject_units(rejects: Iterable[dict[str, Any]], samples: int) -> int:
    """The ``(record, sample)`` pairs ``rejects`` account for: a reject with a ``sample`` one, a reject of
    the whole record ``samples``."""
    return sum(1 if r.get("sample") is not None else samples for r in rejects)
