"""How long the read-only commands a person types take: `datagen status OUT` without
PREFECT_API_URL (the learned fractions from this host's file, no Prefect import) and `datagen --help`;
the median of several runs each, side by side in one run.

Run alone: ``.venv/bin/python bench/bench_cli.py [--quick]`` (rows as JSON lines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.outputs import clean_rows, write_output  # noqa: E402 - the repo goes on sys.path first

DATAGEN = str(Path(sys.executable).parent / "datagen")
STATUS_TARGET_S = 1.5  # without PREFECT_API_URL: no Prefect import


def _time(argv: list[str], env: dict[str, str], n: int) -> float:
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=True, timeout=120)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def run(quick: bool) -> list[dict[str, Any]]:
    n = 3 if quick else 7
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        out = write_output(Path(tmp) / "out", {"ds": [clean_rows("ds", 100, k * 100) for k in range(4)]},
                           shard_size=100)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env["DATAGEN_STATE_DIR"] = str(Path(tmp) / "state")
        plain = _time([DATAGEN, "status", str(out)], env, n)
        helped = _time([DATAGEN, "--help"], env, n)
    note = f"median of {n}; this host's fractions file, no Prefect import"
    return [
        {"metric": "datagen_status_s", "value": round(plain, 2), "unit": "s", "target": f"<= {STATUS_TARGET_S}",
         "ok": plain <= STATUS_TARGET_S, "note": note},
        {"metric": "datagen_help_s", "value": round(helped, 2), "unit": "s", "target": "", "ok": True,
         "note": f"median of {n}"},
    ]


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(json.dumps(row))
