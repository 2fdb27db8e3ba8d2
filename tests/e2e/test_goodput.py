"""Goodput as a user meets it: `datagen run` on the emulator, whose capacity is known (its decode
step costs the same at any batch size: ``max_running_requests / step`` output tokens/s), measures
that capacity, puts every GPU-second of its server in one bucket, and each injected cause grows its
own bucket by the amount the server's own timeline says (``--emu-request-times``): a long last row
(drain), truncation retries (wasted), a kill -9 of the server (relaunch, and wasted for what was in
flight). The slow input reader is injected in-process (tests/unit/inference/test_ledger_reader.py is
not enough: the reader must not stall the answers) with a real emulator below the dispatcher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tasks.inference import (
    PROBE_RID,
    Capacity,
    DatasetSpec,
    Endpoint,
    InferenceSettings,
    Ledger,
    ServerPool,
    run_dataset,
)
from tests.support.emulator import DEMO_MODEL
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, partition, records

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
SLOTS, STEP_MS = 8, 10.0
TRUTH = SLOTS * 1000.0 / STEP_MS  # the emulator's output tokens/s with every slot busy
LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d{3}) \| \w+ +\| .*? - server .+? lifecycle(?: begins|:)", re.M)


def _rows(path: Path, n: int, special: dict[int, str]) -> list[str]:
    ids = [f"ds-{i:04d}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": special.get(k, f"question {k}")}]})
                            + "\n" for k, i in enumerate(ids)))
    return ids


def _run(tmp: Path, prefect_server: PrefectServer, n: int, *, emu: list[str] = (), special: dict[int, str] | None = None,
         run: str = "", sampling: str = "max_new_tokens = 256", args: list[str] = (),
         during: Any = None) -> tuple[str, dict[str, Any], list[str]]:
    """`datagen run` of ``n`` rows on one emulated GPU with SLOTS slots at STEP_MS a step, probed
    with 64 tokens; returns its output, its `_last_run.json` and the row ids."""
    times = tmp / "times.log"
    part, _ = partition(tmp, {"ds": n}, ["--emu-decode-ms-per-step", str(STEP_MS), "--emu-request-times", str(times),
                                         *emu], shard=40, conc=2 * SLOTS, max_relaunches=1,
                        server=f"max_running_requests = {SLOTS}")
    ids = _rows(tmp / "ds.jsonl", n, special or {})
    text = part.read_text().replace("capacity_probe_tokens = 0\n", f"capacity_probe_tokens = 64\norder = \"input\"\n{run}\n")
    part.write_text(text.replace("max_new_tokens = 256", sampling))
    SimGpus.init(tmp / "sim-gpus.json", count=1)
    env = prefect_server.env(**{ENV_VAR: str(tmp / "sim-gpus.json"), "DATAGEN_STATE_DIR": str(tmp / "state"),
                                "DATAGEN_RUN_DIR": str(tmp / "run")})
    out = tmp / "out"
    proc = subprocess.Popen([DATAGEN, "run", "--partition", str(part), "--out", str(out), *args], env=env,
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if during is not None:
            during(proc, tmp)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert_exactly_once(out, {"ds": ids})
    return output, json.loads((out / "_last_run.json").read_text()), ids


def _timeline(tmp: Path) -> list[tuple[float, str, str]]:
    """The server's ``(time, event, rid)``, in order (every server of the run: one file)."""
    events = []
    for line in (tmp / "times.log").read_text().splitlines():
        event, rid, t = line.split()
        events.append((float(t), event, rid))
    return sorted(events)


def _empty_slots(events: list[tuple[float, str, str]], start: float, end: float) -> float:
    """Seconds x empty share of the SLOTS slots between ``start`` and ``end``, by the server's
    timeline (requests in flight: received and not yet answered)."""
    k, t, empty = 0, start, 0.0
    for when, event, _ in events:
        if when > start:
            span = min(when, end) - t
            if span > 0:
                empty += span * (SLOTS - min(k, SLOTS)) / SLOTS
                t = min(when, end)
        if when >= end:
            break
        k += 1 if event == "recv" else -1 if event == "done" else 0
    return empty + max(0.0, end - t) * (SLOTS - min(k, SLOTS)) / SLOTS


def _server(ledger: dict[str, Any]) -> dict[str, Any]:
    (server,) = ledger["servers"].values()
    return server


def _clock(hh: str, mm: str, ss: str) -> float:
    return int(hh) * 3600 + int(mm) * 60 + float(ss)


