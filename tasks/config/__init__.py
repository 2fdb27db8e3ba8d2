"""Partition configuration: one validated TOML file per partition under ``deployments/``.

``load_partition("all")`` reads ``deployments/all.toml`` (a path to any ``.toml`` works too) into a
frozen ``PartitionConfig``; every error is a ``ConfigError`` naming the file and the key. The keys
are listed in the README (Configuration). Parts: ``_model`` (value objects, ``Overrides``),
``_load`` (finding and parsing files), ``_checks`` (value checks), ``_servers`` (the servers of a
partition: ``[server] targets`` entries, ``PartitionConfig.servers()``).
"""

from __future__ import annotations

from tasks.config._checks import ConfigError
from tasks.config._load import deployments_dir, list_partitions, load_partition, project_root, state_dir
from tasks.config._model import BACKENDS, Overrides, PartitionConfig, ServerSettings, SimGpuSettings

__all__ = [
    "BACKENDS",
    "ConfigError",
    "Overrides",
    "PartitionConfig",
    "ServerSettings",
    "SimGpuSettings",
    "deployments_dir",
    "list_partitions",
    "load_partition",
    "project_root",
    "state_dir",
]
