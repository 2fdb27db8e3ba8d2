"""Export committed output as training JSONL (sharegpt, openai-messages, specforge), and re-derive
reasoning/content from the stored raw text without a server (resplit). Both read only shards whose
bytes match the manifest's sha256; shards of an older datagen are read with the defaults of the
columns added since (``tasks.schema.conform``).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.errors import DatagenError
from tasks.prompts import opens_think
from tasks.reasoning import PARSERS, split_reasoning, tags_for
from tasks.schema import ADDED_DEFAULTS, conform
from tasks.shards import OutputDir, ShardRecord

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportReport",
    "ResplitReport",
    "assistant_text",
    "check_export_target",
    "export",
    "missing_shards",
    "resplit",
]

FORMATS = ("sharegpt", "openai-messages", "specforge")
_SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
_EXPORT_COLUMNS = ["id", "messages", "prompt", "reasoning", "content", "finish_reason", "reasoning_parser",
                   "sample", "turns"]
_BATCH_ROWS = 1024


class ExportError(DatagenError):
    """The output cannot be read for export/resplit (message names the path and shard)."""


@dataclass
class ExportReport:
    rows: int = 0
    skipped_truncated: int = 0
    shards: int = 0
    incomplete: list[str] = field(default_factory=list)  # "<dataset>: 1 of 15 shards committed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ResplitReport:
    parser: str
    shards: int = 0
    shards_rewritten: int = 0
    rows: int = 0
    rows_changed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def assistant_text(reasoning: str | None, content: str, parser: str | None) -> str:
    """The assistant turn as the model family writes it, reasoning and content stripped at the ends.

    ``<think>\n{r}\n</think>\n\n{c}`` for the ``<think>`` families (how Qwen3's template renders past
    reasoning turns), ``{start}{r}{end}{c}`` for other tag families (kimi, mistral), the Harmony
    analysis and final channels for gpt-oss, and the content alone without reasoning or parser.

    Args:
        reasoning: the row's reasoning, None when it has none.
        content: the row's content.
        parser: the row's reasoning parser, None when the run had none.

    Raises:
        ValueError: unknown parser.
    """
    content = content.strip()
    if reasoning is None or parser is None:
        return content
    reasoning = reasoning.strip()
    if parser == "gpt-oss":
        return (
            f"<|channel|>analysis<|message|>{reasoning}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{content}"
        )
    start, end = tags_for(parser)
    if start == "<think>":
        return f"<think>\n{reasoning}\n</think>\n\n{content}"
    return f"{start}{reasoning}{end}{content}"


def _verified_shard(out: OutputDir, rec: ShardRecord) -> bytes:
    try:
        data = out.read_shard(rec)
    except FileNotFoundError as exc:
        raise ExportError(f"{out.path}: committed shard {rec.file} is missing") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != rec.sha256:
        raise ExportError(
            f"{out.path}: shard {rec.file} does not match the manifest (sha256 {digest[:12]}..., "
            f"manifest {rec.sha256[:12]}...); run `datagen validate` on it"
        )
    return data


def check_export_target(out_dir: str | Path, target: str | Path) -> None:
    """Refuse an export file inside the output it reads: it could replace a committed shard or the manifest.

    Raises:
        ExportError: ``target`` (symlinks resolved) lies inside ``out_dir``.
    """
    out, dest = Path(out_dir).resolve(), Path(target).resolve()
    if dest == out or out in dest.parents:
        raise ExportError(f"--out {target}: inside the output directory {out_dir}, where it could overwrite "
                          "committed data; write the export outside it")


def missing_shards(out_dir: str | Path, datasets: list[str] | None = None) -> list[str]:
    """Datasets of an output whose shards are not all committed, as ``"<dataset>: K of N shards committed"``
    (``N`` is ``?`` while the input's length is not known yet). Empty for a complete output."""
    manifest = OutputDir(out_dir).read_manifest() or {}
    committed: dict[str, int] = {}
    for rec in OutputDir(out_dir).committed_shards():
        committed[rec.dataset] = committed.get(rec.dataset, 0) + 1
    problems = []
    for name, entry in sorted((manifest.get("datasets") or {}).items()):
        if datasets and name not in datasets:
            continue
        total = entry.get("num_shards")
        if total is None or committed.get(name, 0) < int(total):
            problems.append(f"{name}: {committed.get(name, 0)} of {total if total is not None else '?'} shards committed")
    return problems


def _shards(out: OutputDir, datasets: list[str] | None) -> list[ShardRecord]:
    if out.read_manifest() is None:
        raise ExportError(f"{out.path}: no _manifest.json (not a datagen output, or nothing committed)")
    recs = list(out.committed_shards())
    if datasets:
        known = {r.dataset for r in recs}
        unknown = [d for d in datasets if d not in known]
        if unknown:
            raise ExportError(f"{out.path}: no committed shards for dataset(s) {', '.join(unknown)}")
        recs = [r for r in recs if r.dataset in datasets]
    return recs


def _record(row: dict[str, Any], fmt: str, with_sample: bool = False) -> dict[str, Any]:
    messages = [dict(m) for m in row["messages"] or []]
    if not messages:
        messages = [{"role": "user", "content": row["prompt"]}]
    parser = row["reasoning_parser"]
    # Earlier assistant turns the model generated (regenerate="all") carry their own reasoning.
    generated = {int(t["message_index"]): t for t in row.get("turns") or []}
    head: dict[str, Any] = {"id": row["id"], "sample": row["sample"]} if with_sample else {"id": row["id"]}
    if fmt == "sharegpt":
        turns = []
        for i, m in enumerate(messages):
            t = generated.get(i)
            value = assistant_text(t["reasoning"], t["content"], parser) if t is not None else m["content"]
            turns.append({"from": _SHAREGPT_FROM.get(m["role"], m["role"]), "value": value})
        turns.append({"from": "gpt", "value": assistant_text(row["reasoning"], row["content"], parser)})
        return {**head, "conversations": turns}
    always_reasoning = fmt == "openai-messages"  # null without reasoning; specforge leaves it out
    out = [_answer(generated[i]["reasoning"], generated[i]["content"], always_reasoning) if i in generated else m
           for i, m in enumerate(messages)]
    out.append(_answer(row["reasoning"], row["content"], always_reasoning))
    return {**head, "messages" if fmt == "openai-messages" else "conversations": out}


def _answer(reasoning: str | None, content: str, always_reasoning: bool) -> dict[str, Any]:
    answer: dict[str, Any] = {"role": "assistant", "content": content.strip()}
    stripped = reasoning.strip() if reasoning is not None else None
    if always_reasoning or stripped is not None:
        answer["reasoning_content"] = stripped
    return answer


def _several_samples(out: OutputDir, dataset: str) -> bool:
    entry = ((out.read_manifest() or {}).get("datasets") or {}).get(dataset) or {}
    gen = entry.get("generation")
    return isinstance(gen, dict) and int(gen.get("samples") or 1) > 1


def iter_export(
    out_dir: str | Path, fmt: str, *, datasets: list[str] | None = None, include_truncated: bool = False,
    report: ExportReport | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield export records of every committed shard (dataset, then shard order).

    ``sharegpt``: ``{"id", "conversations": [{"from", "value"}]}``, the last ``gpt`` turn from
    :func:`assistant_text`. ``openai-messages``: ``{"id", "messages": [..., {"role": "assistant",
    "content", "reasoning_content"}]}`` (null without reasoning). ``specforge``: ``{"id",
    "conversations": [{"role", "content"}, ...]}``, ``reasoning_content`` left out without reasoning,
    as SpecForge's ``regenerate_train_data.py --reasoning save`` writes it. A row with a pre-rendered
    prompt and no messages exports the prompt as its user turn. A row of a conversation regenerated
    whole (``turns``) exports every assistant turn the model generated with its own reasoning, in
    the same form as the last. Records of a dataset generated with several samples per prompt carry
    ``"sample"`` after ``"id"`` (the id repeats once per sample).

    Args:
        out_dir: the output directory.
        fmt: one of ``FORMATS``.
        datasets: only these datasets (default: all).
        include_truncated: also rows whose ``finish_reason`` is not ``stop``.
        report: counts are added here as records are yielded.

    Raises:
        ValueError: unknown format.
        ExportError: no manifest, unknown dataset, a shard missing or not matching its checksum.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    out = OutputDir(out_dir)
    report = report if report is not None else ExportReport()
    several: dict[str, bool] = {}
    for rec in _shards(out, datasets):
        pf = pq.ParquetFile(io.BytesIO(_verified_shard(out, rec)))
        report.shards += 1
        if rec.dataset not in several:
            several[rec.dataset] = _several_samples(out, rec.dataset)
        columns = [c for c in _EXPORT_COLUMNS if c in pf.schema_arrow.names]  # older shards lack some
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            for row in batch.to_pylist():
                if row["finish_reason"] != "stop" and not include_truncated:
                    report.skipped_truncated += 1
                    continue
                report.rows += 1
                yield _record({**ADDED_DEFAULTS, **row}, fmt, several[rec.dataset])


def export(
    out_dir: str | Path, fmt: str, sink: IO[str], *, datasets: list[str] | None = None,
    include_truncated: bool = False, allow_incomplete: bool = False,
) -> ExportReport:
    """Write the export JSONL to ``sink`` (a text stream); returns the counts.

    Args:
        out_dir, fmt, datasets, include_truncated: as :func:`iter_export`.
        sink: where the JSON lines go.
        allow_incomplete: export the committed shards of an output whose run has not finished (the
            report lists what is missing); otherwise such an output is refused before anything is written.

    Raises:
        ValueError, ExportError: as :func:`iter_export`; ExportError for an incomplete output.
    """
    report = ExportReport(incomplete=missing_shards(out_dir, datasets) if fmt in FORMATS else [])
    if report.incomplete and not allow_incomplete:
        raise ExportError(f"{out_dir}: output incomplete ({'; '.join(report.incomplete)}); finish the run "
                          "(datagen run) or pass --allow-incomplete to export what is committed")
    for record in iter_export(out_dir, fmt, datasets=datasets, include_truncated=include_truncated, report=report):
        sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    return report


def resplit(out_dir: str | Path, parser: str, *, dry_run: bool = False) -> ResplitReport:
    """Recompute ``reasoning``/``content`` from ``raw`` with ``parser`` for every committed shard.

    The prompt opened the think block when the row's ``think_in_prompt`` says so or its prompt ends
    with ``parser``'s start tag (the column was computed with the run's parser, which may have been
    another one or none); that is the split's ``force_reasoning`` and is written back, with
    ``reasoning_parser``. Shards whose columns do not change are left alone. Holds the output's lock;
    a changed shard is replaced atomically and the manifest's sha256 updated.

    Args:
        out_dir: the output directory.
        parser: the reasoning parser to split with.
        dry_run: count what would change, write nothing.

    Raises:
        ValueError: unknown parser.
        ExportError: no manifest, a shard missing or not matching its checksum.
        tasks.shards.OutputLocked: a run is writing this output.
    """
    if parser.lower() not in PARSERS:
        tags_for(parser)  # raises ValueError naming the valid parsers
    parser = parser.lower()
    out = OutputDir(out_dir)
    report = ResplitReport(parser=parser)
    with out.lock({"command": f"datagen resplit --parser {parser}"}):
        records = _shards(out, None)
        for rec in records:  # every shard checked before any is rewritten: all or nothing
            _verified_shard(out, rec)
        for rec in records:
            table = conform(pq.read_table(io.BytesIO(_verified_shard(out, rec))))
            report.shards += 1
            report.rows += table.num_rows
            new_table, changed = _resplit_table(table, parser)
            report.rows_changed += changed
            unchanged_meta = all(v == parser for v in table.column("reasoning_parser").to_pylist())
            if changed == 0 and unchanged_meta:
                continue
            report.shards_rewritten += 1
            if not dry_run:
                out.replace_shard(rec.dataset, rec.index, new_table)
    return report


def _resplit_table(table: pa.Table, parser: str) -> tuple[pa.Table, int]:
    raws = table.column("raw").to_pylist()
    prompts = table.column("prompt").to_pylist()
    flags = table.column("think_in_prompt").to_pylist()
    old_r = table.column("reasoning").to_pylist()
    old_c = table.column("content").to_pylist()
    reasoning: list[str | None] = []
    content: list[str] = []
    forced: list[bool] = []
    changed = 0
    for i, raw in enumerate(raws):
        force = bool(flags[i]) or opens_think(prompts[i], parser)
        r, c = split_reasoning(raw, parser, force)
        reasoning.append(r)
        content.append(c)
        forced.append(force)
        changed += (r, c) != (old_r[i], old_c[i])
    schema = table.schema
    for name, values in (
        ("reasoning", reasoning),
        ("content", content),
        ("think_in_prompt", forced),
        ("reasoning_parser", [parser] * len(raws)),
    ):
        idx = schema.get_field_index(name)
        table = table.set_column(idx, schema.field(idx), pa.array(values, type=schema.field(idx).type))
    return table, changed
