"""Errors of the output directory (tasks.shards and its parts).

Errors::

    ShardsError
    ├── OutputLocked    another live process holds OUT/_lock (names host, pid, flow run, start)
    ├── InputChanged    shard size or input fingerprint differ from the manifest
    ├── ManifestError   the manifest is unreadable or inconsistent
    │   └── UnrecordedShards  shard files no manifest records, that cannot be adopted
    └── DamagedShards   committed shards whose files are missing or changed (``datagen repair``)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.errors import DatagenError

__all__ = ["DamagedShards", "InputChanged", "ManifestError", "OutputLocked", "ShardsError", "UnrecordedShards"]


class ShardsError(DatagenError):
    """Base of every error raised by tasks.shards."""


class OutputLocked(ShardsError):
    """Another live process holds the output's lock. ``holder`` is the lock body (may be empty)."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        self.path = path
        self.holder = holder
        who = ", ".join(f"{k}={holder[k]}" for k in ("host", "pid", "flow_run", "started") if k in holder)
        super().__init__(
            f"output {path.parent} is being written by another run ({who or 'holder unknown'}); "
            f"only one run may write an output at a time: wait for it to finish, stop it, "
            f"or choose another --out"
        )


class InputChanged(ShardsError):
    """The run's shard size or input differs from what the existing output was written with."""

    def __init__(self, what: str, recorded: Any, requested: Any, advice: str) -> None:
        self.what = what
        self.recorded = recorded
        self.requested = requested
        super().__init__(f"{what}: the output has {recorded!r}, this run has {requested!r}; {advice}")


class ManifestError(ShardsError):
    """The manifest cannot be read or contradicts itself."""


class UnrecordedShards(ManifestError):
    """Shard files of a dataset that no manifest records, and that do not prove to be its input's slices."""


class DamagedShards(ShardsError):
    """Committed shards whose files are missing or no longer match the manifest. ``damage`` lists them."""

    def __init__(self, out_path: Path, damage: list[Any]) -> None:
        self.damage = damage
        listed = "; ".join(d.describe() for d in damage)
        super().__init__(
            f"{len(damage)} committed shard(s) of {out_path} do not match the manifest: {listed}. "
            f"Run `datagen repair {out_path}` to un-commit them, then rerun: exactly those shards are "
            f"generated again (or restore the files from a copy)"
        )