def test_capacity_is_measured_within_10pct_and_the_ledger_sums_to_the_wall_time(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    output, summary, _ = _run(tmp_path, prefect_server, 160)
    ledger = summary["ledger"]
    server = _server(ledger)
    cap = server["capacity"]
    assert abs(cap["tokens_per_s"] - TRUTH) / TRUTH < 0.10, cap
    assert cap["slots"] == SLOTS
    # every second of the lifecycle in one bucket: the sum is the wall time from the lifecycle's
    # first log line (before hygiene) to its last (after the stop), 1 GPU
    (begins, ends) = [_clock(*m) for m in LOG_TIME.findall(output)]
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
    output, summary, _ = _run(
        tmp_path, prefect_server, n, special=special, emu=["--emu-output-tokens-if", "TRUNC=200",
                                                           "--emu-output-tokens-if", "LONG=600"],
        run="truncation = { factor = 16.0, max_new_tokens = 1024 }", sampling="max_new_tokens = 64",
        args=["--truncation-retries", "1"])
    server = _server(summary["ledger"])
    seconds, cap = server["seconds"], server["capacity"]["tokens_per_s"]
    table = pq.read_table(tmp_path / "out" / "ds", columns=["truncation_retries"])
    retried = sum(table.column("truncation_retries").to_pylist())
    assert retried == 15, retried  # the TRUNC rows and the LONG row, once each
    # each retried row's first answer (64 tokens, finished by length) was generated and thrown away
    assert server["wasted_tokens"] == 64 * retried
    expected = 64 * retried / cap
    assert abs(seconds["wasted"] - expected) / expected < 0.10, (seconds["wasted"], expected)
    # drain: the slots left empty from the last row's send to its answer, by the server's timeline
    events = _timeline(tmp_path)
    long_rid = [rid for _, ev, rid in events if ev == "recv" and rid.startswith(f"ds-{n - 1:04d}")]
    start = min(t for t, ev, rid in events if ev == "recv" and rid == long_rid[0])
    end = max(t for t, ev, rid in events if ev == "done" and rid.startswith(f"ds-{n - 1:04d}"))
    expected = _empty_slots(events, start, end)
    assert expected > 1.5  # the long row ran alone for seconds
    assert abs(seconds["drain"] - expected) / expected < 0.10, (seconds["drain"], expected)
    assert "drain of the last shard (empty slots)" in output


def _kill_mid_run(tmp: Path, state: dict[str, float]) -> Any:
    def during(proc: subprocess.Popen[str], _: Path) -> None:
        deadline = time.monotonic() + 120
        times = tmp / "times.log"
        while not times.exists() or times.read_text().count("\ndone ds-") < 24:
            assert proc.poll() is None and time.monotonic() < deadline, "no rows generated"
            time.sleep(0.02)
        (record,) = records(tmp).values()
        pid = record["servers"][0]["pid"]
        state["kill"] = time.time()
        os.kill(pid, signal.SIGKILL)
    return during


def test_a_killed_server_grows_relaunch_by_its_downtime_and_wasted_by_what_was_in_flight(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    state: dict[str, float] = {}
    output, summary, _ = _run(tmp_path, prefect_server, 80, emu=["--emu-output-tokens", "100"],
                              during=_kill_mid_run(tmp_path, state))
    assert "lifecycle: pending -> starting -> serving -> dropped -> relaunching -> serving -> stopped" in output
    seconds = _server(summary["ledger"])["seconds"]
    events = _timeline(tmp_path)
    kill = state["kill"]
    # downtime: from the kill to the first row the relaunched server received (after its probe)
    back = min(t for t, ev, rid in events if ev == "recv" and t > kill and not rid.startswith(PROBE_RID))
    assert abs(seconds["relaunch"] - (back - kill)) / (back - kill) < 0.10, (seconds["relaunch"], back - kill)
    # wasted: what the requests running at the kill had run, by the server's timeline: it admits
    # first come first served into its SLOTS slots (the others wait behind them, generating nothing)
    expected = _running_share(events, kill)
    assert expected > 0.3, "nothing was running at the kill"
    assert abs(seconds["wasted"] - expected) / expected < 0.10, (seconds["wasted"], expected)


def _running_share(events: list[tuple[float, str, str]], until: float) -> float:
    """Seconds / SLOTS each request running at ``until`` had held its slot, summed."""
    running: dict[str, float] = {}
    waiting: list[str] = []
    for t, ev, rid in events:
        if t > until:
            break
        if ev == "recv":
            waiting.append(rid)
        elif rid in running:
            del running[rid]
        elif rid in waiting:
            waiting.remove(rid)
        while waiting and len(running) < SLOTS:
            running[waiting.pop(0)] = t
    return sum(until - t0 for t0 in running.values()) / SLOTS


@pytest.fixture
def slow_reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, float]]:
    """The dataset reader stalls ``pause`` seconds before row 150 (a file system that hangs)."""
    import tasks.inference._driver as driver  # noqa: PLC0415

    plan = {"pause": 0.0}
    real = driver.iter_dataset

    def slow(path: Path, name: str) -> Iterator[Any]:
        for pos, item in enumerate(real(path, name)):
            if pos == 150 and plan["pause"]:
                time.sleep(plan["pause"])
            yield item

    monkeypatch.setattr(driver, "iter_dataset", slow)
    yield plan


def test_a_slow_input_reader_grows_idle_by_its_stall(emulator_factory: Any, tmp_path: Path,
                                                     slow_reader: dict[str, float]) -> None:
    emu = emulator_factory(["--emu-decode-ms-per-step", "5", "--emu-output-tokens", "20", "--max-running-requests",
                            str(SLOTS)])
    data = tmp_path / "in.jsonl"
    _rows(data, 192, {})
    idle = []
    for pause in (0.0, 0.0, 2.0):  # the first run warms the template and the imports up
        slow_reader["pause"] = pause
        ledger = Ledger(1)
        ledger.capacity = Capacity(1000.0, SLOTS)
        pool = ServerPool()
        pool.add("emu", Endpoint(emu.url, "emu"), recoverable=False, ledger=ledger, slots=SLOTS)
        run_dataset(DatasetSpec("ds", data), tmp_path / f"out-{len(idle)}", pool,
                    InferenceSettings(shard_size=32, concurrency=2 * SLOTS, sampling={"max_new_tokens": 64},
                                      model_dir=DEMO_MODEL))
        ledger.end()
        idle.append(ledger.view().seconds["idle"])
    grew = idle[2] - idle[1]
    assert abs(grew - 2.0) / 2.0 < 0.10, idle
