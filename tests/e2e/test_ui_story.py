"""What a user sees of a run in the Prefect UI, read back from a real Prefect server's API after
`datagen run` against the emulator: run and task run names, the task graph's edges, the artifacts
(keys per partition, verdict first, the run summary, the progress end state, validation reports of
a run the shard gate stopped, the launch story of a runtime OOM and its relaunch) and the logs."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tasks.artifacts import artifact_key
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import FAST_EMU, records

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
HOST = socket.gethostname()
HOST_KEY = artifact_key(HOST)


def _partition(tmp: Path, name: str, rows: int, *, run: str = "", sampling: str = "max_new_tokens = 256\n",
               conc: int = 8, long_first: int = 0) -> Path:
    """An emulator partition over the first ``rows`` prompts of the glaive-like sample; the first
    prompt made ``long_first`` words longer. Whether a prefill batch of short prompts crosses the
    emulator's activation headroom depends on how many arrive together, which a loaded machine
    changes; one prompt of 1,800 tokens alone crosses it at 0.93 (about 1,600) and never at 0.88."""
    inp = tmp / "ds.jsonl"
    with open(REPO_ROOT / "data" / "samples" / "glaive_like.jsonl") as src:
        lines = [line for _, line in zip(range(rows), src, strict=False)]
    if long_first:
        first = json.loads(lines[0])
        first["messages"][-1]["content"] += " context" * long_first
        lines[0] = json.dumps(first) + "\n"
    inp.write_text("".join(lines))
    part = tmp / f"{name}.toml"
    part.write_text(f"""name = "{name}"
