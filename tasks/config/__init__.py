"""Partition configuration: one validated TOML file per partition under ``deployments/``.

A partition is a set of datasets generated with one model on one or more GPU targets into one output
root. ``load_partition("all")`` reads ``deployments/all.toml``; a path to any ``.toml`` file works too.
Every error names the file and the key (``ConfigError``), so a bad deployment fails before any GPU is
touched. Relative paths in a file are resolved against the project root (the parent of the
``deployments/`` folder holding it, else the file's folder).

File layout (every table but ``[datasets]`` optional)::

    [datasets]                      # name = path (JSONL or Parquet)
    glaive_like = "data/samples/glaive_like.jsonl"

    [model]
    path = "data/models/demo"       # on the target host for the sglang backend
    reasoning_parser = "qwen3"      # default: inferred from the model's config

    [server]
    backend = "sglang"              # or "emulator"
    targets = ["local"]             # local | ssh://user@host[:port] | pct://user@host[:port]/CTID
    tp_size = 1
    port = 30000                    # 0 = a free port
    mem_fraction_static = 0.88      # where the tuner starts when it has learned nothing yet
    api_key_secret = "datagen-api-key"   # Prefect Secret block; else env DATAGEN_API_KEY
    extra_args = []                 # further launch_server flags (or --emu-* for the emulator)
    # any other launch setting of tasks.server.ServerConfig, under its name (e.g. context_length,
    # speculative_algorithm, trust_remote_code); an unknown key is an error

    [sim_gpus]                      # emulator only: simulated GPUs created when none exist
    count = 8

    [run]
    shard_size = 100
    concurrency = 32
    max_relaunches = 3              # server relaunches per run, one budget shared by all datasets
    hang_timeout_s = 120            # /health_generate failing this long while the server lives = hung

``run.max_relaunches`` is a budget per run, not per dataset: all of the partition's datasets share
it, so a server that keeps dying fails the run after that many relaunches in total, however many
datasets remain.

    [sampling]                      # SGLang sampling_params
    max_new_tokens = 1024

    [validation]                    # thresholds, passed to tasks.validation.Thresholds
    min_reasoning_fraction = 0.99

    [output]
    root = "data/out/all"
    versioned = true                # nightly: a new dated directory per run, `latest` -> last good

Runs override some settings with ``Overrides`` (``PartitionConfig.with_overrides``): the flow's
parameters and ``datagen run``'s options are its fields. ``PartitionConfig.server_config`` builds the
``tasks.server.ServerConfig`` that launches the partition's server from ``[server]``. The parts:
``_model`` (the settings value objects and overrides), ``_load`` (finding and parsing files) and
``_checks`` (value checks and ``ConfigError``).
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
