"""`datagen run` on the emulator for the goodput tests (tests/e2e/test_goodput*.py): one simulated GPU
of SLOTS slots at STEP_MS a step (its capacity: SLOTS / STEP_MS tokens/s), the run's `_last_run.json`,
and the server's own request timeline (``--emu-request-times``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from emulator.simgpu import ENV_VAR, SimGpus
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, partition

DATAGEN = str(Path(sys.executable).parent / "datagen")
SLOTS, STEP_MS = 8, 10.0
TRUTH = SLOTS * 1000.0 / STEP_MS  # the emulator's output tokens/s with every slot busy
LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d{3}) \| \w+ +\| .*? - server .+? lifecycle(?: begins|:)", re.M)

__all__ = ["DATAGEN", "LOG_TIME", "SLOTS", "STEP_MS", "TRUTH", "clock", "empty_slots", "one_server", "rows",
           "run_goodput", "timeline"]


def rows(path: Path, n: int, special: dict[int, str]) -> list[str]:
    ids = [f"ds-{i:04d}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": special.get(k, f"question {k}")}]})
                            + "\n" for k, i in enumerate(ids)))
    return ids


def run_goodput(tmp: Path, prefect_server: PrefectServer, n: int, *, emu: list[str] = (), special: dict[int, str] | None = None,
         run: str = "", sampling: str = "max_new_tokens = 256", args: list[str] = (),
         during: Any = None) -> tuple[str, dict[str, Any], list[str]]:
    """`datagen run` of ``n`` rows on one emulated GPU with SLOTS slots at STEP_MS a step, probed
    with 64 tokens; returns its output, its `_last_run.json` and the row ids."""
    times = tmp / "times.log"
    part, _ = partition(tmp, {"ds": n}, ["--emu-decode-ms-per-step", str(STEP_MS), "--emu-request-times", str(times),
                                         *emu], shard=40, conc=2 * SLOTS, max_relaunches=1,
                        server=f"max_running_requests = {SLOTS}")
    ids = rows(tmp / "ds.jsonl", n, special or {})
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


def timeline(tmp: Path) -> list[tuple[float, str, str]]:
    """The server's ``(time, event, rid)``, in order (every server of the run: one file)."""
    events = []
    for line in (tmp / "times.log").read_text().splitlines():
        event, rid, t = line.split()
        events.append((float(t), event, rid))
    return sorted(events)


def empty_slots(events: list[tuple[float, str, str]], start: float, end: float) -> float:
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


def one_server(ledger: dict[str, Any]) -> dict[str, Any]:
    (server,) = ledger["servers"].values()
    return server


def clock(hh: str, mm: str, ss: str) -> float:
    return int(hh) * 3600 + int(mm) * 60 + float(ss)
