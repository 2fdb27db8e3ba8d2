"""tasks.export + `datagen export` / `datagen resplit` on small hand-made output directories."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tasks.export import ExportError, assistant_text, iter_export, missing_shards, resplit
from tasks.shards import OutputDir, OutputLocked

PROMPT_PLAIN = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
PROMPT_OPENED = PROMPT_PLAIN + "<think>\n"


def _row(i: int, raw: str, *, reasoning: str | None, content: str, prompt: str = PROMPT_PLAIN,
         finish: str = "stop", parser: str | None = "qwen3", think: bool = False,
         messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "id": f"r{i}",
        "dataset": "ds",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": f"Q{i}"}]
        if messages is None else messages,
        "prompt": prompt,
        "raw": raw,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "model": "demo",
        "sampling": "{}",
        "server": "fp",
        "reasoning_parser": parser,
        "think_in_prompt": think,
        "generated_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "latency_s": 0.5,
        "max_new_tokens": 64, "budget_capped": False, "truncation_retries": 0, "truncation_policy": None,
    }


def _output(tmp_path: Path, shards: list[list[dict[str, Any]]]) -> Path:
    out_dir = tmp_path / "out"
    out = OutputDir(out_dir)
    with out.lock({"flow_run": "test"}):
        out.open_dataset("ds", input_path="in.jsonl", input_fingerprint="abc", shard_size=3)
        for k, rows in enumerate(shards):
            out.commit_shard("ds", k, rows)
        out.set_dataset_totals("ds", 3 * (len(shards) - 1) + len(shards[-1]))  # shard_size 3: complete
    return out_dir


def _manifest(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "_manifest.json").read_text())


@pytest.fixture
def wrong_split_output(tmp_path: Path) -> Path:
    """A run that had no reasoning parser: the think block stayed inside content (the empty-reasoning bug)."""
    shard0 = [
        _row(0, "<think>\nplan A\n</think>\n\nanswer A", reasoning=None, content="<think>\nplan A\n</think>\n\nanswer A",
             parser=None),
        _row(1, "plan B</think>\n\nanswer B", reasoning=None, content="plan B</think>\n\nanswer B", parser=None,
             prompt=PROMPT_OPENED, think=False),
        _row(2, "<think>\ncut off", reasoning=None, content="<think>\ncut off", parser=None, finish="length"),
    ]
    shard1 = [_row(3, "no think at all", reasoning=None, content="no think at all", parser=None)]
    return _output(tmp_path, [shard0, shard1])


def test_resplit_fixes_a_run_without_parser(wrong_split_output: Path) -> None:
    out_dir = wrong_split_output
    before = _manifest(out_dir)
    report = resplit(out_dir, "qwen3")
    assert report.to_dict() == {"parser": "qwen3", "shards": 2, "shards_rewritten": 2, "rows": 4, "rows_changed": 3}
    t0 = pq.read_table(out_dir / "ds" / "shard-00000.parquet").to_pylist()
    assert [(r["reasoning"], r["content"]) for r in t0] == [
        ("\nplan A\n", "\n\nanswer A"),
        ("plan B", "\n\nanswer B"),  # the prompt opened the think block: forced
        ("\ncut off", ""),
    ]
    assert [r["think_in_prompt"] for r in t0] == [False, True, False]
    assert {r["reasoning_parser"] for r in t0} == {"qwen3"}
    # raw and everything else untouched
    assert [r["raw"] for r in t0][0] == "<think>\nplan A\n</think>\n\nanswer A"
    assert [r["id"] for r in t0] == ["r0", "r1", "r2"]
    after = _manifest(out_dir)
    for k in ("0", "1"):
        entry = after["datasets"]["ds"]["shards"][k]
        data = (out_dir / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() != before["datasets"]["ds"]["shards"][k]["sha256"]
        assert entry["rows"] == before["datasets"]["ds"]["shards"][k]["rows"]
    # no temp files left behind, and a second resplit is a no-op
    assert sorted(p.name for p in (out_dir / "ds").iterdir()) == ["shard-00000.parquet", "shard-00001.parquet"]
    again = resplit(out_dir, "qwen3")
    assert (again.shards_rewritten, again.rows_changed) == (0, 0)
    assert _manifest(out_dir)["datasets"]["ds"]["shards"] == after["datasets"]["ds"]["shards"]


def test_resplit_dry_run_and_errors(wrong_split_output: Path, tmp_path: Path) -> None:
    before = (wrong_split_output / "_manifest.json").read_bytes()
    report = resplit(wrong_split_output, "deepseek-r1", dry_run=True)
    assert (report.shards_rewritten, report.rows_changed) == (2, 4)
    assert (wrong_split_output / "_manifest.json").read_bytes() == before
    with pytest.raises(ValueError, match="unknown reasoning parser 'bogus'"):
        resplit(wrong_split_output, "bogus")
    with pytest.raises(ExportError, match="no _manifest.json"):
        resplit(tmp_path / "empty", "qwen3")
    with OutputDir(wrong_split_output).lock({"flow_run": "busy-run"}), pytest.raises(OutputLocked):
        resplit(wrong_split_output, "qwen3")
    shard = wrong_split_output / "ds" / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(ExportError, match="shard ds/shard-00001.parquet does not match the manifest"):
        resplit(wrong_split_output, "qwen3")


@pytest.fixture
def good_output(tmp_path: Path) -> Path:
    rows = [
        _row(0, "<think>\nplan\n</think>\n\nanswer", reasoning="\nplan\n", content="\n\nanswer"),
        _row(1, "direct", reasoning=None, content="direct"),
        _row(2, "<think>\ncut", reasoning="\ncut", content="", finish="length"),
    ]
    rows2 = [_row(3, "x", reasoning="", content=" tail ", prompt="PRE", messages=[],
                  parser="mistral")]
    return _output(tmp_path, [rows, rows2])


def test_export_sharegpt(good_output: Path) -> None:
    records = list(iter_export(good_output, "sharegpt"))
    assert [r["id"] for r in records] == ["r0", "r1", "r3"]  # the truncated row is left out
    assert records[0] == {
        "id": "r0",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q0"},
            {"from": "gpt", "value": "<think>\nplan\n</think>\n\nanswer"},
        ],
    }
    assert records[1]["conversations"][-1] == {"from": "gpt", "value": "direct"}
    # prompt-only row: the prompt is the human turn; empty reasoning keeps its (empty) block
    assert records[2]["conversations"] == [{"from": "human", "value": "PRE"}, {"from": "gpt", "value": "[THINK][/THINK]tail"}]
    with_truncated = list(iter_export(good_output, "sharegpt", include_truncated=True))
    assert [r["id"] for r in with_truncated] == ["r0", "r1", "r2", "r3"]
    assert with_truncated[2]["conversations"][-1]["value"] == "<think>\ncut\n</think>\n\n"


def test_export_openai_and_specforge(good_output: Path) -> None:
    oa = list(iter_export(good_output, "openai-messages"))
    assert oa[0]["messages"][-1] == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert oa[1]["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "direct", "reasoning_content": None},
    ]
    sf = list(iter_export(good_output, "specforge"))
    assert sf[0]["conversations"][-1] == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert sf[1]["conversations"][-1] == {"role": "assistant", "content": "direct"}
    with pytest.raises(ValueError, match="unknown export format 'csv'"):
        list(iter_export(good_output, "csv"))
    with pytest.raises(ExportError, match="no committed shards for dataset"):
        list(iter_export(good_output, "sharegpt", datasets=["nope"]))


def test_assistant_text_families() -> None:
    assert assistant_text("r", "c", "kimi") == "◁think▷r◁/think▷c"
    assert assistant_text(" r ", " c", "gpt-oss") == (
        "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>c"
    )
    assert assistant_text("r", "c", None) == "c"
    assert assistant_text(None, "c", "qwen3") == "c"


def _datagen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datagen", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # `datagen` subprocesses: `make test`, not `make unit`
def test_cli_export_and_resplit(good_output: Path, wrong_split_output: Path, tmp_path: Path) -> None:
    target = tmp_path / "train.jsonl"
    proc = _datagen("export", str(good_output), "--format", "sharegpt", "--out", str(target))
    assert proc.returncode == 0, proc.stderr
    assert "exported 3 rows from 2 shards as sharegpt" in proc.stderr and "1 truncated" in proc.stderr
    lines = target.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["r0", "r1", "r3"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".train")] == []
    proc = _datagen("export", str(good_output), "--format", "openai-messages")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 3
    assert _datagen("export", str(tmp_path / "missing"), "--format", "sharegpt").returncode == 2
    assert _datagen("export", str(good_output), "--format", "yaml").returncode == 2

    proc = _datagen("resplit", str(wrong_split_output), "--parser", "qwen3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "resplit with qwen3: 3 of 4 rows changed; rewrote 2 of 2 shards"
    proc = _datagen("resplit", str(wrong_split_output), "--parser", "nope")
    assert proc.returncode == 2 and "unknown reasoning parser 'nope'" in proc.stderr
    # a run holding the output's lock (this process) makes a resplit in another process fail at once
    with OutputDir(wrong_split_output).lock({"flow_run": "run-42"}):
        proc = _datagen("resplit", str(wrong_split_output), "--parser", "qwen3")
    assert proc.returncode == 2 and "run-42" in proc.stderr, proc.stderr


@pytest.mark.slow  # `datagen` subprocesses: `make test`, not `make unit`
def test_export_refuses_a_target_inside_the_output(good_output: Path) -> None:
    shard = good_output / "ds" / "shard-00000.parquet"
    before = {p: p.read_bytes() for p in (shard, good_output / "_manifest.json")}
    for target in (shard, good_output / "_manifest.json", good_output / "new.jsonl"):
        proc = _datagen("export", str(good_output), "--format", "sharegpt", "--out", str(target))
        assert proc.returncode == 2
        assert f"--out {target}: inside the output directory {good_output}" in proc.stderr
    assert {p: p.read_bytes() for p in before} == before
    assert not (good_output / "new.jsonl").exists()
    # a symlink elsewhere that points into OUT is refused too
    link = good_output.parent / "alias"
    link.symlink_to(good_output)
    proc = _datagen("export", str(good_output), "--format", "sharegpt", "--out", str(link / "x.jsonl"))
    assert proc.returncode == 2 and "inside the output directory" in proc.stderr


def test_export_of_an_incomplete_output_is_refused_unless_allowed(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out = OutputDir(out_dir)
    with out.lock({"flow_run": "test"}):
        out.open_dataset("ds", input_path="in.jsonl", input_fingerprint="abc", shard_size=3)
        out.commit_shard("ds", 0, [_row(i, f"a{i}", reasoning=None, content=f"a{i}", parser=None) for i in range(3)])
        out.set_dataset_totals("ds", 45)
    assert missing_shards(out_dir) == ["ds: 1 of 15 shards committed"]
    target = tmp_path / "train.jsonl"
    proc = _datagen("export", str(out_dir), "--format", "sharegpt", "--out", str(target))
    assert proc.returncode == 2
    assert "output incomplete (ds: 1 of 15 shards committed)" in proc.stderr and "--allow-incomplete" in proc.stderr
    assert not target.exists()
    proc = _datagen("export", str(out_dir), "--format", "sharegpt", "--out", str(target), "--allow-incomplete")
    assert proc.returncode == 0, proc.stderr
    assert "warning: incomplete output, ds: 1 of 15 shards committed" in proc.stderr
    assert [json.loads(x)["id"] for x in target.read_text().splitlines()] == ["r0", "r1", "r2"]


def test_resplit_with_a_damaged_shard_changes_nothing(wrong_split_output: Path) -> None:
    damaged = wrong_split_output / "ds" / "shard-00001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"garbage")
    shard0 = wrong_split_output / "ds" / "shard-00000.parquet"
    before = (shard0.read_bytes(), (wrong_split_output / "_manifest.json").read_bytes())
    proc = _datagen("resplit", str(wrong_split_output), "--parser", "qwen3")
    assert proc.returncode == 2 and "shard-00001.parquet does not match the manifest" in proc.stderr
    assert (shard0.read_bytes(), (wrong_split_output / "_manifest.json").read_bytes()) == before


def _conversation_row(sample: int) -> dict[str, Any]:
    """A row of a conversation regenerated whole: turn 0 of the model at messages[2], then the last."""
    row = _row(0, "<think>\nlast plan\n</think>\n\nlast answer", reasoning="\nlast plan\n",
               content="\n\nlast answer", messages=[
                   {"role": "system", "content": "S"}, {"role": "user", "content": "Q0"},
                   {"role": "assistant", "content": f"\n\nfirst answer {sample}"}, {"role": "user", "content": "Q1"}])
    turn = {"message_index": 2, "raw": f"<think>\nfirst plan\n</think>\n\nfirst answer {sample}",
            "reasoning": "\nfirst plan\n", "content": f"\n\nfirst answer {sample}", "finish_reason": "stop",
            "prompt_tokens": 5, "completion_tokens": 9, "latency_s": 0.25}
    return {**row, "sample": sample, "sampling_seed": 100 + sample, "turns": [turn]}


def test_export_of_samples_and_whole_conversations_in_each_format(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out = OutputDir(out_dir)
    with out.lock({"flow_run": "test"}):
        out.open_dataset("ds", input_path="in.jsonl", input_fingerprint="abc", shard_size=1)
        manifest = out.read_manifest()
        manifest["datasets"]["ds"]["generation"] = {"samples": 2, "regenerate": "all"}
        out.write_manifest(manifest)
        out.commit_shard("ds", 0, [_conversation_row(0), _conversation_row(1)], samples=2)
        out.set_dataset_totals("ds", 1)
    sharegpt = list(iter_export(out_dir, "sharegpt"))
    assert [(r["id"], r["sample"]) for r in sharegpt] == [("r0", 0), ("r0", 1)]
    assert sharegpt[1] == {"id": "r0", "sample": 1, "conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q0"},
        {"from": "gpt", "value": "<think>\nfirst plan\n</think>\n\nfirst answer 1"},
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "<think>\nlast plan\n</think>\n\nlast answer"}]}
    openai = list(iter_export(out_dir, "openai-messages"))
    assert openai[0] == {"id": "r0", "sample": 0, "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q0"},
        {"role": "assistant", "content": "first answer 0", "reasoning_content": "first plan"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "last answer", "reasoning_content": "last plan"}]}
    specforge = list(iter_export(out_dir, "specforge"))
    assert specforge[0]["conversations"][2] == {"role": "assistant", "content": "first answer 0",
                                                "reasoning_content": "first plan"}
    assert [len(r["conversations"]) for r in specforge] == [5, 5]
    # one-sample datasets keep their records as they were: no "sample" key
    manifest = _manifest(out_dir)
    manifest["datasets"]["ds"]["generation"]["samples"] = 1
    (out_dir / "_manifest.json").write_text(json.dumps(manifest))
    assert "sample" not in next(iter_export(out_dir, "specforge"))
