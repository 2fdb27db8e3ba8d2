"""The manifest (``OUT/_manifest.json``): shard size, inputs and committed shards of an output.

Keys the validator may rely on: ``shard_size``, ``datasets.<name>.{input, input_fingerprint,
total_rows, num_shards, complete, shards.<k>.{file, rows, rejects, sha256, committed_at}}``.

These functions read and edit the manifest as a dict; ``tasks.shards.OutputDir`` decides when to
write it (under the lock) and in which order relative to the shard files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tasks.files import Dir
from tasks.shards._errors import InputChanged, ManifestError
from tasks.shards._fs import check_dataset_name, shard_file_name, utc_now_iso

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_VERSION",
    "CommittedShard",
    "ShardRecord",
    "add_shard",
    "bind_dataset",
    "check_manifest",
    "check_shard_size",
    "committed_indices",
    "iter_shard_records",
    "new_manifest",
    "read_manifest",
    "set_totals",
    "write_manifest",
]

MANIFEST_VERSION = 1
MANIFEST_FILE = "_manifest.json"


@dataclass(frozen=True)
class ShardRecord:
    """A committed shard, as the manifest records it (``file`` is ``<dataset>/shard-NNNNN.parquet``,
    relative to the output dir; ``path`` names it in messages, it is never opened by that name)."""

    dataset: str
    index: int
    file: str
    rows: int
    rejects: int
    sha256: str
    committed_at: str
    path: Path = field(compare=False)

    @property
    def name(self) -> str:
        """The file's name in its dataset's directory."""
        return self.file.rsplit("/", 1)[-1]

    def to_manifest(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "rejects": self.rejects,
            "sha256": self.sha256,
            "committed_at": self.committed_at,
        }


CommittedShard = ShardRecord


def read_manifest(root: Dir | None, path: Path) -> dict[str, Any] | None:
    """The manifest in the output ``root`` (``path`` names it), checked (``check_manifest``), or None when
    there is none yet (or no output).

    Raises:
        ManifestError: the file is unreadable or not a manifest (names the file and the key).
        UnsafeFile: it is a symlink or not a regular file.
    """
    if root is None:
        return None
    try:
        data = root.read(MANIFEST_FILE)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest: {exc.strerror or exc}") from exc
    try:
        manifest = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}; {_DAMAGED}") from exc
    check_manifest(path, manifest)
    return manifest


_DAMAGED = ("the manifest is damaged: restore it from a copy, or move it aside and rerun with the same "
            "input and --shard-size (each shard file that proves to be its input slice is recorded again)")
_SHA256 = frozenset("0123456789abcdef")


def _count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_manifest(path: Path, manifest: Any) -> None:
    """Check that ``manifest`` (parsed from ``path``) is one this package can trust.

    Dataset names obey the same rule as a partition's (``check_dataset_name``), a shard's key is its
    index and its ``file`` is exactly ``<dataset>/shard-NNNNN.parquet`` (never a path outside the
    output), and every field read later has its type: so no command reads, deletes or counts through
    a damaged or hostile manifest.

    Raises:
        ManifestError: ``<path>: <key>: <problem>; <what to do>``, for the first problem found.
    """
    def bad(key: str, problem: str) -> ManifestError:
        return ManifestError(f"{path}: {key}: {problem}; {_DAMAGED}")

    if not isinstance(manifest, dict):
        raise bad("(top level)", "not a JSON object")
    if "shard_size" not in manifest:
        raise bad("shard_size", "missing")
    if not _count(manifest["shard_size"], 1):
        raise bad("shard_size", f"{manifest['shard_size']!r} is not a whole number >= 1")
    datasets = manifest.setdefault("datasets", {})
    if not isinstance(datasets, dict):
        raise bad("datasets", "not a table of datasets")
    for name, entry in datasets.items():
        try:
            check_dataset_name(name)
        except ValueError as exc:
            raise bad(f"datasets.{name!r}", str(exc)) from None
        _check_dataset(name, entry, bad)


def _check_dataset(name: str, entry: Any, bad: Callable[[str, str], ManifestError]) -> None:
    key = f"datasets.{name}"
    if not isinstance(entry, dict):
        raise bad(key, "not a table")
    for field_, kind in (("input", str), ("input_fingerprint", str)):
        if field_ in entry and not isinstance(entry[field_], kind):
            raise bad(f"{key}.{field_}", f"{entry[field_]!r} is not text")
    for field_ in ("total_rows", "num_shards"):
        if entry.get(field_) is not None and not _count(entry[field_]):
            raise bad(f"{key}.{field_}", f"{entry[field_]!r} is not a whole number >= 0")
    if "complete" in entry and not isinstance(entry["complete"], bool):
        raise bad(f"{key}.complete", f"{entry['complete']!r} is not true or false")
    for field_ in ("sampling", "generation", "attempts"):
        if field_ in entry and not isinstance(entry[field_], dict):
            raise bad(f"{key}.{field_}", "not a table")
    gen = entry.get("generation") or {}
    if "samples" in gen and not _count(gen["samples"], 1):
        raise bad(f"{key}.generation.samples", f"{gen['samples']!r} is not a whole number >= 1")
    shards = entry.setdefault("shards", {})
    if not isinstance(shards, dict):
        raise bad(f"{key}.shards", "not a table of shards")
    for index_key, rec in shards.items():
        _check_shard(name, index_key, rec, f"{key}.shards.{index_key}", bad)


def _check_shard(name: str, index_key: Any, rec: Any, key: str, bad: Callable[[str, str], ManifestError]) -> None:
    if not (isinstance(index_key, str) and index_key.isascii() and index_key.isdigit()
            and str(int(index_key)) == index_key):
        raise bad(key, f"{index_key!r} is not a shard index")
    if not isinstance(rec, dict):
        raise bad(key, "not a table")
    for field_ in ("file", "rows", "sha256", "committed_at"):
        if field_ not in rec:
            raise bad(f"{key}.{field_}", "missing")
    expected = f"{name}/{shard_file_name(int(index_key))}.parquet"
    if rec["file"] != expected:
        raise bad(f"{key}.file", f"{rec['file']!r} is not this shard's file {expected!r}")
    for field_ in ("rows", "rejects"):
        if field_ in rec and not _count(rec[field_]):
            raise bad(f"{key}.{field_}", f"{rec[field_]!r} is not a whole number >= 0")
    digest = rec["sha256"]
    if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256):
        raise bad(f"{key}.sha256", f"{digest!r} is not a sha256 (64 lowercase hex digits)")
    for field_ in ("committed_at", "replaced_at"):
        if field_ in rec and not isinstance(rec[field_], str):
            raise bad(f"{key}.{field_}", f"{rec[field_]!r} is not a timestamp")


def write_manifest(root: Dir, manifest: dict[str, Any]) -> None:
    """Stamp ``updated_at`` and replace the manifest in the output ``root`` atomically.

    Raises:
        OSError: the manifest cannot be written (the old one stays).
    """
    manifest["updated_at"] = utc_now_iso()
    root.write(MANIFEST_FILE, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))


def new_manifest(shard_size: int) -> dict[str, Any]:
    """An empty manifest for an output written with ``shard_size``."""
    return {"version": MANIFEST_VERSION, "shard_size": shard_size, "created_at": utc_now_iso(),
            "datasets": {}}


def check_shard_size(manifest: dict[str, Any], shard_size: int, out_path: Path) -> None:
    """Check that ``manifest`` was written with ``shard_size``.

    Args:
        manifest: the output's manifest.
        shard_size: the shard size of this run.
        out_path: the output directory (for the message).

    Raises:
        InputChanged: the output was written with another shard size.
    """
    if int(manifest["shard_size"]) != shard_size:
        raise InputChanged(
            f"shard size of {out_path}",
            int(manifest["shard_size"]),
            shard_size,
            f"rerun with --shard-size {manifest['shard_size']} to resume this output, "
            f"or write to a new --out",
        )


def bind_dataset(
    manifest: dict[str, Any], dataset: str, input_path: str, input_fingerprint: str
) -> tuple[dict[str, Any], bool]:
    """The dataset's entry, added when new: ``(entry, added)``.

    Args:
        manifest: the output's manifest (edited in place).
        dataset: the dataset name.
        input_path: the input file, recorded for a new dataset.
        input_fingerprint: the input's fingerprint.

    Raises:
        InputChanged: the dataset was recorded with another input fingerprint.
    """
    entry = manifest["datasets"].get(dataset)
    if entry is None:
        entry = {"input": input_path, "input_fingerprint": input_fingerprint, "total_rows": None,
                 "num_shards": None, "complete": False, "shards": {}}
        manifest["datasets"][dataset] = entry
        return entry, True
    if entry.get("input_fingerprint") != input_fingerprint:
        raise InputChanged(
            f"input of dataset {dataset!r} ({entry.get('input')} -> {input_path}) changed; fingerprint",
            entry.get("input_fingerprint"),
            input_fingerprint,
            "committed shards are fixed slices of the original input: restore that input "
            "to resume, or write the new input to a new --out",
        )
    return entry, False


def set_totals(manifest: dict[str, Any], dataset: str, total_rows: int) -> None:
    """Record the input's record count, the shard count it implies and whether all are committed."""
    entry = manifest["datasets"][dataset]
    size = int(manifest["shard_size"])
    entry["total_rows"] = total_rows
    entry["num_shards"] = (total_rows + size - 1) // size
    entry["complete"] = len(entry["shards"]) >= entry["num_shards"]


