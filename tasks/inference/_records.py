"""The records of tasks.inference: what a run is asked to do and what it reports.

``DatasetSpec`` names a dataset and its input; ``ShardProgress`` is handed to the ``progress``
callback after each shard commit; ``DatasetResult`` is what ``run_dataset`` returns (and what a
``ServerGone`` carries). ``estimate_records`` sizes an input for the ETA. Nothing here raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

__all__ = [
    "DEFAULT_SAMPLING",
    "DatasetResult",
    "DatasetSpec",
    "ShardProgress",
    "estimate_records",
]

DEFAULT_SAMPLING: Mapping[str, Any] = {"max_new_tokens": 4096}


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: its name (the output folder) and input file (JSONL or Parquet)."""

    name: str
    path: Path
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # e.g. enable_thinking


@dataclass(frozen=True)
class ShardProgress:
    """Progress after a shard commit. Token rates are over the shard's wall time."""

    dataset: str
    shard: int
    rows: int  # rows in the committed shard
    rows_generated: int  # of those, generated in this run (the rest came from the journal)
    rejects: int
    prompt_tokens: int  # of the rows generated in this run
    completion_tokens: int
    elapsed_s: float  # from the shard's first record to its commit
    tokens_per_s: float  # completion tokens/s of this run's rows in this shard
    retries: int  # client retries since the previous progress record
    shards_committed: int  # in the output, this dataset
    shards_total: int | None  # None until the input size is known
    dataset_rows_done: int  # rows + rejects committed for this dataset
    dataset_rows_total: int | None  # an estimate until the input was read to the end
    eta_s: float | None
    latencies_s: tuple[float, ...] = ()  # request latency of each row generated in this run
    in_flight: int = 0  # requests the run keeps in flight (its workers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DatasetResult:
    """What a run did for one dataset."""

    dataset: str
    out_dir: str
    shard_size: int
    concurrency: int
    shards_total: int | None = None
    shards_committed: int = 0  # in the output after this run
    shards_committed_now: int = 0
    shards_skipped: int = 0  # already committed before this run
    rows_generated: int = 0  # journaled by this run from a server answer
    rows_resumed: int = 0  # found in an open shard's journal and not regenerated
    rejects: int = 0  # journaled by this run
    rows_capped: int = 0  # of rows_generated, those whose max_new_tokens was lowered to fit the context
    truncation_retries: int = 0  # regenerations of rows that finished by length (TruncationPolicy)
    requests: int = 0  # HTTP requests, retries included
    retries: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served by the server's prefix cache (meta_info)
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    complete: bool = False
    recovered: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_records(path: Path) -> int | None:
    """Records in the input, cheaply (for the ETA only): Parquet metadata or JSONL newlines.

    None when the input cannot be read (the run itself then reports why).
    """
    try:
        if path.name.lower().endswith(".parquet"):
            return int(pq.ParquetFile(path).metadata.num_rows)
        n, last = 0, b"\n"
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        return n + (0 if last == b"\n" else 1)
    except (OSError, ValueError):
        return None
