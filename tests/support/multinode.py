"""Two simulated GPU hosts for a server over two nodes (tests/e2e/test_multinode*.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.simgpu import SimGpus
from tests.support.sshd import SSHD, SshHost, start_hosts, stop_hosts

__all__ = ["sim_clean", "two_hosts"]


def two_hosts(tmp_path: Path, addresses: list[str]) -> Iterator[list[SshHost]]:
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
