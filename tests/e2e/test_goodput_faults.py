"""Goodput under faults: a kill -9 of the server mid-run grows relaunch by its downtime and wasted by
what was running, by the server's own timeline (``--emu-request-times``); a stalled input reader
grows idle by its stall (in-process, a real emulator below the dispatcher: the reader must not stall
the answers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
from tests.support.goodput import SLOTS, one_server, rows, run_goodput, timeline
from tests.support.prefect import PrefectServer
from tests.support.runs import records

pytestmark = pytest.mark.slow


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
    # 5 ms a step (the expectations come from the server's timeline, not the step)
    output, summary, _ = run_goodput(tmp_path, prefect_server, 56,
                                     emu=["--emu-output-tokens", "160", "--emu-decode-ms-per-step", "5"],
                              during=_kill_mid_run(tmp_path, state))
    assert "lifecycle: pending -> starting -> serving -> dropped -> relaunching -> serving -> stopped" in output
    seconds = one_server(summary["ledger"])["seconds"]
    events = timeline(tmp_path)
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
    rows(data, 192, {})
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
