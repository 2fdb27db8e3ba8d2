"""The output stage's Prefect tasks: choose the run's output directory (a nightly version to resume or
a new one) and, once validated, point ``latest`` at it."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.config import ConfigError, PartitionConfig, SimGpuSettings
from tasks.gpus import SIM_GPUS_ENV, SIM_GPUS_NOTE, sim_gpu_backend
from tasks.run import RunPlan
from tasks.shards import OutputDir, choose_version, promote_latest

__all__ = ["prepare_run", "promote"]


@task(name="prepare-output", task_run_name="prepare-output", cache_policy=NONE)
def prepare_run(cfg: PartitionConfig) -> RunPlan:
    """Pick the output directory (a nightly version to resume or a new one) and, for the emulator
    with no ``DATAGEN_SIM_GPUS`` set, create the simulated GPUs under the output root."""
    root = cfg.output_root
    out = choose_version(root) if cfg.versioned else root
    sim = _sim_gpus(cfg, root)
    OutputDir(root).subdir("_logs", create=True)  # OUT/_logs, opened with O_NOFOLLOW: a planted link is refused
    log_dir = root / "_logs"
    logger = get_run_logger()
    logger.info("output %s%s", out, f" (version {out.name} of {root})" if cfg.versioned else "")
    if sim:  # said once here; the hygiene reports of the run leave it out
        logger.info("simulated GPUs %s: %s", sim, SIM_GPUS_NOTE)
    return RunPlan(out_dir=out, root=root, version=out.name if cfg.versioned else None, sim_gpus=sim, log_dir=log_dir)


def _sim_gpus(cfg: PartitionConfig, root: Path) -> str | None:
    """The simulated GPUs of the run: those already set in the environment, else, for the emulator
    backend, the partition's ``[sim_gpus]`` (its defaults when the table is absent: the emulator
    never uses a real GPU) under the output root; else none."""
    current = os.environ.get(SIM_GPUS_ENV)
    if current or cfg.server.launch.backend != "emulator":
        return current or None
    s = cfg.sim_gpus or SimGpuSettings()
    try:
        backend = sim_gpu_backend()
    except LookupError as exc:
        raise ConfigError(f"{cfg.source or cfg.name}: [sim_gpus]: {exc}") from exc
    return str(backend.create(root / "_sim-gpus.json", count=s.count, total_mib=s.total_mib, name=s.name,
                              release_delay_s=s.release_delay_s))


@task(name="promote-latest", task_run_name="promote-latest", cache_policy=NONE)
def promote(plan: RunPlan) -> str | None:
    """Nightly: point ``ROOT/latest`` at this validated version (atomic rename)."""
    if plan.version is None:
        return None
    link = promote_latest(plan.root, plan.out_dir)
    get_run_logger().info("%s -> %s", link, plan.out_dir)
    return str(link)
