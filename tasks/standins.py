"""The stand-ins for what a host lacks, chosen here and nowhere else.

A run on the emulator backend (no GPU) gets simulated GPUs (:func:`run_gpus`): those
``DATAGEN_SIM_GPUS`` names, else the partition's ``[sim_gpus]`` created under the output root by the
provider an installed package registers (``tasks.gpus.sim_gpu_backend``: the emulator's), so no
product module imports the emulator. The GPU probe reads simulated GPUs whenever that variable is
set (``tasks.gpus.read_gpus``); a process that must look at a run's GPUs after the run (the cleanup
hook on a worker) points its probe there with :func:`look_at`. The server is SGLang or the emulator
by ``[server] backend`` (``ServerConfig.module``). Decision 104.
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.config import ConfigError, PartitionConfig, SimGpuSettings
from tasks.gpus import SIM_GPUS_ENV, sim_gpu_backend

__all__ = ["look_at", "run_gpus"]


def run_gpus(cfg: PartitionConfig, root: Path) -> str | None:
    """The simulated GPUs of a run: those already set in the environment, else, for the emulator
    backend, the partition's ``[sim_gpus]`` (its defaults when the table is absent: the emulator
    never uses a real GPU) under ``root``; else none (real GPUs).

    Raises:
        ConfigError: the emulator backend, and no package registers simulated GPUs.
    """
    current = os.environ.get(SIM_GPUS_ENV)
    if current or cfg.server.launch.backend != "emulator":
        return current or None
    s = cfg.sim_gpus or SimGpuSettings()
    try:
        provider = sim_gpu_backend()
    except LookupError as exc:
        raise ConfigError(f"{cfg.source or cfg.name}: [sim_gpus]: {exc}") from exc
    return str(provider.create(root / "_sim-gpus.json", count=s.count, total_mib=s.total_mib, name=s.name,
                               release_delay_s=s.release_delay_s))


def look_at(sim_gpus: str | None) -> None:
    """Point this process's GPU probe at a run's simulated GPUs (None: the run had real ones). A
    process that already has simulated GPUs of its own keeps them."""
    if sim_gpus and not os.environ.get(SIM_GPUS_ENV):
        os.environ[SIM_GPUS_ENV] = sim_gpus
