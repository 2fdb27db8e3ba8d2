"""End to end through Prefect: the session's server, `datagen up --api-url` (pool, limits, `prefect deploy
--all`, process worker), deployment runs of datagen/demo on their recovery paths (runtime OOM, hang,
SIGKILL of the flow-run process); and the pieces that talk to Prefect on their own: the tuner's
Variable store and the validation artifacts of a flow run. The deployment runs a user watches in the
UI (a watched demo, a collision, a validation failure, a cancel and its rerun) are test_ui.py's: one
run per story."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from emulator.simgpu import SimGpus
from tasks.server import FractionMemory, list_remembered
from tests.support.common import pid_alive
from tests.support.outputs import clean_rows, write_output
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectApi as Api
from tests.support.prefect import PrefectServer, migrated_home

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
DATAGEN = str(Path(sys.executable).parent / "datagen")


@pytest.fixture(scope="module")
def stack(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`datagen up` against the session's server: pool, gpu limits, deployments, one worker."""
    base = tmp_path_factory.mktemp("e2e")
    env = prefect_server.env(
        DATAGEN_HOME=str(ROOT), DATAGEN_STATE_DIR=str(base / "state"), DATAGEN_RUN_DIR=str(base / "run"),
        PREFECT_WORKER_PREFETCH_SECONDS="1",
    )
    env.pop("PREFECT_WORKER_QUERY_SECONDS", None)  # datagen up's own poll (decision 110)
    env.pop("DATAGEN_SIM_GPUS", None)  # the demo partition creates its own under the output
    up = subprocess.run([DATAGEN, "up", "--api-url", prefect_server.api_url], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=240)
    api = Api(prefect_server.api_url)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"Prefect UI: {prefect_server.api_url.removesuffix('/api')}" in up.stdout
        worker = json.loads((base / "run" / "worker.pid").read_text())["pid"]
        # It asks for submitted runs every 2 s, not Prefect's 10 s.
        assert psutil.Process(worker).environ().get("PREFECT_WORKER_QUERY_SECONDS") == "2"
        yield {"env": env, "base": base, "api": api, "worker": worker}
    finally:
        api.http.close()
        down = subprocess.run([DATAGEN, "down"], env=env, capture_output=True, text=True, timeout=60)
        assert "worker: pid" in down.stdout, down.stdout + down.stderr
        assert pid_alive(prefect_server.pid)  # `down` stops only what `up` started


