"""Every generation feature as a user runs it against real SGLang on CPU:

- `datagen run --partition P --out OUT`, where P's `[server] python` names the real SGLang
  environment, so datagen itself cleans the (simulated) GPU, launches SGLang, checks its health,
  generates, validates and stops it: a plain run with a near-context prompt, one too long for the
  context, truncation retries and provenance, then `datagen export` and the dataset card;
- `datagen run --partition P --server-url URL --out OUT` against one real server of this module (a
  team's shared server; launched once, since each real launch costs about 40 s of CPU here):
  `--samples 3` killed with SIGKILL after its first shard, then the identical command; `--samples 2
  --regenerate all` (whole conversations) killed the same way, then the identical command.

Every request asks for a fixed number of tokens with ``ignore_eos``, so the tokens a run generated
count its requests exactly: a resume that generated ``missing x N`` tokens sent each missing row once.
Generated lengths are a few tokens (the tier must pass on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from emulator.simgpu import SimGpus
from tasks.server import FileStore, FractionMemory, launch_tuned, stop_server
from tasks.shards import OutputDir
from tests.support.inference import (
    committed_keys,
    committed_rows,
    rows_on_disk,
    turns_on_disk,
    write_conversations,
)
from tests.support.paths import REPO_ROOT
from tests.support.prefect import migrated_home, on_shared_server
from tests.support.runs import kill_after_first_commit, records
from tests.support.sglang import CONTEXT, CPU_ARGS, DEADLINE_S, cpu_config

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
DATAGEN = str(Path(sys.executable).parent / "datagen")
TOKENS = 6  # generated per request (ignore_eos): short, so the tier passes under load


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(DATAGEN_SIM_GPUS=os.environ["DATAGEN_SIM_GPUS"], PREFECT_HOME=str(migrated_home(tmp / "prefect")),
               DATAGEN_STATE_DIR=str(tmp / "state"), DATAGEN_RUN_DIR=str(tmp / "run"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    return on_shared_server(env)  # as under `datagen up`: no API server per run


@pytest.fixture(scope="module")
def shared_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real SGLang server for the module's `--server-url` runs, started by datagen's launcher."""
    base = tmp_path_factory.mktemp("sglang-shared")
    handle, _ = launch_tuned(cpu_config(tiny_model), "local", base / "logs", deadline_s=DEADLINE_S,
                             memory=FractionMemory(FileStore(base / "fractions.json")), gpu_name="cpu", hygiene=None)
    try:
        yield handle.url
    finally:
        stop_server(handle, grace_s=30.0, hygiene=None)


def _partition(tmp: Path, data: Path, model: Path, python: Path, *, shard: int, max_new_tokens: int = TOKENS,
               run_extra: str = "") -> Path:
    part = tmp / "real.toml"
    part.write_text(f"""
[datasets]
ds = "{data}"

[model]
path = "{model}"
reasoning_parser = "qwen3"

[server]
backend = "sglang"
targets = ["local"]
python = "{python}"
extra_args = {json.dumps(list(CPU_ARGS))}

[run]
shard_size = {shard}
concurrency = 4
hygiene_grace_s = 1
{run_extra}

[sampling]
max_new_tokens = {max_new_tokens}
ignore_eos = true
temperature = 0.7

# random weights: no reasoning block and every row ends by length, by construction; a sampled row may
# hold a stray <think> token (about 1 in 3,900 tokens), which is noise here, not a parser leak
[validation]
reasoning_missing_max_rate = 1.0
truncation_max_rate = 1.0
tag_leak_max_rate = 1.0

[output]
root = "{tmp / 'unused-root'}"
versioned = false
""")
    return part


def _run(tmp: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO_ROOT, env=_env(tmp), capture_output=True, text=True, timeout=800,
                          stdin=subprocess.DEVNULL)


def _summaries(tmp: Path) -> list[dict]:
    """The run summaries of the state directory's records, oldest first."""
    recs = sorted(records(tmp).values(), key=lambda r: r.get("owner", {}).get("started", 0))
    return [r["summary"] for r in recs if "summary" in r]


