"""Partition configuration: one validated TOML file per partition under ``deployments/``.

``load_partition("all")`` reads ``deployments/all.toml`` (a path to any ``.toml`` works too) into a
frozen ``PartitionConfig``; every error is a ``ConfigError`` naming the file and the key. The keys
are listed in docs/configuration.md. Parts: ``_settings`` (``RunSettings``, the typed model of the
run settings), ``_model`` (value objects),
``_load`` (finding and parsing files), ``_checks`` (value checks), ``_servers`` (the servers of a
partition: ``[server] targets`` entries, ``PartitionConfig.servers()``).
"""

from __future__ import annotations

from tasks.config._checks import ConfigError
from tasks.config._load import (
    OWNED_API_ENV,
    deployments_dir,
    list_partitions,
    load_partition,
    project_root,
    state_dir,
)
from tasks.config._model import PartitionConfig, ServerSettings, SimGpuSettings
from tasks.config._settings import (
    BACKENDS,
    PARTITION,
    RUN_SETTINGS,
    Backend,
    Fraction,
    NonNegative,
    ParserName,
    Positive,
    RegenerateMode,
    RunSetting,
    RunSettings,
    Samples,
    ShardSize,
    add_cli_options,
    flow_parameters,
    reference_table,
    settings_of,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Fraction",
    "NonNegative",
    "ParserName",
    "Positive",
    "RegenerateMode",
    "Samples",
    "ShardSize",
    "ConfigError",
    "PARTITION",
    "RUN_SETTINGS",
    "RunSettings",
    "PartitionConfig",
    "RunSetting",
    "ServerSettings",
    "SimGpuSettings",
    "add_cli_options",
    "deployments_dir",
    "flow_parameters",
    "list_partitions",
    "load_partition",
    "project_root",
    "reference_table",
    "settings_of",
    "state_dir",
    "OWNED_API_ENV",
]
