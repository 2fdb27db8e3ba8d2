"""The generation features as a user runs them: `datagen run --partition P --server-url URL`, the run
killed with SIGKILL mid-output, then the identical command again. A `--samples 3` run and a
`--regenerate all` run resume (they were refused: the flow's resume check assumed one sample of the
last turn), sending exactly the (id, sample) pairs and turns not yet on disk; truncation retries run
through the dispatcher every flow run uses (they crashed on its first length finish).

The real-SGLang versions of these runs are in tests/sglang/test_user_path.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.e2e.test_cli_server_url import _env
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import (
    committed_keys,
    committed_rows,
    metrics,
    rows_on_disk,
    turns_on_disk,
    wait_idle,
    write_conversations,
    write_input,
)
from tests.support.paths import REPO_ROOT
from tests.support.runs import kill_after_first_commit

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def _partition(tmp: Path, data: Path, *, max_new_tokens: int = 128, extra_run: str = "") -> Path:
    part = tmp / "partition.toml"
    part.write_text(f"""
[datasets]
ds = "{data}"

[model]
path = "{DEMO_MODEL}"
reasoning_parser = "qwen3"

[server]
backend = "emulator"
targets = ["local"]

[run]
shard_size = 4
concurrency = 4
{extra_run}

[sampling]
max_new_tokens = {max_new_tokens}
temperature = 0.6

