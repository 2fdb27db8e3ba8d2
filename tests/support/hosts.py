"""Simulated GPU hosts reached over SSH, and the emulator partitions the scale-out and multi-node
tests run on them (tests/e2e/test_scale_out.py, test_multinode*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tests.support.common import free_port
from tests.support.paths import REPO_ROOT
from tests.support.prefect import PrefectServer
from tests.support.runs import FAST_EMU, records
from tests.support.sshd import SSHD, SshHost, hosts_env, start_hosts, stop_hosts

__all__ = ["emulator_partition", "recorded_servers", "run_env", "served_rows", "sim_clean", "sshd_hosts", "start_run",
           "two_node_partition", "wait_rows"]

DATAGEN = str(Path(sys.executable).parent / "datagen")


def sshd_hosts(tmp_path: Path, addresses: list[str]) -> Iterator[list[SshHost]]:
    """A real sshd per address, each with its own simulated GPUs (skips without openssh-server)."""
    if not os.path.exists(SSHD):
        pytest.skip("openssh-server is not installed: apt-get install -y openssh-server")
    started = start_hosts(tmp_path / "hosts", addresses)
    try:
        yield started
    finally:
        stop_hosts(started)


def sim_clean(host: SshHost) -> bool:
    """Whether every simulated GPU of ``host`` is free."""
    return all(g["used_mib"] == 0 for g in SimGpus(host.sim_gpus).snapshot()["gpus"])


def emulator_partition(tmp: Path, n: int, targets: list[str], decode_ms: int, run: str,
                       name: str = "scale") -> tuple[Path, list[str]]:
    """An emulator partition ``name`` of one dataset of ``n`` rows (ids ``row-0000``...) over
    ``targets`` (TOML entries), ``run`` added to its ``[run]``; returns its file and the ids."""
    ids = [f"row-{i:04d}" for i in range(n)]
    (tmp / "ds.jsonl").write_text("".join(
        json.dumps({"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n" for i in ids))
    part = tmp / f"{name}.toml"
    part.write_text(f"""name = "{name}"
[datasets]
ds = "{tmp / 'ds.jsonl'}"
[model]
path = "{REPO_ROOT}/data/models/demo"
reasoning_parser = "qwen3"
[server]
backend = "emulator"
extra_args = {json.dumps([*FAST_EMU, "--emu-decode-ms-per-step", str(decode_ms)])}
targets = [{", ".join(targets)}]
[run]
shard_size = 25
concurrency = 6
hygiene_grace_s = 1
capacity_probe_tokens = 0
{run}
[sampling]
max_new_tokens = 256
[output]
root = "{tmp / 'out'}"
""")
    return part, ids


# -- a server over two nodes, through `datagen run` (tests/e2e/test_multinode*.py) -------------


def two_node_partition(tmp: Path, hosts: list[SshHost], n: int, host_wait_s: int = 5) -> tuple[Path, list[str]]:
    """``n`` rows for one server with tp 2 over both hosts (one GPU on each); node 0 logs the
    requests it serves."""
    head = hosts[0].address
    nodes = ", ".join(f'"{h.url()}"' for h in hosts)
    entry = (f'{{ nodes = [{nodes}], gpus = [0], tp_size = 2, port = {free_port(head)}, flags = {{ host = "{head}", '
             f'env = {{ DATAGEN_EMU_REQUEST_LOG = "{tmp / "requests.log"}" }} }} }}')
    return emulator_partition(tmp, n, [entry], 8, f"max_relaunches = 2\nhang_timeout_s = 5\nhost_wait_s = {host_wait_s}",
                              name="two-nodes")


def run_env(prefect_server: PrefectServer, tmp: Path, hosts: list[SshHost]) -> dict[str, str]:
    env = prefect_server.env(DATAGEN_STATE_DIR=str(tmp / "state"), DATAGEN_RUN_DIR=str(tmp / "run"),
                             **hosts_env(hosts))
    env.pop("DATAGEN_SIM_GPUS", None)  # each host's come from its sshd
    return env


def served_rows(tmp: Path) -> list[str]:
    path = tmp / "requests.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.split(" ", 1)[1].rpartition("@")[0] for line in lines if line.startswith("done ")]


def recorded_servers(tmp: Path) -> list[dict]:
    (record,) = records(tmp).values()
    return record["servers"]


def start_run(part: Path, tmp: Path, env: dict[str, str], reap_pids: list[int]) -> subprocess.Popen[bytes]:
    with open(tmp / "run.log", "wb") as log:
        proc = subprocess.Popen([DATAGEN, "run", "--partition", str(part), "--out", str(tmp / "out")], env=env,
                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    reap_pids.append(proc.pid)
    return proc


def wait_rows(proc: subprocess.Popen[bytes], tmp: Path, rows: int) -> None:
    """Until ``rows`` rows were generated (the run must progress: it fails the test when it ends first)."""
    while len(served_rows(tmp)) < rows:
        assert proc.poll() is None, (tmp / "run.log").read_text()[-4000:]
        time.sleep(0.05)
