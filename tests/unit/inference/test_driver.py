"""tasks.inference against the real emulator process: clean run, rejects, truncation, callbacks, refusals."""

from __future__ import annotations

import json
import shutil
import threading
import time
import traceback

import pyarrow.parquet as pq
import pytest

from tasks.inference import (
    ClientConfig,
    DatasetSpec,
    Endpoint,
    InferenceSettings,
    ServerGone,
    ServerPool,
    run_dataset,
)
from tasks.prompts import ChatTemplate
from tasks.shards import InputChanged, OutputDir
from tests.support.common import free_port
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import (
    EMU_ARGS,
    FAST_CLIENT,
    assert_exactly_once,
    committed_ids,
    metrics,
    rows_on_disk,
    run,
    wait_idle,
    write_input,
)


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS + ["--context-length", "400"])


def test_clean_run_every_id_once_with_rejects_columns_and_progress(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 100, bad_at=(3, 40), long_at=(7,))
    progress, committed = [], []
    r = run(inp, out, emulator.url, progress=progress.append, on_shard_committed=committed.append,
            sampling={"max_new_tokens": 40})
    # 102 records (2 bad lines), 16 per shard -> 7 shards
    assert (r.shards_total, r.shards_committed_now, r.rows_generated, r.rejects) == (7, 7, 99, 3)
    assert r.complete and r.requests == 100  # the long prompt's 400 is a request, not retried
    assert_exactly_once(out, ids)
    rejects = OutputDir(out).read_rejects("ds")
    assert sorted(x["line"] for x in rejects) == [4, 9, 42]
    too_long = [x for x in rejects if x.get("id") == "q00007"][0]
    assert too_long["status"] == 400 and "longer than the model's context length" in too_long["reason"]
    manifest = OutputDir(out).read_manifest()
    for k, s in manifest["datasets"]["ds"]["shards"].items():
        assert s["rows"] + s["rejects"] == (16 if int(k) < 6 else 102 - 96)
    assert manifest["datasets"]["ds"]["total_rows"] == 102 and manifest["datasets"]["ds"]["num_shards"] == 7
    assert [c.index for c in committed] == sorted(c.index for c in committed) or len(committed) == 7
    assert len(progress) == 7 and progress[-1].dataset_rows_done == 102 and progress[-1].shards_total == 7
    assert sum(p.rows for p in progress) == 99 and all(p.completion_tokens > 0 for p in progress)
    assert not list((out / "_journal" / "ds").glob("*.jsonl"))

    rows = [row for c in committed for row in pq.read_table(c.path).to_pylist()]
    tmpl = ChatTemplate.from_model_dir(DEMO_MODEL)
    row = rows[0]
    assert row["prompt"] == tmpl.render(row["messages"])
    assert row["model"] and row["server"] and json.loads(row["sampling"]) == {"max_new_tokens": 40}
    assert row["reasoning_parser"] == "qwen3" and row["think_in_prompt"] is False
    assert str(row["generated_at"].tzinfo) == "UTC" and row["latency_s"] > 0
    for row in rows:
        assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
        if row["finish_reason"] == "stop":
            assert row["reasoning"] is not None and row["raw"].startswith("<think>")
            assert row["raw"] == "<think>" + row["reasoning"] + "</think>" + row["content"]
        else:
            assert row["finish_reason"] == "length"
            if "</think>" not in row["raw"]:  # truncated inside the reasoning: kept, content empty
                assert row["content"] == "" and row["reasoning"] == row["raw"].removeprefix("<think>")
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}

    # a rerun of a complete output sends nothing
    before = metrics(emulator.url)["num_requests_total"]
    r2 = run(inp, out, emulator.url)
    assert r2.shards_skipped == 7 and r2.requests == 0 and r2.shards_committed_now == 0
    assert metrics(emulator.url)["num_requests_total"] == before
    assert_exactly_once(out, ids)


