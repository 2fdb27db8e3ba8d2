"""Several samples per prompt and whole-conversation regeneration against the real emulator: one row
per (id, sample) with its derived seed, rejects counted per sample, turns generated from the model's
own earlier turns, refusals of a resume with other samples or mode, and outputs of an older schema."""

from __future__ import annotations

import hashlib
import io
import json

import orjson
import pyarrow.parquet as pq
import pytest

from tasks.export import export
from tasks.inference import conversation_slots, derive_seed
from tasks.prompts import ChatTemplate
from tasks.schema import ADDED_DEFAULTS, conform
from tasks.shards import InputChanged, OutputDir, UnrecordedShards
from tasks.validation import validate_output
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import (
    EMU_ARGS,
    committed_keys,
    committed_rows,
    metrics,
    run,
    wait_idle,
    write_conversations,
    write_input,
)


class Stop(Exception):
    pass


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS + ["--context-length", "400"])


def _stop_after_one_shard(inp, out, url, **settings) -> None:
    """A run of shards of 8 stopped once its first shard committed (2 requests in flight, so that the
    later shards are not all generated, and committed, before the gate's exception stops the run)."""
    def gate(rec):
        raise Stop(f"stop after shard {rec.index}")

    with pytest.raises(Stop):
        run(inp, out, url, shard=8, on_shard_committed=gate, concurrency=2, **settings)
    assert not OutputDir(out).read_manifest()["datasets"]["ds"].get("complete")


def _checks(report) -> dict[str, str]:
    return {c.name: c.status for c in report.datasets[0].checks}


def test_samples_one_row_per_id_and_sample_with_derived_seeds(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 20, bad_at=(5,), long_at=(9,))
    r = run(inp, out, emulator.url, shard=8, samples=3)
    usable = [i for i in ids if i != "q00009"]
    assert committed_keys(out) == sorted((i, k) for i in usable for k in range(3))
    assert r.rows_generated == 57 and r.requests == 60  # the long prompt: one 400 per sample
    rejects = OutputDir(out).read_rejects("ds")
    assert sorted((x["line"], x.get("sample")) for x in rejects) == [(6, None), (11, 0), (11, 1), (11, 2)]
    manifest = OutputDir(out).read_manifest()
    entry = manifest["datasets"]["ds"]
    assert entry["generation"] == {"samples": 3, "regenerate": "last"} and entry["total_rows"] == 21
    # rows and rejects per (record, sample): 8 records x 3 per full shard, 5 x 3 in the last
    assert [s["rows"] + s["rejects"] for _, s in sorted(entry["shards"].items())] == [24, 24, 15]

    rows = committed_rows(out)
    assert all(row["sampling_seed"] == derive_seed(0, row["id"], row["sample"]) for row in rows)
    assert len({row["sampling_seed"] for row in rows}) == len(rows)
    by_id: dict[str, set[str]] = {}
    for row in rows:
        by_id.setdefault(row["id"], set()).add(row["raw"])
        assert row["turns"] is None and json.loads(row["sampling"]) == {"max_new_tokens": 64}
    assert all(len(texts) == 3 for texts in by_id.values())  # three samples, three answers

    checks = _checks(validate_output(out, write=False))
    assert checks["complete"] == "pass" and checks["unique_ids"] == "pass"

    # the same seed gives the same text: a second output of two samples repeats samples 0 and 1
    out2 = tmp_path / "out2"
    run(inp, out2, emulator.url, shard=8, samples=2)
    first = {(row["id"], row["sample"]): row["raw"] for row in rows}
    assert {(row["id"], row["sample"]): row["raw"] for row in committed_rows(out2)} == {
        k: v for k, v in first.items() if k[1] < 2}
    # another base seed, other seeds and other answers
    out3 = tmp_path / "out3"
    run(inp, out3, emulator.url, shard=8, samples=1, sampling={"max_new_tokens": 64, "sampling_seed": 7})
    again = committed_rows(out3)
    assert all(row["sampling_seed"] == derive_seed(7, row["id"], 0) for row in again)
    assert sum(row["raw"] != first[(row["id"], 0)] for row in again) > len(again) // 2

    # a rerun of the complete output sends nothing
    before = wait_idle(emulator.url)["num_requests_total"]
    assert run(inp, out, emulator.url, shard=8, samples=3).requests == 0
    assert metrics(emulator.url)["num_requests_total"] == before


def test_resume_with_other_samples_or_mode_is_refused_then_resumes(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 30)
    _stop_after_one_shard(inp, out, emulator.url, samples=2)
    before = wait_idle(emulator.url)["num_requests_total"]
    with pytest.raises(InputChanged) as info:
        run(inp, out, emulator.url, shard=8, samples=3)
    assert "samples" in str(info.value) and "--samples 2" in str(info.value)
    with pytest.raises(InputChanged) as info:
        run(inp, out, emulator.url, shard=8, samples=2, regenerate="all")
    assert "--regenerate last" in str(info.value)
    assert metrics(emulator.url)["num_requests_total"] == before
    run(inp, out, emulator.url, shard=8, samples=2)
    assert committed_keys(out) == sorted((i, k) for i in ids for k in range(2))


