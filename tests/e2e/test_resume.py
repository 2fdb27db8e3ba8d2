"""Exactly-once against the real emulator: resume after kill -9 of the run or a server crash (torn journal,
temp files), per (id, sample) with several samples and per turn of whole conversations, and a second
concurrent run refused while the first completes unaffected."""

from __future__ import annotations

import os
import random
import signal
import time

import orjson
import pytest

from tasks.inference import ServerGone
from tasks.shards import OutputDir, OutputLocked
from tests.support.inference import (
    EMU_ARGS,
    assert_exactly_once,
    committed_keys,
    committed_rows,
    metrics,
    rows_on_disk,
    run,
    start_driver,
    turns_on_disk,
    wait_idle,
    write_conversations,
    write_input,
)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_rerun_every_id_once(tmp_path, sim_gpus, emulator_factory, reap_pids):
    # 5 ms per decode step: about 2 s per run, so the kill lands mid-run
    em = emulator_factory(EMU_ARGS + ["--emu-decode-ms-per-step", "5"])
    inp = tmp_path / "in.jsonl"
    ids = write_input(inp, 240, bad_at=(17, 150))
    usable = len(ids)
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        out = tmp_path / f"out-{seed}"
        proc = start_driver(inp, out, em.url, shard=20, conc=32)
        reap_pids.append(proc.pid)
        deadline = time.monotonic() + 30
        while rows_on_disk(out) == 0:  # the driver is generating
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 1.0))  # a random instant of the run, not a synchronisation
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        done = rows_on_disk(out)
        print(f"seed {seed}: {done} of {usable} rows on disk at the kill")
        before = wait_idle(em.url)["num_requests_total"]
        r = run(inp, out, em.url, shard=20)
        # journaled and committed rows are not regenerated: one request per missing row
        assert r.requests == usable - done == r.rows_generated
        assert metrics(em.url)["num_requests_total"] - before == usable - done
        assert_exactly_once(out, ids)
        assert len(OutputDir(out).read_rejects("ds")) == 2


