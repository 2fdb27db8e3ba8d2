"""`datagen run --samples N --regenerate all` through the flow against the emulator: one row per
(id, sample) with every assistant turn regenerated, validated, then `datagen export` in each format."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tasks.export import FORMATS
from tests.support.inference import committed_keys, committed_rows, write_conversations
from tests.support.outputs import REASONING_TEMPLATE
from tests.support.paths import REPO_ROOT
from tests.support.runs import cli_env

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def test_run_with_samples_and_whole_conversations_then_export_each_format(tmp_path: Path) -> None:
    gpus = SimGpus.init(tmp_path / "sim-gpus.json", count=1)
    inp = tmp_path / "chats.jsonl"
    ids = write_conversations(inp, 7, turns=2)
    out = tmp_path / "out"
    env = cli_env(tmp_path, gpus.path)
    res = subprocess.run([DATAGEN, "run", "--input", str(inp), "--model-path", str(REPO_ROOT / "data/models/demo"),
                          "--backend", "emulator", "--out", str(out), "--shard-size", "3", "--samples", "2",
                          "--regenerate", "all"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"completed: 14 rows in {out}" in res.stdout
    logs = res.stdout + res.stderr
    # progress counts what is generated, prompts x samples (7 x 2), never rows against prompts
    assert re.search(r"progress adhoc: 1/3 shards, (2|6)/14 rows \(chats (2|6)/14\)", logs), logs[-3000:]
    assert "DONE in " in logs and "3/3 shards, 14/14 rows (chats 14/14)" in logs
    assert "/7 rows" not in logs
    status = subprocess.run([DATAGEN, "status", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert "  chats: 3/3 shards, 14 of 14 rows and rejects (14 rows, 0 rejects)" in status.stdout, status.stdout
    assert committed_keys(out, "chats") == sorted((i, k) for i in ids for k in range(2))
    rows = committed_rows(out, "chats", ["messages", "turns"])
    assert all([t["message_index"] for t in row["turns"]] == [2] for row in rows)
    assert all(row["messages"][2]["content"] == row["turns"][0]["content"] for row in rows)

    for fmt in FORMATS:
        target = tmp_path / f"{fmt}.jsonl"
        res = subprocess.run([DATAGEN, "export", str(out), "--format", fmt, "--out", str(target),
                              "--include-truncated"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        records = [json.loads(line) for line in target.read_text().splitlines()]
        assert sorted((r["id"], r["sample"]) for r in records) == sorted((i, k) for i in ids for k in range(2))
        turns = records[0]["conversations" if fmt != "openai-messages" else "messages"]
        # system, user, the model's turn, user, the model's last turn
        assert len(turns) == 5 and not any("original answer" in str(t) for t in turns)


def test_export_checks_what_the_trainer_sees_with_the_targets_chat_template(tmp_path: Path) -> None:
    """Issue 48 item 5: the demo model's template ignores reasoning_content, so a drafter trained on the
    specforge export would learn the answers only: the export says so with the share, --strict refuses it;
    with a template that renders the reasoning, nothing is said."""
    gpus = SimGpus.init(tmp_path / "sim-gpus.json", count=1)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i}+{i}?"}]})
                           + "\n" for i in range(12)))
    out, env = tmp_path / "out", cli_env(tmp_path, gpus.path)
    demo = REPO_ROOT / "data/models/demo"
    res = subprocess.run([DATAGEN, "run", "--input", str(inp), "--model-path", str(demo), "--backend", "emulator",
                          "--out", str(out), "--shard-size", "6"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    reasoned = sum(1 for r in committed_rows(out, "prompts", ["reasoning", "finish_reason"])
                   if r["reasoning"] and r["finish_reason"] == "stop")
    assert reasoned > 0

    def export(target: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([DATAGEN, "export", str(out), "--format", "specforge", "--out", str(target), *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    drops = export(tmp_path / "drops.jsonl", "--tokenizer", str(demo))
    assert drops.returncode == 0, drops.stderr
    assert (f"reasoning survives in 0 of {reasoned} rows with reasoning (0%)") in drops.stderr, drops.stderr
    assert f"datagen export: warning: the chat template of {demo}" in drops.stderr
    assert f"drops reasoning_content in {reasoned} of {reasoned} rows" in drops.stderr

    strict = export(tmp_path / "strict.jsonl", "--tokenizer", str(demo), "--strict")
    assert strict.returncode == 2, strict.stderr
    assert strict.stderr.strip().endswith("; nothing was written (--strict)")
    assert not (tmp_path / "strict.jsonl").exists()

    keeps = tmp_path / "keeps-model"
    keeps.mkdir()
    config = json.loads((demo / "tokenizer_config.json").read_text())
    (keeps / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": REASONING_TEMPLATE}))
    kept = export(tmp_path / "keeps.jsonl", "--tokenizer", str(keeps), "--strict")
    assert kept.returncode == 0, kept.stderr
    assert f"reasoning survives in {reasoned} of {reasoned} rows with reasoning (100%)" in kept.stderr
    assert "warning" not in kept.stderr