def add_shard(manifest: dict[str, Any], record: ShardRecord) -> None:
    """Record a committed shard (and the dataset's completeness, once its shard count is known)."""
    entry = manifest["datasets"][record.dataset]
    entry["shards"][str(record.index)] = record.to_manifest()
    if entry.get("num_shards") is not None:
        entry["complete"] = len(entry["shards"]) >= entry["num_shards"]


def committed_indices(manifest: dict[str, Any] | None, dataset: str) -> set[int]:
    """Indices of the committed shards of ``dataset`` (none without a manifest or entry)."""
    entry = (manifest or {"datasets": {}})["datasets"].get(dataset) or {}
    return {int(k) for k in entry.get("shards", {})}


def iter_shard_records(
    manifest: dict[str, Any] | None, root: Path, dataset: str | None = None
) -> Iterator[ShardRecord]:
    """Every committed shard (of ``dataset``, or of all datasets), in dataset then index order."""
    datasets = (manifest or {"datasets": {}})["datasets"]
    for name in sorted(datasets):
        if dataset is not None and name != dataset:
            continue
        shards = datasets[name].get("shards", {})
        for key in sorted(shards, key=int):
            s = shards[key]
            yield ShardRecord(name, int(key), s["file"], int(s["rows"]), int(s.get("rejects", 0)),
                              s["sha256"], s["committed_at"], root / s["file"])
