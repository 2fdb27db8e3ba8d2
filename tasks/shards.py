"""The output directory: lock, manifest, per-shard journals, rejects and atomic shard commits.

Layout (DESIGN.md "Output dataset")::

    OUT/_lock                                   flock held by the writing run; JSON body names it
    OUT/_manifest.json                          shard size, input fingerprints, committed shards
    OUT/<dataset>/shard-00000.parquet           committed shards (ROW_SCHEMA, zstd)
    OUT/_journal/<dataset>/shard-00007.jsonl    rows/rejects finished in a shard not yet committed
    OUT/_rejects/<dataset>.jsonl                input rows that could not be used, with the reason

Shard k of a dataset is the fixed slice ``[k*S, (k+1)*S)`` of its input records (rejects included),
so a committed shard's rows + rejects == the slice size (the last shard may be shorter).

Commit order (each step durable before the next, so a crash at any instant is recoverable):

1. the shard's rejects are appended to ``_rejects/<dataset>.jsonl`` (tagged with the shard), fsync;
2. the Parquet file is written to a temp name in the same directory, fsync, rename, fsync dir;
3. the manifest is rewritten atomically (temp + fsync + rename + fsync dir);
4. the journal is removed.

``OutputDir.recover()`` (run under the lock at the start of every run) undoes a half-finished
commit: temp files are removed, a Parquet file that the manifest does not list is removed (its
journal still exists, so the rows are recommitted without new requests), a journal of a shard the
manifest lists is removed, and reject lines of uncommitted shards are dropped (they come back with
their shard's commit).

Journal durability: every record is written with one ``write`` and flushed to the OS at once, so a
``kill -9`` of the run loses nothing that was journaled (the page cache survives the process). An
``fsync`` is issued at most once per ``JOURNAL_FSYNC_INTERVAL_S`` per journal and at commit, which
bounds what a machine crash (power loss, kernel panic) can lose to about one second of rows; those
rows are simply regenerated. A torn last line (the process died inside ``write``) is ignored on read.

Errors::

    ShardsError
    ├── OutputLocked    another live process holds OUT/_lock (names host, pid, flow run, start)
    ├── InputChanged    shard size or input fingerprint differ from the manifest
    └── ManifestError   the manifest is unreadable or inconsistent
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.schema import PARQUET_COMPRESSION, ROW_SCHEMA

__all__ = [
    "JOURNAL_FSYNC_INTERVAL_S",
    "MANIFEST_VERSION",
    "CommittedShard",
    "InputChanged",
    "Journal",
    "JournalContents",
    "ManifestError",
    "OutputDir",
    "OutputLock",
    "OutputLocked",
    "ShardRecord",
    "ShardsError",
    "rows_to_table",
    "shard_file_name",
    "utc_now_iso",
]

MANIFEST_VERSION = 1
JOURNAL_FSYNC_INTERVAL_S = 1.0
_TMP_MARK = ".tmp-"
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Locks this process holds, by resolved output path: flock locks belong to an open file description,
# so a second open+flock of the same file from this process would conflict with our own lock.
_HELD: dict[str, OutputLock] = {}
_HELD_GUARD = threading.Lock()


class ShardsError(Exception):
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


def utc_now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def shard_file_name(index: int) -> str:
    return f"shard-{index:05d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory: fsync, rename, fsync dir."""
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rows_to_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    """Build a ROW_SCHEMA table from row dicts (journal form: ``generated_at`` as ISO text).

    Raises ``pyarrow.ArrowInvalid``/``KeyError`` when a row lacks a column or has a wrong type.
    """
    cols: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    for row in rows:
        for name, values in cols.items():
            values.append(row[name] if name != "generated_at" else _parse_ts(row[name]))
    return pa.table(cols, schema=ROW_SCHEMA)


def _parse_ts(value: Any) -> Any:
    if isinstance(value, str):
        return dt.datetime.fromisoformat(value)
    return value


@dataclass(frozen=True)
class ShardRecord:
    """A committed shard, as the manifest records it (``file`` is relative to the output dir)."""

    dataset: str
    index: int
    file: str
    rows: int
    rejects: int
    sha256: str
    committed_at: str
    path: Path = field(compare=False)

    def to_manifest(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "rejects": self.rejects,
            "sha256": self.sha256,
            "committed_at": self.committed_at,
        }


CommittedShard = ShardRecord


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
                _fsync_dir(self.path.parent)
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
        """Append one record (flushed to the OS before returning; fsync at most once per interval)."""
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
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def close(self) -> None:
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


