"""Goodput as a user meets it: `datagen run` on the emulator, whose capacity is known (its decode
step costs the same at any batch size: ``max_running_requests / step`` output tokens/s), measures
that capacity and puts every GPU-second of its server in one bucket; a long last row grows drain and
truncation retries grow wasted by what the server's own timeline (``--emu-request-times``) and the
rows say. test_goodput_faults.py: a killed server and a stalled input reader.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.goodput import (
    DATAGEN,
    LOG_TIME,
    SLOTS,
    TRUTH,
    clock,
    empty_slots,
    one_server,
    run_goodput,
    timeline,
)
from tests.support.prefect import PrefectServer

pytestmark = pytest.mark.slow


def test_capacity_is_measured_within_10pct_and_the_ledger_sums_to_the_wall_time(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    output, summary, _ = run_goodput(tmp_path, prefect_server, 160)
    ledger = summary["ledger"]
    server = one_server(ledger)
    cap = server["capacity"]
    # against what the server did with the probe's requests (its own timeline: a loaded machine
    # slows the emulator's steps, and the probe must read that), and never above its model
    probe = [(t, ev) for t, ev, rid in timeline(tmp_path) if rid.startswith("capacity-probe-")]
    span = max(t for t, ev in probe if ev == "done") - min(t for t, ev in probe if ev == "recv")
    served = SLOTS * 64 / span
    assert abs(cap["tokens_per_s"] - served) / served < 0.10, (cap, served)
    assert cap["tokens_per_s"] <= TRUTH * 1.02, cap
    assert cap["slots"] == SLOTS
    # every second of the lifecycle in one bucket: the sum is the wall time from the lifecycle's
    # first log line (before hygiene) to its last (after the stop), 1 GPU
    (begins, ends) = [clock(*m) for m in LOG_TIME.findall(output)]
    wall = ends - begins
    assert sum(server["seconds"].values()) == pytest.approx(server["total_s"], abs=0.01)
    assert abs(ledger["total_gpu_s"] - wall) / wall < 0.01, (ledger["total_gpu_s"], wall)
    assert summary["gpu_hours"] * 3600 == pytest.approx(ledger["total_gpu_s"], rel=1e-3)
    assert server["seconds"]["wasted"] == 0 and server["seconds"]["relaunch"] == 0
    assert server["seconds"]["serving"] > 0 and server["kept_tokens"] == summary["completion_tokens"]
    assert ledger["goodput"] == pytest.approx(server["kept_tokens"] / (cap["tokens_per_s"] * server["total_s"]),
                                              rel=1e-3)
    assert f"capacity {cap['tokens_per_s']:,.0f} tokens/s" in output and "GPU-time ledger:" in output
    status = subprocess.run([DATAGEN, "status", str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                            env=prefect_server.env(DATAGEN_STATE_DIR=str(tmp_path / "state")))
    assert status.returncode == 0, status.stderr
    assert "last run: PASS, 160 rows generated" in status.stdout
    assert re.search(r"serving at full batch \(kept rows\) +[\d.]+ GPU-s", status.stdout), status.stdout


def test_a_long_last_row_grows_drain_and_truncation_retries_grow_wasted(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    n = 120
    special = {k: f"TRUNC question {k}" for k in range(8, 120, 8)}  # 14 rows of about 200 tokens
    special[n - 1] = "LONG question"  # the last row: about 600 tokens
    output, summary, _ = run_goodput(
        tmp_path, prefect_server, n, special=special, emu=["--emu-output-tokens-if", "TRUNC=200",
                                                           "--emu-output-tokens-if", "LONG=600"],
        run="truncation = { factor = 16.0, max_new_tokens = 1024 }", sampling="max_new_tokens = 64",
        args=["--truncation-retries", "1"])
    server = one_server(summary["ledger"])
    seconds, cap = server["seconds"], server["capacity"]["tokens_per_s"]
    table = pq.read_table(tmp_path / "out" / "ds", columns=["truncation_retries"])
    retried = sum(table.column("truncation_retries").to_pylist())
    assert retried == 15, retried  # the TRUNC rows and the LONG row, once each
    # each retried row's first answer (64 tokens, finished by length) was generated and thrown away
    assert server["wasted_tokens"] == 64 * retried
    expected = 64 * retried / cap
    assert abs(seconds["wasted"] - expected) / expected < 0.10, (seconds["wasted"], expected)
    # drain: the slots left empty from the last row's send to its answer, by the server's timeline
    events = timeline(tmp_path)
    long_rid = [rid for _, ev, rid in events if ev == "recv" and rid.startswith(f"ds-{n - 1:04d}")]
    start = min(t for t, ev, rid in events if ev == "recv" and rid == long_rid[0])
    end = max(t for t, ev, rid in events if ev == "done" and rid.startswith(f"ds-{n - 1:04d}"))
    expected = empty_slots(events, start, end)
    assert expected > 0.8  # the long row ran alone for seconds
    assert abs(seconds["drain"] - expected) / expected < 0.10, (seconds["drain"], expected)
    assert "drain of the last shard (empty slots)" in output
