"""Partition settings as frozen value objects, and the overrides a run may apply to them.

``PartitionConfig`` is what ``load_partition`` (tasks.config._load) returns; ``with_overrides``
applies ``RunSettings`` (``datagen run`` options, the flow's parameters) with the file's checks, and
``server_config`` turns ``[server]`` into the ``ServerConfig`` that launches the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config._checks import (
    ConfigError,
    input_file,
    writable_dir,
)
from tasks.config._servers import ServerSlot, TargetServers, slots_of
from tasks.config._settings import BACKENDS, RunSettings, check_text
from tasks.inference import TruncationPolicy
from tasks.server import ServerConfig, ServerConfigError
from tasks.shards import check_dataset_name
from tasks.targets import parse_target
from tasks.validation import Thresholds

__all__ = [
    "BACKENDS",
    "NOT_SERVER_KEYS",
    "SERVER_KEYS",
    "RunSettings",
    "PartitionConfig",
    "ServerSettings",
    "SimGpuSettings",
    "check_launch",
    "check_servers",
    "check_urls",
    "dataset_name_of",
]

_ENV_API_KEY = "DATAGEN_API_KEY"
_LAUNCH_OVERRIDES = frozenset({"backend", "tp_size", "mem_fraction_static"})  # ServerConfig fields


@dataclass(frozen=True)
class SimGpuSettings:
    """``[sim_gpus]``: the simulated GPUs an emulator partition creates when none exist."""

    count: int = 8
    total_mib: int = 97887
    name: str | None = None
    release_delay_s: float = 0.0


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: where the partition's server runs, and how it is launched.

    Args:
        launch: every launch setting of ``[server]``, under ServerConfig's own names (``[server]``
            keys map 1:1 onto its fields); ``PartitionConfig.server_config`` fills in the model
            path, port, reasoning parser and API key of each launch.
        targets: the target strings of the partition's servers (one entry each in ``target_servers``).
        port: the port to listen on; 0: a free one, picked at launch.
        api_key_secret: the Prefect Secret block holding the server's API key.
        hub_token_secret: the Prefect Secret block holding the model hub token.
        launch_deadline_s: how long a launch may take to become ready.
        allow_unauthenticated_bind: accept a server on a routable address (``launch.host`` not a
            loopback one) without an API key; refused otherwise, since anyone who reaches the
            address can use the server.
        target_servers: each target's GPU groups, port and flags (empty: one server per target on
            ``launch.gpus``); see tasks.config._servers.
    """

    launch: ServerConfig
    targets: tuple[str, ...] = ("local",)
    port: int = 0
    api_key_secret: str | None = None
    hub_token_secret: str | None = None
    launch_deadline_s: float = 900.0
    allow_unauthenticated_bind: bool = False
    target_servers: tuple[TargetServers, ...] = ()
    # one server's config (PartitionConfig.for_server) over several hosts: every node, node 0 first,
    # and where the others join node 0 (tasks.config._servers.TargetServers)
    nodes: tuple[str, ...] = ()
    dist_init_host: str | None = None
    dist_init_port: int | None = None


# ServerConfig fields that are not [server] keys: they come from [model], the port above, the secrets.
SERVER_GRACE_S = 180.0  # run.server_grace_s: a few minutes, what a restarted worker needs to come back

NOT_SERVER_KEYS = frozenset({"model_path", "reasoning_parser", "api_key", "port",
                             "peer_nodes", "dist_init_addr", "node_rank"})
_ONE_SERVER_KEYS = frozenset({"launch", "target_servers", "nodes", "dist_init_host", "dist_init_port"})
# Every [server] key: ServerConfig's launch settings and the partition's own.
SERVER_KEYS = frozenset({f.name for f in dataclasses.fields(ServerConfig)} - NOT_SERVER_KEYS
                        | {f.name for f in dataclasses.fields(ServerSettings)} - _ONE_SERVER_KEYS)


