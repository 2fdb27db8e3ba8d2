"""The output walk: the manifest, each committed shard, each dataset's totals, ``_validation.json``."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.files import UnsafeFile, json_bytes
from tasks.schema import conform
from tasks.shards import ManifestError, OutputDir
from tasks.validation._checks import judge_all, measure_all
from tasks.validation._checks_structure import judge_provenance, judge_unique
from tasks.validation._errors import BadOutput
from tasks.validation._results import (
    REPORT_NAME,
    Check,
    Context,
    DatasetValidation,
    ShardValidation,
    ValidationReport,
)
from tasks.validation._stats import (
    RATE_SETTINGS,
    Stats,
    duplicates,
    merge,
    needs,
    ranges,
    row_keys,
    setting_note,
    short,
)
from tasks.validation._thresholds import Thresholds

MANIFEST_NAME = "_manifest.json"


# ------------------------------------------------------------------------------------ output layout
def load_manifest(out: OutputDir) -> dict[str, Any]:
    """The parsed ``_manifest.json`` of the output ``out`` (held open for the validation's reads).

    Raises:
        BadOutput: the output is missing, has no manifest, or the manifest is unreadable or malformed.
    """
    out_dir = out.path
    try:
        if out.open_root() is None:
            raise BadOutput(f"{out_dir}: no such directory")
    except OSError as exc:  # a file where the output should be
        raise BadOutput(f"{out_dir}: not a directory ({exc})") from exc
    try:  # the same checks as every command's: dataset names and shard files that stay inside OUT
        manifest = out.read_manifest()
    except ManifestError as exc:
        raise BadOutput(str(exc)) from exc
    if manifest is None:
        raise BadOutput(f"{out_dir}: not a datagen output (no {MANIFEST_NAME})")
    return manifest


def _dataset_entry(manifest: Mapping[str, Any], dataset: str, out_dir: Path) -> dict[str, Any]:
    entry = manifest["datasets"].get(dataset)
    if not isinstance(entry, dict):
        raise BadOutput(f"{out_dir}: dataset {dataset!r} not in the manifest "
                        f"(has {', '.join(manifest['datasets']) or 'none'})")
    return entry


def _shard_file(out_dir: Path, info: Mapping[str, Any]) -> Path:
    """The shard's path, for messages (``info["file"]`` is checked by load_manifest: exactly
    ``<dataset>/shard-NNNNN.parquet``; the file is read through the output's handles)."""
    return out_dir / info["file"]


def _samples_of(entry: Mapping[str, Any]) -> int:
    """Rows per input record of a dataset (1 for an output that does not record it)."""
    gen = entry.get("generation")
    n = gen.get("samples") if isinstance(gen, dict) else None
    return n if isinstance(n, int) and n >= 1 else 1


def _slice_size(manifest: Mapping[str, Any], entry: Mapping[str, Any], index: int) -> int | None:
    """Rows + rejects shard ``index`` holds: its slice's records times the samples per record."""
    size = manifest.get("shard_size")
    total = entry.get("total_rows")
    if not isinstance(size, int) or not isinstance(total, int):
        return None
    return max(0, min(size, total - index * size)) * _samples_of(entry)


def write_json(out: OutputDir, name: str, doc: Mapping[str, Any]) -> None:
    """Replace file ``name`` of the output atomically (through its handle) with ``doc`` as JSON."""
    out.write_file(name, json_bytes(doc, indent=2, default=str, newline=True))


# ----------------------------------------------------------------------------------------- shards
def _complete_check(rows: int, info: Mapping[str, Any], expected: int | None, shard_size: Any,
                    file_hash_ok: bool | None, ctx: Context, samples: int = 1) -> Check:
    rejects = int(info.get("rejects") or 0)
    problems = []
    if isinstance(info.get("rows"), int) and info["rows"] != rows:
        problems.append(f"manifest says {info['rows']} rows, the file holds {rows}")
    if file_hash_ok is False:
        problems.append("the file's sha256 differs from the manifest (changed after commit)")
    if expected is None and isinstance(shard_size, int) and rows + rejects >= shard_size * samples:
        # Input not read to the end yet (total_rows unknown): a full slice is still provably complete.
        expected = shard_size * samples
    missing = None if expected is None else expected - rows - rejects
    if missing:
        word = "missing from" if missing > 0 else "too many in"
        per = f" ({samples} samples per record)" if samples > 1 else ""
        problems.insert(0, f"{abs(missing)} input rows {word} {ctx.label}: {rows} rows + {rejects} rejects, "
                           f"the slice holds {expected}{per}")
    if problems:
        advice = ("; the shard was committed incomplete or edited: rerun it (the journal resumes by id)"
                  if file_hash_ok is not False else
                  f"; run `datagen repair {ctx.out_dir}` to un-commit it: the next run generates it again")
        return Check("complete", "fail", missing or 0, 0, "; ".join(problems) + advice, abs(missing or 0), rows)
    if expected is None:
        return Check("complete", "unknown", None, None,
                     f"cannot check yet: {rows} rows + {rejects} rejects, a short slice, and the manifest does "
                     f"not know the input's total_rows", 0, rows)
    return Check("complete", "pass", 0, 0, f"{rows} rows + {rejects} rejects = slice of {expected}", 0, rows)


_SAMPLE_COLUMNS = ("id", "finish_reason", "reasoning", "content")


def _samples(table: pa.Table, ctx: Context, k: int = 3, width: int = 160) -> list[dict[str, Any]]:
    cols = [c for c in _SAMPLE_COLUMNS if c in table.column_names]
    rows = table.select(cols).slice(0, k).to_pylist()
    out = []
    for row in rows:
        trimmed = {c: (short(v.replace("\n", " "), width) if isinstance(v, str) else v) for c, v in row.items()}
        out.append({"dataset": ctx.dataset, "shard": ctx.shard_index, **trimmed})
    return out


def _validate_shard(out: OutputDir, manifest: Mapping[str, Any], dataset: str, index: int,
                    thr: Thresholds, *, with_samples: bool = False
                    ) -> tuple[ShardValidation, pa.ChunkedArray | None]:
    """The shard's validation, and its row keys for the dataset's cross-shard duplicate check."""
    out_dir = out.path
    entry = _dataset_entry(manifest, dataset, out_dir)
    info = (entry.get("shards") or {}).get(str(index))
    if not isinstance(info, dict):
        raise BadOutput(f"{out_dir}: shard {index} of {dataset!r} is not committed in the manifest")
    path = _shard_file(out_dir, info)
    ctx = Context(dataset=dataset, shard_index=index, out_dir=str(out_dir))
    try:
        data = out.read_shard(info["file"])
        table = conform(pq.read_table(pa.BufferReader(data)))  # a shard of an older datagen: one sample, last turn
    except UnsafeFile:
        raise  # a link planted in OUT says nothing about the data: refused as such (exit 2), not judged
    except (OSError, pa.ArrowException) as exc:
        check = Check("schema", "fail", None, None, f"{ctx.label}: cannot read {path}: {exc}; run "
                      f"`datagen repair {out_dir}` to un-commit it: the next run generates it again")
        return ShardValidation(dataset, index, str(path), 0, [check]), None
    stats = measure_all(table, ctx, thr)
    checks = judge_all(stats, ctx, thr)
    hash_ok = None
    if isinstance(info.get("sha256"), str):
        hash_ok = hashlib.sha256(data).hexdigest() == info["sha256"]
    checks.insert(1, _complete_check(table.num_rows, info, _slice_size(manifest, entry, index),
                                     manifest.get("shard_size"), hash_ok, ctx, _samples_of(entry)))
    result = ShardValidation(dataset, index, str(path), table.num_rows, checks, stats=stats)
    if with_samples:
        result.samples = _samples(table, ctx)
    return result, (row_keys(table) if needs(table, "id", "sample") is None else None)


def judged_with_dataset(check: Check, thr: Thresholds) -> Check:
    """A small shard's rate check is judged with its dataset, not alone: a shard of fewer than
    ``min_rows_for_rate`` rows (the last of a dataset, or one mostly rejected) fails no rate check; its
    finding warns, and the dataset's totals (the final validation) decide."""
    if check.name not in RATE_SETTINGS or check.status != "fail" or check.rows >= thr.min_rows_for_rate:
        return check
    # the failure's own ending (its setting and how to accept) gives way to why it only warns
    base = check.message.removesuffix(setting_note(check.name, "fail", check.count, check.rows, thr))
    return dataclasses.replace(check, status="warn", message=(
        f"{base}; a shard of {check.rows} rows (under min_rows_for_rate {thr.min_rows_for_rate}) is judged "
        f"with its dataset, not alone"))


def validate_shard(out_dir: str | os.PathLike[str], dataset: str, shard_index: int,
                   thresholds: Thresholds | None = None) -> ShardValidation:
    """Validate one committed shard (row checks plus ``complete`` against the manifest).

    Args:
        out_dir: the output directory.
        dataset: the shard's dataset.
        shard_index: the shard's index in its dataset.
        thresholds: limits of the checks (default: ``Thresholds()``).

    Raises:
        BadOutput: ``out_dir`` is not an output, or the dataset/shard is not in its manifest.
    """
    held = OutputDir(out_dir)
    result, _ids = _validate_shard(held, load_manifest(held), dataset, shard_index, thresholds or Thresholds())
    return result


# --------------------------------------------------------------------------------------- datasets
def _dataset_complete(name: str, entry: Mapping[str, Any], shards: list[ShardValidation]) -> Check:
    """Every shard committed, rows + rejects = input rows, no shard incomplete. An unknown total
    (``num_shards`` missing: the input was never read to the end) fails: this is final validation."""
    num_shards = entry.get("num_shards")
    total_rows = entry.get("total_rows")
    committed = len(shards)
    rows = sum(s.rows for s in shards)
    rejects = sum(int(((entry.get("shards") or {}).get(str(s.shard_index)) or {}).get("rejects") or 0)
                  for s in shards)
    problems = []
    if isinstance(num_shards, int) and committed < num_shards:
        pending = sorted(set(range(num_shards)) - {s.shard_index for s in shards})
        problems.append(f"{num_shards - committed} of {num_shards} shards of {name} not committed "
                        f"(shards {ranges(pending[:20])}); finish the run (`datagen run` resumes)")
    samples = _samples_of(entry)
    if isinstance(total_rows, int) and committed == num_shards and rows + rejects != total_rows * samples:
        per = f" x {samples} samples" if samples > 1 else ""
        problems.append(f"{rows} rows + {rejects} rejects in {name}, the input has {total_rows}{per}")
    bad_shards = [s.shard_index for s in shards if any(c.name == "complete" and c.status == "fail" for c in s.checks)]
    if bad_shards:
        problems.append(f"shards {ranges(bad_shards)} incomplete")
    if problems:
        return Check("complete", "fail", committed, num_shards, "; ".join(problems), committed, rows)
    if not isinstance(num_shards, int):
        # Final validation: an input never read to the end may hold any number of rows more, so the
        # output is not known complete and must not pass (gate_shard, mid-run, judges shards only).
        return Check("complete", "fail", committed, None,
                     f"{name}: the input's size is unknown (the manifest lacks num_shards: the run never "
                     f"read the input to the end); {committed} shard(s), {rows} rows + {rejects} rejects "
                     f"committed so far; finish the run (`datagen run` resumes)", committed, rows)
    return Check("complete", "pass", committed, num_shards,
                 f"{committed} of {num_shards} shards, {rows} rows + {rejects} rejects", committed, rows)


def _volume_check(name: str, entry: Mapping[str, Any], shards: list[ShardValidation], thr: Thresholds) -> Check:
    """Enough rows, and not too many input rows rejected: an empty input, a file of blank lines or an
    input whose every row was rejected (a wrong schema) is a failed run, not a passing empty one."""
    rows = sum(s.rows for s in shards)
    rejects = sum(int(((entry.get("shards") or {}).get(str(s.shard_index)) or {}).get("rejects") or 0)
                  for s in shards)
    seen = rows + rejects
    rate = rejects / seen if seen else 0.0
    where = f"{name}: {rows} rows, {rejects} input rows rejected"
    if rows < thr.min_rows:
        return Check("volume", "fail", rows, thr.min_rows,
                     f"{where}, below min_rows {thr.min_rows}; check the input (an empty file, or rows "
                     f"without messages/prompt: see _rejects/{name}.jsonl for the reasons)", rejects, seen)
    if rate > thr.reject_max_rate:
        return Check("volume", "fail", rate, thr.reject_max_rate,
                     f"{where} ({rate:.1%}), above reject_max_rate {thr.reject_max_rate:.1%}; the reasons are "
                     f"in _rejects/{name}.jsonl", rejects, seen)
    if rate > thr.reject_warn_rate:
        return Check("volume", "warn", rate, thr.reject_warn_rate,
                     f"{where} ({rate:.1%}), above reject_warn_rate {thr.reject_warn_rate:.1%}", rejects, seen)
    return Check("volume", "pass", rate, thr.reject_max_rate, f"{where} ({rate:.1%})", rejects, seen)


def _dataset_totals(name: str, entry: Mapping[str, Any], shards: list[ShardValidation],
                    ids: list[pa.ChunkedArray], thr: Thresholds, out_dir: Path) -> list[Check]:
    ctx = Context(dataset=name, out_dir=str(out_dir))
    merged: dict[str, Stats] = {}
    for s in shards:
        for key, st in s.stats.items():
            merged[key] = merge(merged[key], st) if key in merged else st
    checks = judge_all(merged, ctx, thr) if merged else []
    # Duplicates across shards: judged on all ids together, not on summed per-shard counts.
    if ids:
        extra, examples = duplicates(pa.chunked_array([c for a in ids for c in a.chunks], type=pa.string()))
        stats = {"rows": sum(len(a) for a in ids), "duplicates": extra, "examples": examples}
        checks = [judge_unique(stats, ctx, thr) if c.name == "unique_ids" else c for c in checks]
    checks.insert(1 if checks else 0, _dataset_complete(name, entry, shards))
    checks.insert(2 if len(checks) > 1 else 1, _volume_check(name, entry, shards, thr))
    return checks


def validate_output(out_dir: str | os.PathLike[str], thresholds: Thresholds | None = None,
                    *, write: bool = True) -> ValidationReport:
    """Validate every committed shard and each dataset as a whole; write ``OUT/_validation.json``.

    Args:
        out_dir: the output directory.
        thresholds: limits of the checks (default: ``Thresholds()``).
        write: write the report to ``OUT/_validation.json``.

    Raises:
        BadOutput: ``out_dir`` is missing or not a datagen output.
    """
    started = time.perf_counter()
    held = OutputDir(out_dir)
    out = held.path
    thr = thresholds or Thresholds()
    manifest = load_manifest(held)
    datasets: list[DatasetValidation] = []
    samples: list[dict[str, Any]] = []
    provenance: Stats = {}
    for name in sorted(manifest["datasets"]):
        entry = _dataset_entry(manifest, name, out)
        shards: list[ShardValidation] = []
        ids: list[pa.ChunkedArray] = []
        for key in sorted((entry.get("shards") or {}), key=int):
            result, idcol = _validate_shard(held, manifest, name, int(key), thr, with_samples=not shards)
            result.checks = [judged_with_dataset(c, thr) for c in result.checks]  # the totals below decide
            if idcol is not None:
                ids.append(idcol)
            samples.extend(result.samples)
            shards.append(result)
        checks = _dataset_totals(name, entry, shards, ids, thr, out)
        for s in shards:
            prov = s.stats.get("provenance")
            if prov is not None and not prov.get("unknown"):
                provenance = merge(provenance, prov) if provenance else prov
            s.stats = {}  # the totals are judged; free the per-shard counts
        datasets.append(DatasetValidation(name, sum(s.rows for s in shards), shards, checks))
    if len(datasets) > 1 and provenance:
        _judge_output_provenance(datasets, provenance, thr, out)
    report = ValidationReport(str(out), datasets, thr, samples=samples)
    report.elapsed_s = time.perf_counter() - started
    if write:
        write_report(out, report)
    return report


def _judge_output_provenance(datasets: list[DatasetValidation], stats: Stats, thr: Thresholds,
                             out: Path) -> None:
    """One model revision and chat template across the output's datasets: a mix across datasets
    replaces the passing ``provenance`` total of every dataset with the output-wide check."""
    ctx = Context(dataset="*", out_dir=str(out), rows_label=f"the datasets of {out}")
    check = judge_provenance(stats, ctx, thr)
    if check.status == "pass":
        return
    for d in datasets:
        d.checks = [check if c.name == "provenance" and c.status == "pass" else c for c in d.checks]


def write_report(out_dir: str | os.PathLike[str], report: ValidationReport) -> Path:
    """Write ``report`` to ``OUT/_validation.json`` atomically; returns the path.

    Raises:
        OSError: the file cannot be written (``UnsafeFile`` for a planted link or foreign file).
    """
    write_json(OutputDir(out_dir), REPORT_NAME, report.to_dict())
    return Path(out_dir) / REPORT_NAME
