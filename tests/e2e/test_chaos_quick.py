"""Quick chaos: a few seeded rounds of bench/chaos.py (kill -9 of the flow, server crash) with real
`datagen run` processes on the emulator; nothing lost, duplicated or left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.prefect import migrated_home

ROOT = REPO_ROOT


@pytest.mark.slow
def test_chaos_quick_rounds_lose_nothing(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    migrated_home(tmp_path / "work" / "prefect")  # chaos.py's server home: no migrations at its start
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--rounds", "2", "--seed", "7", "--quick",
         "--faults", "server_crash,kill9", "--work-dir", str(tmp_path / "work"), "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rounds = json.loads(report.read_text())["rounds"]
    assert [r["fault"] for r in rounds] == ["server_crash", "kill9"]
    for r in rounds:
        assert r["ok"], r
        assert (r["lost"], r["duplicated"], r["unexpected"]) == (0, 0, 0)
        assert r["rows"] == r["expected"] > 0
        assert r["rejects"] == r["rejects_expected"] > 0
        assert r["validate_rc"] == 0
        assert r["leftovers"] == [] and r["gpu_mib_left"] == 0
    assert rounds[1]["runs"][0].startswith("killed@")  # the fault really hit the run
    assert rounds[1]["runs"][-1] == "0"