def _input_datasets(inputs: tuple[str, ...], where: str) -> dict[str, Path]:
    datasets: dict[str, Path] = {}
    for raw in inputs:
        p = input_file(Path(raw).expanduser().resolve(), where, f"--input {raw}")
        name = dataset_name_of(p)
        try:
            check_dataset_name(name)
        except ValueError as exc:
            raise ConfigError(f"{where}: --input {raw}: {exc}; rename the file") from exc
        if name in datasets:
            raise ConfigError(f"{where}: --input {raw}: a second input named {name!r}")
        datasets[name] = p
    return datasets


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
    concurrency: int | None = None  # per server; None: twice the slots the server reports
    max_relaunches: int = 3  # server relaunches per run, one budget shared by all datasets
    sampling: Mapping[str, Any] = field(default_factory=dict)
    truncation: TruncationPolicy = field(default_factory=TruncationPolicy)  # [run.truncation]
    validation: Thresholds = field(default_factory=Thresholds)  # [validation], checked together at load
    output_root: Path = Path("data/out")
    versioned: bool = False
    sim_gpus: SimGpuSettings | None = None
    hygiene_grace_s: float = 10.0
    hang_timeout_s: float = 120.0
    order: str = "prefix"  # send order: prefix (cache-aware) | input
    order_window: int | None = None  # rows per reordering window (None: from the concurrency)
    dispatch: str = "prefix"  # across servers: prefix (to the server that served the prefix) | free
    server_urls: tuple[str, ...] = ()  # running servers to use instead of launching (no hygiene)
    host_wait_s: float = 300.0  # how long a server whose host is unreachable is waited for
    # how long a server outlives its dead run (a control host's crash), waiting for the next run to adopt it
    server_grace_s: float = SERVER_GRACE_S
    price_per_gpu_hour: float | None = None  # the run summary's cost per 1,000 rows (None: not shown)
    # the capacity probe's new tokens per request after each health check (0: no probe, goodput unknown)
    capacity_probe_tokens: int = 128
    # a warning names the biggest loss when goodput over the last goodput_window_s stays below this (0: never)
    goodput_warn_below: float = 0.3
    goodput_window_s: float = 900.0
    # mem_fraction_static given for this run (an override): the first launch uses it whatever the
    # tuner remembers; the file's [server] value is only where the tuner starts
    explicit_fraction: float | None = None

    samples: int = 1  # rows per prompt
    regenerate: str = "last"  # tasks.inference.REGENERATE_MODES

    @property
    def server_url(self) -> str | None:
        """The first running server of ``server_urls``; None: the run launches its own."""
        return self.server_urls[0] if self.server_urls else None

    @property
    def targets(self) -> tuple[str, ...]:
        return self.server.targets

    def servers(self) -> list[ServerSlot]:
        """The servers this partition launches, in config order (none with ``server_urls``)."""
        if self.server_urls:
            return []
        return slots_of(self.server.target_servers, self.server.targets, self.server.port)

    def hosts(self) -> list[str]:
        """Every target the partition launches on, each node of a server over several nodes
        included (node 0s are ``targets``): what the run holds ``gpu:<host>`` of and cleans."""
        nodes = dict.fromkeys(n for slot in self.servers() for n in (slot.nodes or (slot.target,)))
        return list(nodes) or list(self.targets)

    def for_server(self, slot: ServerSlot) -> PartitionConfig:
        """This config as the single-server config of ``slot``: its target, GPUs, port and flags.

        Raises:
            ServerConfigError: the flags or GPUs make an invalid launch (e.g. fewer GPUs than tp_size).
        """
        launch = self.server.launch
        launch = dataclasses.replace(launch, gpus=slot.gpus if slot.gpus is not None else launch.gpus,
                                     peer_nodes=slot.nodes[1:], **slot.flags)
        server = dataclasses.replace(self.server, launch=launch, targets=(slot.target,), target_servers=(),
                                     port=slot.port, nodes=slot.nodes, dist_init_host=slot.dist_init_host,
                                     dist_init_port=slot.dist_init_port)
        return dataclasses.replace(self, server=server)

    def for_url(self, url: str) -> PartitionConfig:
        """This config using the one running server at ``url``."""
        return dataclasses.replace(self, server_urls=(url,))

    def with_overrides(self, overrides: RunSettings) -> PartitionConfig:
        """A copy with ``overrides`` applied and validated with the file's checks.

        Args:
            overrides: the set fields replace the config's; ``inputs`` replaces the datasets (each
                named after its file's stem), ``out`` is the output directory itself (no versioning).

        Raises:
            ConfigError: an override is invalid; the message starts with "override: <key>".
        """
        where = "override"
        server = self.server
        changes: dict[str, Any] = {}
        launch: dict[str, Any] = {}
        for setting, value in overrides.items():
            name = setting.name
            if name == "inputs":
                changes["datasets"] = _input_datasets(value, where)
            elif name == "model_path":
                changes["model_path"] = launch["model_path"] = str(Path(check_text(value, where, name)).expanduser().resolve())
            elif name == "out":
                changes["output_root"] = writable_dir(Path(check_text(value, where, name)).expanduser().resolve(), where, name)
                changes["versioned"] = False
            elif name == "server_url":
                changes["server_urls"] = check_urls((value,) if isinstance(value, str) else value, where, name)
            elif name in _LAUNCH_OVERRIDES:
                launch[name] = setting.check(value, where, name)
                if name == "mem_fraction_static":
                    changes["explicit_fraction"] = launch[name]
            elif name == "truncation_retries":
                changes["truncation"] = dataclasses.replace(self.truncation, retries=setting.check(value, where, name))
            else:  # a [run] or [model] value of the same name
                changes[name] = setting.check(value, where, name)
        try:
            server = dataclasses.replace(server, launch=dataclasses.replace(server.launch, **launch))
        except ServerConfigError as exc:  # e.g. tp_size above the number of server.gpus: name the override
            key = exc.field if exc.field in launch else ", ".join(sorted(launch))
            raise ConfigError(f"{where}: {key}: {exc}") from exc
        out_cfg = dataclasses.replace(self, server=server, **changes)
        check_launch(out_cfg, where)
        check_servers(out_cfg, where)
        return out_cfg

    def server_config(self, port: int, reasoning_parser: str | None) -> ServerConfig:
        """The ``ServerConfig`` that launches this partition's server.

        The launch settings of ``[server]`` (``ServerSettings.launch``) with this launch's model
        path, port and reasoning parser; the API key goes in as ``api_key`` (the launcher keeps it
        off the command line), the hub token as ``HF_TOKEN`` in the server's environment.

        Args:
            port: the port the server listens on (on its target).
            reasoning_parser: SGLang's ``--reasoning-parser`` (None: none).

        Raises:
            ServerConfigError: a setting ServerConfig rejects.
            ConfigError: the server would listen on a routable address without an API key
                (``check_bind``).
        """
        self.check_bind()
        launch = self.server.launch
        env = dict(launch.env)
        token = self.hub_token()
        if token:
            env["HF_TOKEN"] = token
        return dataclasses.replace(launch, model_path=self.model_path, port=port, env=env,
                                   reasoning_parser=reasoning_parser, api_key=self.api_key())

    def server_fingerprint(self) -> str:
        """The rows' ``server`` column: what the generated text depends on.

        Model, backend, parallelism and flags; not the port, pid or memory fraction (a relaunch at
        a lower fraction produces the same rows), nor the reasoning parser (/generate returns the
        raw text whatever the parser, and the split is recorded per row, so a rerun with a fixed
        ``--reasoning-parser`` continues the output). A shared server is named by its URL here; the
        run asks the server itself (``tasks.inference.external_fingerprint``) and keeps this only
        when the server reports nothing about itself.
        """
        if self.server_url is not None:
            return f"external:{self.server_url}"
        s = self.server.launch
        doc = [self.model_path, s.backend, s.tp_size, s.served_model_name, s.context_length, list(s.extra_args)]
        return f"{s.backend}:{hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:12]}"

    def server_gpus(self) -> list[int]:
        """The GPUs the partition's server uses (``server.gpus``, else 0..tp_size-1): the only GPUs
        the run's hygiene touches, so that another job on another GPU of a shared host survives."""
        return self.server.launch.gpu_indexes()

    def api_key(self) -> str | None:
        """The server's ``--api-key``: the Prefect Secret block named in the config (when an API
        is reachable), else ``$DATAGEN_API_KEY``. Never logged."""
        return _secret(self.server.api_key_secret, _ENV_API_KEY)

    def check_bind(self) -> None:
        """Refuse a launch that would listen on a routable address (``server.host`` not loopback)
        with no API key (``api_key()`` None), unless ``server.allow_unauthenticated_bind``.

        Raises:
            ConfigError: no key for a routable address; names the file and ``server.host``.
        """
        server = self.server
        if self.server_url is not None or server.allow_unauthenticated_bind or _loopback(server.launch.host):
            return
        if self.api_key() is None:
            why = (f"the secret block {server.api_key_secret!r} has no value and ${_ENV_API_KEY} is unset"
                   if server.api_key_secret else None)
            _check_bind(server, str(self.source or "override"), why)

    def hub_token(self) -> str | None:
        """A model hub token for the server's environment (``HF_TOKEN``), same lookup order."""
        return _secret(self.server.hub_token_secret, "HF_TOKEN")

    def to_summary(self) -> dict[str, Any]:
        """A loggable view (no secrets: only the names of the secret blocks)."""
        return {
            "partition": self.name,
            "datasets": {k: str(v) for k, v in self.datasets.items()},
            "model_path": self.model_path,
            "backend": self.server.launch.backend,
            "targets": list(self.targets),
            "servers": [s.label() for s in self.servers()],
            "server_url": list(self.server_urls) if len(self.server_urls) > 1 else self.server_url,
            "shard_size": self.shard_size,
            "concurrency": self.concurrency,
            "samples": self.samples,
            "regenerate": self.regenerate,
            "output_root": str(self.output_root),
            "versioned": self.versioned,
        }