class OutputLock:
    """The flock on ``OUT/_lock``, held from ``acquire()`` to ``release()`` (or the process's death).

    The body is JSON ``{host, pid, flow_run, started}`` so a refused run can name the holder. The
    kernel drops a flock when its holder dies, so a stale body from a killed run never blocks.
    The descriptor is not inherited by child processes (servers started by the flow).
    """

    def __init__(self, out: OutputDir, run_info: dict[str, Any] | None = None) -> None:
        self.out = out
        self.path = out.path / "_lock"
        self.info: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "flow_run": None,
            "started": utc_now_iso(),
        }
        self.info.update(run_info or {})
        self._fd: int | None = None
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock without waiting. Raises ``OutputLocked`` naming the current holder."""
        key = self.out.key
        with _HELD_GUARD:
            mine = _HELD.get(key)
            if mine is not None:
                if mine is self:
                    self._depth += 1
                    return self
                raise OutputLocked(self.path, mine.info)
            self.out.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputLocked(self.path, self.out.lock_body()) from exc
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(self.info) + b"\n", 0)
            self._fd = fd
            self._depth = 1
            _HELD[key] = self
        return self

    def release(self) -> None:
        with _HELD_GUARD:
            if self._fd is None:
                return
            self._depth -= 1
            if self._depth > 0:
                return
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # an unlocked file with a body would look like a holder
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            _HELD.pop(self.out.key, None)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class OutputDir:
    """One partition's output directory. Writing methods require the lock (``with out.lock(...)``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"OutputDir({str(self.path)!r})"

    @property
    def key(self) -> str:
        return str(self.path.resolve())

    # -- paths -------------------------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.path / "_manifest.json"

    def shard_path(self, dataset: str, index: int) -> Path:
        return self.path / dataset / f"{shard_file_name(index)}.parquet"

    def journal_path(self, dataset: str, index: int) -> Path:
        return self.path / "_journal" / dataset / f"{shard_file_name(index)}.jsonl"

    def rejects_path(self, dataset: str) -> Path:
        return self.path / "_rejects" / f"{dataset}.jsonl"

    @staticmethod
    def check_dataset_name(dataset: str) -> None:
        """Raises ValueError for a name that is not a safe single path component."""
        if not _DATASET_NAME.match(dataset) or dataset.startswith("_"):
            raise ValueError(
                f"dataset name {dataset!r} must be 1-128 of [A-Za-z0-9._-], not starting with '_' or '.'"
            )

    # -- lock --------------------------------------------------------------------------------------

    def lock(self, run_info: dict[str, Any] | None = None) -> OutputLock:
        """The output's lock as a context manager (``with out.lock({"flow_run": id}):``).

        Entering raises ``OutputLocked`` when another process (or another lock object in this
        process) holds it; re-entering the same lock object nests.
        """
        return OutputLock(self, run_info)

    def held_lock(self) -> OutputLock | None:
        """The lock this process holds on this output, if any."""
        with _HELD_GUARD:
            return _HELD.get(self.key)

    @contextlib.contextmanager
    def ensure_locked(self, run_info: dict[str, Any] | None = None) -> Iterator[OutputLock]:
        """Reuse this process's lock on the output, or take it for the duration of the block."""
        held = self.held_lock()
        if held is not None:
            yield held
            return
        with self.lock(run_info) as lk:
            yield lk

    def lock_body(self) -> dict[str, Any]:
        try:
            data = (self.path / "_lock").read_bytes()
            body = orjson.loads(data) if data.strip() else {}
            return body if isinstance(body, dict) else {}
        except (OSError, orjson.JSONDecodeError):
            return {}

    def lock_holder(self) -> dict[str, Any] | None:
        """The body of a lock that a live process holds right now, else None (stale bodies ignored)."""
        held = self.held_lock()
        if held is not None:
            return dict(held.info)
        path = self.path / "_lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return self.lock_body() or {"host": None, "pid": None}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _require_lock(self) -> None:
        if self.held_lock() is None:
            raise ShardsError(f"writing {self.path} needs its lock: use `with OutputDir(...).lock(...)`")

    # -- manifest ----------------------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, or None when the output has none yet. Raises ``ManifestError`` if unreadable."""
        try:
            data = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            manifest = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ManifestError(f"{self.manifest_path} is not valid JSON: {exc}") from exc
        if not isinstance(manifest, dict) or "shard_size" not in manifest:
            raise ManifestError(f"{self.manifest_path} has no shard_size")
        manifest.setdefault("datasets", {})
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest atomically (temp + fsync + rename + fsync dir). Needs the lock."""
        self._require_lock()
        manifest["updated_at"] = utc_now_iso()
        _atomic_write_bytes(self.manifest_path, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))

    def open_dataset(
        self,
        dataset: str,
        *,
        input_path: str,
        input_fingerprint: str,
        shard_size: int,
    ) -> dict[str, Any]:
        """Bind ``dataset`` to its input and the output to ``shard_size``, recording both on first use.

        Returns the dataset's manifest entry. Raises ``InputChanged`` when the output was written
        with another shard size or another input fingerprint, ``ValueError`` for a bad name/size.
        """
        self.check_dataset_name(dataset)
        if shard_size < 1:
            raise ValueError(f"shard size must be >= 1, got {shard_size}")
        self._require_lock()
        manifest = self.read_manifest()
        if manifest is None:
            manifest = {"version": MANIFEST_VERSION, "shard_size": shard_size, "created_at": utc_now_iso(),
                        "datasets": {}}
        if int(manifest["shard_size"]) != shard_size:
            raise InputChanged(
                f"shard size of {self.path}",
                int(manifest["shard_size"]),
                shard_size,
                f"rerun with --shard-size {manifest['shard_size']} to resume this output, "
                f"or write to a new --out",
            )
        entry = manifest["datasets"].get(dataset)
        if entry is None:
            entry = {"input": input_path, "input_fingerprint": input_fingerprint, "total_rows": None,
                     "num_shards": None, "complete": False, "shards": {}}
            manifest["datasets"][dataset] = entry
            self.write_manifest(manifest)
        elif entry.get("input_fingerprint") != input_fingerprint:
            raise InputChanged(
                f"input of dataset {dataset!r} ({entry.get('input')} -> {input_path}) changed; fingerprint",
                entry.get("input_fingerprint"),
                input_fingerprint,
                "committed shards are fixed slices of the original input: restore that input "
                "to resume, or write the new input to a new --out",
            )
        return entry

    def set_dataset_totals(self, dataset: str, total_rows: int) -> None:
        """Record the input's record count (known once it was streamed to the end). Needs the lock."""
        manifest = self._manifest_or_raise()
        entry = manifest["datasets"][dataset]
        size = int(manifest["shard_size"])
        entry["total_rows"] = total_rows
        entry["num_shards"] = (total_rows + size - 1) // size
        entry["complete"] = len(entry["shards"]) >= entry["num_shards"]
        self.write_manifest(manifest)

    def _manifest_or_raise(self) -> dict[str, Any]:
        manifest = self.read_manifest()
        if manifest is None:
            raise ManifestError(f"{self.path} has no manifest")
        return manifest

    def committed_indices(self, dataset: str) -> set[int]:
        manifest = self.read_manifest() or {"datasets": {}}
        entry = manifest["datasets"].get(dataset) or {}
        return {int(k) for k in entry.get("shards", {})}

    def committed_shards(self, dataset: str | None = None) -> Iterator[ShardRecord]:
        """Every committed shard (of ``dataset``, or of all datasets), in dataset then index order."""
        manifest = self.read_manifest() or {"datasets": {}}
        for name in sorted(manifest["datasets"]):
            if dataset is not None and name != dataset:
                continue
            shards = manifest["datasets"][name].get("shards", {})
            for key in sorted(shards, key=int):
                s = shards[key]
                yield ShardRecord(name, int(key), s["file"], int(s["rows"]), int(s.get("rejects", 0)),
                                  s["sha256"], s["committed_at"], self.path / s["file"])

    # -- commit ------------------------------------------------------------------------------------

    def _write_parquet(self, dataset: str, index: int, table: pa.Table) -> tuple[Path, str]:
        if table.schema != ROW_SCHEMA:
            table = table.select(list(ROW_SCHEMA.names)).cast(ROW_SCHEMA)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=PARQUET_COMPRESSION)
        data = sink.getvalue().to_pybytes()
        final = self.shard_path(dataset, index)
        final.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(final, data)
        return final, hashlib.sha256(data).hexdigest()

    def commit_shard(
        self,
        dataset: str,
        index: int,
        rows: Iterable[dict[str, Any]] | pa.Table,
        rejects: Iterable[dict[str, Any]] = (),
    ) -> ShardRecord:
        """Commit shard ``index``: rejects, then Parquet (atomic), then manifest, then drop the journal.

        ``rows`` are row dicts (journal form) or a ROW_SCHEMA table. Needs the lock; raises
        ``ManifestError`` when the dataset was not opened.
        """
        self._require_lock()
        manifest = self._manifest_or_raise()
        if dataset not in manifest["datasets"]:
            raise ManifestError(f"dataset {dataset!r} was not opened in {self.path}")
        table = rows if isinstance(rows, pa.Table) else rows_to_table(rows)
        reject_list = list(rejects)
        if reject_list:
            self._append_rejects(dataset, index, reject_list)
        path, digest = self._write_parquet(dataset, index, table)
        record = ShardRecord(dataset, index, str(path.relative_to(self.path)), table.num_rows,
                             len(reject_list), digest, utc_now_iso(), path)
        entry = manifest["datasets"][dataset]
        entry["shards"][str(index)] = record.to_manifest()
        if entry.get("num_shards") is not None:
            entry["complete"] = len(entry["shards"]) >= entry["num_shards"]
        self.write_manifest(manifest)
        with contextlib.suppress(FileNotFoundError):
            self.journal_path(dataset, index).unlink()
        return record

    def replace_shard(self, dataset: str, index: int, table: pa.Table) -> ShardRecord:
        """Atomically replace committed shard ``index`` with ``table`` (same rows, rewritten columns).

        For ``datagen resplit``. Takes the lock for the call if this process does not hold it
        (raises ``OutputLocked`` when another run does); raises ``ManifestError`` when the shard is
        not committed or the row count changes.
        """
        with self.ensure_locked({"command": "replace_shard"}):
            manifest = self._manifest_or_raise()
            entry = manifest["datasets"].get(dataset, {}).get("shards", {}).get(str(index))
            if entry is None:
                raise ManifestError(f"shard {index} of {dataset!r} is not committed in {self.path}")
            if int(entry["rows"]) != table.num_rows:
                raise ManifestError(
                    f"replacing shard {index} of {dataset!r} would change its rows "
                    f"from {entry['rows']} to {table.num_rows}"
                )
            path, digest = self._write_parquet(dataset, index, table)
            entry["sha256"] = digest
            entry["replaced_at"] = utc_now_iso()
            self.write_manifest(manifest)
            return ShardRecord(dataset, index, entry["file"], int(entry["rows"]), int(entry.get("rejects", 0)),
                               digest, entry["committed_at"], path)

    def _append_rejects(self, dataset: str, index: int, rejects: list[dict[str, Any]]) -> None:
        path = self.rejects_path(dataset)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(orjson.dumps({**r, "shard": index}) + b"\n" for r in rejects)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_rejects(self, dataset: str) -> list[dict[str, Any]]:
        """The dataset's reject records (torn lines skipped)."""
        try:
            data = self.rejects_path(dataset).read_bytes()
        except FileNotFoundError:
            return []
        out = []
        for line in data.split(b"\n"):
            if line.strip():
                with contextlib.suppress(orjson.JSONDecodeError):
                    out.append(orjson.loads(line))
        return out

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self, dataset: str) -> dict[str, int]:
        """Undo half-finished commits of ``dataset`` (see the module docstring). Needs the lock.

        Returns counts of what was cleaned: temp_files, orphan_shards, stale_journals, stale_rejects.
        """
        self._require_lock()
        counts = {"temp_files": 0, "orphan_shards": 0, "stale_journals": 0, "stale_rejects": 0}
        for directory in (self.path, self.path / dataset, self.path / "_rejects",
                          self.path / "_journal" / dataset):
            if not directory.is_dir():
                continue
            for p in directory.iterdir():
                if _TMP_MARK in p.name and p.is_file():
                    p.unlink()
                    counts["temp_files"] += 1
        committed = self.committed_indices(dataset)
        shard_dir = self.path / dataset
        if shard_dir.is_dir():
            for p in shard_dir.glob("shard-*.parquet"):
                idx = _index_of(p.name)
                if idx is not None and idx not in committed:
                    p.unlink()  # renamed before the manifest update: its journal still holds the rows
                    counts["orphan_shards"] += 1
        jdir = self.path / "_journal" / dataset
        if jdir.is_dir():
            for p in jdir.glob("shard-*.jsonl"):
                idx = _index_of(p.name)
                if idx is not None and idx in committed:
                    p.unlink()
                    counts["stale_journals"] += 1
        counts["stale_rejects"] = self._prune_rejects(dataset, committed)
        return counts

    def _prune_rejects(self, dataset: str, committed: set[int]) -> int:
        path = self.rejects_path(dataset)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        keep: list[bytes] = []
        dropped = 0
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
                ok = int(rec["shard"]) in committed
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                ok = False
            if ok:
                keep.append(line)
            else:
                dropped += 1
        if dropped or (data and not data.endswith(b"\n")):
            _atomic_write_bytes(path, b"".join(line + b"\n" for line in keep))
        return dropped

    def open_journals(self, dataset: str) -> list[int]:
        """Indices of shards of ``dataset`` that have a journal (open, uncommitted)."""
        jdir = self.path / "_journal" / dataset
        if not jdir.is_dir():
            return []
        found = (_index_of(p.name) for p in jdir.glob("shard-*.jsonl"))
        return sorted(i for i in found if i is not None)


def _index_of(name: str) -> int | None:
    m = re.match(r"^shard-(\d+)\.(parquet|jsonl)$", name)
    return int(m.group(1)) if m else None

