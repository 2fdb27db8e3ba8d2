"""What a `datagen run` costs around its serving (issue 22 item 1): the same small run on the
emulator (8 rows, `--input ... --backend emulator`) measured side by side in one run, alternating,
- with no Prefect server anywhere: the run starts its own API server (beside the flow's imports);
- with PREFECT_API_URL naming a running `prefect server start` (as under `datagen up`).
For each: the wall time from the process start to the flow's first log line ("Beginning flow run"),
and the whole command. The difference is what the run's own API server costs. Beside them, the
whole `datagen demo` (what `make demo` runs once installed; target 30 s).

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
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.prefect import _start_server, _stop_group, migrated_home  # noqa: E402 - repo on sys.path first

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
            for k in range(n):  # alternating, so a busy spell of the machine weighs on both
                own.append(_one(tmp, base, 2 * k))
                shared.append(_one(tmp, dict(base, PREFECT_API_URL=server.api_url), 2 * k + 1))
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
    took = statistics.median(demo)
    rows.append({"metric": "datagen_demo_whole_s", "value": round(took, 2), "unit": "s",
                 "target": f"<= {DEMO_TARGET_S:.0f}", "ok": took <= DEMO_TARGET_S,
                 "note": f"`make demo` once installed (600 rows, own API server), median of {len(demo)}: "
                         + ", ".join(f"{d:.1f}" for d in demo)})
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(json.dumps(row))