def _secret(block_name: str | None, env_var: str) -> str | None:
    if block_name:
        try:
            # Prefect reads its settings at import (the CLI sets them first): loaded only here.
            from prefect.blocks.system import Secret  # noqa: PLC0415

            value = Secret.load(block_name).get()  # type: ignore[union-attr]
            if value:
                return str(value)
        except Exception:
            # No API, or no such block: fall back to the environment (documented order).
            pass
    return os.environ.get(env_var) or None


def check_launch(cfg: PartitionConfig, where: str) -> None:
    """Check what can be checked on this host of a partition that launches its own server.

    A local emulator's model directory must hold config.json (an SGLang model lives on the target
    host); a local target's ``server.python`` must be an executable; a routable ``server.host``
    needs an API key source (``server.api_key_secret`` or ``$DATAGEN_API_KEY``) or
    ``server.allow_unauthenticated_bind``. A shared server (``run.server_url``) is not launched:
    nothing is checked.

    Args:
        cfg: the partition.
        where: the file (or "override") named in the message.

    Raises:
        ConfigError: a check failed; names ``where`` and the key.
    """
    if cfg.server_url is not None:
        return
    launch = cfg.server.launch
    local = any(parse_target(t).is_local for t in cfg.targets)
    if launch.backend == "emulator" and cfg.targets == ("local",):
        if not Path(cfg.model_path, "config.json").is_file():
            raise ConfigError(f"{where}: model.path: {cfg.model_path} has no config.json")
    if local and shutil.which(launch.python) is None:
        raise ConfigError(f"{where}: server.python: {launch.python} is not an executable on this host "
                          "(the interpreter that has SGLang, or the emulator's)")
    if cfg.server.api_key_secret is None and not os.environ.get(_ENV_API_KEY):
        _check_bind(cfg.server, where, None)


