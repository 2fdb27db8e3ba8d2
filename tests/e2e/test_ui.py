"""What a user of the Prefect UI gets from `datagen up` on a port other than 4200 (DATAGEN_PREFECT_PORT):
the UI finds its API, the nightly schedule stays off until asked for, the failure automation is kept
in place and notifies a webhook block; and, in a real headless Chromium, the run list and a run's
artifacts. With DATAGEN_UI_SHOTS=<dir> (`make ui-shots`) the browser tests also save the README's
screenshots there, and a relaunched run is added for them.

One Prefect server, worker and browser for the module, stopped by pid at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.variables import Variable

from datagen._notify import AUTOMATION_NAME
from datagen.cmd_up import apply_schedules
from emulator.simgpu import SimGpus
from flows.params import PARAMETER_HELP
from tasks.server import FractionMemory, PrefectStore, ServerConfig, memory_key, variable_name
from tests.support.browser import SHOTS_ENV, Page
from tests.support.common import free_port, pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectApi, datagen_up, up_env
from tests.support.runs import partition
from tests.support.webhook import Hook, save_block

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
PREFECT = str(Path(sys.executable).parent / "prefect")
BLOCK = "custom-webhook/datagen-ui-test"
SUMMARY_KEY_PREFIX = "run-summary"  # the run-summary artifact of every finished run
SHOTS = bool(os.environ.get(SHOTS_ENV))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`datagen up` with DATAGEN_PREFECT_PORT set to a free port, no PREFECT_API_URL in the shell."""
    base = tmp_path_factory.mktemp("ui")
    port = free_port()
    env = up_env(base, port)
    api_url = f"http://127.0.0.1:{port}/api"
    api = PrefectApi(api_url)
    try:
        out = datagen_up(env)
        yield {"env": env, "base": base, "port": port, "api_url": api_url, "api": api, "up": out}
    finally:
        api.http.close()
        server = json.loads((base / "run" / "server.pid").read_text())["pid"] if (base / "run" / "server.pid").exists() \
            else None
        down = subprocess.run([DATAGEN, "down"], env=env, capture_output=True, text=True, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert server is None or not pid_alive(server)


@pytest.fixture(scope="module")
def hook(stack: dict[str, Any]) -> Iterator[Hook]:
    """A webhook notification block (``custom-webhook/datagen-ui-test``) posting to a loopback endpoint."""
    hook = Hook()
    try:
        save_block(stack["api_url"], BLOCK.split("/")[1], hook.url)
        yield hook
    finally:
        hook.close()


def _schedules(api: PrefectApi) -> dict[str, list[bool]]:
    deps = api.http.post("/deployments/filter", json={}).raise_for_status().json()
    return {d["name"]: [s["active"] for s in d["schedules"]] for d in deps}


def _automations(api: PrefectApi) -> list[dict[str, Any]]:
    return [a for a in api.http.post("/automations/filter", json={}).raise_for_status().json()
            if a["name"] == AUTOMATION_NAME]


KEPT: dict[str, dict[str, Any]] = {}  # the shards a cancelled run had committed, by run id


def _committed(manifest: Path, dataset: str = "glaive_like") -> dict[str, Any]:
    try:
        return dict(json.loads(manifest.read_text())["datasets"][dataset]["shards"])
    except (OSError, ValueError, KeyError):
        return {}


def _watched_demo(stack: dict[str, Any], out: Path) -> tuple[str, str]:
    """The bundled demo started as a user does, `prefect deployment run datagen/demo --watch`: its run
    id and the command's output (it returns when the run ends)."""
    api: PrefectApi = stack["api"]
    watch = subprocess.Popen(
        [PREFECT, "deployment", "run", "datagen/demo", "--params", json.dumps({"out": str(out)}), "--watch"],
        env=dict(stack["env"], PREFECT_API_URL=stack["api_url"]), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while not found:  # the watched run, once it exists
            found = [r for r in api.http.post("/flow_runs/filter", json={}).json()
                     if r["parameters"].get("out") == str(out)]
            assert time.monotonic() < deadline, "the watched run was not created"
            time.sleep(0.3)
        output, _ = watch.communicate(timeout=240)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, output
    return found[0]["id"], output


def _partition(tmp: Path, extra: list[str], max_new_tokens: int = 256) -> Path:
    tmp.mkdir(parents=True)
    part, _ = partition(tmp, {"glaive_like": 120}, extra, shard=40, conc=8, max_relaunches=2,
                        server="\n[sim_gpus]\ncount = 2")
    part.write_text(part.read_text().replace("max_new_tokens = 256", f"max_new_tokens = {max_new_tokens}"))
    return part


@pytest.fixture(scope="module")
def runs(stack: dict[str, Any], hook: Hook) -> dict[str, str]:
    """The runs the UI tests look at, one after another on datagen/demo (one run at a time):
    ``failed`` (validation fails: 8-token answers are truncated) with ``collided`` submitted while it
    runs (cancelled by the deployment's CANCEL_NEW limit), then ``demo`` (the bundled demo, passes;
    started by `prefect deployment run --watch`, whose output is ``watch``), ``canary`` (a wrong
    parser), ``cancelled`` (by `prefect flow-run cancel` once a shard is committed; ``rerun`` resumes
    it under a name given to the run), and with screenshots asked for, ``relaunched`` (the emulator
    crashes after 60 requests). The API-level tests of this module check the same runs: one stack
    and one run per story (test_prefect.py runs the recovery paths the UI does not show)."""
    api: PrefectApi = stack["api"]
    if [a["type"] for a in _automations(api)[0]["actions"]] != ["send-notification"]:
        datagen_up(stack["env"], "--no-worker", "--notify", BLOCK)
    base: Path = stack["base"]
    ids: dict[str, str] = {}
    ids["failed"] = api.run("datagen/demo", partition=str(_partition(base / "failed", [], max_new_tokens=8)))
    api.wait(ids["failed"], {"RUNNING"}, 120)
    ids["collided"] = api.run("datagen/demo", out=str(base / "collided"))
    assert api.wait(ids["collided"], {"CANCELLED", "COMPLETED", "FAILED", "CRASHED"}, 60)["type"] == "CANCELLED"
    st = api.wait(ids["failed"], {"COMPLETED", "FAILED", "CRASHED"}, 180)
    assert st["type"] == "FAILED" and "ValidationFailed" in st["message"], st
    ids["demo"], ids["watch"] = _watched_demo(stack, base / "demo")
    st = api.wait(ids["demo"], {"COMPLETED", "FAILED", "CRASHED"}, 180)
    assert st["type"] == "COMPLETED", st["message"] + api.logs(ids["demo"])[-3000:]
    # the canary stops a wrong parser on its first rows (its reason holds <think>...</think>)
    ids["canary"] = api.run("datagen/demo", out=str(base / "canary"), reasoning_parser="mistral")
    st = api.wait(ids["canary"], {"COMPLETED", "FAILED", "CRASHED"}, 180)
    assert st["type"] == "FAILED" and "canary" in st["message"], st
    # cancelled in Prefect once a shard is committed: about 10 s a shard, so the two shards left
    # outlast `prefect flow-run cancel` starting on a loaded host (at 12 ms a step the run once
    # completed before the cancel came)
    part = _partition(base / "cancel", ["--emu-decode-ms-per-step", "40", "--emu-output-tokens", "48"])
    # goodput stays under 99% over any 2 s: the run warns and the failure automation notifies it
    part.write_text(part.read_text().replace("capacity_probe_tokens = 0\n", "capacity_probe_tokens = 16\n"
                                             "goodput_warn_below = 0.99\ngoodput_window_s = 2\n"))
    ids["cancelled"] = api.run("datagen/demo", partition=str(part))
    api.wait(ids["cancelled"], {"RUNNING"}, 120)
    manifest, deadline = base / "cancel" / "out" / "_manifest.json", time.monotonic() + 120
    while not (manifest.exists() and any(d.get("shards") for d in json.loads(manifest.read_text())["datasets"].values())):
        assert time.monotonic() < deadline, "no shard committed before the cancel"
        time.sleep(0.2)
    cancel = subprocess.run([PREFECT, "flow-run", "cancel", ids["cancelled"]],
                            env=dict(stack["env"], PREFECT_API_URL=stack["api_url"]), capture_output=True, text=True,
                            timeout=60)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert api.wait(ids["cancelled"], {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, 90)["type"] == "CANCELLED"
    KEPT[ids["cancelled"]] = _committed(manifest)
    ids["rerun"] = api.run("datagen/demo", name="my-parser-experiment", partition=str(part))
    st = api.wait(ids["rerun"], {"COMPLETED", "FAILED", "CRASHED"}, 180)
    assert st["type"] == "COMPLETED", st["message"] + api.logs(ids["rerun"])[-3000:]
    if SHOTS:
        ids["relaunched"] = api.run("datagen/demo", partition=str(_partition(base / "relaunch",
                                                                              ["--emu-crash-after", "60"])))
        st = api.wait(ids["relaunched"], {"COMPLETED", "FAILED", "CRASHED"}, 240)
        assert st["type"] == "COMPLETED", st["message"] + api.logs(ids["relaunched"])[-3000:]
    return ids


# ------------------------------------------------------------------------------ API level


def test_ui_settings_name_the_api_on_the_chosen_port(stack: dict[str, Any]) -> None:
    settings = httpx.get(f"http://127.0.0.1:{stack['port']}/ui-settings", timeout=30).raise_for_status().json()
    assert settings["api_url"] == stack["api_url"]
    assert f"Prefect UI: http://127.0.0.1:{stack['port']}\n" in stack["up"]


def test_plain_up_leaves_the_nightly_off_and_a_do_nothing_automation(stack: dict[str, Any]) -> None:
    sched = _schedules(stack["api"])
    assert sched["all"] == [False] and sched["demo"] == []
    assert "schedules: none active" in stack["up"]
    (auto,) = _automations(stack["api"])
    assert [a["type"] for a in auto["actions"]] == ["do-nothing"]
    assert sorted(auto["trigger"]["expect"]) == ["datagen.goodput.low", "prefect.flow-run.Cancelled",
                                                 "prefect.flow-run.Crashed", "prefect.flow-run.Failed"]


def test_up_again_turns_on_only_what_was_asked_and_updates_in_place(stack: dict[str, Any], hook: Hook) -> None:
    api: PrefectApi = stack["api"]
    (first,) = _automations(api)
    out = datagen_up(stack["env"], "--no-worker", "--schedule", "--notify", BLOCK)
    assert "schedules active: datagen/all 0 2 * * * UTC" in out
    assert _schedules(api)["all"] == [True] and _schedules(api)["demo"] == []
    (auto,) = _automations(api)
    assert auto["id"] == first["id"] and [a["type"] for a in auto["actions"]] == ["send-notification"]
    datagen_up(stack["env"], "--no-worker")  # neither flag: as the server had them
    assert _schedules(api)["all"] == [True]
    (auto,) = _automations(api)
    assert auto["id"] == first["id"] and [a["type"] for a in auto["actions"]] == ["send-notification"]
    assert apply_schedules(stack["api_url"], {}, want=False) == []  # what --no-schedule does after the deploy
    assert _schedules(api)["all"] == [False]


def test_up_names_a_missing_notification_block(stack: dict[str, Any]) -> None:
    up = subprocess.run([DATAGEN, "up", "--no-worker", "--notify", "slack-webhook/nope"], env=stack["env"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "notification block 'slack-webhook/nope' not found" in up.stderr


def test_failed_and_cancelled_runs_notify_the_block(stack: dict[str, Any], hook: Hook, runs: dict[str, str]) -> None:
    api: PrefectApi = stack["api"]
    failed = api.http.get(f"/flow_runs/{runs['failed']}").json()
    body = hook.wait(failed["name"])
    assert body["subject"] == f"datagen demo: {failed['name']} Failed"
    assert "ValidationFailed" in body["body"]
    assert f"http://127.0.0.1:{stack['port']}/runs/flow-run/{runs['failed']}" in body["body"]
    collided = api.http.get(f"/flow_runs/{runs['collided']}").json()
    body = hook.wait(collided["name"])
    assert body["subject"] == f"datagen demo: {collided['name']} Cancelled"
    assert "Deployment concurrency limit reached" in body["body"]
    demo = api.http.get(f"/flow_runs/{runs['demo']}").json()
    assert not [b for b in hook.bodies if demo["name"] in json.dumps(b)]  # a completed run is quiet


def test_a_run_whose_goodput_stays_low_notifies_the_block_naming_its_biggest_loss(
        stack: dict[str, Any], hook: Hook, runs: dict[str, str]) -> None:
    api: PrefectApi = stack["api"]
    rerun = api.http.get(f"/flow_runs/{runs['rerun']}").json()
    body = hook.wait(f"{rerun['name']} goodput low")
    assert body["subject"] == f"datagen demo: {rerun['name']} goodput low"
    assert "is running below its goodput threshold: goodput " in body["body"]
    assert "below run.goodput_warn_below 99%; the biggest loss is " in body["body"]
    assert "goodput" in api.logs(runs["rerun"])


@pytest.fixture(scope="module")
def learned(stack: dict[str, Any]) -> Iterator[dict[str, str]]:
    """A fraction learned under the old hashed Variable name (reasoning parser in the key), then
    used and updated by this version: ``{"legacy": old name, "name": new name}``."""
    cfg = ServerConfig(model_path="/models/Qwen3-8B", tp_size=8, reasoning_parser="qwen3")
    key = memory_key(cfg, "gpu-ui", "NVIDIA H200")
    assert key.legacy is not None
    legacy = "datagen_fraction_" + hashlib.sha256(key.legacy.encode()).hexdigest()[:24]
    old = {"key": key.legacy, "fraction": 0.83, "headroom_gib": 5.47, "runtime_oom_at": 0.88, "updated_at": "t",
           "history": ["2026-01-01T00:00:00Z launched at 0.88, headroom 5.47 GB"]}
    with temporary_settings({PREFECT_API_URL: stack["api_url"]}):
        Variable.set(legacy, old)
        mem = FractionMemory(PrefectStore())
        entry = mem.get(key)
        assert entry is not None and (entry.fraction, entry.runtime_oom_at) == (0.83, 0.88)
        mem.remember_success(key, 0.83, 5.5)
    yield {"legacy": legacy, "name": variable_name(key)}


def test_learned_fractions_move_to_readable_variables(stack: dict[str, Any], learned: dict[str, str]) -> None:
    names = {v["name"]: v["value"] for v in stack["api"].http.post("/variables/filter", json={}).json()}
    assert learned["legacy"] not in names
    assert learned["name"] == "datagen_fraction_gpu-ui_qwen3-8b_tp8_nvidia-h200_" + learned["name"][-8:]
    value = names[learned["name"]]
    assert (value["fraction"], value["runtime_oom_at"], value["headroom_gib"]) == (0.83, 0.88, 5.5)
    assert value["history"][0].endswith("headroom 5.47 GiB")
    status = subprocess.run([DATAGEN, "status"], env=dict(stack["env"], PREFECT_API_URL=stack["api_url"]),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert ("learned memory fraction: 0.83 for gpu-ui, /models/Qwen3-8B, tp 8, NVIDIA H200 (headroom 5.5 GiB; "
            "runtime OOM at 0.88; updated ") in status.stdout
    assert f"[prefect: {learned['name']}]" in status.stdout


def _rows(out: Path) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = {}
    for f in sorted(out.glob("*/shard-*.parquet")):
        ids.setdefault(f.parent.name, []).extend(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return ids


def _artifact(api: PrefectApi, run_id: str, key_prefix: str) -> dict[str, Any]:
    found = [a for a in _artifacts(api, run_id) if (a.get("key") or "").startswith(key_prefix)]
    assert found, [a.get("key") for a in _artifacts(api, run_id)]
    return found[-1]


def _record(stack: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The run record, once the flow's on-failure/on-cancellation hook has marked it (Prefect reports
    the final state before the hook has finished)."""
    path = stack["base"] / "state" / "runs" / f"{run_id}.json"
    deadline = time.monotonic() + 60
    while "cleanup" not in (record := json.loads(path.read_text())):
        assert time.monotonic() < deadline, "the run's hook did not run"
        time.sleep(0.3)
    return record


def test_a_watched_demo_run_completes_every_row_once_and_a_second_run_is_rejected(
        stack: dict[str, Any], runs: dict[str, str]) -> None:
    assert "Completed" in runs["watch"], runs["watch"]
    out = stack["base"] / "demo"
    rows = _rows(out)
    assert {k: len(set(v)) for k, v in rows.items()} == {"glaive_like": 300, "opencode_like": 300}
    assert all(len(v) == len(set(v)) for v in rows.values())
    assert SimGpus(out / "_sim-gpus.json").snapshot()["gpus"][0]["used_mib"] == 0
    # `collided`, submitted while `failed` ran, was cancelled by the deployment's limit before it began
    collided = stack["api"].http.get(f"/flow_runs/{runs['collided']}").json()
    assert collided["state"]["type"] == "CANCELLED" and "Beginning flow run" not in stack["api"].logs(runs["collided"])
    assert not list((stack["base"] / "collided").glob("*/shard-*.parquet"))


def test_validation_failure_is_not_retried_its_hook_ran_and_nothing_is_left(
        stack: dict[str, Any], runs: dict[str, str]) -> None:
    api: PrefectApi = stack["api"]
    run = runs["failed"]
    st = api.http.get(f"/flow_runs/{run}").json()["state"]
    assert st["type"] == "FAILED" and "ValidationFailed" in st["message"], st
    logs = api.logs(run)
    assert logs.count("Beginning flow run") <= 1 and "Retrying" not in logs  # neither flow nor task retried
    record = _record(stack, run)
    assert record["cleanup"]["state"] == "Failed"
    assert record["servers"] and all(not pid_alive(s["pid"]) for s in record["servers"])
    out = stack["base"] / "failed" / "out"
    assert all(g["used_mib"] == 0 for g in SimGpus(out / "_sim-gpus.json").snapshot()["gpus"])
    assert (out / "_validation.json").exists()
    # The worker's own output tells the failure in one line, no traceback (issue 25 item 3).
    text = (stack["base"] / "run" / "worker.log").read_text()
    mine = text[text.index(f"submitting flow run '{run}'"):]
    mine = mine[:mine.index("submitting flow run", 1)] if "submitting flow run" in mine[1:] else mine
    assert "Traceback" not in mine and "unexpected exception" not in mine, mine[-4000:]


def test_a_cancelled_run_is_cancelled_everywhere_keeps_its_shards_and_a_named_rerun_resumes(
        stack: dict[str, Any], runs: dict[str, str]) -> None:
    """Issue 25 item 1: `prefect flow-run cancel` is a Cancelled run everywhere (state, logs, progress,
    summary), never a crash; the committed shards stay, the server is stopped, and a rerun resumes."""
    api: PrefectApi = stack["api"]
    run = runs["cancelled"]
    record = _record(stack, run)
    assert record["cleanup"]["state"] == "Cancelling"  # Prefect runs on_cancellation hooks as the run enters it
    assert record["servers"] and all(not pid_alive(s["pid"]) for s in record["servers"])
    deadline = time.monotonic() + 30
    while "Finished: cancelled" not in (logs := api.logs(run)) and time.monotonic() < deadline:
        time.sleep(0.5)  # the last log lines travel after the state
    for wrong in ("Crash detected", "Crashed", "TerminationSignal", "FAILED", "ERROR", "Running()"):
        assert wrong not in logs, (wrong, logs[-3000:])
    assert "stopped: the flow run was cancelled" in logs and "Finished: cancelled" in logs, logs[-3000:]
    out = stack["base"] / "cancel" / "out"
    kept = KEPT[run]
    n = len(kept)
    assert 1 <= n < 3
    cause = "cancelled in Prefect (flow-run cancel or the UI)"
    progress = _artifact(api, run, "datagen-progress")
    assert progress["description"].startswith(f"recovery: CANCELLED ({cause}) after "), progress["description"]
    assert f"{n}/3 shards" in progress["description"]
    summary = _artifact(api, run, SUMMARY_KEY_PREFIX)
    assert summary["data"].startswith("# Run summary: CANCELLED"), summary["data"]
    why = f"{cause}; {n} of 3 shards were committed and are kept: a rerun with the same parameters resumes after them"
    assert why in summary["data"] and f"CANCELLED: recovery: {n * 40} rows -> {out}" in logs and why in logs
    # A name a person gives the run is kept (issue 25 item 7); Prefect's made-up one is replaced by the
    # partition file's name and the time.
    assert re.fullmatch(r"partition-\d{4}-\d\d-\d\d-\d{4}", api.http.get(f"/flow_runs/{run}").json()["name"])
    assert api.http.get(f"/flow_runs/{runs['rerun']}").json()["name"] == "my-parser-experiment"
    after = _committed(out / "_manifest.json")
    assert len(after) == 3 and {k: after[k] for k in kept} == kept
    assert sorted(_rows(out)["glaive_like"]) == [f"glaive_like-{i:04d}" for i in range(120)]


# ------------------------------------------------------------------------------ in a browser


def test_browser_variables_page_shows_readable_fraction_names(stack: dict[str, Any], learned: dict[str, str],
                                                             browser: Page) -> None:
    browser.open(f"http://127.0.0.1:{stack['port']}/variables")
    browser.wait_text(learned["name"])
    browser.shot("variables")


def _artifacts(api: PrefectApi, run_id: str) -> list[dict[str, Any]]:
    body = {"artifacts": {"flow_run_id": {"any_": [run_id]}}}
    return list(api.http.post("/artifacts/filter", json=body).raise_for_status().json())


def _open_artifacts_tab(browser: Page, stack: dict[str, Any], run_id: str, keys: list[str]) -> str:
    """The text of a run's Artifacts tab once every key in ``keys`` shows (task-run artifacts load
    when scrolled into view)."""
    browser.open(f"http://127.0.0.1:{stack['port']}/runs/flow-run/{run_id}")
    browser.click_text("Artifacts")
    return browser.wait_for(lambda t: all(k in t for k in keys), f"artifact keys {keys}", scroll=True)


def test_browser_run_list_shows_the_demo_run(stack: dict[str, Any], runs: dict[str, str], browser: Page) -> None:
    name = stack["api"].http.get(f"/flow_runs/{runs['demo']}").json()["name"]
    browser.open(f"http://127.0.0.1:{stack['port']}/runs")
    text = browser.wait_text(name)
    assert "Can't connect to Server API" not in text
    browser.show(name)
    browser.shot("runs-list")


def test_browser_artifacts_tab_shows_validation(stack: dict[str, Any], runs: dict[str, str], browser: Page) -> None:
    keys = [a["key"] for a in _artifacts(stack["api"], runs["demo"]) if a["key"] and "validation" in a["key"]]
    assert keys, "the demo run published no validation artifact"
    text = _open_artifacts_tab(browser, stack, runs["demo"], keys)
    assert "PASS" in text.upper()
    browser.shot("run-artifacts")


def test_browser_artifacts_tab_shows_the_run_summary(stack: dict[str, Any], runs: dict[str, str],
                                                      browser: Page) -> None:
    (summary,) = [a for a in _artifacts(stack["api"], runs["demo"])
                  if (a["key"] or "").startswith(SUMMARY_KEY_PREFIX)]
    _open_artifacts_tab(browser, stack, runs["demo"], [summary["key"]])
    browser.open(f"http://127.0.0.1:{stack['port']}/artifacts/artifact/{summary['id']}")
    browser.wait_text("rows")
    browser.shot("run-summary")
    # the GPU-time ledger (issue 44): goodput, each bucket with its bar, the server's capacity
    text = browser.wait_text("GPU-time ledger", scroll=True)
    for needle in ("goodput", "serving at full batch (kept rows)", "health check and capacity probe",
                   "capacity (tokens/s at full batch)", "\u2588"):
        assert needle in text, needle
    browser.show("GPU-time ledger")
    browser.shot("run-summary-ledger")


def test_browser_custom_run_form_shows_each_parameter_typed_with_its_description(stack: dict[str, Any],
                                                                                 browser: Page) -> None:
    (demo,) = [d for d in stack["api"].http.post("/deployments/filter", json={}).json() if d["name"] == "demo"]
    props = demo["parameter_openapi_schema"]["properties"]
    assert not [n for n, p in props.items() if {"type": "null"} in p.get("anyOf", [])]  # `up` rewrote the form
    browser.open(f"http://127.0.0.1:{stack['port']}/deployments/deployment/{demo['id']}/run")
    text = browser.wait_text(PARAMETER_HELP["regenerate"], scroll=True)
    assert "Property is type" not in text
    for name, help_text in PARAMETER_HELP.items():
        assert f"{name} (Optional)" in text and help_text in text, name
    assert "qwen3-thinking" in text and "emulator" in text  # the choices of reasoning_parser and backend
    browser.show("shard_size (Optional)")
    browser.shot("custom-run")


def test_browser_failed_validation_run(stack: dict[str, Any], runs: dict[str, str], browser: Page) -> None:
    browser.open(f"http://127.0.0.1:{stack['port']}/runs/flow-run/{runs['failed']}")
    browser.wait_text("ValidationFailed")
    browser.shot("run-failed-validation")


def _artifact_page(browser: Page, stack: dict[str, Any], run_id: str, prefix: str, needle: str) -> str:
    (art,) = [a for a in _artifacts(stack["api"], run_id) if (a["key"] or "").startswith(prefix)]
    browser.open(f"http://127.0.0.1:{stack['port']}/artifacts/artifact/{art['id']}")
    return browser.wait_text(needle, scroll=True)


def test_browser_cancelled_run_is_cancelled_with_what_is_kept(stack: dict[str, Any], runs: dict[str, str],
                                                              browser: Page) -> None:
    """Issue 25 item 1 in the UI: the run page says Cancelled, the logs tell no crash, the summary and
    progress say what is kept and how to resume."""
    run = runs["cancelled"]
    browser.open(f"http://127.0.0.1:{stack['port']}/runs/flow-run/{run}")
    text = browser.wait_text("Cancelled")
    text = browser.wait_text("stopped: the flow run was cancelled", scroll=True)
    for wrong in ("Crash detected", "TerminationSignal", "Finished in state Running"):
        assert wrong not in text, wrong
    browser.show("Cancelled")
    browser.shot("run-cancelled")
    summary = _artifact_page(browser, stack, run, SUMMARY_KEY_PREFIX, "Run summary: CANCELLED")
    assert "cancelled in Prefect (flow-run cancel or the UI)" in summary
    assert "a rerun with the same parameters resumes after them" in summary
    progress = _artifact_page(browser, stack, run, "datagen-progress", "CANCELLED")
    assert "FAILED" not in progress


def test_browser_canary_stop_leads_with_its_cause_and_shows_the_think_tags(stack: dict[str, Any],
                                                                          runs: dict[str, str], browser: Page) -> None:
    """Issue 25 items 2 and 3: the validation summary leads with the canary's stop and its checks, the
    run summary's reason shows <think>...</think> as written (not swallowed as an HTML tag)."""
    run = runs["canary"]
    validation = _artifact_page(browser, stack, run, "validation-summary", "Stopped by the canary")
    assert "Stopped by the canary on the first rows of glaive_like:" in validation
    assert "reasoning_present" in validation and "100% without reasoning" in validation
    assert "not judged: the canary on the first rows of glaive_like stopped the run first" in validation
    assert "datagen resplit" not in validation  # nothing was committed: a rerun, not a resplit
    browser.shot("run-canary-stop")
    summary = _artifact_page(browser, stack, run, SUMMARY_KEY_PREFIX, "the raw output uses the")
    assert "the raw output uses the <think>…</think> format but parser is mistral" in summary
    browser.shot("run-summary-think")


@pytest.mark.skipif(not SHOTS, reason=f"the relaunched run is made only for screenshots (${SHOTS_ENV})")
def test_browser_relaunched_run(stack: dict[str, Any], runs: dict[str, str], browser: Page) -> None:
    browser.open(f"http://127.0.0.1:{stack['port']}/runs/flow-run/{runs['relaunched']}")
    browser.wait_text("Completed")
    browser.click_text("Task Runs")
    browser.wait_text("recover-")  # the task that classified the crash and relaunched the server
    browser.shot("run-relaunched")
