"""Secrets end to end through the flow: the server's API key and a model hub token come from Prefect
Secret blocks (or the environment), reach the server through its environment only, and appear in no
process list, log, artifact, run record, server log, output file or console output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pyarrow.parquet as pq
import pytest
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTextSearch,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from emulator.simgpu import SimGpus
from tasks.config import load_partition
from tasks.server import API_KEY_ENV, launch_argv, launch_env
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer

ROOT = REPO_ROOT
DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS = 40
SHARD = 20


@dataclass
class Sampled:
    """What the sampler thread saw while `datagen run` ran."""

    ps_texts: set[str] = field(default_factory=set)  # each distinct line of `ps -ww -eo args`
    cmdlines: set[str] = field(default_factory=set)  # each distinct /proc/<pid>/cmdline
    samples: int = 0
    server_pids: set[int] = field(default_factory=set)
    server_env_token: bool = False  # HF_TOKEN in the server's environment had the token's value
    no_key_status: int | None = None  # POST /generate without Authorization
    with_key_status: int | None = None  # POST /generate with the right key


def _cmdlines() -> set[str]:
    out: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            out.add(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace"))
        except OSError:
            continue
    return out


def _sample(root_pid: int, key: str, token: str, seen: Sampled, stop: threading.Event) -> None:
    """Sample process lists until ``stop``; probe the run's server once it listens."""
    with httpx.Client(timeout=5, trust_env=False) as http:
        while not stop.is_set():
            # -ww: ps cuts lines at the terminal width (80 columns without one) and would hide the tail
            ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
            seen.ps_texts.update(ps.splitlines())
            seen.cmdlines.update(_cmdlines())
            seen.samples += 1
            try:
                family = psutil.Process(root_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                family = []
            for p in family:
                try:
                    cmd = p.cmdline()
                    if "emulator" not in cmd or "--port" not in cmd:
                        continue
                    seen.server_pids.add(p.pid)
                    if p.environ().get("HF_TOKEN") == token:
                        seen.server_env_token = True
                    port = int(cmd[cmd.index("--port") + 1])
                except (psutil.Error, ValueError, IndexError):
                    continue
                if seen.no_key_status is None or seen.with_key_status in (None, 503):
                    _probe(http, port, key, seen)
            time.sleep(0.05)


def _probe(http: httpx.Client, port: int, key: str, seen: Sampled) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    url = f"http://127.0.0.1:{port}/generate"
    try:
        seen.no_key_status = http.post(url, json=body).status_code
        seen.with_key_status = http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}).status_code
    except httpx.HTTPError:
        pass  # not listening yet: the next sample tries again


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seen: Sampled
    flow_run_id: str
    out: Path
    state: Path


def _partition(tmp: Path, secrets: str) -> Path:
    data = tmp / "prompts.jsonl"
    lines = (ROOT / "data/samples/glaive_like.jsonl").read_text().splitlines()[:ROWS]
    data.write_text("\n".join(lines) + "\n")
    f = tmp / "secrets.toml"
    f.write_text(
        f'[datasets]\nglaive_like = "{data}"\n'
        f'[model]\npath = "{ROOT}/data/models/demo"\nreasoning_parser = "qwen3"\n'
        f'[server]\nbackend = "emulator"\ntargets = ["local"]\ntp_size = 1\nport = 0\n{secrets}'
        f"[run]\nshard_size = {SHARD}\nconcurrency = 16\nhygiene_grace_s = 2\n"
        f"[sampling]\nmax_new_tokens = 256\n"
        f'[output]\nroot = "{tmp / "root"}"\nversioned = false\n'
    )
    return f


def _run(server: PrefectServer, tmp: Path, partition: Path, key: str, token: str, reap: list[int],
         **env_extra: str) -> Run:
    sim = tmp / "sim-gpus.json"
    SimGpus.init(sim, count=2)
    state = tmp / "state"
    out = tmp / "out"
    env = server.env(DATAGEN_SIM_GPUS=str(sim), DATAGEN_STATE_DIR=str(state), DATAGEN_RUN_DIR=str(tmp / "run"),
                     **env_extra)
    for var in ("DATAGEN_API_KEY", "HF_TOKEN"):
        if var not in env_extra:
            env.pop(var, None)  # the block path must not be helped by the environment
    seen, stop = Sampled(), threading.Event()
    with open(tmp / "stdout", "w") as so, open(tmp / "stderr", "w") as se:
        proc = subprocess.Popen([DATAGEN, "run", "--partition", str(partition), "--out", str(out)],
                                env=env, cwd=ROOT, stdout=so, stderr=se, stdin=subprocess.DEVNULL)
    reap.append(proc.pid)
    sampler = threading.Thread(target=_sample, args=(proc.pid, key, token, seen, stop), daemon=True)
    sampler.start()
    try:
        rc = proc.wait(timeout=150)
    finally:
        stop.set()
        sampler.join(timeout=30)
    reap.extend(seen.server_pids)
    runs = sorted((state / "runs").glob("*.json"))
    assert len(runs) == 1, runs
    return Run(rc, (tmp / "stdout").read_text(), (tmp / "stderr").read_text(), seen, runs[0].stem, out, state)


