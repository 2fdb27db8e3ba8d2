"""The output stage's Prefect tasks: choose the run's output directory (a nightly version to resume or
a new one) and, once validated, point ``latest`` at it."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.config import PartitionConfig
from tasks.gpus import SIM_GPUS_NOTE
from tasks.run import RunPlan
from tasks.shards import OutputDir, choose_version, promote_latest
from tasks.standins import run_gpus

__all__ = ["prepare_run", "promote"]


@task(name="prepare-output", task_run_name="prepare-output", cache_policy=NONE)
def prepare_run(cfg: PartitionConfig) -> RunPlan:
    """Pick the output directory (a nightly version to resume or a new one) and the run's GPUs: for
    the emulator with no ``DATAGEN_SIM_GPUS`` set, simulated ones under the output root
    (tasks.standins)."""
    root = cfg.output_root
    out = choose_version(root) if cfg.versioned else root
    sim = run_gpus(cfg, root)
    OutputDir(root).subdir("_logs", create=True)  # OUT/_logs, opened with O_NOFOLLOW: a planted link is refused
    log_dir = root / "_logs"
    logger = get_run_logger()
    logger.info("output %s%s", out, f" (version {out.name} of {root})" if cfg.versioned else "")
    if sim:  # said once here; the hygiene reports of the run leave it out
        logger.info("simulated GPUs %s: %s", sim, SIM_GPUS_NOTE)
    return RunPlan(out_dir=out, root=root, version=out.name if cfg.versioned else None, sim_gpus=sim, log_dir=log_dir)


@task(name="promote-latest", task_run_name="promote-latest", cache_policy=NONE)
def promote(plan: RunPlan) -> str | None:
    """Nightly: point ``ROOT/latest`` at this validated version (atomic rename)."""
    if plan.version is None:
        return None
    link = promote_latest(plan.root, plan.out_dir)
    get_run_logger().info("%s -> %s", link, plan.out_dir)
    return str(link)
