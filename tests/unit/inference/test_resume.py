"""A resume must keep the sampling and reasoning parser of the rows the output holds: refused before any
request otherwise, against the real emulator and real output files."""

from __future__ import annotations

import pytest

from tasks.export import resplit
from tasks.inference import RequestRejected
from tasks.shards import InputChanged, OutputDir
from tasks.validation import validate_output
from tests.support.inference import (
    EMU_ARGS,
    assert_exactly_once,
    metrics,
    rows_on_disk,
    run,
    wait_idle,
    write_input,
)

SAMPLING = {"max_new_tokens": 64}


class Stop(Exception):
    pass


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS)


def _partial(tmp_path, url) -> tuple[object, object, list[str]]:
    """An output of 80 rows stopped once shard 0 (of 16 rows) committed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 80)

    def gate(rec):
        raise Stop(f"stop after shard {rec.index}")

    with pytest.raises(Stop):
        run(inp, out, url, sampling=SAMPLING, on_shard_committed=gate)
    assert OutputDir(out).committed_indices("ds")
    return inp, out, ids


def _refused(inp, out, url, **settings) -> InputChanged:
    before = wait_idle(url)["num_requests_total"]
    with pytest.raises(InputChanged) as info:
        run(inp, out, url, **settings)
    assert metrics(url)["num_requests_total"] == before  # refused before any request
    return info.value


def test_changed_sampling_is_refused_naming_old_and_new_values(tmp_path, emulator):
    inp, out, ids = _partial(tmp_path, emulator.url)
    assert OutputDir(out).read_manifest()["datasets"]["ds"]["sampling"] == SAMPLING
    err = _refused(inp, out, emulator.url, sampling={"max_new_tokens": 64, "temperature": 0.9})
    assert str(err) == (
        f"sampling of dataset 'ds' in {out}: the output has {{'temperature': '(unset)'}}, this run has "
        f"{{'temperature': 0.9}}; its rows were generated with {{'max_new_tokens': 64}}: rerun with that "
        f"[sampling] to resume, or write to a new --out")
    # An output written before the manifest recorded the sampling: read from its rows.
    out_dir = OutputDir(out)
    with out_dir.lock():
        manifest = out_dir.read_manifest()
        del manifest["datasets"]["ds"]["sampling"]
        out_dir.write_manifest(manifest)
    err = _refused(inp, out, emulator.url, sampling={"max_new_tokens": 32})
    assert (err.recorded, err.requested) == ({"max_new_tokens": 64}, {"max_new_tokens": 32})
    # The same sampling resumes.
    run(inp, out, emulator.url, sampling=dict(SAMPLING))
    assert_exactly_once(out, ids)


def test_changed_parser_is_refused_pointing_at_resplit_then_resumes_after_it(tmp_path, emulator):
    inp, out, ids = _partial(tmp_path, emulator.url)
    err = _refused(inp, out, emulator.url, sampling=SAMPLING, reasoning_parser="deepseek-r1")
    assert str(err) == (
        f"reasoning parser of dataset 'ds' in {out}: the output has 'qwen3', this run has 'deepseek-r1'; its "
        f"committed shards were split with qwen3: run `datagen resplit {out} --parser deepseek-r1` first (it "
        f"splits them again from their raw text, without a server), then rerun; or rerun with "
        f"--reasoning-parser qwen3")
    err = _refused(inp, out, emulator.url, sampling=SAMPLING, reasoning_parser=None)
    assert str(err).endswith("its committed shards were split with qwen3: rerun with --reasoning-parser qwen3")
    resplit(out, "deepseek-r1")
    run(inp, out, emulator.url, sampling=SAMPLING, reasoning_parser="deepseek-r1")
    assert_exactly_once(out, ids)
    report = validate_output(out)
    assert report.ok, report.summary()


def test_journaled_rows_bind_the_sampling_not_the_parser(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 80)

    def stop(rows):
        raise Stop("canary")

    with pytest.raises(Stop):
        run(inp, out, emulator.url, shard=40, concurrency=8, sampling=SAMPLING, canary_rows=4, on_canary=stop)
    assert OutputDir(out).committed_indices("ds") == set() and rows_on_disk(out) >= 4
    err = _refused(inp, out, emulator.url, shard=40, sampling={"max_new_tokens": 48})
    assert (err.recorded, err.requested) == ({"max_new_tokens": 64}, {"max_new_tokens": 48})
    # Journaled rows are split again with the run's parser when their shard commits: no refusal.
    run(inp, out, emulator.url, shard=40, sampling=SAMPLING, reasoning_parser="deepseek-r1")
    assert_exactly_once(out, ids)
    assert validate_output(out).ok


def test_a_run_that_generated_nothing_leaves_the_sampling_free(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 20)
    with pytest.raises(RequestRejected):  # the server refuses the sampling: no row is generated
        run(inp, out, emulator.url, sampling={"max_new_tokens": 64, "temperature": -1})
    assert OutputDir(out).read_manifest()["datasets"]["ds"]["sampling"] == {"max_new_tokens": 64, "temperature": -1}
    run(inp, out, emulator.url, sampling=SAMPLING)
    assert_exactly_once(out, ids)
    assert OutputDir(out).read_manifest()["datasets"]["ds"]["sampling"] == SAMPLING
