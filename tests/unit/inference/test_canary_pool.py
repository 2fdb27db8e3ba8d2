"""The canary hook of run_dataset against the real emulator: handed the first rows once, as soon as they
are journaled, and a failing canary stops the run before the server answered twice the concurrency."""

from __future__ import annotations

import pytest

from tasks.shards import OutputDir
from tests.support.inference import EMU_ARGS, metrics, rows_on_disk, run, wait_idle, write_input


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS)


def test_canary_gets_the_first_rows_once(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 60)
    seen: list[list[dict]] = []
    r = run(inp, out, emulator.url, shard=20, concurrency=8, canary_rows=32, on_canary=seen.append)
    assert r.complete and r.rows_generated == 60
    assert [len(rows) for rows in seen] == [4]  # at most half the concurrency
    assert {row["id"] for row in seen[0]} <= {f"q{i:05d}" for i in range(60)}


def test_no_canary_when_disabled_or_too_few_rows(tmp_path, emulator):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 3)
    seen: list[list[dict]] = []
    run(inp, tmp_path / "a", emulator.url, shard=20, concurrency=8, canary_rows=0, on_canary=seen.append)
    run(inp, tmp_path / "b", emulator.url, shard=20, concurrency=8, canary_rows=32, on_canary=seen.append)
    assert seen == []


def test_failing_canary_stops_before_twice_the_concurrency(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 400)
    before = metrics(emulator.url)["num_requests_total"]

    def stop(rows: list[dict]) -> None:
        raise RuntimeError(f"canary saw {len(rows)} rows")

    with pytest.raises(RuntimeError, match="canary saw 8 rows"):
        run(inp, out, emulator.url, shard=100, concurrency=16, canary_rows=32, on_canary=stop)
    answered = wait_idle(emulator.url)["num_requests_total"] - before
    print(f"answered before the canary stopped the run: {answered:.0f} (concurrency 16)")
    assert answered < 2 * 16
    # Nothing committed; the rows that finished are journaled and a rerun keeps them.
    assert OutputDir(out).committed_indices("ds") == set()
    assert 8 <= rows_on_disk(out) == len(OutputDir(out).read_journal("ds", 0).rows)
