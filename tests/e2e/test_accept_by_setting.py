"""Issue 48 item 1 through `datagen run` (emulator, a real Prefect server): a complete output that a
[validation] setting fails is failed with that setting named and how to accept the rows; once the user
raises it, a rerun passes without generating anything (no server is launched)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_flow_recovery import DATAGEN, ROOT, _env
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once, partition, records

pytestmark = pytest.mark.slow


def _with_limit(part: Path, rate: float) -> None:
    text = part.read_text().split("[validation]")[0]
    part.write_text(text + f"[validation]\ntruncation_max_rate = {rate}\n")


def test_a_complete_output_failed_by_a_setting_passes_once_it_is_raised_without_generating(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    # every answer is longer than the budget: every row finishes by length (truncated)
    part, ids = partition(tmp_path, {"ds": 24}, ["--emu-output-tokens", "400"], shard=8, conc=4, max_relaunches=0)
    part.write_text(part.read_text().replace("max_new_tokens = 256", "max_new_tokens = 16"))
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]

    _with_limit(part, 1.0)  # the first run accepts truncated rows: it completes
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert first.returncode == 0, first.stderr[-3000:]
    assert_exactly_once(out, ids)

    _with_limit(part, 0.5)  # a stricter limit: the complete output fails, the setting named
    strict = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert strict.returncode == 1, strict.stderr[-3000:]
    assert "0 rows generated: complete in" in strict.stderr
    assert ("finish_reason length in 100% of 24 rows of ds: outputs hit max_new_tokens; raise [sampling] max_new_tokens "
            "(within the context length), generate truncated rows again with a larger budget ([run.truncation] "
            "retries); the limit is [validation] truncation_max_rate = 0.5: to accept such rows raise it in the "
            "partition and rerun `datagen run` (what is committed is kept; a complete output is judged again "
            "without generating anything)") in strict.stderr, strict.stderr[-3000:]

    _with_limit(part, 1.0)  # raised: the rerun passes, generating nothing and launching nothing
    accepted = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "0 rows generated: complete in" in accepted.stderr
    assert [len(r.get("servers") or []) for r in sorted(records(tmp_path).values(), key=lambda r: r.get("started", ""))
            ].count(0) == 2  # the two reruns launched no server
    assert_exactly_once(out, ids)
