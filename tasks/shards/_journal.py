"""Per-shard journals: the rows and rejects finished in a shard that is not committed yet.

Each record is one ``write``, flushed to the OS at once (a ``kill -9`` of the run loses nothing);
``fsync`` runs at most once per ``JOURNAL_FSYNC_INTERVAL_S`` and at commit. A torn last line (the
process died inside ``write``) is ignored on read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tasks.files import fsync_dir

__all__ = ["JOURNAL_FSYNC_INTERVAL_S", "Journal", "JournalContents"]

JOURNAL_FSYNC_INTERVAL_S = 1.0


@dataclass
class JournalContents:
    """What a journal holds: rows by id and rejects by input position (both deduplicated)."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejects: dict[int, dict[str, Any]] = field(default_factory=dict)
    torn_lines: int = 0

    @property
    def positions(self) -> set[int]:
        """Input positions already accounted for (rows carry ``_pos``, rejects are keyed by it)."""
        done = {int(r["_pos"]) for r in self.rows.values() if "_pos" in r}
        done.update(self.rejects)
        return done


class Journal:
    """Append-only JSONL of one open shard. One record per line, written with a single write().

    Record kinds: a finished row (the ROW_SCHEMA columns plus ``_pos``, its input position) or a
    reject ``{"_reject": true, "_pos": N, "line": ..., "reason": ..., ...}``.
    """

    def __init__(self, path: Path, fsync_interval_s: float = JOURNAL_FSYNC_INTERVAL_S) -> None:
        self.path = path
        self._fsync_interval_s = fsync_interval_s
        self._fd: int | None = None
        self._last_sync = time.monotonic()
        self._dirty = False

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if existed:
                self._heal_torn_tail()
            else:
                fsync_dir(self.path.parent)
        return self._fd

    def _heal_torn_tail(self) -> None:
        # A record appended after a torn line would be glued to it and lost; end the torn line first.
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
        if last != b"\n":
            assert self._fd is not None
            os.write(self._fd, b"\n")

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (flushed to the OS before returning; fsync at most once per interval).

        Raises:
            OSError: the write failed (``EIO`` for a short write: never half a record).
        """
        fd = self._open()
        data = orjson.dumps(record) + b"\n"
        written = os.write(fd, data)
        if written != len(data):  # only on a full disk or a signal; never leave half a record
            raise OSError(errno.EIO, f"short write to journal {self.path}")
        self._dirty = True
        now = time.monotonic()
        if now - self._last_sync >= self._fsync_interval_s:
            os.fsync(fd)
            self._last_sync = now
            self._dirty = False

    def sync(self) -> None:
        """fsync what was appended since the last sync (nothing to do when clean)."""
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def close(self) -> None:
        """Sync (errors ignored: the OS already has every record) and close the file."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.sync()
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def read(path: Path) -> JournalContents:
        """Read a journal: torn or unparseable lines are skipped and counted; later duplicates drop."""
        out = JournalContents()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return out
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                out.torn_lines += 1
                continue
            if not isinstance(rec, dict):
                out.torn_lines += 1
                continue
            if rec.get("_reject"):
                out.rejects.setdefault(int(rec["_pos"]), rec)
            elif "id" in rec:
                out.rows.setdefault(str(rec["id"]), rec)
            else:
                out.torn_lines += 1
        return out