def _files_text(root: Path) -> Iterator[tuple[Path, str]]:
    """Every file under ``root`` as text; Parquet as its decoded rows and metadata (compressed
    pages would hide a secret from a byte search)."""
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        if f.suffix == ".parquet":
            pf = pq.ParquetFile(f)
            yield f, json.dumps(pf.read().to_pylist(), default=str) + str(pf.metadata.metadata) + str(pf.schema_arrow)
        else:
            yield f, f.read_bytes().decode("utf-8", "replace")


def _prefect_records(server: PrefectServer, flow_run_id: str, secrets: tuple[str, ...]) -> dict[str, Any]:
    """The run's flow run, task runs, logs and artifacts as read through the Prefect client, and
    what a server-wide text search for each secret finds in logs."""
    fid = uuid.UUID(flow_run_id)
    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(fid)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fid])))
        logs = []
        while True:  # page through: a run logs a line per shard and per stage
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fid])), limit=200,
                                    offset=len(logs))
            logs.extend(page)
            if len(page) < 200:
                break
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fid])))
        hits = {s: len(client.read_logs(LogFilter(text=LogFilterTextSearch(query=s)))) for s in secrets}
        variables = client.read_variables()
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=server.api_url, timeout=30) as http:
        # the run's own events and those of its task runs (related to it); no server-side text
        # search: Prefect's events text filter needs SQL concat(), which SQLite lacks
        for where in ({"any_resource": {"id": [f"prefect.flow-run.{fid}"]}},
                      {"related": {"id": [f"prefect.flow-run.{fid}"]}}):
            body = {"filter": {**where, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}
            page = http.post("/events/filter", json=body).raise_for_status().json()
            events.extend(page["events"])
            while page.get("next_page"):
                page = http.get(page["next_page"]).raise_for_status().json()
                events.extend(page["events"])
    return {"flow_run": flow_run, "task_runs": task_runs, "logs": logs, "artifacts": artifacts,
            "log_hits": hits, "events": events, "variables": variables}


def _assert_no_leak(server: PrefectServer, run: Run, secrets: tuple[str, ...]) -> None:
    seen = run.seen
    # process lists: sampled often enough to cover the server's whole life
    assert seen.samples >= 10 and seen.server_pids, (seen.samples, seen.server_pids)
    assert any("--port" in line and "emulator" in line for line in seen.ps_texts)
    for s in secrets:
        assert not [line for line in seen.ps_texts if s in line], "secret in `ps -ww -eo args`"
        assert not [c for c in seen.cmdlines if s in c], "secret in a /proc/*/cmdline"
        assert s not in run.stdout and s not in run.stderr, "secret on the console"

    rec = _prefect_records(server, run.flow_run_id, secrets)
    assert rec["flow_run"].state.is_completed()
    names = {t.name for t in rec["task_runs"]}
    assert any(n.startswith("launch-") for n in names) and any(n.startswith("health-") for n in names), names
    task_logs = [g for g in rec["logs"] if g.task_run_id is not None]
    assert len(rec["logs"]) >= 5 and task_logs, "the run's flow and task logs were read"
    kinds = {a.type for a in rec["artifacts"]}
    assert {"progress", "markdown"} <= kinds, kinds
    assert any(e["event"].startswith("prefect.task-run.") for e in rec["events"]), "the run's events were read"
    for s in secrets:
        assert s not in rec["flow_run"].model_dump_json(), "secret in the flow run (parameters, state)"
        for t in rec["task_runs"]:
            assert s not in t.model_dump_json(), f"secret in task run {t.name}"
        for g in rec["logs"]:
            assert s not in g.message, f"secret in a log line: {g.name}"
        for a in rec["artifacts"]:
            assert s not in a.model_dump_json(), f"secret in artifact {a.key} ({a.type})"
        assert rec["log_hits"][s] == 0, "a log anywhere on the server holds the secret"
        assert s not in json.dumps(rec["events"]), "secret in an event of the run"
        for v in rec["variables"]:
            assert s not in v.model_dump_json(), f"secret in variable {v.name}"

    # files: run record + state, output dir (Parquet, manifest, _validation.json, server logs), Prefect's log
    server_logs = sorted(run.out.glob("_logs/*")) + sorted((run.out.parent / "root").glob("_logs/*"))
    assert server_logs, "the emulator's log was written"
    log_text = "".join(p.read_text(errors="replace") for p in server_logs)
    assert "api_key='***'" in log_text, "the server was started with an API key (redacted in its log)"
    assert list(run.out.glob("glaive_like/shard-*.parquet")) and (run.out / "_validation.json").is_file()
    assert list((run.state / "runs").glob("*.json"))
    files = [*_files_text(run.state), *_files_text(run.out), *_files_text(run.out.parent / "root"),
             (server.log, server.log.read_text(errors="replace"))]
    files += [(p, p.read_text(errors="replace")) for p in server.home.rglob("*.log")]
    for s in secrets:
        leaked = [str(p) for p, text in files if s in text]
        assert not leaked, f"secret in files: {leaked}"

    # the server really required the key, and the flow's client sent it: all rows were generated
    assert seen.no_key_status == 401, seen
    assert seen.with_key_status in (200, 503), seen  # 503 only while still loading: the key was accepted
    rows = sum(pq.read_metadata(f).num_rows for f in run.out.glob("glaive_like/shard-*.parquet"))
    assert rows == ROWS


def _save_secret(server: PrefectServer, name: str, value: str) -> None:
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        Secret(value=value).save(name, overwrite=True)


@pytest.mark.slow
def test_secrets_from_blocks_never_leak(prefect_server: PrefectServer, tmp_path: Path, reap_pids: list[int]) -> None:
    tag = uuid.uuid4().hex[:10]
    key, token = f"sk-blockkey-{uuid.uuid4().hex}", f"hf_blocktoken{uuid.uuid4().hex}"
    _save_secret(prefect_server, f"e2e-api-key-{tag}", key)
    _save_secret(prefect_server, f"e2e-hub-token-{tag}", token)
    part = _partition(tmp_path, f'api_key_secret = "e2e-api-key-{tag}"\nhub_token_secret = "e2e-hub-token-{tag}"\n')
    run = _run(prefect_server, tmp_path, part, key, token, reap_pids)
    assert run.rc == 0, run.stdout + run.stderr
    assert re.search(rf"completed: {ROWS} rows", run.stdout), run.stdout
    assert run.seen.server_env_token, "the hub token reached the server through its environment"
    _assert_no_leak(prefect_server, run, (key, token))


@pytest.mark.slow
def test_secrets_from_environment_never_leak(prefect_server: PrefectServer, tmp_path: Path,
                                             reap_pids: list[int]) -> None:
    key, token = f"sk-envkey-{uuid.uuid4().hex}", f"hf_envtoken{uuid.uuid4().hex}"
    part = _partition(tmp_path, "")
    run = _run(prefect_server, tmp_path, part, key, token, reap_pids, DATAGEN_API_KEY=key, HF_TOKEN=token)
    assert run.rc == 0, run.stdout + run.stderr
    assert run.seen.server_env_token
    _assert_no_leak(prefect_server, run, (key, token))


def test_flow_server_config_carries_secrets_but_never_shows_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's ServerConfig holds the key and the hub token (for the server's environment), and
    its repr (what a log line or an exception would show) holds neither."""
    key, token = f"sk-envkey-{uuid.uuid4().hex}", f"hf_envtoken{uuid.uuid4().hex}"
    monkeypatch.setenv("DATAGEN_API_KEY", key)
    monkeypatch.setenv("HF_TOKEN", token)
    scfg = load_partition(str(_partition(tmp_path, ""))).server_config(30000, "qwen3")
    env = launch_env(scfg, base={})
    assert (env[API_KEY_ENV], env["HF_TOKEN"]) == (key, token)
    shown = repr(scfg) + " ".join(launch_argv(scfg, 0.88))
    assert key not in shown and token not in shown