def _kill_when(proc, started, reap_pids) -> None:
    """SIGKILL ``proc`` a random instant after ``started()`` holds (the driver is generating)."""
    reap_pids.append(proc.pid)
    deadline = time.monotonic() + 30
    while not started():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.005)
    time.sleep(random.Random(7).uniform(0.1, 0.6))  # a random instant of the run, not a synchronisation
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_kill_9_mid_shard_with_samples_then_resume_every_id_and_sample_once(
        tmp_path, sim_gpus, emulator_factory, reap_pids):
    em = emulator_factory(EMU_ARGS + ["--emu-decode-ms-per-step", "5"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 90, bad_at=(31,))
    proc = start_driver(inp, out, em.url, shard=20, conc=32, samples=3)
    _kill_when(proc, lambda: rows_on_disk(out) > 0, reap_pids)
    done = rows_on_disk(out)
    assert 0 < done < 270
    before = wait_idle(em.url)["num_requests_total"]
    r = run(inp, out, em.url, shard=20, samples=3)
    # journaled and committed (id, sample) rows are not generated again: one request per missing one
    assert r.requests == 270 - done == r.rows_generated
    assert metrics(em.url)["num_requests_total"] - before == 270 - done
    assert committed_keys(out) == sorted((i, k) for i in ids for k in range(3))
    rejects = OutputDir(out).read_rejects("ds")
    assert [(x["line"], x.get("sample")) for x in rejects] == [(32, None)]
    entry = OutputDir(out).read_manifest()["datasets"]["ds"]
    assert entry["complete"] and sum(s["rows"] + s["rejects"] for s in entry["shards"].values()) == 91 * 3


def test_kill_9_mid_conversation_resumes_from_the_last_finished_turn(tmp_path, sim_gpus, emulator_factory,
                                                                     reap_pids):
    em = emulator_factory(EMU_ARGS + ["--emu-decode-ms-per-step", "5"])
    inp, out, clean = tmp_path / "in.jsonl", tmp_path / "out", tmp_path / "clean"
    ids = write_conversations(inp, 30, turns=3)
    total_turns = 30 * 2 * 3
    proc = start_driver(inp, out, em.url, shard=8, conc=32, samples=2, regenerate="all")
    _kill_when(proc, lambda: turns_on_disk(out) > 0, reap_pids)
    done = turns_on_disk(out)
    assert 0 < done < total_turns
    o = OutputDir(out)
    journals = [o.read_journal("ds", k) for k in o.open_journals("ds")]
    assert any(set(j.turns) - set(j.rows) for j in journals)  # killed mid-conversation
    before = wait_idle(em.url)["num_requests_total"]
    r = run(inp, out, em.url, shard=8, samples=2, regenerate="all")
    # a finished turn is never sent again: one request per turn not on disk at the kill
    assert r.requests == total_turns - done == metrics(em.url)["num_requests_total"] - before
    assert committed_keys(out) == sorted((i, k) for i in ids for k in range(2))
    # the resumed conversations are those of an uninterrupted run: each turn continued from the
    # model's own journaled turns (same seeds, same prompts, same answers)
    run(inp, clean, em.url, shard=8, samples=2, regenerate="all")
    def answers(path):
        rows = committed_rows(path, columns=["id", "sample", "messages", "prompt", "raw", "turns", "sampling_seed"])
        for row in rows:
            row["turns"] = [{k: v for k, v in t.items() if k != "latency_s"} for t in row["turns"]]
        return rows

    assert answers(out) == answers(clean)


def test_server_crash_mid_shard_relaunch_resume_with_torn_journal_and_temp_file(
    tmp_path, sim_gpus, emulator_factory
):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 200)
    crashing = emulator_factory(EMU_ARGS + ["--emu-crash-after", "90"], wait_ready=True)
    with pytest.raises(ServerGone) as e:
        run(inp, out, crashing.url, shard=32)
    assert e.value.rows_done > 0 and e.value.result.rows_generated == e.value.rows_done
    assert "stopped answering" in str(e.value) and "rerun to resume" in str(e.value)
    assert crashing.wait_exit(timeout=15) == -signal.SIGKILL
    o = OutputDir(out)
    open_shards = [k for k in o.open_journals("ds") if k not in o.committed_indices("ds")]
    assert open_shards, "the crash should leave a shard open mid-way"
    # a torn last journal line (killed inside write) and a leftover temp shard from a dead commit
    with open(o.journal_path("ds", open_shards[0]), "ab") as f:
        f.write(orjson.dumps({"id": "q00199", "dataset": "ds", "raw": "half"})[:25])
    (out / "ds").mkdir(exist_ok=True)
    (out / "ds" / "shard-00005.parquet.tmp-4242").write_bytes(b"PAR1 partial")
    done = rows_on_disk(out)
    assert 0 < done < 200

    relaunched = emulator_factory(EMU_ARGS)
    r = run(inp, out, relaunched.url, shard=32)
    assert r.recovered["temp_files"] == 1 and r.rows_resumed > 0
    assert metrics(relaunched.url)["num_requests_total"] == 200 - done == r.requests
    assert not (out / "ds" / "shard-00005.parquet.tmp-4242").exists()
    assert_exactly_once(out, ids)


@pytest.mark.slow
def test_second_concurrent_run_refused_first_unaffected(tmp_path, sim_gpus, emulator_factory, reap_pids):
    em = emulator_factory(EMU_ARGS[:-2] + ["--max-running-requests", "8", "--emu-decode-ms-per-step", "3"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 150)
    first = start_driver(inp, out, em.url, shard=16, conc=16, flow_run="fr-first")
    reap_pids.append(first.pid)
    deadline = time.monotonic() + 30
    while OutputDir(out).lock_holder() is None:
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read().decode()
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(OutputLocked) as e:
        run(inp, out, em.url)
    assert time.monotonic() - t0 < 2.0
    assert f"pid={first.pid}" in str(e.value) and "flow_run=fr-first" in str(e.value)
    assert first.poll() is None  # still running, unaffected
    stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr.decode()[-2000:]
    assert orjson.loads(stdout.splitlines()[-1])["rows_generated"] == 150
    assert_exactly_once(out, ids)
