"""The canary end to end: the field reports' empty-reasoning bug (a chat template that opens the think
block, a parser that does not expect it) stops `datagen run` on its first rows, before the server has
answered twice the concurrency; a normal run is not stopped. The real CLI against a real emulator
(``--server-url``, so that its /metrics can be read after the run).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.e2e.test_cli_server_url import _env
from tests.e2e.test_reasoning_bug import _model_dir
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import metrics, wait_idle
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS, SHARD, CONCURRENCY = 600, 100, 64
EMU_ARGS = ["--emu-decode-ms-per-step", "2", "--emu-output-tokens", "48", "--max-running-requests", "64"]


def _input(path: Path) -> None:
    path.write_text("".join(json.dumps({"id": f"q-{i:03d}", "messages": [{"role": "user", "content": f"Explain {i}."}]})
                            + "\n" for i in range(ROWS)))


def _probed(out: Path) -> int:
    """The requests of the capacity probe after the health check (one per batch slot), from the
    run's summary in the output: not rows."""
    (server,) = json.loads((out / "_last_run.json").read_text())["ledger"]["servers"].values()
    return int(server["capacity"]["slots"])


def _run(tmp: Path, url: str, model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    data = tmp / "prompts.jsonl"
    _input(data)
    argv = [DATAGEN, "run", "--input", str(data), "--model-path", str(model), "--server-url", url, "--out", str(out),
            "--shard-size", str(SHARD), "--concurrency", str(CONCURRENCY), *extra]
    env = _env(tmp)
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"  # a loaded test machine
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_empty_reasoning_bug_stops_before_twice_the_concurrency(tmp_path: Path, sim_gpus: SimGpus,
                                                                 emulator_factory) -> None:
    model = _model_dir(tmp_path)
    em = emulator_factory(EMU_ARGS + ["--model-path", str(model)])
    out = tmp_path / "out"
    run = _run(tmp_path, em.url, model, out, "--reasoning-parser", "mistral")
    answered = wait_idle(em.url)["num_requests_total"] - _probed(out)
    print(f"rows answered when the run stopped: {answered:.0f} of {ROWS} (concurrency {CONCURRENCY})")
    assert run.returncode == 1, run.stderr[-3000:]
    assert answered < 2 * CONCURRENCY
    assert re.search(
        r"datagen run: run failed: reasoning empty in 100% of 32 rows of the first rows of prompts \(e\.g\. id "
        r"q-\d{3}\): the prompt opens the think block \(chat template\) and the raw output uses the <think>…</think> "
        r"format but parser is mistral; fix the reasoning parser \(one of deepseek-r1, qwen3, qwen3-thinking; "
        + re.escape("set by --reasoning-parser, the reasoning_parser flow parameter in the Prefect UI or [model] "
                    "reasoning_parser in the partition") + r"\), then "
        + re.escape("run again (nothing of prompts was committed, so nothing needs re-splitting); the limit is "
                    "[validation] reasoning_missing_max_rate = 0.05: to accept such rows raise it in the partition and "
                    "rerun `datagen run` (what is committed is kept; a complete output is judged again without "
                    "generating anything) (also failing: tag_leak); stopped by the canary on the first rows "
                    "([validation] canary_rows)\n"), run.stderr), \
        run.stderr[-3000:]
    assert "resplit" not in run.stderr  # nothing was committed: nothing to re-split (issue 25 item 2)
    # The validation report leads with the stop and its checks, and judges neither `complete` nor
    # `volume` of what the stop left unfinished ("finish the run", "check the input" would mislead).
    summary = run.stderr[run.stderr.index(f"validation of {out}: FAIL"):]
    lines = summary.splitlines()
    assert lines[1].startswith("  STOPPED by the canary on the first rows of prompts: reasoning empty in 100% of 32 "
                               "rows"), lines[:3]
    assert re.match(r"    FAIL reasoning_present  100% without reasoning +reasoning empty in 100% of 32 rows",
                    lines[2]), lines[2]
    assert re.match(r"    FAIL tag_leak +100% with tags left", lines[3]) and lines[4].startswith("    ok   empty_content")
    assert lines[5] == "  prompts: warn - 0 rows in 0 shards"
    for line, check in zip(lines[6:8], ("complete", "volume"), strict=True):
        assert re.match(rf"    \?\?   {check} +not judged: the canary on the first rows of prompts stopped the run "
                        r"first$", line), line
    report = json.loads((out / "_validation.json").read_text())
    assert report["verdict"] == "fail" and report["stop"]["by"] == "the canary on the first rows of prompts"
    assert [c["name"] for c in report["stop"]["checks"]] == ["reasoning_present", "tag_leak", "empty_content"]
    assert OutputDir(out).committed_indices("prompts") == set()
    assert OutputDir(out).lock_holder() is None


def test_normal_run_with_short_rows_is_not_stopped(tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    # Answers of 8 to 24 tokens (a think block of a few words, a two-word answer) among the first rows.
    em = emulator_factory(EMU_ARGS + ["--emu-output-tokens", "16"])
    out = tmp_path / "out"
    run = _run(tmp_path, em.url, DEMO_MODEL, out)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"completed: {ROWS} rows in {out}\n" in run.stdout
    assert re.search(r"canary of prompts on \S+: 32 rows, reasoning_present pass, tag_leak pass, empty_content pass",
                     run.stderr), run.stderr[-3000:]
    assert metrics(em.url)["num_requests_total"] - _probed(out) == ROWS
