"""Datagen output directories built by hand with pyarrow (manifest, shards, rejects), for the validation
tests and bench/bench_validation.py, independent of the inference code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.reasoning import split_reasoning
from tasks.schema import PARQUET_COMPRESSION, ROW_SCHEMA

SAMPLING = json.dumps({"max_new_tokens": 1024, "temperature": 0.6}, sort_keys=True)
SERVER = "sglang-0.5.4:qwen3:tp1:mfs0.88:abc123"
MODEL_REVISION = "sha256:0123456789abcdef"
TEMPLATE_HASH = "sha256:fedcba9876543210"
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def make_row(dataset: str, i: int, *, parser: str | None = "qwen3", think_in_prompt: bool = False,
             raw: str | None = None, sample: int = 0) -> dict[str, Any]:
    """One consistent row: raw with a think block, split by ``parser``, plausible token counts."""
    if raw is None:
        body = f"Let me think about question {i}. The user asks for a sum; two plus two is four."
        raw = (f"{body}</think>\n\nThe answer to {i} is 4." if think_in_prompt
               else f"<think>{body}</think>\n\nThe answer to {i} is 4.")
    if parser is None:
        reasoning, content = None, raw
    else:
        reasoning, content = split_reasoning(raw, parser, force_reasoning=think_in_prompt)
    prompt = f"<|im_start|>user\nWhat is 2+2? ({i})<|im_end|>\n<|im_start|>assistant\n"
    if think_in_prompt:
        prompt += "<think>\n"
    return {
        "id": f"{dataset}-{i:06d}",
        "dataset": dataset,
        "messages": [{"role": "user", "content": f"What is 2+2? ({i})"}],
        "prompt": prompt,
        "raw": raw,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": "stop",
        "prompt_tokens": max(1, len(prompt) // 4),
        "completion_tokens": max(1, len(raw) // 4),
        "model": "demo",
        "sampling": SAMPLING,
        "server": SERVER,
        "reasoning_parser": parser,
        "think_in_prompt": think_in_prompt,
        "generated_at": NOW,
        "latency_s": 1.5,
        "max_new_tokens": 1024, "budget_capped": False, "truncation_retries": 0, "truncation_policy": None,
        "model_revision": MODEL_REVISION,
        "engine": "sglang",
        "engine_version": "0.5.23",
        "chat_template_hash": TEMPLATE_HASH,
        "run_id": "run-1",
        "attempt": 1,
        "sample": sample,
        "sampling_seed": None,
        "turns": None,
    }


def write_output(out: Path, datasets: dict[str, list[list[dict[str, Any]]]], *, shard_size: int,
                 total_rows: dict[str, int] | None = None, rejects: dict[str, dict[int, int]] | None = None,
                 num_shards: dict[str, int] | None = None, schema: pa.Schema = ROW_SCHEMA,
                 table_hook: Callable[[pa.Table], pa.Table] | None = None, samples: int | None = None) -> Path:
    """Write shards (a list of row lists per dataset), rejects and the manifest; return ``out``.

    ``total_rows`` defaults to the rows written plus rejects; ``rejects[dataset][shard] = n`` writes n
    reject lines for that shard. ``table_hook`` may alter each table before it is written. ``samples``
    records that many samples per record in the manifest (``total_rows`` then counts records).
    """
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"version": 1, "shard_size": shard_size, "datasets": {}}
    for name, shards in datasets.items():
        (out / name).mkdir(exist_ok=True)
        entry: dict[str, Any] = {"input": f"/data/{name}.jsonl", "input_fingerprint": "sha256:feed",
                                 "shards": {}}
        reject_lines: list[str] = []
        written = 0
        for k, rows in enumerate(shards):
            table = pa.Table.from_pylist(rows, schema=schema)
            if table_hook is not None:
                table = table_hook(table)
            path = out / name / f"shard-{k:05d}.parquet"
            pq.write_table(table, path, compression=PARQUET_COMPRESSION)
            n_rej = (rejects or {}).get(name, {}).get(k, 0)
            for j in range(n_rej):
                reject_lines.append(json.dumps({"dataset": name, "line": k * shard_size + j,
                                                "reason": "no messages", "raw": "{}"}))
            entry["shards"][str(k)] = {
                "file": f"{name}/{path.name}", "rows": table.num_rows, "rejects": n_rej,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "committed_at": NOW.isoformat(),
            }
            written += table.num_rows + n_rej
        if samples is not None:
            entry["generation"] = {"samples": samples, "regenerate": "last"}
        entry["total_rows"] = (total_rows or {}).get(name, written // (samples or 1))
        entry["num_shards"] = (num_shards or {}).get(name, len(shards))
        manifest["datasets"][name] = entry
        (out / "_rejects").mkdir(exist_ok=True)
        (out / "_rejects" / f"{name}.jsonl").write_text("".join(line + "\n" for line in reject_lines))
    (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def clean_rows(dataset: str, n: int, start: int = 0, **kw: Any) -> list[dict[str, Any]]:
    return [make_row(dataset, i, **kw) for i in range(start, start + n)]


def clean_output(out: Path, *, dataset: str = "glaive", shards: int = 2, shard_size: int = 50,
                 **kw: Any) -> Path:
    """A clean output: ``shards`` full shards of ``shard_size`` consistent rows."""
    data = [clean_rows(dataset, shard_size, k * shard_size, **kw) for k in range(shards)]
    return write_output(out, {dataset: data}, shard_size=shard_size)


def accept(setting: str, limit: float) -> str:
    """What a failing rate check's message ends with: its setting, and how to accept the rows."""
    return (f"; the limit is [validation] {setting} = {limit:g}: to accept such rows raise it in the partition and "
            "rerun `datagen run` (what is committed is kept; a complete output is judged again without generating "
            "anything)")


# A chat template that renders an assistant turn's reasoning_content in a think block, as Qwen3's does
# (the demo and tiny models' templates ignore it).
REASONING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + "
    "'\\n</think>\\n\\n' }}{%- endif %}{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
