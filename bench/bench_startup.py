"""What a `datagen run` costs around its serving (issue 22 item 1): the same small run on the
emulator (8 rows, `--input ... --backend emulator`) measured side by side in one run, alternating,
- with no Prefect server anywhere: the run starts its own API server (beside the flow's imports);
- with PREFECT_API_URL naming a running `prefect server start` (as under `datagen up`).
For each: the wall time from the process start to the flow's first log line ("Beginning flow run"),
and the whole command. The difference is what the run's own API server costs. Beside them, the
whole `datagen demo` (what `make demo` runs once installed; target 30 s), and `datagen run
--server-url` against a running server (a minimal one): the process start to its first request
(target 3 s with a running Prefect server) and the whole command less the serving span (target 5 s).

Run alone: ``.venv/bin/python bench/bench_startup.py [--quick]`` (rows as JSON lines).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_client import _stop  # noqa: E402 - repo on sys.path first
from bench.bench_scale import _start  # noqa: E402
from tests.support.prefect import _start_server, _stop_group, migrated_home  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
_BEGIN = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| INFO .* - Beginning flow run", re.M)


def _one(tmp: Path, env: dict[str, str], k: int) -> tuple[float, float]:
    """(seconds to the flow's first line, seconds for the whole command) of one run."""
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(8)))
    started = time.time()
    done = subprocess.run([DATAGEN, "run", "--input", str(inp), "--backend", "emulator", "--out", str(tmp / f"out{k}")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp, stdin=subprocess.DEVNULL)
    whole = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"datagen run exited {done.returncode}: {done.stderr[-2000:]}")
    m = _BEGIN.search(done.stderr)
    if m is None:
        raise RuntimeError("no 'Beginning flow run' line")
    day = datetime.fromtimestamp(started).strftime("%Y-%m-%d")
    begin = datetime.strptime(f"{day} {m.group(1)}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return begin - started, whole


DEMO_RUNS = 2
DEMO_TARGET_S = 30.0


def _demo(tmp: Path, env: dict[str, str], k: int) -> float:
    """Seconds for the whole `datagen demo` (what `make demo` runs once installed): its own API
    server, the emulator on simulated GPUs, 600 rows, validation."""
    started = time.time()
    done = subprocess.run([DATAGEN, "demo", "--out", str(tmp / f"demo{k}")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"datagen demo exited {done.returncode}: {done.stderr[-2000:]}")
    return time.time() - started


FIRST_TARGET_S = 3.0  # issue 22: the first request within 3 s of the process start
OVERHEAD_TARGET_S = 5.0  # and the whole run at most 5 s longer than its serving span
SERVED_ROWS = 256


def _against(tmp: Path, env: dict[str, str], k: int) -> tuple[float, float]:
    """(process start to the first request at the server, whole command less the serving span) of
    `datagen run --input ... --server-url URL` against a running server (a fresh ``emulator.minimal``
    with 16 slots at 200 ms per request and a reasoning model's answers; its ``/occupancy`` says
    when the first request arrived and the last was answered)."""
    srv, url = _start("minimal", tmp, ["--slots", "16", "--latency-ms", "200", "--think"])
    try:
        inp = tmp / "served.jsonl"
        inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n"
                               for i in range(SERVED_ROWS)))
        started = time.time()
        done = subprocess.run([DATAGEN, "run", "--input", str(inp), "--server-url", url, "--out", str(tmp / f"url{k}")],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp, stdin=subprocess.DEVNULL)
        whole = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(f"datagen run --server-url exited {done.returncode}: {done.stderr[-2000:]}")
        with urllib.request.urlopen(url + "/occupancy", timeout=10) as r:
            occ = json.loads(r.read())
    finally:
        _stop(srv)
    return occ["first_at"] - started, whole - (occ["last_at"] - occ["first_at"])


def run(quick: bool) -> list[dict[str, Any]]:
    n = 2 if quick else 5
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as name:
        tmp = Path(name)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
        base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", DATAGEN_STATE_DIR=str(tmp / "state"),
                    DATAGEN_RUN_DIR=str(tmp / "run"), PREFECT_HOME=str(migrated_home(tmp / "home")))
        proc, server = _start_server(migrated_home(tmp / "server-home"), 180)
        try:
            own: list[tuple[float, float]] = []
            shared: list[tuple[float, float]] = []
            demo: list[float] = []
            url_own: list[tuple[float, float]] = []
            url_shared: list[tuple[float, float]] = []
            for k in range(n):  # alternating, so a busy spell of the machine weighs on both
                own.append(_one(tmp, base, 2 * k))
                shared.append(_one(tmp, dict(base, PREFECT_API_URL=server.api_url), 2 * k + 1))
                url_own.append(_against(tmp, base, 2 * k))
                url_shared.append(_against(tmp, dict(base, PREFECT_API_URL=server.api_url), 2 * k + 1))
                if k < DEMO_RUNS:
                    demo.append(_demo(tmp, base, k))
        finally:
            _stop_group(proc.pid)
            proc.wait(timeout=10)
    for label, runs, note in (("own_api", own, "no Prefect server: the run starts its own API server"),
                              ("server", shared, "PREFECT_API_URL names a running server")):
        first = statistics.median(r[0] for r in runs)
        whole = statistics.median(r[1] for r in runs)
        rows.append({"metric": f"run_{label}_to_flow_s", "value": round(first, 2), "unit": "s", "target": "",
                     "ok": True, "note": f"process start to 'Beginning flow run', median of {n}; {note}"})
        rows.append({"metric": f"run_{label}_whole_s", "value": round(whole, 2), "unit": "s", "target": "",
                     "ok": True, "note": f"8 rows on the emulator, median of {n}; {note}"})
    for label, runs, note in (("own_api", url_own, "no Prefect server: the run starts its own API server"),
                              ("server", url_shared, "PREFECT_API_URL names a running server")):
        first = statistics.median(r[0] for r in runs)
        over = statistics.median(r[1] for r in runs)
        shared_api = label == "server"
        rows.append({"metric": f"server_url_{label}_first_request_s", "value": round(first, 2), "unit": "s",
                     "target": f"<= {FIRST_TARGET_S:.0f}" if shared_api else "",
                     "ok": first <= FIRST_TARGET_S or not shared_api,
                     "note": f"process start to the first /generate at a running server, median of {n}; {note}"})
        rows.append({"metric": f"server_url_{label}_overhead_s", "value": round(over, 2), "unit": "s",
                     "target": f"<= {OVERHEAD_TARGET_S:.0f}" if shared_api else "",
                     "ok": over <= OVERHEAD_TARGET_S or not shared_api,
                     "note": f"whole command less its serving span ({SERVED_ROWS} rows), median of {n}; {note}"})
    took = statistics.median(demo)
    rows.append({"metric": "datagen_demo_whole_s", "value": round(took, 2), "unit": "s",
                 "target": f"<= {DEMO_TARGET_S:.0f}", "ok": took <= DEMO_TARGET_S,
                 "note": f"`make demo` once installed (600 rows, own API server), median of {len(demo)}: "
                         + ", ".join(f"{d:.1f}" for d in demo)})
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(json.dumps(row))