def _write_prompts(path: Path, n: int) -> list[str]:
    ids = [f"p{i:03d}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                            for i in ids))
    return ids


def test_plain_run_near_context_truncation_retries_provenance_export_and_card(
        tmp_path: Path, sim_gpus: SimGpus, sglang_env: Path, tiny_model: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    # the chat template adds 10 tokens: 2,038 prompt tokens leave 10 of the 2,048 context, of which
    # SGLang's scheduler generates 8; 2,100 cannot fit at all
    rows.append({"id": "near", "messages": [{"role": "user", "content": " ".join(["kalo"] * (CONTEXT - 20))}]})
    rows.append({"id": "toolong", "messages": [{"role": "user", "content": " ".join(["kalo"] * (CONTEXT + 52))}]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    part = _partition(tmp_path, data, tiny_model, sglang_env, shard=3, max_new_tokens=4,
                      run_extra="truncation = { factor = 2.0, max_new_tokens = 16 }")

    res = _run(tmp_path, [DATAGEN, "run", "--partition", str(part), "--out", str(out), "--truncation-retries", "2"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"completed: 5 rows in {out}" in res.stdout
    got = {r["id"]: r for r in committed_rows(out, "ds", [
        "id", "prompt_tokens", "completion_tokens", "max_new_tokens", "finish_reason", "truncation_retries",
        "budget_capped", "raw", "reasoning", "content", "model", "reasoning_parser", "model_revision", "engine", "engine_version",
        "chat_template_hash", "sampling", "sample", "sampling_seed"])}
    assert sorted(got) == ["near", "p0", "p1", "p2", "p3"]
    for i in range(4):  # 4 -> 8 -> 16 tokens, each generated in full
        r = got[f"p{i}"]
        assert (r["max_new_tokens"], r["completion_tokens"], r["truncation_retries"]) == (16, 16, 2), r
    near = got["near"]
    assert near["prompt_tokens"] == CONTEXT - 10
    # 4, then the 8 SGLang generates in full so near the context; nothing larger fits
    assert (near["max_new_tokens"], near["completion_tokens"], near["truncation_retries"]) == (8, 8, 1), near
    assert {r["finish_reason"] for r in got.values()} == {"length"}
    # provenance: the raw text kept, the split recorded, the model and its template identified
    assert all(r["raw"] and r["content"] == r["raw"] and r["reasoning"] is None for r in got.values())
    assert {r["reasoning_parser"] for r in got.values()} == {"qwen3"}
    assert {(r["engine"], r["engine_version"]) for r in got.values()} == {("sglang", "0.5.23")}
    assert len({r["chat_template_hash"] for r in got.values()}) == 1 and near["chat_template_hash"]
    assert json.loads(near["sampling"])["max_new_tokens"] == 4  # the configured budget, per row
    rejects = OutputDir(out).read_rejects("ds")
    assert [x.get("id") for x in rejects] == ["toolong"]
    assert "longer than the model's context length" in json.dumps(rejects[0])
    # the server datagen launched is stopped: nothing of it is left
    recs = list(records(tmp_path).values())
    assert [s["state"] for r in recs for s in r.get("servers", [])] == ["stopped"]
    assert not any(psutil.pid_exists(s["pid"]) for r in recs for s in r.get("servers", []))

    exported = tmp_path / "export.jsonl"
    ex = subprocess.run([DATAGEN, "export", str(out), "--format", "openai-messages", "--out", str(exported),
                         "--include-truncated"], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True,
                        timeout=120)
    assert ex.returncode == 0, ex.stderr
    records_out = [json.loads(line) for line in exported.read_text().splitlines()]
    assert sorted(r["id"] for r in records_out) == sorted(got)
    assert records_out[0]["messages"][-1]["role"] == "assistant"

    card = (out / "README.md").read_text()
    assert "launched SGLang" in card and "cleaned" in card


def test_killed_samples_run_resumes_with_the_identical_command(
        tmp_path: Path, sim_gpus: SimGpus, sglang_env: Path, tiny_model: Path, reap_pids: list[int],
        shared_url: str) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = _write_prompts(data, 12)  # 6 shards of 2 prompts x 3 samples: 36 rows
    out = tmp_path / "out"
    argv = [DATAGEN, "run", "--partition", str(_partition(tmp_path, data, tiny_model, sglang_env, shard=2)),
            "--server-url", shared_url, "--out", str(out), "--samples", "3"]

    kill_after_first_commit(argv, _env(tmp_path), out, reap_pids, deadline_s=600)
    done = rows_on_disk(out, "ds")
    assert 6 <= done < 36

    again = _run(tmp_path, argv)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"completed: 36 rows in {out}" in again.stdout
    assert committed_keys(out, "ds") == sorted((i, k) for i in ids for k in range(3))
    last = _summaries(tmp_path)[-1]
    # the resume generated exactly the missing (id, sample) pairs, TOKENS tokens each
    assert (last["rows_new"], last["completion_tokens"]) == (36 - done, (36 - done) * TOKENS)
    seeds = {(r["id"], r["sample"]): r["sampling_seed"] for r in committed_rows(out, "ds", ["id", "sample",
                                                                                            "sampling_seed"])}
    assert len(set(seeds.values())) == 36  # each sample its own seed
    # the card tells what the run did: a server it did not launch, so no hygiene and no tuned launch
    card = (out / "README.md").read_text()
    assert "used an SGLang server it did not launch (`--server-url`: no GPU hygiene" in card
    assert "cleaned the GPUs" not in card


def test_killed_whole_conversation_run_resumes_with_the_identical_command(
        tmp_path: Path, sim_gpus: SimGpus, sglang_env: Path, tiny_model: Path, reap_pids: list[int],
        shared_url: str) -> None:
    data = tmp_path / "chats.jsonl"
    ids = write_conversations(data, 8, turns=2)  # 4 shards of 2 x 2 samples x 2 turns: 32 turns
    out = tmp_path / "out"
    argv = [DATAGEN, "run", "--partition", str(_partition(tmp_path, data, tiny_model, sglang_env, shard=2)),
            "--server-url", shared_url, "--out", str(out), "--samples", "2", "--regenerate", "all"]

    kill_after_first_commit(argv, _env(tmp_path), out, reap_pids, deadline_s=600)
    turns_done = turns_on_disk(out, "ds")
    assert 8 <= turns_done < 32

    again = _run(tmp_path, argv)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"completed: 16 rows in {out}" in again.stdout
    assert committed_keys(out, "ds") == sorted((i, k) for i in ids for k in range(2))
    # journaled turns were never generated again: TOKENS tokens for each turn not on disk
    assert _summaries(tmp_path)[-1]["completion_tokens"] == (32 - turns_done) * TOKENS
    for row in committed_rows(out, "ds", ["messages", "turns"]):
        assert [t["message_index"] for t in row["turns"]] == [2]
        assert row["messages"][2]["content"] == row["turns"][0]["content"] != "original answer 0"