def _rows(out: Path) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = {}
    for f in sorted(out.glob("*/shard-*.parquet")):
        ids.setdefault(f.parent.name, []).extend(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return ids


def _partition(tmp: Path, name: str, extra_args: list[str], run: str = "", sampling: str = "") -> Path:
    f = tmp / f"{name}.toml"
    f.write_text(
        f'[datasets]\nglaive_like = "{ROOT}/data/samples/glaive_like.jsonl"\n'
        f'[model]\npath = "{ROOT}/data/models/demo"\nreasoning_parser = "qwen3"\n'
        f'[server]\nbackend = "emulator"\ntp_size = 1\nextra_args = {json.dumps(extra_args)}\n'
        f"[sim_gpus]\ncount = 2\n"
        f"[run]\nshard_size = 50\nconcurrency = 16\nhygiene_grace_s = 2\nhang_timeout_s = 4\n"
        f"capacity_probe_tokens = 0\n{run}"  # the probe's requests would count against the faults
        f"[sampling]\nmax_new_tokens = 256\n{sampling}"
        f'[output]\nroot = "{tmp / name}"\n'
    )
    return f


def test_up_deploys_every_partition_with_limits(stack: dict[str, Any]) -> None:
    http = stack["api"].http
    deps = http.post("/deployments/filter", json={}).json()
    by_name = {d["name"]: d for d in deps}
    assert set(by_name) >= {"all", "demo", "glaive_like", "opencode_like"}
    for d in by_name.values():
        assert d["work_pool_name"] == "gpu" and d["global_concurrency_limit"]["limit"] == 1
        assert d["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    sched = by_name["all"]["schedules"]
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in sched] == [("0 2 * * *", "UTC")]
    assert not by_name["demo"]["schedules"]
    # The custom-run form (as `up` rewrites it): every parameter typed, with a description, choices and
    # bounds where they exist, and no None branch.
    props = by_name["demo"]["parameter_openapi_schema"]["properties"]
    assert all(p.get("description") and ("type" in p or "anyOf" in p) for p in props.values()), props
    assert not [n for n, p in props.items() if p.get("default", "") is None], props
    assert props["backend"]["enum"] == ["sglang", "emulator"] and "qwen3" in props["reasoning_parser"]["enum"]
    assert (props["mem_fraction_static"]["exclusiveMinimum"], props["mem_fraction_static"]["exclusiveMaximum"]) \
        == (0, 1)
    limits = http.post("/v2/concurrency_limits/filter", json={}).json()
    assert any(lim["name"].startswith("gpu:") and lim["limit"] == 1 for lim in limits)


def test_runtime_oom_relaunches_lower_and_completes(stack: dict[str, Any], tmp_path: Path) -> None:
    api: Api = stack["api"]
    # no prefix cache: the demo's shared system prompts would otherwise keep prefills small (no OOM)
    part = _partition(tmp_path, "oom", ["--disable-radix-cache"])
    run = api.run("datagen/demo", partition=str(part), mem_fraction_static=0.93)
    st = api.wait(run, {"COMPLETED", "FAILED", "CRASHED"}, 150)
    logs = api.logs(run)
    assert st["type"] == "COMPLETED", st["message"] + logs[-3000:]
    assert "recorded runtime OOM at fraction 0.93" in logs, logs[-3000:]
    assert len(set(_rows(tmp_path / "oom")["glaive_like"])) == 300
    status = subprocess.run([DATAGEN, "status", str(tmp_path / "oom"), "--json"], env=stack["env"],
                            capture_output=True, text=True, timeout=60)
    learned = [e for e in json.loads(status.stdout)["learned_fractions"] if e.get("runtime_oom_at") == 0.93]
    assert learned and learned[0]["fraction"] < 0.93


def test_hang_is_detected_and_recovered(stack: dict[str, Any], tmp_path: Path) -> None:
    api: Api = stack["api"]
    part = _partition(tmp_path, "hang", ["--emu-hang-after", "200"])
    run = api.run("datagen/demo", partition=str(part))
    st = api.wait(run, {"COMPLETED", "FAILED", "CRASHED"}, 150)
    logs = api.logs(run)
    assert st["type"] == "COMPLETED", st["message"] + logs[-3000:]
    assert "not answering /health_generate" in logs
    ids = _rows(tmp_path / "hang")["glaive_like"]
    assert len(ids) == len(set(ids)) == 300


def _flow_process(worker: int, run_id: str, deadline_s: float = 60) -> psutil.Process:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for p in psutil.Process(worker).children(recursive=True):
            try:
                if p.environ().get("PREFECT__FLOW_RUN_ID") == run_id:
                    return p
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no flow-run process for {run_id} under worker {worker}")


def _running_with_a_shard(stack: dict[str, Any], part: Path, out: Path, **params: Any) -> tuple[str, int]:
    """A deployment run of ``part`` once a shard of it is committed (recorded in the manifest: a shard
    file alone may be a moment ahead of it): its id and its server's pid."""
    api: Api = stack["api"]
    run = api.run("datagen/demo", partition=str(part), **params)
    api.wait(run, {"RUNNING"}, 90)
    deadline = time.monotonic() + 120
    while not _committed_shards(out / "_manifest.json", "glaive_like"):
        assert time.monotonic() < deadline, "no shard committed"
        time.sleep(0.1)
    record = json.loads((stack["base"] / "state" / "runs" / f"{run}.json").read_text())
    return run, int(record["servers"][0]["pid"])


def test_sigkill_runs_crash_hook_and_next_run_resumes_exactly_once(stack: dict[str, Any], tmp_path: Path) -> None:
    api: Api = stack["api"]
    # Decode slow enough that the kill lands with shards left (the rerun keeps the flags: they are part
    # of the rows' server fingerprint, which validation requires to be one per shard).
    # Two samples per prompt: the resume of a killed --samples run through the deployment path (the
    # flow's resume check once assumed one sample and refused the identical rerun).
    part = _partition(tmp_path, "kill", ["--emu-decode-ms-per-step", "12", "--emu-output-tokens", "48"],
                      run="", sampling="")
    out = tmp_path / "kill"
    run, server_pid = _running_with_a_shard(stack, part, out, samples=2)
    proc = _flow_process(stack["worker"], run)
    assert pid_alive(server_pid)
    proc.send_signal(signal.SIGKILL)
    st = api.wait(run, {"CRASHED", "FAILED", "COMPLETED"}, 60)
    assert st["type"] == "CRASHED", st
    deadline = time.monotonic() + 60
    rec_path = stack["base"] / "state" / "runs" / f"{run}.json"
    while "cleanup" not in json.loads(rec_path.read_text()):  # written by the hook, in the worker
        assert time.monotonic() < deadline, "crash hook did not run"
        time.sleep(0.3)
    assert json.loads(rec_path.read_text())["cleanup"]["state"] == "Crashed"
    assert not pid_alive(server_pid)
    assert all(g["used_mib"] == 0 for g in SimGpus(out / "_sim-gpus.json").snapshot()["gpus"])
    manifest = json.loads((out / "_manifest.json").read_text())
    before = manifest["datasets"]["glaive_like"]["shards"]
    assert 1 <= len(before) < 6
    rerun = api.run("datagen/demo", partition=str(part), samples=2)
    st = api.wait(rerun, {"COMPLETED", "FAILED", "CRASHED"}, 150)
    assert st["type"] == "COMPLETED", st["message"] + api.logs(rerun)[-3000:]
    keys = [(r["id"], r["sample"]) for f in sorted(out.glob("glaive_like/shard-*.parquet"))
            for r in pq.read_table(f, columns=["id", "sample"]).to_pylist()]
    assert len(keys) == len(set(keys)) == 600 and {k for _, k in keys} == {0, 1}
    after = json.loads((out / "_manifest.json").read_text())["datasets"]["glaive_like"]["shards"]
    assert len(after) == 6
    assert {k: after[k] for k in before} == before  # committed shards were not redone


def test_prefect_variable_store_against_real_api(prefect_server, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", prefect_server.api_url)
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        mem = FractionMemory.default()
        assert mem.kind == "prefect"
        key = f"host|/m|tp8|NVIDIA H200|{os.getpid()}"
        assert mem.get(key) is None
        mem.remember_success(key, 0.88, 5.47)
        mem.remember_runtime_oom(key, 0.88, 0.05)
        e = mem.get(key)
        assert (e.fraction, e.headroom_gib, e.runtime_oom_at) == (0.83, 5.47, 0.88)
        rows = [r for r in list_remembered(mem) if r["key"] == key]
        assert len(rows) == 1 and rows[0]["store"] == "prefect" and rows[0]["fraction"] == 0.83


ARTIFACT_SCRIPT = """
import json, sys
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from tasks.validation import publish_artifacts, validate_output

@flow(name="validation-artifacts")
def publish(out):
    return publish_artifacts(validate_output(out), "Validation Run_1")

state = publish(sys.argv[1], return_state=True)
run_id = state.state_details.flow_run_id
with get_client(sync_client=True) as client:
    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
print(json.dumps({"ids": state.result(), "arts": [{"key": a.key, "type": a.type, "data": a.data} for a in arts]}))
"""


def test_artifacts_in_a_flow_run(tmp_path, prefect_server):
    """On the session's server (the artifacts of this flow run only)."""
    out = write_output(tmp_path / "out", {"glaive": [clean_rows("glaive", 30, parser=None)]}, shard_size=30)
    env = {**os.environ, "PREFECT_HOME": str(migrated_home(tmp_path / "prefect")),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_API_URL": prefect_server.api_url}
    proc = subprocess.run([sys.executable, "-c", ARTIFACT_SCRIPT, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(doc["ids"]) == 2
    arts = {a["key"]: a for a in doc["arts"]}
    assert set(arts) == {"validation-run-1-checks", "validation-run-1-summary"}
    assert arts["validation-run-1-summary"]["type"] == "markdown"
    assert arts["validation-run-1-summary"]["data"].startswith("# Validation: FAIL")
    table = arts["validation-run-1-checks"]
    assert table["type"] == "table"
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    assert {r["check"]: r["status"] for r in rows}["tag_leak"] == "fail"


def _committed_shards(manifest: Path, dataset: str) -> dict[str, Any]:
    try:
        return dict(json.loads(manifest.read_text())["datasets"][dataset]["shards"])
    except (OSError, ValueError, KeyError):
        return {}
