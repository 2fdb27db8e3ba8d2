"""GPU hygiene speed: 16 holders on 8 simulated GPUs, half ignoring SIGTERM (full mode: each with a child
and a 0.5 s driver release lag), ended and verified clean within grace + 2 s.

Run alone: ``.venv/bin/python bench/bench_hygiene.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from emulator.simgpu import ENV_VAR, SimGpus  # noqa: E402
from tasks.hygiene import clean_gpus  # noqa: E402
from tests.support.hygiene import Holder, start_holder, stop_holders  # noqa: E402

GRACE_S = 2.0


def _one(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-hygiene-") as tmp:
        path = os.path.join(tmp, "sim.json")
        old = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = path
        sim = SimGpus.init(path, count=8, release_delay_s=0.0 if quick else 0.5)
        holders: list[Holder] = []
        try:
            for i in range(16):
                holders.append(start_holder((i % 8,), 4096, ignore_term=i % 2 == 1,
                                            children=0 if quick else 1, child_gpu=i % 8, child_mib=1024))
            before = sum(g["used_mib"] for g in sim.snapshot()["gpus"])
            t0 = time.monotonic()
            report = clean_gpus(grace_s=GRACE_S, deadline_s=10)
            elapsed = time.monotonic() - t0
            return {"elapsed_s": elapsed, "clean": report.clean, "before_mib": before,
                    "killed": len(report.killed), "sigkill": sum(p.ended_by == "SIGKILL" for p in report.killed),
                    "waited_s": report.waited_s}
        finally:
            stop_holders(holders)
            if old is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = old


def run(quick: bool) -> list[dict]:
    r = _one(quick)
    limit = GRACE_S + 2.0
    return [
        {"metric": "hygiene_16_holders_clean_s", "value": round(r["elapsed_s"], 3), "unit": "s",
         "target": f"<= {limit:.1f} (grace {GRACE_S:.0f} s + 2 s), verified clean",
         "ok": bool(r["clean"] and r["elapsed_s"] <= limit)},
        {"metric": "hygiene_processes_ended", "value": float(r["killed"]), "unit": "processes",
         "target": f"== {16 if quick else 32} ({r['sigkill']} needed SIGKILL)",
         "ok": r["killed"] == (16 if quick else 32)},
    ]


if __name__ == "__main__":
    rows = run("--quick" in sys.argv[1:])
    print(json.dumps(rows, indent=2))
    sys.exit(0 if all(row["ok"] for row in rows) else 1)
