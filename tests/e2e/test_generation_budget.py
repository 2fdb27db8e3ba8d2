"""The generation budget end to end against the emulator: an over-long budget capped to the context and
stored, a prompt that alone does not fit rejected with the server's message, truncated rows generated
again with a larger budget (stored once, also across kill -9 and resume), and validation counting
what is finally stored."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from tasks.inference import ServerGone, TruncationPolicy
from tasks.shards import OutputDir
from tasks.validation import validate_output
from tests.support.inference import EMU_ARGS, assert_exactly_once, metrics, rows_on_disk, run, start_driver


def _write(path: Path, contents: list[str]) -> list[str]:
    ids = [f"q{i:05d}" for i in range(len(contents))]
    with open(path, "w") as f:
        for row_id, text in zip(ids, contents, strict=True):
            f.write(json.dumps({"id": row_id, "messages": [{"role": "user", "content": text}]}) + "\n")
    return ids


def _stored(out: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for rec in OutputDir(out).committed_shards("ds"):
        for row in pq.read_table(rec.path).to_pylist():
            assert row["id"] not in rows, f"{row['id']} stored twice"
            rows[row["id"]] = row
    return rows


def _natural(url: str, prompt: str, seed: int | None) -> dict[str, Any]:
    """The emulator's whole answer to ``prompt`` with the row's ``sampling_seed`` (its text does not
    depend on the budget)."""
    r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2000,
                                                                               "sampling_seed": seed}},
                   timeout=30, trust_env=False)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    return body


def test_overlong_budget_is_capped_and_stored_and_a_prompt_alone_too_long_is_rejected(
        tmp_path, sim_gpus, emulator_factory):
    em = emulator_factory(EMU_ARGS + ["--context-length", "400", "--emu-output-tokens", "1000"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    medium = " ".join(f"m{j}" for j in range(150))  # fits, but leaves less than 300 tokens
    long = " ".join(f"w{j}" for j in range(600))  # longer than the whole context
    _write(inp, ["short question 0", medium, "short question 2", long, "short question 4"])
    r = run(inp, out, em.url, shard=8, sampling={"max_new_tokens": 300})
    assert (r.rows_generated, r.rows_capped, r.rejects) == (4, 1, 1)
    assert r.requests == 4 + 1 + 1  # the capped row was sent twice, the rejected one once
    rows = _stored(out)
    assert sorted(rows) == ["q00000", "q00001", "q00002", "q00004"]
    capped = rows["q00001"]
    # the room less SGLang's scheduler reserve of 2: the budget it generates in full
    assert capped["budget_capped"] is True and capped["max_new_tokens"] == 400 - 2 - capped["prompt_tokens"]
    assert capped["finish_reason"] == "length" and capped["completion_tokens"] == capped["max_new_tokens"]
    assert json.loads(capped["sampling"]) == {"max_new_tokens": 300}  # the configured sampling, as resume checks
    for row_id in ("q00000", "q00002", "q00004"):
        row = rows[row_id]
        assert (row["budget_capped"], row["max_new_tokens"], row["completion_tokens"]) == (False, 300, 300)
        assert (row["truncation_retries"], row["truncation_policy"]) == (0, None)
    (reject,) = OutputDir(out).read_rejects("ds")
    prompt_tokens = int(reject["reason"].split("(")[1].split(" ")[0])
    assert reject["id"] == "q00003" and reject["status"] == 400 and prompt_tokens > 400
    assert reject["reason"] == (f"prompt too long: The input ({prompt_tokens} tokens) is longer than the model's "
                                f"context length (400 tokens).")


def test_truncated_rows_are_generated_again_with_a_larger_budget_and_validation_counts_what_is_stored(
        tmp_path, sim_gpus, emulator_factory):
    em = emulator_factory(EMU_ARGS)  # answers of about 40 tokens
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = _write(inp, [f"question number {i}" for i in range(16)])
    policy = TruncationPolicy(retries=1, factor=4.0)
    r = run(inp, out, em.url, shard=8, sampling={"max_new_tokens": 8}, truncation=policy)
    rows = _stored(out)
    assert sorted(rows) == ids
    outcome: dict[str, str] = {}
    for row_id, row in rows.items():
        whole = _natural(em.url, row["prompt"], row["sampling_seed"])
        n = whole["meta_info"]["completion_tokens"]
        # 8 tokens first; a row cut there is generated once more with 32; the first answer is not stored
        expected = (0, 8, "stop") if n <= 8 else (1, 32, "stop") if n <= 32 else (1, 32, "length")
        got = (row["truncation_retries"], row["max_new_tokens"], row["finish_reason"])
        assert got == expected, (row_id, n)
        assert row["raw"] == (whole["text"] if n <= 32 else row["raw"]) and row["budget_capped"] is False
        assert json.loads(row["truncation_policy"]) == {"factor": 4.0, "max_new_tokens": None, "retries": 1}
        outcome[row_id] = got[2] if got[0] else "first"
    assert {"stop", "length"} <= set(outcome.values())  # both outcomes of a regeneration occur
    regenerated = sum(1 for v in outcome.values() if v != "first")
    assert r.truncation_retries == regenerated and r.requests == len(ids) + regenerated
    # the truncation rate counts the stored rows, not the first answers (most of which were cut at 8)
    still_cut = sum(1 for v in outcome.values() if v == "length")
    report = validate_output(out, write=False)
    (check,) = [c for c in report.datasets[0].checks if c.name == "truncation"]
    assert check.value == still_cut / len(ids) < regenerated / len(ids)


def test_kill_9_during_a_regeneration_then_resume_stores_each_row_once(
        tmp_path, sim_gpus, emulator_factory, reap_pids):
    # 20 ms per decode step: a first answer (2 tokens) takes ~40 ms, a regeneration (~40 tokens) ~1 s
    em = emulator_factory(EMU_ARGS + ["--emu-decode-ms-per-step", "20"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = _write(inp, [f"question number {i}" for i in range(8)])
    truncation = {"retries": 1, "factor": 100.0}
    proc = start_driver(inp, out, em.url, shard=8, conc=8, sampling={"max_new_tokens": 2}, truncation=truncation)
    reap_pids.append(proc.pid)
    deadline = time.monotonic() + 30
    while True:  # every first answer is in, and only regenerations are running
        m = metrics(em.url)
        if m["num_requests_total"] >= len(ids) and m["num_running_reqs"] > 0:
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode() if proc.stderr else ""
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    done = rows_on_disk(out)
    assert done < len(ids)  # the regenerations in flight journaled nothing
    r = run(inp, out, em.url, shard=8, sampling={"max_new_tokens": 2}, truncation=TruncationPolicy(**truncation))
    assert r.rows_generated == len(ids) - done and r.rows_resumed == done
    assert r.requests == r.rows_generated + r.truncation_retries
    assert_exactly_once(out, ids)
    rows = _stored(out)
    assert all(row["max_new_tokens"] == (200 if row["truncation_retries"] else 2) for row in rows.values())


def test_rows_journaled_by_an_older_datagen_commit_with_the_budget_they_were_generated_with(
        tmp_path, sim_gpus, emulator_factory):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = _write(inp, [f"question number {i}" for i in range(6)])
    crashing = emulator_factory(EMU_ARGS + ["--emu-crash-after", "3"], wait_ready=True)
    with pytest.raises(ServerGone):
        run(inp, out, crashing.url, shard=8, concurrency=1, sampling={"max_new_tokens": 64})
    crashing.wait_exit(timeout=15)
    journal = OutputDir(out).journal_path("ds", 0)
    old = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(old) == 3 and all(rec["max_new_tokens"] == 64 for rec in old)
    budget = ("max_new_tokens", "budget_capped", "truncation_retries", "truncation_policy")
    journal.write_text("".join(json.dumps({k: v for k, v in rec.items() if k not in budget}) + "\n" for rec in old))
    r = run(inp, out, emulator_factory(EMU_ARGS).url, shard=8, sampling={"max_new_tokens": 64},
            truncation=TruncationPolicy(retries=1))
    assert (r.rows_resumed, r.rows_generated) == (3, 3)
    assert_exactly_once(out, ids)
    rows = _stored(out)
    for rec in old:
        row = rows[rec["id"]]
        assert row["raw"] == rec["raw"]
        assert (row["max_new_tokens"], row["budget_capped"], row["truncation_retries"], row["truncation_policy"]) == (
            64, False, 0, None)
