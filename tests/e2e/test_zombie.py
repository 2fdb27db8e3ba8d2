"""A run outlives its control host: `datagen up`, a deployment run, then SIGKILL of the worker and every
process under it (what a control host's crash, OOM-kill or reboot does) while the run generates.

Prefect alone leaves such a run Running for ever, holding its deployment's concurrency slot, so every
later run is cancelled. Through `datagen up` (heartbeats every 30 s, the zombie automation's bound
60 s here): `datagen status` names the stale run and the command that ends it, the automation marks it
Crashed, the failure notification says where it stood, and the next run of the deployment completes
with every row exactly once. Its own Prefect server on a spare port, stopped by pid at the end.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from flows.heartbeats import CRASH_MESSAGE_START
from tests.support.common import free_port, pid_alive
from tests.support.prefect import PrefectApi, datagen_up, up_env
from tests.support.runs import partition
from tests.support.webhook import Hook, save_block

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
BLOCK = "custom-webhook/datagen-zombie-test"
CRASH_AFTER_S = 60  # the least the bound may be with Prefect's 30 s heartbeats


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("zombie")
    port = free_port()
    env = up_env(base, port, DATAGEN_CRASH_AFTER_S=str(CRASH_AFTER_S))
    api_url = f"http://127.0.0.1:{port}/api"
    api = PrefectApi(api_url)
    hook = Hook()
    try:
        out = datagen_up(env)
        assert f"marks a datagen deployment run Crashed {CRASH_AFTER_S} s after its last heartbeat" in out, out
        assert "flow-run heartbeats every 30 s" in out, out
        save_block(api_url, BLOCK.split("/")[1], hook.url)
        yield {"env": env, "base": base, "api_url": api_url, "api": api, "hook": hook}
    finally:
        hook.close()
        api.http.close()
        down = subprocess.run([DATAGEN, "down"], env=env, capture_output=True, text=True, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr


def _worker_pid(stack: dict[str, Any]) -> int:
    return int(json.loads((stack["base"] / "run" / "worker.pid").read_text())["pid"])


def _committed(manifest: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(manifest.read_text())["datasets"]["glaive_like"]["shards"])
    except (OSError, ValueError, KeyError):
        return {}


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process under it, the way a control host's crash ends them (all at
    once, no process told); returns the pids killed."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def _ids(out: Path) -> list[str]:
    return [i for f in sorted(out.glob("glaive_like/shard-*.parquet"))
            for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]


def test_killed_worker_tree_is_crashed_by_heartbeats_and_the_next_run_completes(stack: dict[str, Any],
                                                                                 tmp_path: Path) -> None:
    api: PrefectApi = stack["api"]
    env = stack["env"]
    part, ids = partition(tmp_path, {"glaive_like": 240}, ["--emu-decode-ms-per-step", "10", "--emu-output-tokens", "40"],
                          shard=40, conc=8, max_relaunches=2, server="\n[sim_gpus]\ncount = 2")
    out = tmp_path / "out"
    run = api.run("datagen/demo", partition=str(part))
    api.wait(run, {"RUNNING"}, 120)
    deadline = time.monotonic() + 180
    while not _committed(out / "_manifest.json"):
        assert time.monotonic() < deadline, "no shard committed"
        time.sleep(0.2)
    deadline = time.monotonic() + 60  # the run labels itself off its generating thread (flows/progress.py)
    while "shards committed" not in (labels := api.http.get(f"/flow_runs/{run}").json()["labels"]).get(
            "datagen.progress", "") or labels["datagen.progress"].startswith("0/"):
        assert time.monotonic() < deadline, labels
        time.sleep(0.2)
    assert labels.get("datagen.host") == socket.gethostname(), labels
    killed = _kill_tree(_worker_pid(stack))
    killed_at = time.monotonic()
    assert len(killed) >= 3, killed  # the worker, the flow-run process, its server (and their helpers)
    assert api.state(run)["type"] == "RUNNING"  # Prefect alone would leave it so

    # The worker comes back; `up` also points the failure automation at the webhook.
    again = datagen_up(env, "--notify", BLOCK)
    # unchanged, so the server keeps the clock it started at the run's last heartbeat (an update would
    # give the trigger a new id, and the killed run would stay Running)
    assert "zombie automation 'datagen: crash runs whose heartbeats stopped': unchanged" in again, again
    status_env = dict(env, PREFECT_API_URL=stack["api_url"])
    st = subprocess.run([DATAGEN, "status", str(out)], env=status_env, capture_output=True, text=True, timeout=60)
    if api.state(run)["type"] == "RUNNING":  # the automation has not fired yet: status says what Prefect does not
        assert "stale run: Prefect says" in st.stdout and f"({run}) is RUNNING" in st.stdout, st.stdout
        assert f"end it now: datagen status {out} --end-stale" in st.stdout, st.stdout

    crashed = api.wait(run, {"CRASHED", "COMPLETED", "FAILED", "CANCELLED"}, 3 * CRASH_AFTER_S)
    assert crashed["type"] == "CRASHED", crashed
    assert crashed["message"].startswith(f"{CRASH_MESSAGE_START} for {CRASH_AFTER_S} s"), crashed["message"]
    # within the bound: the last heartbeat came at most 30 s before the kill (plus the trigger's evaluation)
    assert time.monotonic() - killed_at < 30 + CRASH_AFTER_S + 45
    note = json.dumps(stack["hook"].wait(CRASH_MESSAGE_START, 60))
    assert f"Control host: {socket.gethostname()}" in note, note
    shards_before = _committed(out / "_manifest.json")
    assert " shards committed (glaive_like " in note and "a rerun resumes after them" in note, note

    st = subprocess.run([DATAGEN, "status", str(out), "--json"], env=status_env, capture_output=True, text=True,
                        timeout=60)
    assert json.loads(st.stdout)["stale_runs"] == [], st.stdout

    # The deployment's slot is free: the next run is not cancelled, and it resumes.
    rerun = api.run("datagen/demo", partition=str(part))
    done = api.wait(rerun, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 240)
    assert done["type"] == "COMPLETED", done["message"] + api.logs(rerun)[-3000:]
    got = _ids(out)
    assert sorted(got) == sorted(ids["glaive_like"]) and len(got) == len(set(got)) == 240
    after = _committed(out / "_manifest.json")
    assert {k: after[k] for k in shards_before} == shards_before  # committed shards were not redone
    assert not [p for p in killed if pid_alive(p)]
