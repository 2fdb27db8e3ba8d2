"""Partition settings as frozen value objects, and command-line overrides of them.

``PartitionConfig`` is what ``load_partition`` (tasks.config._load) returns; ``with_overrides``
applies ``datagen run`` options and deployment parameters with the same checks as the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config._checks import ConfigError, fraction, parser_name, positive_int

__all__ = ["BACKENDS", "PartitionConfig", "ServerSettings", "SimGpuSettings", "check_model"]

BACKENDS = ("sglang", "emulator")
_ENV_API_KEY = "DATAGEN_API_KEY"


@dataclass(frozen=True)
class SimGpuSettings:
    """``[sim_gpus]``: the simulated GPUs an emulator partition creates when none exist."""

    count: int = 8
    total_mib: int = 97887
    name: str | None = None
    release_delay_s: float = 0.0


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: how and where the inference server is launched (see tasks.server.ServerConfig)."""

    backend: str = "sglang"
    targets: tuple[str, ...] = ("local",)
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    mem_fraction_static: float | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    enable_hierarchical_cache: bool = False
    hicache_size: float | None = None
    hicache_ratio: float | None = None
    gpus: tuple[int, ...] | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    api_key_secret: str | None = None
    hub_token_secret: str | None = None
    launch_deadline_s: float = 900.0
    python: str | None = None


@dataclass(frozen=True)
class PartitionConfig:
    """One partition, validated. Paths are absolute."""

    name: str
    source: Path | None
    datasets: Mapping[str, Path]
    model_path: str
    server: ServerSettings
    reasoning_parser: str | None = None
    shard_size: int = 100
    concurrency: int = 32
    max_relaunches: int = 3  # server relaunches per run, one budget shared by all datasets
    sampling: Mapping[str, Any] = field(default_factory=dict)
    validation: Mapping[str, Any] = field(default_factory=dict)
    output_root: Path = Path("data/out")
    versioned: bool = False
    sim_gpus: SimGpuSettings | None = None
    server_url: str | None = None
    hygiene_grace_s: float = 10.0
    hang_timeout_s: float = 120.0

    @property
    def targets(self) -> tuple[str, ...]:
        return self.server.targets

    def with_overrides(
        self,
        *,
        inputs: list[str] | None = None,
        model_path: str | None = None,
        out: str | None = None,
        backend: str | None = None,
        server_url: str | None = None,
        shard_size: int | None = None,
        concurrency: int | None = None,
        mem_fraction_static: float | None = None,
        reasoning_parser: str | None = None,
    ) -> PartitionConfig:
        """A copy with command-line / deployment-parameter overrides applied and validated.

        ``inputs`` replaces the datasets (named after each file's stem); ``out`` is used as the
        output directory itself (no versioning). Raises ``ConfigError``."""
        where = "override"
        cfg = self
        server = cfg.server
        changes: dict[str, Any] = {}
        if inputs:
            datasets: dict[str, Path] = {}
            for raw in inputs:
                p = Path(raw).expanduser().resolve()
                if not p.is_file():
                    raise ConfigError(f"{where}: --input {raw}: no such file")
                name = dataset_name_of(p)
                if name in datasets:
                    raise ConfigError(f"{where}: --input {raw}: a second input named {name!r}")
                datasets[name] = p
            changes["datasets"] = datasets
        if model_path is not None:
            changes["model_path"] = str(Path(model_path).expanduser().resolve())
        if out is not None:
            changes["output_root"] = Path(out).expanduser().resolve()
            changes["versioned"] = False
        if backend is not None:
            if backend not in BACKENDS:
                raise ConfigError(f"{where}: backend: {backend!r} is not one of {', '.join(BACKENDS)}")
            server = dataclasses.replace(server, backend=backend)
        if server_url is not None:
            if not server_url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}: server_url: {server_url!r} is not an http(s) URL")
            changes["server_url"] = server_url.rstrip("/")
        if shard_size is not None:
            changes["shard_size"] = positive_int(shard_size, where, "shard_size")
        if concurrency is not None:
            changes["concurrency"] = positive_int(concurrency, where, "concurrency")
        if mem_fraction_static is not None:
            server = dataclasses.replace(
                server, mem_fraction_static=fraction(mem_fraction_static, where, "mem_fraction_static")
            )
        if reasoning_parser is not None:
            changes["reasoning_parser"] = parser_name(reasoning_parser, where, "reasoning_parser")
        out_cfg = dataclasses.replace(cfg, server=server, **changes)
        check_model(out_cfg, where)
        return out_cfg

    def api_key(self) -> str | None:
        """The server's ``--api-key``: the Prefect Secret block named in the config (when an API
        is reachable), else ``$DATAGEN_API_KEY``. Never logged."""
        return _secret(self.server.api_key_secret, _ENV_API_KEY)

    def hub_token(self) -> str | None:
        """A model hub token for the server's environment (``HF_TOKEN``), same lookup order."""
        return _secret(self.server.hub_token_secret, "HF_TOKEN")

    def to_summary(self) -> dict[str, Any]:
        """A loggable view (no secrets: only the names of the secret blocks)."""
        return {
            "partition": self.name,
            "datasets": {k: str(v) for k, v in self.datasets.items()},
            "model_path": self.model_path,
            "backend": self.server.backend,
            "targets": list(self.targets),
            "server_url": self.server_url,
            "shard_size": self.shard_size,
            "concurrency": self.concurrency,
            "output_root": str(self.output_root),
            "versioned": self.versioned,
        }


def _secret(block_name: str | None, env_var: str) -> str | None:
    if block_name:
        try:
            from prefect.blocks.system import Secret

            value = Secret.load(block_name).get()  # type: ignore[union-attr]
            if value:
                return str(value)
        except Exception:
            # No API, or no such block: fall back to the environment (documented order).
            pass
    return os.environ.get(env_var) or None


def check_model(cfg: PartitionConfig, where: str) -> None:
    """Raises ``ConfigError`` when a local emulator's model directory has no config.json."""
    # The sglang model dir lives on the target host (maybe remote): only a local emulator's can be checked.
    if cfg.server_url is None and cfg.server.backend == "emulator" and cfg.targets == ("local",):
        if not Path(cfg.model_path, "config.json").is_file():
            raise ConfigError(f"{where}: model.path: {cfg.model_path} has no config.json")


_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")


def dataset_name_of(path: Path) -> str:
    """The dataset name of an ``--input`` file: its name without the data suffix
    (``my.data.v2.jsonl`` -> ``my.data.v2``)."""
    name = path.name
    for suffix in _DATA_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return path.stem or name
