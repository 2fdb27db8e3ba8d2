"""`datagen run` on an output with a lost manifest or a damaged shard, with a real Prefect server and the
emulator: the lost manifest is rebuilt without a request, a damaged shard stops the run before a server
is launched, and `datagen repair` makes the next run regenerate exactly that shard."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.e2e.test_flow_recovery import DATAGEN, ROOT, _env
from tests.support.prefect import PrefectServer
from tests.support.runs import assert_exactly_once as _assert_exactly_once
from tests.support.runs import partition as _partition
from tests.support.runs import records as _records

pytestmark = pytest.mark.slow


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_lost_manifest_rebuilt_damaged_shard_refused_then_repaired(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    part, ids = _partition(tmp_path, {"ds": 40}, [], shard=10, conc=8, max_relaunches=1)
    env = _env(prefect_server, tmp_path)
    out = tmp_path / "out"
    run = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    first = _run(run, env)
    assert first.returncode == 0, first.stderr[-3000:]
    shards = {p.name: p.read_bytes() for p in (out / "ds").glob("shard-*.parquet")}
    assert len(shards) == 4

    (out / "_manifest.json").unlink()
    rebuilt = _run(run, env)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert (f"dataset ds: no manifest recorded its 4 shard files in {out}; each matched its input slice and "
            f"was recorded again") in rebuilt.stderr + rebuilt.stdout
    assert "4 shards committed (0 now, 4 resumed), 0 rows generated" in rebuilt.stderr + rebuilt.stdout
    assert {p.name: p.read_bytes() for p in (out / "ds").glob("shard-*.parquet")} == shards

    (out / "ds" / "shard-00002.parquet").unlink()
    runs_before = set(_records(tmp_path))
    refused = _run(run, env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"datagen run: run failed: 1 committed shard(s) of {out} do not match the manifest: shard 2 of 'ds' "
            f"(ds/shard-00002.parquet): the file is missing. Run `datagen repair {out}`") in refused.stderr
    new_runs = {k: r for k, r in _records(tmp_path).items() if k not in runs_before}
    assert not any(r.get("servers") for r in new_runs.values())  # stopped before a server was launched
    status = _run([DATAGEN, "status", str(out)], env)
    assert status.returncode == 1 and "damaged shard 2 (ds/shard-00002.parquet): the file is missing" in status.stdout

    assert _run([DATAGEN, "repair", str(out)], env).returncode == 0
    again = _run(run, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 shards committed (1 now, 3 resumed), 10 rows generated" in again.stderr + again.stdout
    assert {n: b for n, b in shards.items() if n != "shard-00002.parquet"} == \
        {p.name: p.read_bytes() for p in (out / "ds").glob("shard-*.parquet") if p.name != "shard-00002.parquet"}
    assert pq.read_table(out / "ds" / "shard-00002.parquet").num_rows == 10
    _assert_exactly_once(out, ids)
    assert _run([DATAGEN, "status", str(out)], env).returncode == 0
