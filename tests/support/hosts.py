"""Simulated GPU hosts reached over SSH, and the emulator partitions the scale-out and multi-node
tests run on them (tests/e2e/test_scale_out.py, test_multinode*.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tests.support.paths import REPO_ROOT
from tests.support.runs import FAST_EMU
from tests.support.sshd import SSHD, SshHost, start_hosts, stop_hosts

__all__ = ["emulator_partition", "sim_clean", "sshd_hosts"]


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
