"""The output's dataset card: ``OUT/README.md`` in Hugging Face dataset-card form.

A YAML header (one config per dataset with its ``data_files`` and ``features``, split sizes, tags)
lets the Hub and ``datasets.load_dataset(OUT, name)`` read the output as it is; the body gives the
counts, the provenance found in the rows, the validation summary and how the output was made.
``write_card`` reads the manifest, a few columns of each committed shard and ``_validation.json``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.files import UnsafeFile
from tasks.schema import COLUMN_DOCS, ROW_SCHEMA
from tasks.shards import OutputDir
from tasks.validation import Check, md_text, measured

__all__ = ["CARD_NAME", "card_text", "hf_features", "write_card"]

CARD_NAME = "README.md"
_SPLIT = "train"
# Columns whose distinct values the card lists (what the rows were made with).
_PROVENANCE = ("model", "model_revision", "engine", "engine_version", "chat_template_hash", "reasoning_parser",
               "sampling", "server", "run_id")
_SCALARS = {pa.string(): "string", pa.int32(): "int32", pa.int64(): "int64", pa.float64(): "float64",
            pa.bool_(): "bool"}


def _dtype(t: pa.DataType) -> str:
    if t in _SCALARS:
        return _SCALARS[t]
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}" + (f", tz={t.tz}]" if t.tz else "]")
    raise ValueError(f"no Hugging Face dtype for {t}")


def hf_features(schema: pa.Schema = ROW_SCHEMA) -> list[dict[str, Any]]:
    """``schema`` as the card's ``features`` list (the ``datasets`` YAML form)."""
    out: list[dict[str, Any]] = []
    for f in schema:
        if pa.types.is_list(f.type) and pa.types.is_struct(f.type.value_type):
            out.append({"name": f.name, "list": hf_features(pa.schema(list(f.type.value_type)))})
        else:
            out.append({"name": f.name, "dtype": _dtype(f.type)})
    return out


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML of dicts, lists and scalars; strings are JSON-quoted (valid YAML)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(v, Mapping | list) and v:
                lines.append(f"{pad}{k}:")
                lines.extend(_yaml(v, indent + 2))
            else:
                lines.append(f"{pad}{k}: {_scalar(v)}")
    elif isinstance(value, list):
        for item in value:
            sub = _yaml(item, indent + 2)
            lines.append(f"{pad}- {sub[0].lstrip()}")
            lines.extend(sub[1:])
    else:
        lines.append(f"{pad}{_scalar(value)}")
    return lines


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if v is None:
        return "null"
    if isinstance(v, Mapping | list):  # empty
        return "{}" if isinstance(v, Mapping) else "[]"
    return json.dumps(str(v), ensure_ascii=False)


def _public(value: str) -> str:
    """A provenance value as the card shows it: a host path (``/data/models/x``) becomes its last
    component, since the card is published and the path says nothing to its readers."""
    return Path(value).name or value if value.startswith("/") else value


def _shard_files(name: str, entry: Mapping[str, Any]) -> list[str]:
    """The dataset's committed shard files, as the manifest names them (``<dataset>/shard-NNNNN.parquet``)."""
    return [str(entry["shards"][key].get("file") or f"{name}/shard-{int(key):05d}.parquet")
            for key in sorted((entry.get("shards") or {}), key=int)]


def _values(out: OutputDir, files: Iterable[str]) -> tuple[dict[str, Counter[str]], Counter[str], int, int]:
    """Distinct values (with row counts) of the provenance columns, rows per finish_reason, the
    shards' uncompressed data bytes (Parquet row-group sizes: a split's ``num_bytes``) and their
    files' bytes (read through the output's handles)."""
    values: dict[str, Counter[str]] = {c: Counter() for c in _PROVENANCE}
    finish: Counter[str] = Counter()
    size = stored = 0
    for file in files:
        try:
            data = out.read_shard(file)
            pf = pq.ParquetFile(pa.BufferReader(data))
        except UnsafeFile:
            raise
        except (OSError, pa.ArrowException):
            continue
        stored += len(data)
        meta = pf.metadata
        size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        names = set(pf.schema_arrow.names)
        cols = [c for c in (*_PROVENANCE, "finish_reason") if c in names]
        table = pf.read(columns=cols)
        for c in cols:
            vc = pc.value_counts(table.column(c))
            counter = finish if c == "finish_reason" else values[c]
            for v, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True):
                counter["null" if v is None else str(v)] += int(n)
    return values, finish, size, stored


