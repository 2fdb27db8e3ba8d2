"""Adopting shard files that no manifest records (the manifest was lost), each proven against its input slice.

A file is adopted as shard k only when it is a readable ROW_SCHEMA Parquet file whose rows are the
usable records of input slice k (every ``(id, sample)`` once, no other) and whose slice's remaining
record samples are exactly the dataset's reject lines tagged with shard k; rows, rejects and sha256 are recomputed from
the files. One file that fails refuses the whole dataset and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.files import Dir
from tasks.schema import ROW_SCHEMA, conform
from tasks.shards._fs import shard_file_name, shard_index_of, utc_now_iso
from tasks.shards._manifest import ShardRecord

__all__ = ["InputSlice", "check_adoptable", "shard_files"]


@dataclass
class InputSlice:
    """The records of input slice ``index``: every record's line (JSONL line or Parquet row number)
    in input order, and the line of each usable record by id."""

    index: int
    lines: list[int] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)


def shard_files(shard_dir: Dir | None) -> dict[int, str]:
    """The Parquet shard files' names in ``shard_dir`` by index (symlinks and other non-files left out)."""
    if shard_dir is None:
        return {}
    found = {}
    for name in shard_dir.files(".parquet"):
        index = shard_index_of(name)
        if index is not None:
            found[index] = name
    return found


def _reject_lines(rejects: Iterable[dict[str, Any]]) -> dict[int, list[tuple[int, int | None]]]:
    """``(line, sample)`` of each reject by shard (sample None: every sample of the record)."""
    by_shard: dict[int, list[tuple[int, int | None]]] = {}
    for rec in rejects:
        try:
            sample = None if rec.get("sample") is None else int(rec["sample"])
            by_shard.setdefault(int(rec["shard"]), []).append((int(rec["line"]), sample))
        except (KeyError, TypeError, ValueError):
            continue
    return by_shard


def _check(data: bytes, dataset: str, s: InputSlice, reject_lines: list[tuple[int, int | None]],
           samples: int, regenerate: str) -> tuple[int, str | None]:
    """The row count of the file's ``data``, and why it is not shard ``s.index`` of this input (None: it is)."""
    try:
        table = conform(pq.read_table(pa.BufferReader(data)))
    except (OSError, pa.ArrowException) as exc:
        return 0, f"unreadable Parquet ({exc})"
    if not table.schema.equals(ROW_SCHEMA, check_metadata=False):
        return table.num_rows, "its columns differ from the row schema"
    ids = [str(i) for i in table.column("id").to_pylist()]
    if set(table.column("dataset").to_pylist()) - {dataset}:
        return table.num_rows, f"it holds rows of another dataset than {dataset!r}"
    whole = table.column("turns").null_count < table.num_rows  # turns: regenerate="all"
    if table.num_rows and whole != (regenerate == "all"):
        return table.num_rows, f"its rows were not generated with --regenerate {regenerate}"
    foreign = [i for i in ids if i not in s.ids]
    if foreign:
        return table.num_rows, (f"{len(foreign)} row id(s) are not records of input slice {s.index} "
                                f"(e.g. {foreign[0]!r})")
    covered = [(s.ids[i], int(k)) for i, k in zip(ids, table.column("sample").to_pylist(), strict=True)]
    for line, sample in reject_lines:
        covered.extend([(line, sample)] if sample is not None else [(line, k) for k in range(samples)])
    expected = {(line, k) for line in s.lines for k in range(samples)}
    if len(covered) != len(expected) or set(covered) != expected:
        return table.num_rows, (f"{len(ids)} rows + {len(reject_lines)} rejects do not account for the "
                                f"{len(s.lines)} records x {samples} samples of input slice {s.index} one to one")
    return table.num_rows, None


def check_adoptable(root: Path, shard_dir: Dir, dataset: str, files: dict[int, str], slices: Iterable[InputSlice],
                    rejects: Iterable[dict[str, Any]], samples: int = 1,
                    regenerate: str = "last") -> tuple[list[ShardRecord], list[str]]:
    """Check each file of ``files`` against its input slice.

    Args:
        root: the output directory (for the records' paths).
        shard_dir: the dataset's directory, held open.
        dataset: the dataset.
        files: shard file names by index (``shard_files``).
        slices: the input's slices in index order (consumed once; only those in ``files`` are kept).
        rejects: the dataset's reject records.
        samples: rows per input record.
        regenerate: the regeneration mode the rows must have been generated with.

    Returns:
        The records to commit, and the problems (``shard-NNNNN.parquet: why``); adopt only when
        there are no problems.
    """
    reject_lines = _reject_lines(rejects)
    records: list[ShardRecord] = []
    problems: list[str] = []
    seen: set[int] = set()
    for s in slices:
        name = files.get(s.index)
        if name is None:
            continue
        seen.add(s.index)
        lines = reject_lines.get(s.index, [])
        data = shard_dir.read(name)
        rows, why = _check(data, dataset, s, lines, samples, regenerate)
        if why is not None:
            problems.append(f"{name}: {why}")
            continue
        units = sum(1 if sample is not None else samples for _, sample in lines)
        records.append(ShardRecord(dataset, s.index, f"{dataset}/{name}", rows, units,
                                   hashlib.sha256(data).hexdigest(), utc_now_iso(), root / dataset / name))
    for index in sorted(set(files) - seen):
        problems.append(f"{shard_file_name(index)}.parquet: the input has no slice {index}")
    return records, problems
