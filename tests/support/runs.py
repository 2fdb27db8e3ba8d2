"""Runs of `datagen run` in tests: an emulator partition written to a temporary directory, the run
records it leaves, rows done so far, and the exactly-once check of its Parquet output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq

from emulator.simgpu import ENV_VAR
from tasks.shards import OutputDir
from tests.support.paths import REPO_ROOT
from tests.support.prefect import migrated_home, on_shared_server

ROOT = REPO_ROOT
FAST_EMU = ["--emu-load-time", "0.2", "--emu-graph-time", "0.05", "--emu-warmup-time", "0.1",
            "--emu-output-tokens", "24", "--emu-health-timeout", "1"]


def cli_env(tmp: Path, sim_gpus: Path, *, own_api: bool = False, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `datagen` subprocess: this one without PREFECT_/DATAGEN_ settings, its
    Prefect home, run and state folders under ``tmp``, and the simulated GPUs file ``sim_gpus``; on
    the session's Prefect server unless ``own_api`` (then the run starts its own API server);
    ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update({ENV_VAR: str(sim_gpus)}, PREFECT_HOME=str(migrated_home(tmp / "prefect")),
               DATAGEN_RUN_DIR=str(tmp / "run"),
               DATAGEN_STATE_DIR=str(tmp / "state"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90", **(extra or {}))
    return env if own_api else on_shared_server(env)


def _dataset(path: Path, name: str, n: int) -> list[str]:
    ids = [f"{name}-{i:04d}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                            for i in ids))
    return ids


def partition(tmp: Path, datasets: dict[str, int], extra: list[str], *, shard: int, conc: int,
               max_relaunches: int, server: str = "", probe_tokens: int = 0) -> tuple[Path, dict[str, list[str]]]:
    """An emulator partition under ``tmp`` and the row ids of each dataset. ``probe_tokens``: the capacity
    probe's tokens (0: no probe; the probe's own requests would count against faults such as
    ``--emu-crash-after``: tests/e2e/test_goodput.py tests it)."""
    ids = {name: _dataset(tmp / f"{name}.jsonl", name, n) for name, n in datasets.items()}
    lines = "\n".join(f'{name} = "{tmp / name}.jsonl"' for name in datasets)
    part = tmp / "partition.toml"
    part.write_text(f"""name = "recovery"
[datasets]
{lines}
[model]
path = "{ROOT}/data/models/demo"
reasoning_parser = "qwen3"
[server]
backend = "emulator"
targets = ["local"]
tp_size = 1
extra_args = {json.dumps(FAST_EMU + extra)}
{server}
[run]
shard_size = {shard}
concurrency = {conc}
max_relaunches = {max_relaunches}
hygiene_grace_s = 1
hang_timeout_s = 5
capacity_probe_tokens = {probe_tokens}
[sampling]
max_new_tokens = 256
[output]
root = "{tmp / 'out'}"
""")
    return part, ids


def records(tmp: Path) -> dict[str, dict]:
    folder = tmp / "state" / "runs"
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")} if folder.is_dir() else {}


def done_rows(out: Path) -> int:
    """Rows on disk now: committed shards and journal lines. A run in progress removes files and
    folders while this reads (its write probe ``.datagen-write-test-*``, journals folded into a
    shard): a read that meets one is taken again."""
    for _ in range(19):
        try:
            return _rows_on_disk(out)
        except FileNotFoundError:
            time.sleep(0.01)
    return _rows_on_disk(out)


def _rows_on_disk(out: Path) -> int:
    n = sum(len(pq.read_table(f, columns=["id"])) for f in out.glob("*/shard-*.parquet"))
    return n + sum(j.read_bytes().count(b"\n") for j in out.glob("_journal/*/*.jsonl"))


def assert_exactly_once(out: Path, ids: dict[str, list[str]]) -> None:
    for name, expected in ids.items():
        seen = Counter(i for f in sorted((out / name).glob("shard-*.parquet"))
                       for i in pq.read_table(f, columns=["id"]).column("id").to_pylist())
        assert sorted(seen) == sorted(expected) and set(seen.values()) == {1}, name


def kill_after_first_commit(argv: list[str], env: dict[str, str], out: Path, reap_pids: list[int], *,
                            dataset: str = "ds", deadline_s: float = 240.0) -> None:
    """Start `datagen run` (``argv``) and SIGKILL its process alone (`kill -9 PID`) once a shard of
    ``dataset`` is committed in ``out``. What it started (SGLang, its Prefect API server) is the next
    run's to end; its pids go to ``reap_pids``, so the fixture ends whatever is left."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    reap_pids.append(proc.pid)
    deadline = time.monotonic() + deadline_s
    try:
        while not (out.exists() and OutputDir(out).read_manifest() and OutputDir(out).committed_indices(dataset)):
            if proc.poll() is not None:
                raise AssertionError(f"the run exited {proc.returncode} before a shard committed: "
                                     f"{proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"no shard committed in {deadline_s:.0f} s"
            time.sleep(0.05)
        reap_pids.extend(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()  # type: ignore[union-attr]