def _report(out: Path) -> dict[str, Any]:
    try:
        doc = json.loads(OutputDir(out).read_file("_validation.json") or b"")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("kind") == "output" else {}


def card_text(out_dir: str | os.PathLike[str], manifest: Mapping[str, Any], report: Mapping[str, Any] | None = None,
              *, title: str | None = None) -> str:
    """The card of the output at ``out_dir`` whose manifest is ``manifest``.

    Args:
        out_dir: the output directory.
        manifest: its parsed ``_manifest.json``.
        report: the validation report (``ValidationReport.to_dict()``); None: ``_validation.json``.
        title: the card's title (default: the directory's name).
    """
    out = Path(out_dir)
    report = dict(report) if report is not None else _report(out)
    datasets = manifest.get("datasets") or {}
    configs: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    sections: list[str] = []
    table_rows: list[str] = []
    verdicts = (report.get("datasets") or {})
    total_rows = 0
    served: Counter[str] = Counter()  # rows by who started their server: datagen, or someone else
    for i, name in enumerate(sorted(datasets)):
        entry = datasets[name]
        files = _shard_files(name, entry)
        shards = entry.get("shards") or {}
        rows = sum(int(s.get("rows") or 0) for s in shards.values())
        rejects = sum(int(s.get("rejects") or 0) for s in shards.values())
        total_rows += rows
        config: dict[str, Any] = {"config_name": name, "data_files": [{"split": _SPLIT, "path": f"{name}/shard-*.parquet"}]}
        if i == 0:
            config["default"] = True
        configs.append(config)
        values, finish, size, stored = _values(OutputDir(out), files)
        # the `datasets` form of a split: name, bytes (uncompressed) and examples, else it warns
        infos.append({"config_name": name, "features": hf_features(),
                      "splits": [{"name": _SPLIT, "num_bytes": size, "num_examples": rows}],
                      "download_size": stored,
                      "dataset_size": size})
        verdict = (verdicts.get(name) or {}).get("verdict", "not validated")
        table_rows.append(f"| `{name}` | {rows:,} | {rejects:,} | {len(shards)} of {entry.get('num_shards', '?')} | "
                          f"{finish.get('stop', 0):,} / {finish.get('length', 0):,} / {finish.get('abort', 0):,} "
                          f"| {verdict} |")
        for server, n in values["server"].items():
            served["shared" if server.startswith("external:") else "launched"] += n
        sections.extend(_dataset_section(name, entry, values, (verdicts.get(name) or {}).get("total") or []))
    header = {
        "configs": configs,
        "dataset_info": infos,
        "tags": ["synthetic", "datagen", "sglang"],
        "task_categories": ["text-generation"],
    }
    lines = ["---", *_yaml(header), "---", "", f"# {title or out.name}", ""]
    lines += [
        f"Model outputs generated by datagen: {total_rows:,} rows in {len(datasets)} dataset(s), one config "
        f"per dataset (split `{_SPLIT}`). Each row holds the input conversation (`messages`), the exact "
        "prompt sent (`prompt`), the exact text returned (`raw`), its split into `reasoning` and `content`, "
        "and how it was made (the provenance columns).",
        "",
        "| dataset | rows | input rows rejected | shards | finish stop / length / abort | validation |",
        "|---|---|---|---|---|---|",
        *table_rows,
        "",
        "```python",
        "from datasets import load_dataset",
        f'ds = load_dataset("parquet", data_files="{next(iter(sorted(datasets)), "NAME")}/shard-*.parquet", '
        f'split="{_SPLIT}")',
        "```",
        "",
    ]
    verdict = report.get("verdict")
    lines += ["## Validation", ""]
    lines.append(f"Verdict **{verdict}**, validated at {report.get('validated_at')}; the full report is "
                 "`_validation.json`." if verdict else "Not validated yet: run `datagen validate OUT`.")
    lines.append("")
    lines += sections
    lines += ["## How it was made", "",
              _how_served(served) + ", then streamed each input through SGLang's native "
              "`/generate` with the model's chat template, in shards of "
              f"{manifest.get('shard_size')} input rows committed atomically (resumable after a crash: every "
              "input id is stored exactly once), and validated each shard as it committed and the whole "
              "output at the end. Input rows that could not be used are listed with their reason in "
              "`_rejects/<dataset>.jsonl`.", "",
              "`reasoning` and `content` are `raw` split at the reasoning parser's end tag with nothing "
              "stripped: newlines are kept, including those that open `reasoning` and the blank line "
              "after `</think>` that opens `content` (trim them if your trainer expects trimmed text).", "",
              "## Columns", "", "| column | type | holds |", "|---|---|---|",
              *(f"| `{f.name}` | `{_type_name(f.type)}` | {COLUMN_DOCS[f.name]} |" for f in ROW_SCHEMA), ""]
    return "\n".join(lines)


