"""The resume check: a run continues an output only with the sampling, samples per prompt,
regeneration mode and parser its rows hold.

Rows generated with other sampling parameters, or committed shards split with another reasoning
parser, would mix with this run's rows and fail the final validation after the whole dataset was
generated again. ``check_resume`` refuses such a run before any request. The sampling of a
dataset's rows is recorded in the manifest (``datasets.<name>.sampling``); outputs written before
that key existed are read from their rows. Samples per prompt and the regeneration mode are recorded
as ``datasets.<name>.generation``; an output without that key was written with one sample of the
last turn. The parser is read from the newest committed shard:
``datagen resplit`` rewrites the shards, so they, not a record, say how the output is split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson
import pyarrow.parquet as pq

from tasks.shards import InputChanged, OutputDir

__all__ = ["check_resume"]

_UNSET = "(unset)"
# What an output written before ``generation`` was recorded was generated with.
_OLDER_GENERATION = {"samples": 1, "regenerate": "last"}


def check_resume(out: OutputDir, dataset: str, sampling: Mapping[str, Any], parser: str | None, *,
                 record: bool = False, generation: Mapping[str, Any] | None = None) -> None:
    """Refuse to continue ``dataset`` of ``out`` with other sampling or another reasoning parser.

    A dataset the output does not hold yet, one with no generated rows and a complete one (nothing
    is generated again) pass. Journaled rows of another parser pass too: they are split again with
    this run's parser when their shard commits.

    Args:
        out: the output directory.
        dataset: the dataset name.
        sampling: this run's sampling parameters.
        parser: this run's reasoning parser (None: no split).
        record: write ``sampling`` and ``generation`` into the dataset's manifest entry once the
            check passes (needs the output's lock).
        generation: ``{"samples": N, "regenerate": mode}`` of this run (default: one sample of the
            last turn).

    Raises:
        InputChanged: the sampling, samples, regeneration mode or parser differs from the rows the
            output holds.
        ManifestError: the manifest is unreadable.
    """
    manifest = out.read_manifest()
    entry = (manifest or {"datasets": {}})["datasets"].get(dataset)
    if manifest is None or entry is None or entry.get("complete"):
        return
    wanted = dict(sampling)
    newest = _newest_shard_row(out, dataset)
    journaled = None if newest is not None else _journaled_row(out, dataset)
    held_row = newest if newest is not None else journaled
    if held_row is not None:
        held = entry.get("sampling")
        if not isinstance(held, dict):
            held = orjson.loads(held_row["sampling"])
        _refuse_change(f"sampling of dataset {dataset!r} in {out.path}", held, wanted,
                       lambda keys: f"its rows were generated with {held}: rerun with that [sampling] to resume")
    generation = dict(generation or _OLDER_GENERATION)
    if held_row is not None or entry.get("shards"):
        held_gen = entry.get("generation") if isinstance(entry.get("generation"), dict) else _OLDER_GENERATION
        _refuse_change(f"samples per prompt / regeneration of dataset {dataset!r} in {out.path}", held_gen,
                       generation, lambda keys: (
                           f"its rows were generated with {', '.join(f'{k} = {held_gen.get(k)!r}' for k in keys)}: "
                           f"rerun with {' '.join(f'--{k} {held_gen.get(k)}' for k in keys)} to resume"))
    if newest is not None and newest["reasoning_parser"] != parser:
        raise InputChanged(f"reasoning parser of dataset {dataset!r} in {out.path}", newest["reasoning_parser"],
                           parser, _parser_advice(out, newest["reasoning_parser"], parser))
    if record and (entry.get("sampling") != wanted or entry.get("generation") != generation):
        entry["sampling"] = wanted
        entry["generation"] = generation
        out.write_manifest(manifest)


def _refuse_change(what: str, held: Mapping[str, Any], wanted: Mapping[str, Any],
                   advice: Callable[[list[str]], str]) -> None:
    """Raise ``InputChanged`` naming the keys whose values differ between ``held`` and ``wanted``."""
    if held == wanted:
        return
    keys = sorted(k for k in set(held) | set(wanted) if held.get(k, _UNSET) != wanted.get(k, _UNSET))
    raise InputChanged(what, {k: held.get(k, _UNSET) for k in keys}, {k: wanted.get(k, _UNSET) for k in keys},
                       f"{advice(keys)}, or write to a new --out")


def _parser_advice(out: OutputDir, held: str | None, wanted: str | None) -> str:
    keep = f"--reasoning-parser {held}" if held is not None else "no --reasoning-parser"
    if wanted is None:
        return f"its committed shards were split with {held}: rerun with {keep}"
    return (f"its committed shards were split with {held or 'no parser'}: run `datagen resplit {out.path} "
            f"--parser {wanted}` first (it splits them again from their raw text, without a server), then "
            f"rerun; or rerun with {keep}")


def _newest_shard_row(out: OutputDir, dataset: str) -> dict[str, Any] | None:
    """``sampling`` and ``reasoning_parser`` of the first row of the newest committed shard."""
    records = sorted(out.committed_shards(dataset), key=lambda r: (r.committed_at, r.index))
    for rec in reversed(records):
        if rec.rows:
            with out.shard_reader(rec) as f:
                table = pq.read_table(f, columns=["sampling", "reasoning_parser"]).slice(0, 1)
            return table.to_pylist()[0]
    return None


def _journaled_row(out: OutputDir, dataset: str) -> dict[str, Any] | None:
    """A generated row of an uncommitted shard's journal, if there is one."""
    committed = out.committed_indices(dataset)
    for index in out.open_journals(dataset):
        if index in committed:
            continue
        contents = out.read_journal(dataset, index)
        if contents.rows:
            return next(iter(contents.rows.values()))
    return None
