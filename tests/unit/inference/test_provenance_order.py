"""Per-row provenance and the cache-aware send order, against the real emulator process."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emulator.textgen import count_tokens
from tasks.inference import InferenceSettings, model_revision, prefix_order, template_hash
from tasks.prompts import ChatTemplate
from tasks.shards import OutputDir
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import EMU_ARGS, run


def committed_rows(out: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for rec in sorted(OutputDir(out).committed_shards("ds"), key=lambda r: r.index):
        rows.extend(pq.read_table(rec.path).to_pylist())
    return rows


# --------------------------------------------------------------------------------------- provenance
def test_model_revision_hashes_config_and_index_not_the_path(tmp_path):
    config = (DEMO_MODEL / "config.json").read_bytes()
    expected = "sha256:" + hashlib.sha256(b"config.json\0" + config + b"\0").hexdigest()[:16]
    assert model_revision(DEMO_MODEL) == expected
    copy = tmp_path / "models--org--demo" / "snapshots" / "abc123"
    copy.mkdir(parents=True)
    (copy / "config.json").write_bytes(config)
    assert model_revision(copy) == expected  # same files elsewhere: same revision
    (copy / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert model_revision(copy) != expected
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "model.safetensors").write_bytes(b"x" * 10)
    assert model_revision(tmp_path / "single") == (
        "sha256:" + hashlib.sha256(b"model.safetensors\x0010\x00").hexdigest()[:16])
    assert model_revision(tmp_path / "missing") is None and model_revision(None) is None


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS)


def test_rows_record_provenance_and_each_call_of_a_run_is_the_next_attempt(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    with open(inp, "w") as f:
        for i in range(60):
            row = ({"id": f"p{i}", "prompt": f"<|im_start|>user\nq {i}<|im_end|>\n<|im_start|>assistant\n"}
                   if i % 5 == 4 else {"id": f"m{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
            f.write(json.dumps(row) + "\n")

    class Stop(Exception):
        pass

    def stop_after_first(rec):  # type: ignore[no-untyped-def]
        raise Stop

    with pytest.raises(Stop):
        run(inp, out, emulator.url, shard=4, on_shard_committed=stop_after_first, run_info={"flow_run": "fr-1"},
            concurrency=4)
    r = run(inp, out, emulator.url, shard=4, run_info={"flow_run": "fr-1"})
    rows = committed_rows(out)
    assert [x["id"] for x in rows] == [f"{'p' if i % 5 == 4 else 'm'}{i}" for i in range(60)]
    source = ChatTemplate.from_model_dir(DEMO_MODEL).source
    tmpl = "sha256:" + hashlib.sha256(source.encode()).hexdigest()[:16]
    assert template_hash(source) == tmpl
    for x in rows:
        assert (x["model_revision"], x["engine"], x["engine_version"], x["run_id"]) == (
            model_revision(DEMO_MODEL), "emulator", "0.5.23", "fr-1")
        assert x["chat_template_hash"] == (None if str(x["id"]).startswith("p") else tmpl)
    # shard 0 came from the first call; the rows the second call generated say attempt 2
    assert {x["attempt"] for x in rows[:4]} == {1}
    assert sum(1 for x in rows if x["attempt"] == 2) == r.rows_generated > 0
    assert OutputDir(out).read_manifest()["datasets"]["ds"]["attempts"] == {"fr-1": 2}

    again = run(inp, out, emulator.url, shard=4)  # complete: nothing generated, the call still counted
    assert again.rows_generated == 0
    attempts = OutputDir(out).read_manifest()["datasets"]["ds"]["attempts"]
    assert len(attempts) == 2 and [k for k in attempts if k != "fr-1"][0].startswith("local-")


# -------------------------------------------------------------------------------------------- order
SYSTEMS = {name: f"{name} assistant. " + " ".join(f"{name.lower()}{j}" for j in range(80))
           for name in ("Alpha", "Beta", "Gamma")}


def test_prefix_order_groups_rows_sharing_a_prefix_and_keeps_the_rest_in_place():
    a, b = "S" * 300, "T" * 300
    prompts = [a + "1", "x1", b + "1", a + "2", "x2", b + "2", a + "3"]
    assert prefix_order(prompts) == [0, 3, 6, 1, 2, 5, 4]
    assert prefix_order(prompts, min_shared=400) == list(range(7))  # nothing shares that much
    # what every prompt shares (a chat template's header) does not make a group by itself
    head = "H" * 1000
    assert prefix_order([head + p for p in ("b", "a", "c")]) == [0, 1, 2]
    assert prefix_order([]) == [] and prefix_order(["only"]) == [0]


def test_window_size_follows_concurrency_within_bounds():
    s = InferenceSettings(shard_size=10)
    assert (s.window_for(4), s.window_for(100), s.window_for(10_000)) == (256, 3200, 4096)
    assert InferenceSettings(shard_size=10, order_window=7).window_for(100) == 7
    assert InferenceSettings(shard_size=10, order="input").window_for(100) == 1
    with pytest.raises(ValueError, match="order must be one of prefix, input, got 'lpm'"):
        InferenceSettings(shard_size=10, order="lpm")


@pytest.fixture
def small_pool(sim_gpus, emulator_factory):
    # A KV pool that holds about one prompt: what is not sent together is evicted before its reuse.
    return emulator_factory(EMU_ARGS + ["--max-total-tokens", "160"])


def test_prefix_order_sends_groups_together_stores_input_order_and_hits_the_cache(tmp_path, small_pool):
    inp = tmp_path / "in.jsonl"
    names = list(SYSTEMS)
    with open(inp, "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"r{i:02d}", "messages": [
                {"role": "system", "content": SYSTEMS[names[i % 3]]},
                {"role": "user", "content": f"question {i:02d}"}]}) + "\n")
    results, sent = {}, {}
    for order in ("input", "prefix"):
        out = tmp_path / order
        results[order] = run(inp, out, small_pool.url, shard=5, concurrency=1, order=order)
        rows = committed_rows(out)
        assert [x["id"] for x in rows] == [f"r{i:02d}" for i in range(12)]  # stored in input order
        sent[order] = [x["id"] for x in sorted(rows, key=lambda x: x["generated_at"])]
    assert sent["input"] == [f"r{i:02d}" for i in range(12)]
    assert sent["prefix"] == [f"r{i:02d}" for i in (0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11)]
    system_tokens = count_tokens(SYSTEMS["Alpha"])
    # ordered: 3 of each group of 4 find their system prompt cached; in input order it is always evicted
    assert results["prefix"].cached_tokens >= 9 * system_tokens > 3 * results["input"].cached_tokens
