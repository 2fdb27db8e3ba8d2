"""The output directory: lock, manifest, per-shard journals, rejects and atomic shard commits."""

from __future__ import annotations

from tasks.shards._commit import (
    reject_units,
    rows_to_table,
)
from tasks.shards._errors import (
    DamagedShards,
    InputChanged,
    ManifestError,
    OutputLocked,
    ShardsError,
    UnrecordedShards,
)
from tasks.shards._fs import (
    check_dataset_name,
    shard_file_name,
    utc_now_iso,
)
from tasks.shards._integrity import (
    ShardDamage,
)
from tasks.shards._journal import (
    JOURNAL_FSYNC_INTERVAL_S,
    WHOLE_RECORD,
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
from tasks.shards._rebuild import (
    InputSlice,
)
from tasks.shards._versions import (
    choose_version,
    mark_failed,
    promote_latest,
)

__all__ = [
    "choose_version",
    "mark_failed",
    "promote_latest",
    "CommittedShard",
    "DamagedShards",
    "InputChanged",
    "InputSlice",
    "JOURNAL_FSYNC_INTERVAL_S",
    "Journal",
    "JournalContents",
    "MANIFEST_VERSION",
    "ManifestError",
    "OutputDir",
    "OutputLock",
    "OutputLocked",
    "ShardDamage",
    "ShardRecord",
    "ShardsError",
    "UnrecordedShards",
    "WHOLE_RECORD",
    "check_dataset_name",
    "reject_units",
    "rows_to_table",
    "shard_file_name",
    "utc_now_iso",
]