def test_changed_shard_size_or_input_refused_output_untouched(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 20)
    run(inp, out, emulator.url, shard=8)
    before = (out / "_manifest.json").read_bytes()
    with pytest.raises(InputChanged) as e:
        run(inp, out, emulator.url, shard=5)
    assert "shard size" in str(e.value) and "8" in str(e.value) and "5" in str(e.value)
    assert "--shard-size 8" in str(e.value)
    with open(inp, "a") as f:
        f.write(json.dumps({"id": "extra", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(InputChanged, match="fingerprint"):
        run(inp, out, emulator.url, shard=8)
    assert (out / "_manifest.json").read_bytes() == before
    assert sorted(committed_ids(out)) == ids


def test_callback_failure_stops_run_cleanly_then_resumes(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 80)

    class Gate(Exception):
        pass

    def gate(rec):
        if rec.index == 1 or len(OutputDir(out).committed_indices("ds")) >= 2:
            raise Gate(f"shard {rec.index} failed validation")

    with pytest.raises(Gate):
        run(inp, out, emulator.url, on_shard_committed=gate)
    assert OutputDir(out).lock_holder() is None  # lock released
    done = rows_on_disk(out)
    before = wait_idle(emulator.url)["num_requests_total"]  # cancelled requests drain first
    r = run(inp, out, emulator.url)
    assert r.requests == 80 - done and metrics(emulator.url)["num_requests_total"] - before == 80 - done
    assert_exactly_once(out, ids)


def _journaled(out) -> int:
    """Rows in the journal: answered and accounted, not yet in a committed shard."""
    return sum(j.read_bytes().count(b"\n") for j in out.glob("_journal/*/*.jsonl"))


def test_a_failing_gate_lets_no_shard_waiting_for_its_turn_commit(tmp_path, emulator):
    """The first shard's gate fails while the other shards, filled meanwhile, wait for the commit turn:
    only the judged shard is committed. ciL saw shard 1 committed after shard 0's gate failed: the turn
    goes to the next waiter before the TaskGroup cancels it, and its commit escapes the cancel when
    the committer thread takes it first. That last step is a race, so without the fix this test fails
    only sometimes; with it, never. Rows of the other shards stay journaled."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 48)  # 3 shards of 16, all 48 requests in flight at once
    before = metrics(emulator.url)["num_requests_total"]
    judged: list[int] = []

    class Gate(Exception):
        pass

    def gate(rec):
        judged.append(rec.index)
        deadline = time.monotonic() + 30
        while metrics(emulator.url)["num_requests_total"] - before < 48 and time.monotonic() < deadline:
            time.sleep(0.02)
        wait_idle(emulator.url)  # every answer is back: the other shards filled and wait for the turn
        while _journaled(out) < 48 - 16 and time.monotonic() < deadline:
            time.sleep(0.01)  # and the client has written their rows to the journal
        raise Gate(f"shard {rec.index} failed validation")

    with pytest.raises(Gate):
        run(inp, out, emulator.url, on_shard_committed=gate, concurrency=48)
    assert judged == sorted(OutputDir(out).committed_indices("ds")) and len(judged) == 1
    assert OutputDir(out).lock_holder() is None
    assert _journaled(out) == 48 - 16  # the other shards' rows stay journaled for the rerun


def test_prerendered_prompt_that_opens_think_is_split_as_forced(tmp_path, emulator):
    """A pre-rendered prompt that already opened <think>: kept as is, its generation split as forced."""
    opened = "<|im_start|>user\nThink first.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    a = tmp_path / "alpha.jsonl"
    a.write_text(json.dumps({"id": "open", "prompt": opened}) + "\n" + json.dumps(
        {"id": "plain", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}]}) + "\n")
    out = tmp_path / "out"
    settings = InferenceSettings(shard_size=2, sampling={"max_new_tokens": 200}, model_dir=DEMO_MODEL,
                                 client=FAST_CLIENT, run_info={"flow_run": "adhoc"})
    r = run_dataset(DatasetSpec("alpha", a), out, ServerPool.of(Endpoint(emulator.url, "test-server")), settings)
    assert (r.dataset, r.rows_generated, r.complete) == ("alpha", 2, True)
    rows = {r["id"]: r for rec in OutputDir(out).committed_shards("alpha") for r in pq.read_table(rec.path).to_pylist()}
    row = rows["open"]
    assert row["prompt"] == opened and row["messages"] == [] and row["think_in_prompt"] is True
    assert not row["raw"].startswith("<think>") and row["reasoning"] is not None
    if row["finish_reason"] == "stop":
        assert row["reasoning"] + "</think>" + row["content"] == row["raw"]
    plain = rows["plain"]
    assert plain["messages"] == [{"role": "user", "content": "hi"}] and plain["think_in_prompt"] is False
    assert plain["prompt"] == ChatTemplate.from_model_dir(DEMO_MODEL).render(plain["messages"])
    assert {r["server"] for r in rows.values()} == {"test-server"}


def test_empty_input_completes_and_unknown_parser_refused_before_any_request(tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("")
    dead = "http://127.0.0.1:9"  # nothing listens: any request would fail
    r = run_dataset(DatasetSpec("ds", inp), tmp_path / "out", ServerPool.of(Endpoint(dead, "f")),
                    InferenceSettings(model_dir=DEMO_MODEL, shard_size=4, concurrency=2, model_name="m",
                                      client=FAST_CLIENT))
    assert (r.complete, r.shards_total, r.requests) == (True, 0, 0)
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        run_dataset(DatasetSpec("ds", inp), tmp_path / "out2", ServerPool.of(Endpoint(dead, "f")),
                    InferenceSettings(model_dir=DEMO_MODEL, shard_size=4, reasoning_parser="nope"))
    assert not (tmp_path / "out2").exists()


def test_server_gone_traceback_is_a_clean_chain(tmp_path):
    # run_dataset probes for a running event loop; that probe's RuntimeError must not head the chain.
    inp = tmp_path / "in.jsonl"
    write_input(inp, 4)
    with pytest.raises(ServerGone) as e:
        run(inp, tmp_path / "out", f"http://127.0.0.1:{free_port()}")
    text = "".join(traceback.format_exception(e.value))
    assert "no running event loop" not in text, text
    chain, exc = [], e.value
    while exc is not None:
        chain.append(type(exc).__name__)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    assert "RuntimeError" not in chain and chain[0] == "ServerGone", chain


def test_dead_server_process_raises_server_gone_at_once(tmp_path, sim_gpus, emulator_factory):
    # Default client settings (6 attempts, 0.5 s backoff base: ~9.5 s of retries on "refused"); the
    # liveness check turns the crash into ServerGone without those retries.
    em = emulator_factory(EMU_ARGS + ["--emu-crash-after", "60"])
    inp = tmp_path / "in.jsonl"
    write_input(inp, 200)
    crashed: list[float] = []
    watcher = threading.Thread(target=lambda: (em.proc.wait(), crashed.append(time.monotonic())), daemon=True)
    watcher.start()
    with pytest.raises(ServerGone) as e:
        run(inp, tmp_path / "out", em.url, shard=32, client=ClientConfig(),
            server_alive=lambda: em.proc.poll() is None)
    gone = time.monotonic()
    watcher.join(timeout=5)
    assert crashed and gone - crashed[0] < 2.0, f"ServerGone {gone - crashed[0]:.2f} s after the crash"
    assert "its server process is dead" in str(e.value) and "rerun to resume" in str(e.value)
    assert "no running event loop" not in "".join(traceback.format_exception(e.value))


def test_template_and_context_length_rejects_keep_the_input_row(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 4, long_at=(1,))
    lines = inp.read_text().splitlines()
    # The demo model's template refuses a tool turn before the first user turn.
    bad_roles = json.dumps({"id": "roles", "messages": [{"role": "tool", "content": "t"},
                                                        {"role": "user", "content": "u"}]})
    inp.write_text("\n".join([*lines, bad_roles]) + "\n")
    r = run(inp, out, emulator.url, sampling={"max_new_tokens": 20})
    assert (r.rows_generated, r.rejects) == (3, 2)
    rejects = {x["id"]: x for x in OutputDir(out).read_rejects("ds")}
    assert rejects["q00001"]["raw"] == lines[1] and rejects["q00001"]["status"] == 400
    assert rejects["q00001"]["reason"].startswith("prompt too long: ")
    assert rejects["roles"]["raw"] == bad_roles
    assert rejects["roles"]["reason"].startswith("chat template failed: ")


@pytest.fixture
def gpt_oss_model(tmp_path):
    """The demo model directory as a gpt-oss checkpoint (Harmony output, gpt-oss parser)."""
    model = tmp_path / "gpt-oss-demo"
    shutil.copytree(DEMO_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("sampling, markers", [
    ({"max_new_tokens": 200}, True),  # datagen asks to keep the special tokens: the Harmony parse
    ({"max_new_tokens": 200, "skip_special_tokens": True}, False),  # markers dropped: the text fallback
])
def test_gpt_oss_rows_split_from_harmony_markers_or_from_the_text_fallback(
        tmp_path, sim_gpus, emulator_factory, gpt_oss_model, sampling, markers):
    em = emulator_factory(EMU_ARGS + ["--model-path", str(gpt_oss_model)])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 3)
    r = run_dataset(DatasetSpec("ds", inp), out, ServerPool.of(Endpoint(em.url, "test-server")),
                    InferenceSettings(shard_size=16, model_dir=gpt_oss_model, sampling=sampling, concurrency=4,
                                      client=FAST_CLIENT))
    assert r.complete and r.rows_generated == 3
    rows = [row for rec in OutputDir(out).committed_shards("ds") for row in pq.read_table(rec.path).to_pylist()]
    for row in rows:
        assert row["reasoning_parser"] == "gpt-oss" and row["finish_reason"] == "stop"
        assert ("<|channel|>analysis<|message|>" in row["raw"]) is markers
        assert ("<|" in row["raw"]) is markers
        assert row["reasoning"] and row["content"]
        assert "<|" not in row["reasoning"] + row["content"]
        assert row["reasoning"].split()[0] in ("Okay", "First", "Let", "Hmm", "So", "Now", "Wait")
        assert row["content"] in row["raw"] and row["reasoning"] in row["raw"]
        assert json.loads(row["sampling"]) == sampling  # the configured sampling, as the rows record it
