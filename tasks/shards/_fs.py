"""Names shared by the parts of tasks.shards: shard file names, dataset names, timestamps.

The durable writes themselves live in ``tasks.files``.
"""

from __future__ import annotations

import datetime as dt
import re

__all__ = [
    "check_dataset_name",
    "shard_file_name",
    "shard_index_of",
    "utc_now_iso",
]

_SHARD_FILE = re.compile(r"^shard-(\d+)\.(parquet|jsonl)$")
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def utc_now_iso() -> str:
    """The current UTC time as ISO 8601 text with microseconds (the manifest's timestamps)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def shard_file_name(index: int) -> str:
    """The stem of shard ``index``'s files (``shard-00007``), shared by Parquet and journal."""
    return f"shard-{index:05d}"


def check_dataset_name(dataset: str) -> None:
    """Check that ``dataset`` is a safe single path component.

    Raises:
        ValueError: it is not (1-128 of ``[A-Za-z0-9._-]``, not starting with ``_`` or ``.``).
    """
    if not _DATASET_NAME.match(dataset) or dataset.startswith("_"):
        raise ValueError(
            f"dataset name {dataset!r} must be 1-128 of [A-Za-z0-9._-], not starting with '_' or '.'"
        )


def shard_index_of(name: str) -> int | None:
    """The shard index of a ``shard-NNNNN.parquet``/``.jsonl`` file name, else None."""
    m = _SHARD_FILE.match(name)
    return int(m.group(1)) if m else None
