"""Errors of the output directory (tasks.shards and its parts).

Errors::

    ShardsError
    ├── OutputLocked    another live process holds OUT/_lock (names host, pid, flow run, start)
    ├── InputChanged    shard size or input fingerprint differ from the manifest
    └── ManifestError   the manifest is unreadable or inconsistent
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.errors import DatagenError

__all__ = ["InputChanged", "ManifestError", "OutputLocked", "ShardsError"]


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
