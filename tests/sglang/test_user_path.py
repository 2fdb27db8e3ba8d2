"""`datagen run` as a user runs it against real SGLang on CPU, launching the server itself.

`datagen run --partition P --out OUT`, where P's `[server] python` names the real SGLang environment,
so datagen itself cleans the (simulated) GPU, launches SGLang, checks its health, generates, validates
and stops it: a plain run with a near-context prompt, one too long for the context, truncation
retries and provenance, then `datagen export` and the dataset card.

`datagen run --server-url URL` against a running real server (killed, then resumed with the identical
command) is in test_differential.py, on that module's real server: each real launch costs about 40 s
of CPU here.

Every request asks for a fixed number of tokens with ``ignore_eos`` (tests/support/sglang.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil
import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.support.inference import committed_rows
from tests.support.runs import records
from tests.support.sglang import CONTEXT, DATAGEN, run_datagen, run_partition

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


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
    part = run_partition(tmp_path, data, tiny_model, sglang_env, shard=3, max_new_tokens=4,
                      run_extra="truncation = { factor = 2.0, max_new_tokens = 16 }\ncapacity_probe_tokens = 16")

    # 8 batch slots (CPU SGLang reports 1,024 of its own): the capacity probe sends one request per slot
    part.write_text(part.read_text().replace("\n[run]\n", "\nmax_running_requests = 8\n[run]\n"))
    res = run_datagen(tmp_path, [DATAGEN, "run", "--partition", str(part), "--out", str(out), "--truncation-retries", "2"])
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
    # (random weights sample a stray <think> token about once in 3,900: such a row is split, as it must be)
    assert all(r["raw"] and r["content"] == r["raw"] and r["reasoning"] is None for r in got.values()
               if "think>" not in r["raw"])
    assert {r["reasoning_parser"] for r in got.values()} == {"qwen3"}
    assert {(r["engine"], r["engine_version"]) for r in got.values()} == {("sglang", "0.5.23")}
    assert len({r["chat_template_hash"] for r in got.values()}) == 1 and near["chat_template_hash"]
    assert json.loads(near["sampling"])["max_new_tokens"] == 4  # the configured budget, per row
    # the missing-reasoning hint on real rows (issue 48 item 3): its example shows what the message says,
    # and a re-split with the parser already used is suggested only with the rows it would change
    report = json.loads((out / "_validation.json").read_text())
    (hint,) = [c["message"] for c in report["datasets"]["ds"]["total"] if c["name"] == "reasoning_present"]
    example = re.search(r"\(e\.g\. id (\S+)\)", hint).group(1)  # type: ignore[union-attr]
    assert ("</think>" in got[example]["raw"]) == ("holds </think>" in hint.split(";")[0]), hint
    if "--parser qwen3`" in hint:
        assert re.search(r"--parser qwen3` \(re-split with qwen3, [1-9]\d* of the", hint), hint
    rejects = OutputDir(out).read_rejects("ds")
    assert [x.get("id") for x in rejects] == ["toolong"]
    assert "longer than the model's context length" in json.dumps(rejects[0])
    # goodput (issue 44): the real server's capacity was probed after its health check, and every
    # second of its lifecycle is in one bucket; the truncation retries' first answers are wasted
    summary = json.loads((out / "_last_run.json").read_text())
    (server,) = summary["ledger"]["servers"].values()
    cap = server["capacity"]
    assert cap["tokens_per_s"] > 0 and cap["slots"] >= 1 and cap["seconds"] > 0, cap
    assert sum(server["seconds"].values()) == pytest.approx(server["total_s"], abs=0.01)
    assert server["seconds"]["launch"] > 0 and server["seconds"]["health"] > 0 and server["seconds"]["serving"] > 0
    # 4 in flight on a server of 8 slots: half of them empty while rows are to come
    assert cap["slots"] == 8 and server["seconds"]["underfilled"] > 0
    # 4 rows answered 4 then 8 tokens before their kept 16, "near" 4 before its 8: 52 tokens thrown away
    assert server["wasted_tokens"] == 52 and server["seconds"]["wasted"] > 0
    assert server["kept_tokens"] == summary["completion_tokens"] - 52
    assert 0 < summary["ledger"]["goodput"] < 1
    assert "GPU-time ledger:" in res.stdout and f"capacity {cap['tokens_per_s']:,.0f} tokens/s" in res.stdout
    # the server datagen launched is stopped: nothing of it is left
    recs = list(records(tmp_path).values())
    assert [s["state"] for r in recs for s in r.get("servers", [])] == ["stopped"]
    assert not any(psutil.pid_exists(s["pid"]) for r in recs for s in r.get("servers", []))

    exported = tmp_path / "export.jsonl"
    ex = run_datagen(tmp_path, [DATAGEN, "export", str(out), "--format", "openai-messages", "--out", str(exported),
                                "--include-truncated"])
    assert ex.returncode == 0, ex.stderr
    records_out = [json.loads(line) for line in exported.read_text().splitlines()]
    assert sorted(r["id"] for r in records_out) == sorted(got)
    assert records_out[0]["messages"][-1]["role"] == "assistant"

    card = (out / "README.md").read_text()
    assert "launched SGLang" in card and "cleaned" in card
