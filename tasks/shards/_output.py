"""The output directory: lock, manifest, per-shard journals, rejects and atomic shard commits.

Layout::

    OUT/_lock                                   flock held by the writing run; JSON body names it
    OUT/_manifest.json                          shard size, input fingerprints, committed shards
    OUT/<dataset>/shard-00000.parquet           committed shards (ROW_SCHEMA, zstd)
    OUT/_journal/<dataset>/shard-00007.jsonl    rows/rejects finished in a shard not yet committed
    OUT/_rejects/<dataset>.jsonl                input rows that could not be used, with the reason

Shard k of a dataset is the slice ``[k*S, (k+1)*S)`` of its input records. A commit appends the
rejects, writes the Parquet file, rewrites the manifest and removes the journal, each step durable
before the next; ``OutputDir.recover()`` undoes what a crash between two steps leaves behind.
``OutputDir.rebuild_dataset()`` records shard files a lost manifest no longer lists, once each is
proven to be its input slice; ``OutputDir.repair()`` un-commits shards whose files are missing or
changed.

The output is held open as a directory handle (``tasks.files.Dir``), and so is each subdirectory the
run uses, opened relative to its parent with ``O_NOFOLLOW``: nothing below OUT is reached by its path,
so a directory or file swapped for a symlink at any moment is refused, never followed (see
docs/architecture.md, "Threat model"). ``shard_path``, ``journal_path`` and ``rejects_path`` name files
in messages only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import pyarrow as pa

from tasks.files import Dir
from tasks.shards._commit import append_rejects, read_rejects, reject_units, rows_to_table, write_parquet
from tasks.shards._errors import DamagedShards, ManifestError, ShardsError, UnrecordedShards
from tasks.shards._fs import check_dataset_name, shard_file_name, utc_now_iso
from tasks.shards._integrity import ShardDamage, find_damage, uncommit
from tasks.shards._journal import Journal, JournalContents
from tasks.shards._lock import OutputLock, held_lock, lock_holder
from tasks.shards._manifest import (
    MANIFEST_FILE,
    ShardRecord,
    add_shard,
    bind_dataset,
    check_shard_size,
    committed_indices,
    iter_shard_records,
    new_manifest,
    read_manifest,
    set_totals,
    write_manifest,
)
from tasks.shards._rebuild import InputSlice, check_adoptable, shard_files
from tasks.shards._recovery import (
    journal_indices,
    prune_rejects,
    remove_orphan_shards,
    remove_stale_journals,
    remove_temp_files,
)

__all__ = ["OutputDir"]


class OutputDir:
    """One partition's output directory. Writing methods require the lock (``with out.lock(...)``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._root: Dir | None = None
        self._dirs: dict[tuple[str, ...], tuple[Dir, tuple[int, int]]] = {}

    def __repr__(self) -> str:
        return f"OutputDir({str(self.path)!r})"

    # -- handles -----------------------------------------------------------------------------------

    def open_root(self, *, create: bool = False) -> Dir | None:
        """The output directory, held open (the lock's handle when this process holds the lock); None
        when it does not exist and ``create`` is not set. OUT itself is reached by its path: the user
        chose it and its parent is trusted."""
        if self._root is not None and self._root._fd is not None:
            return self._root
        try:
            d = Dir.open(self.path, create=create)
        except FileNotFoundError:
            return None
        lock = held_lock(d.key)
        if lock is not None and lock.root is not None:
            d.close()
            d = lock.root
        self._root = d
        self._dirs.clear()
        return d

    @property
    def root(self) -> Dir:
        """The output directory, held open (created when missing)."""
        root = self.open_root(create=True)
        assert root is not None
        return root

    def _dir(self, *parts: str, create: bool = False) -> Dir | None:
        """``OUT/<parts>`` held open, each component opened relative to its parent's handle with
        ``O_NOFOLLOW`` (created with ``create``); None when one is missing.

        A held handle is used again while its name still leads to it (one ``fstatat``); when the name
        now leads elsewhere the directory is opened again, so a symlink put there is refused.

        Raises:
            UnsafeFile: a component is a symlink, not a directory, or another user's.
        """
        parent = self.open_root(create=create)
        for i, name in enumerate(parts):
            if parent is None:
                return None
            key = parts[: i + 1]
            held = self._dirs.get(key)
            if held is not None:
                st = parent.lstat(name)
                if st is None or not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != held[1]:
                    for k in [k for k in self._dirs if k[: len(key)] == key]:
                        del self._dirs[k]
                    held = None
            if held is None:
                d = parent.sub(name, create=create)
                if d is not None:
                    held = (d, d.key)
                    self._dirs[key] = held
            parent = held[0] if held is not None else None
        return parent

    # -- paths (for messages) ----------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE

    def shard_path(self, dataset: str, index: int) -> Path:
        return self.path / dataset / f"{shard_file_name(index)}.parquet"

    def journal_path(self, dataset: str, index: int) -> Path:
        return self.path / "_journal" / dataset / f"{shard_file_name(index)}.jsonl"

    def rejects_path(self, dataset: str) -> Path:
        return self.path / "_rejects" / f"{dataset}.jsonl"

    def journal(self, dataset: str, index: int) -> Journal:
        """The journal of shard ``index`` of ``dataset``; its directory is checked now and created (checked
        again) on the first append.

        Raises:
            UnsafeFile: ``_journal`` or ``_journal/<dataset>`` is a symlink, not a directory, or another user's.
        """
        self._dir("_journal", dataset)

        def directory() -> Dir:
            d = self._dir("_journal", dataset, create=True)
            assert d is not None
            return d

        return Journal(directory, f"{shard_file_name(index)}.jsonl", self.journal_path(dataset, index))

    def read_journal(self, dataset: str, index: int, *, check_rows: bool = True) -> JournalContents:
        """What the journal of shard ``index`` of ``dataset`` holds (empty when there is none)."""
        d = self._dir("_journal", dataset)
        try:
            data = d.read(f"{shard_file_name(index)}.jsonl") if d is not None else b""
        except FileNotFoundError:
            data = b""
        return Journal.parse(data, check_rows=check_rows)

    def remove_journal_dir(self, dataset: str) -> bool:
        """Remove ``OUT/_journal/<dataset>`` when it is empty; whether it was removed."""
        parent = self._dir("_journal")
        if parent is None:
            return False
        self._dirs.pop(("_journal", dataset), None)
        return parent.remove_dir(dataset)

    def shard_reader(self, rec: ShardRecord | str) -> IO[bytes]:
        """A committed shard's file (a record, or the manifest's ``<dataset>/shard-NNNNN.parquet``)
        opened for reading through its dataset's directory handle.

        Raises:
            FileNotFoundError: the file (or its directory) is missing.
            UnsafeFile: it, or its directory, is a symlink or not a regular file.
        """
        dataset, name = rec.split("/", 1) if isinstance(rec, str) else (rec.dataset, rec.name)
        d = self._dir(dataset)
        if d is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.path / dataset / name))
        return d.reader(name)

    def read_shard(self, rec: ShardRecord | str) -> bytes:
        """A committed shard file's bytes (see ``shard_reader``)."""
        with self.shard_reader(rec) as f:
            return f.read()

    def read_file(self, name: str) -> bytes | None:
        """The bytes of file ``name`` directly in OUT (``_validation.json``, ``README.md``), None when it
        or the output is missing.

        Raises:
            UnsafeFile: it is a symlink or not a regular file.
        """
        root = self.open_root()
        try:
            return root.read(name) if root is not None else None
        except FileNotFoundError:
            return None

    def write_file(self, name: str, data: bytes) -> None:
        """Replace file ``name`` directly in OUT atomically (the validation report, the card).

        Raises:
            UnsafeFile: it is a symlink, not a regular file, or another user's.
            OSError: it cannot be written (it keeps its old content).
        """
        self.root.write(name, data)

    def subdir(self, name: str, *, create: bool = False) -> Dir | None:
        """``OUT/<name>`` held open (``_logs``), see ``_dir``."""
        return self._dir(name, create=create)

    @staticmethod
    def check_dataset_name(dataset: str) -> None:
        """Check that ``dataset`` is a safe single path component.

        Raises:
            ValueError: it is not.
        """
        check_dataset_name(dataset)

    # -- lock --------------------------------------------------------------------------------------

    def lock(self, run_info: dict[str, Any] | None = None) -> OutputLock:
        """The output's lock as a context manager (``with out.lock({"flow_run": id}):``).

        Re-entering the same lock object nests.

        Args:
            run_info: written into the lock's JSON body (e.g. ``{"flow_run": id}``).

        Raises:
            OutputLocked: on entering, when another process (or another lock object in this
                process) holds it.
        """
        return OutputLock(self, run_info)

    def held_lock(self) -> OutputLock | None:
        """The lock this process holds on this output, if any."""
        root = self.open_root()
        return held_lock(root.key) if root is not None else None

    @contextlib.contextmanager
    def ensure_locked(self, run_info: dict[str, Any] | None = None) -> Iterator[OutputLock]:
        """Reuse this process's lock on the output, or take it for the duration of the block.

        Raises:
            OutputLocked: it has to take the lock and another run holds it.
        """
        held = self.held_lock()
        if held is not None:
            yield held
            return
        with self.lock(run_info) as lk:
            yield lk

    def lock_holder(self) -> dict[str, Any] | None:
        """The body of a lock that a live process holds right now, else None (stale bodies ignored)."""
        root = self.open_root()
        return lock_holder(root) if root is not None else None

    def _require_lock(self) -> None:
        if self.held_lock() is None:
            raise ShardsError(f"writing {self.path} needs its lock: use `with OutputDir(...).lock(...)`")

    # -- manifest ----------------------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, or None when the output has none yet.

        Raises:
            ManifestError: the manifest is unreadable.
        """
        return read_manifest(self.open_root(), self.manifest_path)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest atomically (temp + fsync + rename + fsync dir). Needs the lock.

        Raises:
            ShardsError: this process does not hold the lock.
            OSError: the manifest cannot be written.
        """
        self._require_lock()
        write_manifest(self.root, manifest)

    def open_dataset(
        self,
        dataset: str,
        *,
        input_path: str,
        input_fingerprint: str,
        shard_size: int,
    ) -> dict[str, Any]:
        """Bind ``dataset`` to its input and the output to ``shard_size``, recording both on first use.

        Returns the dataset's manifest entry. Needs the lock.

        Args:
            dataset: the dataset name.
            input_path: the input file.
            input_fingerprint: the input's fingerprint.
            shard_size: input records per shard.

        Raises:
            InputChanged: the output was written with another shard size or input fingerprint.
            ValueError: a bad dataset name or shard size.
            UnsafeFile: a directory of the dataset is a symlink or not the user's (``check_dirs``).
            ShardsError: this process does not hold the lock.
        """
        self.check_dirs(dataset)
        if shard_size < 1:
            raise ValueError(f"shard size must be >= 1, got {shard_size}")
        self._require_lock()
        manifest = self.read_manifest()
        if manifest is None:
            manifest = new_manifest(shard_size)
        check_shard_size(manifest, shard_size, self.path)
        entry, added = bind_dataset(manifest, dataset, input_path, input_fingerprint)
        if added:
            self.write_manifest(manifest)
        return entry

    def unrecorded_shards(self, dataset: str) -> list[int]:
        """Indices of ``dataset``'s shard files on disk when no manifest records the dataset.

        Raises:
            ManifestError: the manifest is unreadable.
        """
        self.check_dirs(dataset)
        manifest = self.read_manifest()
        if manifest is not None and dataset in manifest["datasets"]:
            return []
        return sorted(shard_files(self._dir(dataset)))

    def rebuild_dataset(
        self,
        dataset: str,
        *,
        input_path: str,
        input_fingerprint: str,
        shard_size: int,
        slices: Iterable[InputSlice],
        generation: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Record ``dataset`` with the shard files no manifest records, each proven to be its slice.

        For an output whose manifest (or the dataset's entry) was lost: every file must be shard k of
        this input (``tasks.shards._rebuild``); then the dataset is bound to the input and the files
        are committed in one manifest write. Returns the adopted indices (none when the manifest
        records the dataset or there are no files). Needs the lock.

        Args:
            dataset: the dataset name.
            input_path: the input file.
            input_fingerprint: the input's fingerprint.
            shard_size: input records per shard.
            slices: the input's slices in index order.
            generation: ``{"samples": N, "regenerate": mode}`` of the run: the files must hold that
                many samples per record and turns of that mode; recorded with the dataset.

        Raises:
            UnrecordedShards: a file is not its slice (lists each; nothing is changed).
            InputChanged: the manifest exists with another shard size.
            ShardsError: this process does not hold the lock.
        """
        self._require_lock()
        self.check_dirs(dataset)
        manifest = self.read_manifest()
        if manifest is not None and dataset in manifest["datasets"]:
            return []
        shard_dir = self._dir(dataset)
        files = shard_files(shard_dir)
        if not files or shard_dir is None:
            return []
        gen = dict(generation or {"samples": 1, "regenerate": "last"})
        if manifest is None:
            manifest = new_manifest(shard_size)
        check_shard_size(manifest, shard_size, self.path)
        records, problems = check_adoptable(self.path, shard_dir, dataset, files, slices, self.read_rejects(dataset),
                                             int(gen.get("samples", 1)), str(gen.get("regenerate", "last")))
        if problems:
            raise UnrecordedShards(
                f"{self.path / dataset} holds {len(files)} shard file(s) that no manifest records "
                f"({self.manifest_path} is missing or lacks {dataset!r}), and {len(problems)} of them are "
                f"not this input's slices of {shard_size} records: {'; '.join(problems)}. Nothing was "
                f"changed. Restore {self.manifest_path.name}, or rerun with the input and --shard-size "
                f"(and --samples, --regenerate) the output was written with; a shard file moved out of {self.path / dataset} is "
                f"generated again"
            )
        entry, _ = bind_dataset(manifest, dataset, input_path, input_fingerprint)
        if generation is not None:
            entry["generation"] = gen
        for record in records:
            add_shard(manifest, record)
        self.write_manifest(manifest)
        return [r.index for r in records]

    def set_dataset_totals(self, dataset: str, total_rows: int) -> None:
        """Record the input's record count (known once it was streamed to the end). Needs the lock."""
        manifest = self._manifest_or_raise()
        set_totals(manifest, dataset, total_rows)
        self.write_manifest(manifest)

    def _manifest_or_raise(self) -> dict[str, Any]:
        manifest = self.read_manifest()
        if manifest is None:
            raise ManifestError(f"{self.path} has no manifest")
        return manifest

    def committed_indices(self, dataset: str) -> set[int]:
        """Indices of the committed shards of ``dataset``. Raises ``ManifestError`` if unreadable."""
        return committed_indices(self.read_manifest(), dataset)

    def committed_shards(self, dataset: str | None = None) -> Iterator[ShardRecord]:
        """Every committed shard (of ``dataset``, or of all datasets), in dataset then index order."""
        yield from iter_shard_records(self.read_manifest(), self.path, dataset)

    # -- commit ------------------------------------------------------------------------------------

    def commit_shard(
        self,
        dataset: str,
        index: int,
        rows: Iterable[dict[str, Any]] | pa.Table,
        rejects: Iterable[dict[str, Any]] = (),
        *,
        samples: int = 1,
    ) -> ShardRecord:
        """Commit shard ``index``: rejects, then Parquet (atomic), then manifest, then drop the journal.

        Needs the lock. The shard's ``rejects`` count is in ``(record, sample)`` units, like its rows.

        Args:
            dataset: an opened dataset.
            index: the shard index.
            rows: row dicts (journal form) or a ROW_SCHEMA table.
            rejects: the shard's reject records.
            samples: rows per input record: a reject without a ``sample`` stands for that many.

        Raises:
            ShardsError: this process does not hold the lock.
            ManifestError: there is no manifest or the dataset was not opened.
            OSError: a file cannot be written (the commit can be redone after ``recover``).
        """
        self._require_lock()
        manifest = self._manifest_or_raise()
        if dataset not in manifest["datasets"]:
            raise ManifestError(f"dataset {dataset!r} was not opened in {self.path}")
        table = rows if isinstance(rows, pa.Table) else rows_to_table(rows)
        reject_list = list(rejects)
        self._dir("_journal", dataset)  # its journal is removed below: checked before anything is written
        if reject_list:
            self._append_rejects(dataset, index, reject_list)
        shard_dir = self._dir(dataset, create=True)
        assert shard_dir is not None
        name = f"{shard_file_name(index)}.parquet"
        digest = write_parquet(shard_dir, name, table)
        record = ShardRecord(dataset, index, f"{dataset}/{name}", table.num_rows,
                             reject_units(reject_list, samples), digest, utc_now_iso(), self.shard_path(dataset, index))
        add_shard(manifest, record)
        self.write_manifest(manifest)
        journal_dir = self._dir("_journal", dataset)
        if journal_dir is not None:
            journal_dir.remove(f"{shard_file_name(index)}.jsonl")
        return record

    def replace_shard(self, dataset: str, index: int, table: pa.Table) -> ShardRecord:
        """Atomically replace committed shard ``index`` with ``table`` (same rows, rewritten columns).

        For ``datagen resplit``. Takes the lock for the call if this process does not hold it.

        Raises:
            OutputLocked: another run holds the lock.
            ManifestError: the shard is not committed, or the row count changes.
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
            shard_dir = self._dir(dataset)
            path = self.shard_path(dataset, index)
            if shard_dir is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path.parent))
            digest = write_parquet(shard_dir, path.name, table)
            entry["sha256"] = digest
            entry["replaced_at"] = utc_now_iso()
            self.write_manifest(manifest)
            return ShardRecord(dataset, index, entry["file"], int(entry["rows"]), int(entry.get("rejects", 0)),
                               digest, entry["committed_at"], path)

    def _append_rejects(self, dataset: str, index: int, rejects: list[dict[str, Any]]) -> None:
        d = self._dir("_rejects", create=True)
        assert d is not None
        append_rejects(d, f"{dataset}.jsonl", index, rejects)

    def read_rejects(self, dataset: str) -> list[dict[str, Any]]:
        """The dataset's reject records (torn lines skipped)."""
        return read_rejects(self._dir("_rejects"), f"{dataset}.jsonl")

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self, dataset: str) -> dict[str, int]:
        """Undo half-finished commits of ``dataset`` (see the module docstring). Needs the lock.

        Returns counts of what was cleaned: temp_files, orphan_shards, stale_journals, stale_rejects.

        Raises:
            ShardsError: this process does not hold the lock.
            ManifestError: the manifest is unreadable.
        """
        self._require_lock()
        self.check_dirs(dataset)
        shard_dir, rejects_dir = self._dir(dataset), self._dir("_rejects")
        journal_dir = self._dir("_journal", dataset)
        temp_files = remove_temp_files((self.root, shard_dir, rejects_dir, journal_dir))
        committed = self.committed_indices(dataset)
        return {
            "temp_files": temp_files,
            "orphan_shards": remove_orphan_shards(shard_dir, committed),
            "stale_journals": remove_stale_journals(journal_dir, committed),
            "stale_rejects": prune_rejects(rejects_dir, f"{dataset}.jsonl", committed),
        }

    def check_dirs(self, dataset: str) -> None:
        """Check the directories a run of ``dataset`` writes and cleans: ``OUT/<dataset>``, ``OUT/_rejects``,
        ``OUT/_journal`` and ``OUT/_journal/<dataset>`` (absent, or real directories of this user).

        Raises:
            ValueError: a bad dataset name.
            UnsafeFile: one is a symlink, not a directory, or another user's (names it).
        """
        self.check_dataset_name(dataset)
        for parts in ((dataset,), ("_rejects",), ("_journal", dataset)):
            self._dir(*parts)

    # -- integrity ---------------------------------------------------------------------------------

    def damaged_shards(self, dataset: str | None = None) -> list[ShardDamage]:
        """Committed shards (of ``dataset``, or all) whose file is missing or fails its sha256.

        Raises:
            ManifestError: the manifest is unreadable.
        """
        return list(find_damage(self.read_manifest(), self.path, self._dir, dataset))

    def check_intact(self, dataset: str | None = None) -> None:
        """Check every committed shard (of ``dataset``, or all) against the manifest.

        Raises:
            DamagedShards: a shard file is missing or changed (names each, and ``datagen repair``).
            ManifestError: the manifest is unreadable.
        """
        damage = self.damaged_shards(dataset)
        if damage:
            raise DamagedShards(self.path, damage)

    def repair(self, *, dry_run: bool = False) -> list[ShardDamage]:
        """Un-commit every damaged shard, so the next run generates exactly those again.

        Under the output's lock (taken for the call unless held): the manifest drops the shards in
        one atomic replace, then their files and reject lines are removed as for any uncommitted
        shard. Returns the damage found (with ``dry_run``, changes nothing).

        Raises:
            OutputLocked: another run holds the output.
            ManifestError: there is no manifest or it is unreadable.
            OSError: a file cannot be written (the manifest is replaced whole or not at all).
        """
        with self.ensure_locked({"command": "datagen repair"}):
            manifest = self._manifest_or_raise()
            damage = list(find_damage(manifest, self.path, self._dir))
            if damage and not dry_run:
                touched = uncommit(manifest, damage)
                self.write_manifest(manifest)
                for dataset in sorted(touched):
                    self.recover(dataset)
            return damage

    def journal_problems(self, dataset: str) -> list[str]:
        """``<journal> line N: why`` for each line of ``dataset``'s open journals that is JSON but not a
        record (``Journal.read`` skips them: their rows are generated again)."""
        problems = []
        for index in self.open_journals(dataset):
            path = self.journal_path(dataset, index)
            problems += [f"{path} {line}" for line in self.read_journal(dataset, index).bad_lines]
        return problems

    def open_journals(self, dataset: str) -> list[int]:
        """Indices of shards of ``dataset`` that have a journal (open, uncommitted)."""
        return journal_indices(self._dir("_journal", dataset))