def test_regenerate_all_every_turn_from_the_models_own_turns(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_conversations(inp, 5, turns=3)
    before = wait_idle(emulator.url)["num_requests_total"]
    r = run(inp, out, emulator.url, shard=2, samples=2, regenerate="all", sampling={"max_new_tokens": 24})
    assert committed_keys(out) == sorted((i, k) for i in ids for k in range(2))
    assert r.requests == 5 * 2 * 3 == metrics(emulator.url)["num_requests_total"] - before
    template = ChatTemplate.from_model_dir(DEMO_MODEL)
    rows = committed_rows(out)
    for row in rows:
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert [t["message_index"] for t in row["turns"]] == conversation_slots(messages)[:-1] == [2, 4]
        for t in row["turns"]:
            assert messages[t["message_index"]]["content"] == t["content"]
            assert not t["content"].startswith("original answer")
            assert t["prompt_tokens"] > 0 and t["completion_tokens"] > 0
        assert row["prompt"] == template.render(messages)  # the last turn saw the model's own turns
        assert row["sampling_seed"] == derive_seed(0, row["id"], row["sample"])
    samples_differ = {row["id"]: set() for row in rows}
    for row in rows:
        samples_differ[row["id"]].add(row["turns"][0]["raw"])
    assert all(len(v) == 2 for v in samples_differ.values())
    checks = _checks(validate_output(out, write=False))
    assert checks["complete"] == "pass" and checks["unique_ids"] == "pass"


def test_conversation_slots_skip_assistant_turns_before_the_first_user_turn():
    roles = ["assistant", "user", "assistant", "tool", "assistant", "user"]
    assert conversation_slots([{"role": r, "content": "x"} for r in roles]) == [2, 4, 6]
    assert conversation_slots([{"role": "user", "content": "x"}]) == [1]


def test_an_output_of_the_older_schema_resumes_validates_and_exports(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 30)
    _stop_after_one_shard(inp, out, emulator.url)
    # make it an output of the older datagen: shard 0 without the added columns, no `generation`
    o = OutputDir(out)
    manifest = o.read_manifest()
    rec = next(o.committed_shards("ds"))
    table = pq.read_table(rec.path)
    pq.write_table(table.drop_columns(list(ADDED_DEFAULTS)), rec.path, compression="zstd")
    manifest["datasets"]["ds"]["shards"][str(rec.index)]["sha256"] = hashlib.sha256(rec.path.read_bytes()).hexdigest()
    del manifest["datasets"]["ds"]["generation"]
    (out / "_manifest.json").write_bytes(orjson.dumps(manifest))

    with pytest.raises(InputChanged, match="--samples 1"):
        run(inp, out, emulator.url, shard=8, samples=2)
    run(inp, out, emulator.url, shard=8)
    assert committed_keys(out) == sorted((i, 0) for i in ids)
    checks = _checks(validate_output(out, write=False))
    assert checks["complete"] == "pass" and checks["unique_ids"] == "pass" and checks["schema"] == "pass"
    assert checks["provenance"] == "pass"  # the older shard's unknown provenance is no second value
    old = conform(pq.read_table(rec.path))  # the shard written by the "older datagen", as read now
    assert old.column("max_new_tokens").to_pylist() == [64] * old.num_rows  # from its `sampling` JSON
    assert set(old.column("budget_capped").to_pylist()) == {False} and set(old.column("model_revision").to_pylist()) == {None}
    sink = io.StringIO()
    assert export(out, "openai-messages", sink, include_truncated=True).rows == 30
    assert all("sample" not in json.loads(line) for line in sink.getvalue().splitlines())  # one sample: as before


def test_derived_seeds_are_pinned_in_range_and_distinct():
    # pinned: a changed derivation would make the seeds recorded in existing outputs unreproducible
    assert derive_seed(0, "q00000", 0) == int.from_bytes(hashlib.sha256(b"0\x00q00000\x000").digest()[:8], "big") >> 1
    seeds = {derive_seed(base, f"q{i}", k) for base in (0, 1, -(2**63)) for i in range(50) for k in range(4)}
    assert len(seeds) == 600 and all(0 <= s < 2**63 for s in seeds)


def test_lost_manifest_adopts_shards_of_samples_and_conversations_only_with_their_settings(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_conversations(inp, 6, turns=2)
    run(inp, out, emulator.url, shard=4, samples=2, regenerate="all", sampling={"max_new_tokens": 16})
    (out / "_manifest.json").unlink()
    before = wait_idle(emulator.url)["num_requests_total"]
    for settings, why in [({"samples": 3, "regenerate": "all"}, "records x 3 samples of input slice 0"),
                          ({"samples": 2, "regenerate": "last"}, "not generated with --regenerate last")]:
        with pytest.raises(UnrecordedShards, match=why):
            run(inp, out, emulator.url, shard=4, sampling={"max_new_tokens": 16}, **settings)
        assert not (out / "_manifest.json").exists()
    r = run(inp, out, emulator.url, shard=4, samples=2, regenerate="all", sampling={"max_new_tokens": 16})
    assert r.recovered["rebuilt_shards"] == 2 and r.requests == 0
    assert metrics(emulator.url)["num_requests_total"] == before
    entry = OutputDir(out).read_manifest()["datasets"]["ds"]
    assert entry["generation"] == {"samples": 2, "regenerate": "all"} and entry["complete"]
    assert committed_keys(out) == sorted((i, k) for i in ids for k in range(2))