def _measured(c: Mapping[str, Any]) -> tuple[str, str]:
    try:
        return measured(Check(str(c.get("name")), str(c.get("status")), c.get("value"), c.get("threshold"),
                              str(c.get("message", ""))))
    except (TypeError, ValueError):  # a report written by another version
        return str(c.get("value", "")), ""


def _type_name(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        inner = t.value_type
        names = ", ".join(f.name for f in inner) if pa.types.is_struct(inner) else str(inner)
        return f"list<struct<{names}>>" if pa.types.is_struct(inner) else f"list<{names}>"
    return "timestamp (UTC)" if pa.types.is_timestamp(t) else str(t)


def _how_served(served: Mapping[str, int]) -> str:
    """What datagen did to the servers of the rows: launched them (GPU hygiene, tuned launch, health
    check), used servers someone else runs (``--server-url``: none of that), or both."""
    launched = ("cleaned the GPUs, launched SGLang with a tuned `--mem-fraction-static` and checked its "
                "health")
    shared = ("used an SGLang server it did not launch (`--server-url`: no GPU hygiene, no launch, no "
              "memory tuning by datagen)")
    n_launched, n_shared = served.get("launched", 0), served.get("shared", 0)
    if n_shared and n_launched:
        return (f"datagen (a Prefect workflow) {launched} for {n_launched:,} rows, and {shared} for "
                f"{n_shared:,} rows")
    return f"datagen (a Prefect workflow) {shared if n_shared else launched}"


def _dataset_section(name: str, entry: Mapping[str, Any], values: Mapping[str, Counter[str]],
                     checks: list[Mapping[str, Any]]) -> list[str]:
    source = Path(str(entry.get("input") or "?")).name
    lines = [f"## `{name}`", "", f"- input: `{source}` (sha256 {entry.get('input_fingerprint')}), "
             f"{entry.get('total_rows', '?')} records"]
    for col in _PROVENANCE:
        seen = values.get(col) or Counter()
        if not seen:
            continue
        shown = ", ".join(f"`{_public(v)}` ({n:,} rows)" for v, n in seen.most_common(5))
        more = f" and {len(seen) - 5} more" if len(seen) > 5 else ""
        lines.append(f"- {col}: {shown}{more}")
    attempts = entry.get("attempts")
    if isinstance(attempts, dict) and attempts:
        lines.append("- runs (calls per run): " + ", ".join(f"`{k}` ({v})" for k, v in attempts.items()))
    lines.append("")
    if checks:
        lines += ["| check | status | measured | limit | message |", "|---|---|---|---|---|"]
        for c in checks:
            message = md_text(c.get("message", "")).replace("|", "\\|").replace("\n", " ")
            value, limit = _measured(c)
            lines.append(f"| {c.get('name')} | {c.get('status')} | {value} | {limit} | {message} |")
        lines.append("")
    return lines


def write_card(out_dir: str | os.PathLike[str], report: Mapping[str, Any] | None = None, *,
               title: str | None = None) -> Path:
    """Write ``OUT/README.md`` (atomically); returns its path.

    Args:
        out_dir: the output directory (holds ``_manifest.json``).
        report: the validation report as a dict; None: read ``_validation.json``.
        title: the card's title (default: the directory's name).

    Raises:
        OSError: the manifest is unreadable or the card cannot be written.
        ValueError: the manifest is not JSON.
    """
    out = OutputDir(out_dir)
    manifest = out.read_manifest() or {"datasets": {}}
    out.write_file(CARD_NAME, card_text(out.path, manifest, report, title=title).encode("utf-8"))
    return out.path / CARD_NAME
