"""The generation features as a user runs them: `datagen run --partition P --server-url URL` on the
emulator. Truncation retries run through the dispatcher every flow run uses (they crashed on its
first length finish); two runs of the same ids on one shared server never share a request id; a lone
surrogate is one reject.

A `--samples 3` run and a `--regenerate all` run killed with SIGKILL mid-output, then resumed with
the identical command, are proven on real SGLang (tests/sglang/test_user_path.py): the emulator's
copies of those two runs proved nothing more and were removed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.e2e.test_cli_server_url import _env
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import (
    committed_keys,
    committed_rows,
    metrics,
    write_input,
)
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def _partition(tmp: Path, data: Path, *, max_new_tokens: int = 128, extra_run: str = "") -> Path:
    part = tmp / "partition.toml"
    part.write_text(f"""
[datasets]
ds = "{data}"

[model]
path = "{DEMO_MODEL}"
reasoning_parser = "qwen3"

[server]
backend = "emulator"
targets = ["local"]

[run]
shard_size = 4
concurrency = 4
capacity_probe_tokens = 0
{extra_run}

[sampling]
max_new_tokens = {max_new_tokens}
temperature = 0.6

[output]
root = "{tmp / 'unused-root'}"
versioned = false
""")
    return part


def _argv(part: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [DATAGEN, "run", "--partition", str(part), "--server-url", url, "--out", str(out), *extra]


def _run(tmp: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO_ROOT, env=_env(tmp), capture_output=True, text=True, timeout=400,
                          stdin=subprocess.DEVNULL)


def test_truncation_retries_through_the_run_regenerate_length_finishes(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 8)
    out = tmp_path / "out"
    # answers of 20-60 tokens: every one finishes by length at 12, some at 36, none at 108
    em = emulator_factory(["--emu-decode-ms-per-step", "1", "--emu-output-tokens", "40"])
    part = _partition(tmp_path, data, max_new_tokens=12, extra_run="truncation = { factor = 3.0, max_new_tokens = 108 }")
    res = _run(tmp_path, _argv(part, em.url, out, "--truncation-retries", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"completed: 8 rows in {out}" in res.stdout
    rows = committed_rows(out, "ds", ["id", "finish_reason", "max_new_tokens", "truncation_retries"])
    assert sorted(r["id"] for r in rows) == ids
    assert {r["finish_reason"] for r in rows} == {"stop"}
    assert {r["truncation_retries"] for r in rows} <= {1, 2}
    assert all(r["max_new_tokens"] == 12 * 3 ** r["truncation_retries"] for r in rows)
    # one request per row, plus one per regeneration
    assert metrics(em.url)["num_requests_total"] == 8 + sum(r["truncation_retries"] for r in rows)


def test_two_runs_of_the_same_ids_on_one_shared_server_never_share_a_request_id(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory, reap_pids) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 40)
    log = tmp_path / "requests.log"
    em = emulator_factory(["--emu-decode-ms-per-step", "4", "--emu-output-tokens", "40",
                           "--emu-request-log", str(log)])
    part = _partition(tmp_path, data)
    procs = []
    for name in ("first", "second"):  # one after the other: each gets its own Prefect home
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen(_argv(part, em.url, tmp_path / name / "out"), cwd=REPO_ROOT,
                                      env=_env(tmp_path / name), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL))
        reap_pids.append(procs[-1].pid)
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, stderr[-3000:]
    for name in ("first", "second"):
        assert committed_keys(tmp_path / name / "out", "ds") == [(i, 0) for i in ids]
    events = [line.split(" ", 1) for line in log.read_text().splitlines()]
    # SGLang answers a rid already in flight with 400 "Duplicate request ID": none was refused
    assert [rid for ev, rid in events if ev == "duplicate"] == []
    received = [rid for ev, rid in events if ev == "recv"]
    assert len(received) == len(set(received)) == 80  # each run's rids its own
    assert sorted(rid.rpartition("@")[0] for rid in received) == sorted(ids * 2)


def test_a_lone_surrogate_in_one_row_is_a_reject_and_the_run_completes(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    data = tmp_path / "prompts.jsonl"
    ids = write_input(data, 40)
    with open(data, "a") as f:  # valid JSON, but "\ud800" is half a UTF-16 pair: no UTF-8 text
        f.write('{"id": "broken\\ud800", "messages": [{"role": "user", "content": "question \\ud800"}]}\n')
    out = tmp_path / "out"
    em = emulator_factory(["--emu-decode-ms-per-step", "1", "--emu-output-tokens", "20"])
    argv = _argv(_partition(tmp_path, data), em.url, out)
    res = _run(tmp_path, argv)
    assert res.returncode == 0, res.stderr[-3000:]  # it crashed in the request encoder, every rerun too
    assert f"completed: 40 rows in {out}" in res.stdout
    assert [r["id"] for r in committed_rows(out, "ds", ["id"])] == ids
    (reject,) = OutputDir(out).read_rejects("ds")
    assert reject["line"] == 41 and "lone surrogate \\ud800" in reject["reason"]
    again = _run(tmp_path, argv)  # a rerun finds the output complete
    assert again.returncode == 0, again.stderr[-3000:]
