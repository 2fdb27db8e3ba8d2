"""The config stage's Prefect task: the partition loaded, the run's overrides applied, logged readably."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.config import PartitionConfig, RunSettings, load_partition

__all__ = ["load_config"]


@task(name="load-config", task_run_name="load-config", cache_policy=NONE)
def load_config(partition: str, overrides: RunSettings) -> PartitionConfig:
    """Load ``deployments/<partition>.toml`` (or a path) and apply the overrides. Not retried.

    Raises:
        ConfigError: the file or an override is invalid, or the server would listen on a routable
            address without an API key.
    """
    cfg = load_partition(partition).with_overrides(overrides)
    cfg.check_bind()  # a routable server.host without a key: refused before any GPU work
    get_run_logger().info("partition %s:\n%s", cfg.name, _readable(cfg.to_summary()))
    return cfg


def _readable(summary: dict[str, Any], indent: str = "  ") -> str:
    """One ``key: value`` line per setting; a mapping's items indented under its key."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += [f"{indent}  {k}: {v}" for k, v in value.items()]
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)