[datasets]
ds = "{inp}"
[model]
path = "{REPO_ROOT}/data/models/demo"
reasoning_parser = "qwen3"
[server]
backend = "emulator"
tp_size = 1
extra_args = {json.dumps(FAST_EMU)}
[run]
shard_size = 20
concurrency = {conc}
hygiene_grace_s = 1
hang_timeout_s = 5
capacity_probe_tokens = 0
{run}
[sampling]
{sampling}
[output]
root = "{tmp / 'out'}"
""")
    return part


def _run(prefect_server: PrefectServer, tmp: Path, part: Path, *args: str) -> tuple[int, str, str]:
    """`datagen run`: (exit code, output, flow run id)."""
    SimGpus.init(tmp / "sim-gpus.json", count=2)
    env = prefect_server.env(**{ENV_VAR: str(tmp / "sim-gpus.json"), "DATAGEN_STATE_DIR": str(tmp / "state"),
                                "DATAGEN_RUN_DIR": str(tmp / "run")})
    before = set(records(tmp))
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240)
    (run_id,) = set(records(tmp)) - before
    return proc.returncode, proc.stdout + proc.stderr, run_id


class Api:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def flow_run(self, run_id: str) -> dict[str, Any]:
        return self.http.get(f"/flow_runs/{run_id}").raise_for_status().json()

    def task_runs(self, run_id: str) -> list[dict[str, Any]]:
        body = {"flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
        return self.http.post("/task_runs/filter", json=body).raise_for_status().json()

    def artifacts(self, **artifact_filter: Any) -> list[dict[str, Any]]:
        body = {"artifacts": artifact_filter, "sort": "CREATED_DESC"}
        return list(reversed(self.http.post("/artifacts/filter", json=body).raise_for_status().json()))

    def logs(self, run_id: str) -> list[dict[str, Any]]:
        body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200, "sort": "TIMESTAMP_ASC"}
        return self.http.post("/logs/filter", json=body).raise_for_status().json()


@pytest.fixture(scope="module")
def api(prefect_server: PrefectServer) -> Any:
    client = Api(prefect_server.api_url)
    yield client
    client.http.close()


def _edges(tasks: list[dict[str, Any]]) -> set[tuple[str, str]]:
    names = {t["id"]: t["name"] for t in tasks}
    return {(names[i["id"]], t["name"]) for t in tasks for ins in t["task_inputs"].values() for i in ins
            if i.get("input_type") == "task_run"}


def test_a_clean_run_names_its_runs_draws_a_clean_graph_and_summarises_itself(
        prefect_server: PrefectServer, api: Api, tmp_path: Path) -> None:
    part = _partition(tmp_path, "uiclean", 50, run="price_per_gpu_hour = 4.0")
    code, out, run_id = _run(prefect_server, tmp_path, part)
    assert code == 0, out[-3000:]
    assert re.fullmatch(r"uiclean-\d{4}-\d{2}-\d{2}-\d{4}", api.flow_run(run_id)["name"])

    tasks = api.task_runs(run_id)
    gpu = f"{HOST}-gpu0"
    session = "server-local[gpu 0]"  # the server's session: its hygiene, launch, health and stop inside
    assert [t["name"] for t in tasks] == [
        "load-config", "prepare-output", "open-datasets", session, f"hygiene-before-launch-{gpu}",
        f"launch-{gpu}-1", f"health-{gpu}", f"infer-ds@{HOST}", f"stop-server-{gpu}", "validate-output",
        "promote-latest"]
    # Only the data a task takes: the config for the output's choice, the output plan for promotion,
    # the opened dataset for its inference,
    # the launched server's endpoint, and the server's lifecycle holding its tasks.
    assert _edges(tasks) == {("load-config", "prepare-output"), ("prepare-output", "promote-latest"),
                             ("open-datasets", f"infer-ds@{HOST}"), (f"launch-{gpu}-1", f"health-{gpu}"),
                             (session, f"hygiene-before-launch-{gpu}"), (session, f"launch-{gpu}-1"),
                             (session, f"health-{gpu}"), (session, f"stop-server-{gpu}")}

    arts = {a["key"]: a for a in api.artifacts(flow_run_id={"any_": [run_id]})}
    assert set(arts) == {"datagen-progress-uiclean", f"hygiene-before-launch-uiclean-{HOST_KEY}",
                         f"server-launch-uiclean-{HOST_KEY}", "validation-checks-uiclean",
                         "validation-summary-uiclean", "run-summary-uiclean",
                         "server-uiclean-local-gpu-0", "servers-uiclean"}
    assert arts["validation-summary-uiclean"]["description"].startswith("PASS: validation of ")
    assert arts[f"server-launch-uiclean-{HOST_KEY}"]["description"].startswith("OK: launch 1 on ")
    assert arts[f"hygiene-before-launch-uiclean-{HOST_KEY}"]["description"].startswith("CLEAN: hygiene ")
    progress = arts["datagen-progress-uiclean"]
    assert progress["data"] == 100.0
    assert progress["description"].startswith("uiclean: DONE in ") and "ETA" not in progress["description"]
    assert "3/3 shards, 50/50 rows (ds 50/50)" in progress["description"] and "rows/s" in progress["description"]
    summary = arts["run-summary-uiclean"]
    assert summary["description"].startswith(f"PASS: uiclean: 50 rows -> {tmp_path / 'out'}")
    record = records(tmp_path)[run_id]["summary"]
    completion = sum(sum(pq.read_table(f, columns=["completion_tokens"]).column(0).to_pylist())
                     for f in (tmp_path / "out" / "ds").glob("shard-*.parquet"))
    assert record["completion_tokens"] == completion and record["rows_new"] == 50 and record["relaunches"] == 0
    assert record["cost_per_1k_rows"] == pytest.approx(record["gpu_hours"] * 4.0 * 1000 / 50)
    for part_md in ("| cost per 1,000 rows |", "| GPU-hours |", "| tokens in / out |", "| relaunches | 0 of 3 |"):
        assert part_md in summary["data"], part_md

    messages = [log["message"] for log in api.logs(run_id)]
    text = "\n".join(messages)
    assert messages.count("Finished in state Completed()") == 1  # the flow run's, not one per task
    assert "partition uiclean:\n  partition: uiclean\n  datasets:\n    ds: " in text  # readable, not a dict repr
    assert text.count("simulated GPUs only") == 1


def test_a_run_the_shard_gate_stops_publishes_its_validation_reports_and_counts_what_it_committed(
        prefect_server: PrefectServer, api: Api, tmp_path: Path) -> None:
    part = _partition(tmp_path, "uigate", 60, sampling="max_new_tokens = 8\n")
    code, out, run_id = _run(prefect_server, tmp_path, part)
    assert code == 1, out[-3000:]
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())["datasets"]["ds"]["shards"]
    committed = len(manifest)
    assert committed >= 1

    arts = {a["key"]: a for a in api.artifacts(flow_run_id={"any_": [run_id]})}
    assert arts["validation-summary-uigate"]["description"].startswith("FAIL: validation of ")
    assert arts["validation-summary-uigate"]["data"].startswith("# Validation: FAIL")
    assert arts["validation-checks-uigate"]["type"] == "table"
    history = api.artifacts(key={"any_": ["validation-summary-uigate"]})
    assert [a["flow_run_id"] for a in history] == [run_id]  # the failed run is in the key's history
    progress = arts["datagen-progress-uigate"]["description"]
    assert progress.startswith("uigate: FAILED (ValidationFailed) after ")
    assert f"{committed}/3 shards, {committed * 20}/60 rows" in progress
    assert arts["run-summary-uigate"]["description"].startswith("FAIL: uigate: ")
    assert arts["hygiene-cleanup-uigate"]["description"] == "CLEAN: GPU hygiene after Failed (uigate)"

    logs = api.logs(run_id)
    text = "\n".join(log["message"] for log in logs)
    told = [log for log in logs if log["message"].startswith("ValidationFailed: ")]
    assert len(told) == 1 and told[0]["level"] == 40, text[-3000:]  # once, as an error
    assert "Traceback" not in text and "Task run encountered an exception" not in text
    assert "Finished in state Failed: ValidationFailed (above)" in text


def test_a_runtime_oom_and_its_relaunch_tell_their_story_and_an_explicit_fraction_wins_over_memory(
        prefect_server: PrefectServer, api: Api, tmp_path: Path) -> None:
    part = _partition(tmp_path, "uioom", 40, conc=16, long_first=1800)
    code, out, run_id = _run(prefect_server, tmp_path, part, "--mem-fraction-static", "0.93")
    assert code == 0, out[-3000:]
    assert "relaunched" in api.flow_run(run_id)["tags"]  # told apart from a clean run in the run list
    gpu = f"{HOST}-gpu0"
    names = [t["name"] for t in api.task_runs(run_id)]
    assert f"launch-{gpu}-1" in names and f"launch-{gpu}-2 (relaunch 1/3)" in names

    launches = [a for a in api.artifacts(flow_run_id={"any_": [run_id]})
                if a["key"] == f"server-launch-uioom-{HOST_KEY}"]
    assert len(launches) == 2
    first, second = launches
    assert first["description"].startswith("DIED: ") and first["data"].startswith("**DIED** during the run")
    assert "**0.93** (start: explicit run parameter" in first["data"] and "**LOW**" in first["data"]
    assert "start: relaunch 1/3 after a runtime OOM at 0.93" in second["data"]
    assert "relaunch budget: 1 of 3 used" in second["data"]
    assert second["description"].startswith("OK: launch 2 on ") and "(relaunch 1/3 after a runtime OOM" in \
        second["description"]

    logs = api.logs(run_id)
    assert not [log["message"] for log in logs if log["level"] >= 40]  # self-healed: no error
    healed = [log for log in logs if "its lifecycle relaunches it (relaunch 1/3)" in log["message"]]
    assert len(healed) == 1 and healed[0]["level"] == 30
    assert [log["level"] for log in logs if "headroom after graph capture" in log["message"]] == [30]
    assert not [log for log in logs if "rerun to resume" in log["message"]]

    # The tuner now remembers 0.88 (below the OOM at 0.93); an explicit 0.9 still wins, memory shown.
    code, out, again = _run(prefect_server, tmp_path, part, "--mem-fraction-static", "0.9",
                            "--out", str(tmp_path / "again"))
    assert code == 0, out[-3000:]
    (launch,) = [a for a in api.artifacts(flow_run_id={"any_": [again]}) if a["key"].startswith("server-launch-")]
    assert "**0.9** (start: explicit run parameter; remembered 0.88" in launch["data"]