def check_urls(urls: tuple[str, ...] | list[str], where: str, key: str) -> tuple[str, ...]:
    """Running servers' URLs: each http(s), none twice; returned without trailing slashes.

    Raises:
        ConfigError: not a list, an empty list, a URL that is not http(s), or one given twice.
    """
    if not isinstance(urls, (list, tuple)):
        raise ConfigError(f"{where}: {key}: {urls!r} is neither an http(s) URL nor a list of them")
    if not urls:
        raise ConfigError(f"{where}: {key}: at least one http(s) URL")
    out: list[str] = []
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: {key}: {url!r} is not an http(s) URL")
        if url.rstrip("/") in out:
            raise ConfigError(f"{where}: {key}: {url!r} is given twice")
        out.append(url.rstrip("/"))
    return tuple(out)


def check_servers(cfg: PartitionConfig, where: str) -> None:
    """Every server of ``cfg`` makes a valid launch (its GPUs hold its tp_size, its flags are
    ServerConfig values).

    Raises:
        ConfigError: names the target and what is wrong.
    """
    for slot in cfg.servers():
        try:
            cfg.for_server(slot)
        except ServerConfigError as exc:
            raise ConfigError(f"{where}: server.targets: {slot.target} server {slot.index} "
                              f"(GPUs {list(slot.gpus or ())}): {exc}") from exc
        except TypeError as exc:
            raise ConfigError(f"{where}: server.targets: {slot.target}: flags: {exc}") from exc


def _check_bind(server: ServerSettings, where: str, why_no_key: str | None) -> None:
    """Refuse a routable ``server.host`` without an API key, unless the partition allows it."""
    host = server.launch.host
    if server.allow_unauthenticated_bind or _loopback(host):
        return
    why = why_no_key or f"no server.api_key_secret and ${_ENV_API_KEY} is unset"
    raise ConfigError(
        f"{where}: server.host: {host!r} is reachable from other machines but the server would have "
        f"no API key ({why}); set server.api_key_secret or ${_ENV_API_KEY}, bind 127.0.0.1, or set "
        "server.allow_unauthenticated_bind = true to accept an open server"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it resolves to some interface, which others may reach
        return False


_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")


def dataset_name_of(path: Path) -> str:
    """The dataset name of an ``--input`` file: its name without the data suffix
    (``my.data.v2.jsonl`` -> ``my.data.v2``)."""
    name = path.name
    for suffix in _DATA_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return path.stem or name
