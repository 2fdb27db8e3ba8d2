"""`datagen run --server-url URL` against a server datagen did not start: every id exactly once, the
server left alone (no hygiene, memory untouched), a second run refused naming the lock holder, and a
missing input a configuration error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emulator.simgpu import SimGpus
from tasks.inference import PROBE_RID
from tasks.shards import OutputDir
from tests.support.paths import REPO_ROOT
from tests.support.prefect import migrated_home, on_shared_server

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS = 40
# ~100-150 tokens at 20 ms a decode step: each dataset takes a few seconds, so the second run
# certainly finds the first one holding the output.
EMU_ARGS = ["--emu-decode-ms-per-step", "20", "--emu-output-tokens", "100"]


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(
        DATAGEN_SIM_GPUS=os.environ["DATAGEN_SIM_GPUS"],
        PREFECT_HOME=str(migrated_home(tmp / "prefect")),
        DATAGEN_STATE_DIR=str(tmp / "state"),
        DATAGEN_RUN_DIR=str(tmp / "run"),  # never pick up a `make up` server of the checkout
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
    )
    return on_shared_server(env)  # as under `datagen up`: no API server per run


def _write_input(path: Path, prefix: str) -> list[str]:
    ids = [f"{prefix}-{i:03d}" for i in range(ROWS)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                            for i in ids))
    return ids


def _wait_for_lock(out: Path, proc: subprocess.Popen[str], deadline_s: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"first run exited {proc.returncode} before taking the lock"
        holder = OutputDir(out).lock_holder() if out.exists() else None
        if holder:
            return holder
        time.sleep(0.1)
    raise AssertionError(f"{out}/_lock not taken within {deadline_s} s")


def test_server_url_run_two_datasets_lock_and_bad_input(tmp_path: Path, sim_gpus: SimGpus,
                                                        emulator_factory) -> None:
    em = emulator_factory(EMU_ARGS)
    gpus_before = sim_gpus.snapshot()
    ranks = {c.pid for c in em.children()}
    holders = {p["pid"] for g in gpus_before["gpus"] for p in g["processes"]}
    assert holders and holders <= ranks  # the emulator's scheduler process holds GPU 0, as SGLang's does
    a, b = tmp_path / "alpha.jsonl", tmp_path / "beta.jsonl"
    expected = {"alpha": _write_input(a, "a"), "beta": _write_input(b, "b")}
    out = tmp_path / "out"
    env = _env(tmp_path)
    argv = [DATAGEN, "run", "--input", str(a), "--input", str(b), "--server-url", em.url, "--out", str(out)]

    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        holder = _wait_for_lock(out, first)
        assert holder["pid"] == first.pid

        # A second run on the same output: refused at once, naming the holder, nothing else touched.
        t0 = time.monotonic()
        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
        elapsed = time.monotonic() - t0
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.startswith(
            f"datagen run: refused: output {out} is being written by another run (host={holder['host']}, "
            f"pid={first.pid}, flow_run={holder['flow_run']}"), second.stderr
        assert elapsed < 15, f"refusal took {elapsed:.1f} s"
        assert first.poll() is None, "the first run must still be running: the refusal was not tested"

        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-4000:]
    assert f"completed: {2 * ROWS} rows in {out}\n" in stdout

    for name, ids in expected.items():
        got = [i for f in sorted((out / name).glob("shard-*.parquet"))
               for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
        assert sorted(got) == ids and len(got) == ROWS, name
        servers = {s for f in (out / name).glob("shard-*.parquet")
                   for s in pq.read_table(f, columns=["server"]).column("server").to_pylist()}
        assert len(servers) == 1 and re.fullmatch(r"external:[0-9a-f]{12}", servers.pop())

    # The server is untouched: same process, alive, its GPU memory as before, no hygiene ran.
    assert em.proc.poll() is None and {c.pid for c in em.children()} == ranks
    assert sim_gpus.snapshot() == gpus_before
    assert "hygiene" not in stdout + stderr
    assert OutputDir(out).lock_holder() is None

    # A missing input is a configuration error naming the path; nothing starts.
    missing = tmp_path / "nope" / "gamma.jsonl"
    bad = subprocess.run([DATAGEN, "run", "--input", str(a), "--input", str(missing), "--server-url", em.url,
                          "--out", str(tmp_path / "out2")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2
    assert bad.stderr == f"datagen run: configuration error: override: --input {missing}: no such file\n"
    assert not (tmp_path / "out2").exists()
    assert em.proc.poll() is None and sim_gpus.snapshot() == gpus_before


def _peak_in_flight(log: Path) -> int:
    """The most /generate requests the server held at once, from its request log ('recv RID' on
    arrival, 'done RID' when answered, in the order they happened)."""
    held = peak = 0
    for line in log.read_text().splitlines():
        event, _, rid = line.partition(" ")
        if rid.startswith(PROBE_RID):
            continue  # the capacity probe after the health check: one request per slot, not the run's
        held += {"recv": 1, "done": -1}.get(event, 0)
        peak = max(peak, held)
    return peak


def test_requests_in_flight_follow_the_servers_slots_unless_set(tmp_path: Path, sim_gpus: SimGpus,
                                                                emulator_factory) -> None:
    # The server reports 24 running slots: with no [run] concurrency datagen keeps twice that in
    # flight (the old fixed default was 32); --concurrency sets it.
    log = tmp_path / "requests.log"
    em = emulator_factory(["--max-running-requests", "24", "--emu-decode-ms-per-step", "20",
                           "--emu-output-tokens", "40", "--emu-request-log", str(log)])
    env = _env(tmp_path)
    for extra, peak, rows in (([], 48, 60), (["--concurrency", "5"], 5, 15)):
        inp = tmp_path / "rows.jsonl"
        inp.write_text("".join(json.dumps({"id": f"r{i:03d}", "messages": [{"role": "user", "content": f"Q {i}?"}]})
                               + "\n" for i in range(rows)))
        log.write_text("")
        out = tmp_path / f"out-{peak}"
        proc = subprocess.run([DATAGEN, "run", "--input", str(inp), "--server-url", em.url, "--out", str(out), *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert pq.read_table(sorted((out / "rows").glob("shard-*.parquet")), columns=["id"]).num_rows == rows
        assert _peak_in_flight(log) == peak
