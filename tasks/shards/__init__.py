"""The output directory: lock, manifest, per-shard journals, rejects and atomic shard commits."""

from __future__ import annotations

from tasks.shards._commit import (
    rows_to_table,
)
from tasks.shards._errors import (
    InputChanged,
    ManifestError,
    OutputLocked,
    ShardsError,
)
from tasks.shards._fs import (
    check_dataset_name,
    shard_file_name,
    utc_now_iso,
)
from tasks.shards._journal import (
    JOURNAL_FSYNC_INTERVAL_S,
    Journal,
    JournalContents,
)
from tasks.shards._lock import (
    OutputLock,
)
from tasks.shards._manifest import (
    MANIFEST_VERSION,
    CommittedShard,
    ShardRecord,
)
from tasks.shards._output import (
    OutputDir,
)

__all__ = [
    "CommittedShard",
    "InputChanged",
    "JOURNAL_FSYNC_INTERVAL_S",
    "Journal",
    "JournalContents",
    "MANIFEST_VERSION",
    "ManifestError",
    "OutputDir",
    "OutputLock",
    "OutputLocked",
    "ShardRecord",
    "ShardsError",
    "check_dataset_name",
    "rows_to_table",
    "shard_file_name",
    "utc_now_iso",
]