[output]
root = "{tmp / 'unused-root'}"
versioned = false
""")
    return part


def _argv(part: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [DATAGEN, "run", "--partition", str(part), "--server-url", url, "--out", str(out), *extra]


def _run(tmp: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO_ROOT, env=_env(tmp), capture_output=True, text=True, timeout=400,
                          stdin=subprocess.DEVNULL)


def test_killed_samples_run_resumes_with_the_identical_command(tmp_path: Path, sim_gpus: SimGpus,
                                                               emulator_factory, reap_pids) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 24)  # 6 shards of 4 prompts, 3 samples each: 72 rows
    out = tmp_path / "out"
    em = emulator_factory(["--emu-decode-ms-per-step", "8", "--emu-output-tokens", "40"])
    argv = _argv(_partition(tmp_path, data), em.url, out, "--samples", "3")

    kill_after_first_commit(argv, _env(tmp_path), out, reap_pids)
    done = rows_on_disk(out, "ds")
    assert 12 <= done < 72
    sent_before = wait_idle(em.url)["num_requests_total"]  # the killed run's requests drained

    again = _run(tmp_path, argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"completed: 72 rows in {out}" in again.stdout
    assert committed_keys(out, "ds") == sorted((i, k) for i in ids for k in range(3))
    # exactly the (id, sample) pairs not on disk were asked for: no pair twice, none lost
    assert metrics(em.url)["num_requests_total"] - sent_before == 72 - done
    # the card tells what the run did: a server it did not launch, so no hygiene and no tuned launch
    card = (out / "README.md").read_text()
    assert "used an SGLang server it did not launch (`--server-url`: no GPU hygiene" in card
    assert "cleaned the GPUs" not in card


def test_killed_whole_conversation_run_resumes_with_the_identical_command(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory, reap_pids) -> None:
    data = tmp_path / "chats.jsonl"
    ids = write_conversations(data, 16, turns=3)  # 4 shards, 2 samples, 3 turns a conversation: 96 turns
    out = tmp_path / "out"
    em = emulator_factory(["--emu-decode-ms-per-step", "8", "--emu-output-tokens", "40"])
    argv = _argv(_partition(tmp_path, data), em.url, out, "--samples", "2", "--regenerate", "all")

    kill_after_first_commit(argv, _env(tmp_path), out, reap_pids)
    turns_done = turns_on_disk(out, "ds")
    assert 24 <= turns_done < 96
    sent_before = wait_idle(em.url)["num_requests_total"]  # the killed run's requests drained

    again = _run(tmp_path, argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"completed: 32 rows in {out}" in again.stdout
    assert committed_keys(out, "ds") == sorted((i, k) for i in ids for k in range(2))
    # journaled turns are never sent again: one request per turn not on disk
    assert metrics(em.url)["num_requests_total"] - sent_before == 96 - turns_done
    for row in committed_rows(out, "ds", ["messages", "turns", "content"]):
        assert [t["message_index"] for t in row["turns"]] == [2, 4]  # every earlier assistant turn, in order
        assert [row["messages"][t["message_index"]]["content"] for t in row["turns"]] == \
            [t["content"] for t in row["turns"]]


def test_truncation_retries_through_the_run_regenerate_length_finishes(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 8)
    out = tmp_path / "out"
    # answers of 20-60 tokens: every one finishes by length at 12, some at 36, none at 108
    em = emulator_factory(["--emu-decode-ms-per-step", "1", "--emu-output-tokens", "40"])
    part = _partition(tmp_path, data, max_new_tokens=12, extra_run="truncation = { factor = 3.0, max_new_tokens = 108 }")
    res = _run(tmp_path, _argv(part, em.url, out, "--truncation-retries", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"completed: 8 rows in {out}" in res.stdout
    rows = committed_rows(out, "ds", ["id", "finish_reason", "max_new_tokens", "truncation_retries"])
    assert sorted(r["id"] for r in rows) == ids
    assert {r["finish_reason"] for r in rows} == {"stop"}
    assert {r["truncation_retries"] for r in rows} <= {1, 2}
    assert all(r["max_new_tokens"] == 12 * 3 ** r["truncation_retries"] for r in rows)
    # one request per row, plus one per regeneration
    assert metrics(em.url)["num_requests_total"] == 8 + sum(r["truncation_retries"] for r in rows)


def test_two_runs_of_the_same_ids_on_one_shared_server_never_share_a_request_id(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory, reap_pids) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 40)
    log = tmp_path / "requests.log"
    em = emulator_factory(["--emu-decode-ms-per-step", "4", "--emu-output-tokens", "40",
                           "--emu-request-log", str(log)])
    part = _partition(tmp_path, data)
    procs = []
    for name in ("first", "second"):  # one after the other: each gets its own Prefect home
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen(_argv(part, em.url, tmp_path / name / "out"), cwd=REPO_ROOT,
                                      env=_env(tmp_path / name), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL))
        reap_pids.append(procs[-1].pid)
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, stderr[-3000:]
    for name in ("first", "second"):
        assert committed_keys(tmp_path / name / "out", "ds") == [(i, 0) for i in ids]
    events = [line.split(" ", 1) for line in log.read_text().splitlines()]
    # SGLang answers a rid already in flight with 400 "Duplicate request ID": none was refused
    assert [rid for ev, rid in events if ev == "duplicate"] == []
    received = [rid for ev, rid in events if ev == "recv"]
    assert len(received) == len(set(received)) == 80  # each run's rids its own
    assert sorted(rid.rpartition("@")[0] for rid in received) == sorted(ids * 2)


def test_a_lone_surrogate_in_one_row_is_a_reject_and_the_run_completes(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 40)
    with open(data, "a") as f:  # valid JSON, but "\ud800" is half a UTF-16 pair: no UTF-8 text
        f.write('{"id": "broken\\ud800", "messages": [{"role": "user", "content": "question \\ud800"}]}\n')
    out = tmp_path / "out"
    em = emulator_factory(["--emu-decode-ms-per-step", "1", "--emu-output-tokens", "20"])
    argv = _argv(_partition(tmp_path, data), em.url, out)
    res = _run(tmp_path, argv)
    assert res.returncode == 0, res.stderr[-3000:]  # it crashed in the request encoder, every rerun too
    assert f"completed: 40 rows in {out}" in res.stdout
    assert [r["id"] for r in committed_rows(out, "ds", ["id"])] == ids
    (reject,) = OutputDir(out).read_rejects("ds")
    assert reject["line"] == 41 and "lone surrogate \\ud800" in reject["reason"]
    again = _run(tmp_path, argv)  # a rerun finds the output complete
    assert again.returncode == 0, again.stderr[-3000:]
