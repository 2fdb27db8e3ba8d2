"""`datagen run --input X --model-path Y` without a partition on a host with fewer GPUs than `all` uses:
the ad-hoc partition runs on one GPU and completes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.support.paths import REPO_ROOT
from tests.support.runs import cli_env

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def test_input_run_on_a_two_gpu_host_completes_on_one_gpu(tmp_path: Path) -> None:
    gpus = SimGpus.init(tmp_path / "sim-gpus.json", count=2)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Q{i}?"}]}) + "\n"
                           for i in range(12)))
    out = tmp_path / "out"
    env = cli_env(tmp_path, gpus.path)
    res = subprocess.run([DATAGEN, "run", "--input", str(inp), "--model-path", str(REPO_ROOT / "data/models/demo"),
                          "--backend", "emulator", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"completed: 12 rows in {out}" in res.stdout
    assert [s.rows for s in OutputDir(out).committed_shards("prompts")] == [12]
    # the flow's validation wrote the dataset card, and the rows name the flow run that made them
    card = (out / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n") and "| `prompts` | 12 | 0 | 1 of 1 |" in card
    run_ids = pq.read_table(list(OutputDir(out).committed_shards("prompts"))[0].path, columns=["run_id"]).column(0)
    assert len(set(run_ids.to_pylist())) == 1 and f"- run_id: `{run_ids[0]}` (12 rows)" in card


def _prompts(tmp: Path, n: int) -> Path:
    inp = tmp / "my.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Q{i}?"}]}) + "\n"
                           for i in range(n)))
    return inp


def test_own_prompts_on_the_emulator_need_no_simulated_gpus_set_up(tmp_path: Path) -> None:
    """Issue 25 item 6: the README's way to try one's own prompts; DATAGEN_SIM_GPUS unset, no [sim_gpus]."""
    env = cli_env(tmp_path, tmp_path / "unused", own_api=True)  # as the README's user has it: no server
    env.pop("DATAGEN_SIM_GPUS")
    out = tmp_path / "X"
    res = subprocess.run([DATAGEN, "run", "--input", str(_prompts(tmp_path, 10)), "--backend", "emulator",
                          "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"completed: 10 rows in {out}" in res.stdout
    assert "GpusNotClean" not in res.stderr and "Retrying" not in res.stderr
    assert [g["used_mib"] for g in SimGpus(out / "_sim-gpus.json").snapshot()["gpus"]] == [0] * 8
    _published_files_are_data_only(out)
    _card_is_fit_to_publish(out, tmp_path)
    # The run kept its learned fraction in its own Prefect API's Variables; `datagen status` without
    # PREFECT_API_URL reads this host's copy (issue 25 item 10), never "none yet".
    status = subprocess.run([DATAGEN, "status", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "learned memory fraction: none yet" not in lines, status.stdout
    assert any(x.startswith("learned memory fraction: ") and "[file: " in x for x in lines), status.stdout
    assert any(x.startswith("validation: pass (10 rows, validated ") for x in lines), status.stdout


def _published_files_are_data_only(out: Path) -> None:
    """Issue 25 item 8: docs/output.md's `hf upload` patterns, applied as the Hub's CLI applies them
    (fnmatch on the path relative to OUT), publish the data and nothing of the run's machinery."""
    import fnmatch

    doc = (REPO_ROOT / "docs" / "output.md").read_text()
    block = doc[doc.index("<!-- publish-command:"):]
    command = block[block.index("```sh"):block.index("```", block.index("```sh") + 5)]
    patterns = re.findall(r'--include "([^"]+)"', command.split("\n# ")[0])
    assert patterns and "--exclude" not in command
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert any(f.startswith("_logs/server-") for f in files) and "_sim-gpus.json" in files  # both exist here
    sent = [f for f in files if any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert sent == ["README.md", "_validation.json", "my/shard-00000.parquet"], sent


def _card_is_fit_to_publish(out: Path, tmp: Path) -> None:
    from tasks.schema import COLUMNS

    card = (out / "README.md").read_text()
    body = card[card.index("\n---\n", 4):]
    assert "\n# adhoc: X\n" in body  # the partition and the output, each once
    assert str(tmp) not in card and str(REPO_ROOT) not in card  # no host path is published
    assert "- input: `my.jsonl` (sha256 " in card
    assert "nothing stripped: newlines are kept" in card
    for col in COLUMNS:
        assert re.search(rf"^\| `{col}` \| `[^`]+` \| \S.+ \|$", body, re.M), col
    assert "| reasoning_present | pass | 0% without reasoning | at most 5% |" in card


def test_a_machine_without_gpus_is_told_once_how_to_run_instead_not_retried(tmp_path: Path) -> None:
    env = cli_env(tmp_path, tmp_path / "unused")
    env.pop("DATAGEN_SIM_GPUS")
    out = tmp_path / "X"
    res = subprocess.run([DATAGEN, "run", "--input", str(_prompts(tmp_path, 4)), "--model-path",
                          str(REPO_ROOT / "data/models/demo"), "--out", str(out)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("datagen run: run failed: no GPU can be read on "), last
    model = REPO_ROOT / "data/models/demo"
    assert last.endswith(
        "the ways on: run where the GPUs are ([server] targets = [\"ssh://user@gpu-host\"] in a partition, `datagen run "
        "--partition FILE.toml`); use a server already running elsewhere (--server-url http://host:port); SGLang on "
        f"this CPU, slow but real (start `python -m sglang.launch_server --model-path {model} --device cpu --port "
        "30000` and pass --server-url http://127.0.0.1:30000: datagen launches servers on GPUs only); or try the "
        "pipeline on the emulator (--backend emulator: simulated GPUs are created under the output)"), last
    assert "Retrying" not in res.stderr and res.stderr.count("hygiene before-launch") == 1
    assert not list(out.glob("*/shard-*.parquet"))
