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

    [sim_gpus]                      # emulator only: simulated GPUs created when none exist
    count = 8

    [run]
    shard_size = 100
    concurrency = 32
    max_relaunches = 3
    hang_timeout_s = 120            # /health_generate failing this long while the server lives = hung

    [sampling]                      # SGLang sampling_params
    max_new_tokens = 1024

    [validation]                    # thresholds, passed to tasks.validation.Thresholds
    min_reasoning_fraction = 0.99

    [output]
    root = "data/out/all"
    versioned = true                # nightly: a new dated directory per run, `latest` -> last good
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BACKENDS",
    "ConfigError",
    "PartitionConfig",
    "ServerSettings",
    "SimGpuSettings",
    "deployments_dir",
    "list_partitions",
    "load_partition",
    "project_root",
    "state_dir",
]

BACKENDS = ("sglang", "emulator")
_ENV_API_KEY = "DATAGEN_API_KEY"


class ConfigError(ValueError):
    """A partition config (or an override) is missing, unreadable or invalid; the message names
    the file and the key."""


def project_root() -> Path:
    """The datagen checkout: ``$DATAGEN_HOME`` when set, else the folder above this package."""
    env = os.environ.get("DATAGEN_HOME")
    return Path(env).resolve() if env else Path(__file__).resolve().parent.parent


def deployments_dir() -> Path:
    return project_root() / "deployments"


def state_dir() -> Path:
    """Where datagen keeps state between runs (``$DATAGEN_STATE_DIR``, default
    ``~/.local/state/datagen``), shared with tasks.tuner's fraction memory."""
    env = os.environ.get("DATAGEN_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "datagen"


def list_partitions() -> list[str]:
    """Names of the partition files in ``deployments/``."""
    return sorted(p.stem for p in deployments_dir().glob("*.toml"))


@dataclass(frozen=True)
class SimGpuSettings:
    count: int = 8
    total_mib: int = 97887
    name: str | None = None
    release_delay_s: float = 0.0


@dataclass(frozen=True)
class ServerSettings:
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
    max_relaunches: int = 3
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
                name = p.name.split(".")[0]
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
            changes["shard_size"] = _positive_int(shard_size, where, "shard_size")
        if concurrency is not None:
            changes["concurrency"] = _positive_int(concurrency, where, "concurrency")
        if mem_fraction_static is not None:
            server = dataclasses.replace(
                server, mem_fraction_static=_fraction(mem_fraction_static, where, "mem_fraction_static")
            )
        if reasoning_parser is not None:
            changes["reasoning_parser"] = _parser(reasoning_parser, where, "reasoning_parser")
        out_cfg = dataclasses.replace(cfg, server=server, **changes)
        _check_model(out_cfg, where)
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


# ---------------------------------------------------------------------------------------- loading

_TOP_KEYS = {"name", "datasets", "model", "server", "sim_gpus", "run", "sampling", "validation", "output"}
_MODEL_KEYS = {"path", "reasoning_parser"}
_RUN_KEYS = {"shard_size", "concurrency", "max_relaunches", "hygiene_grace_s", "server_url", "hang_timeout_s"}
_OUTPUT_KEYS = {"root", "versioned"}
_SIM_KEYS = {"count", "total_mib", "name", "release_delay_s"}
_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerSettings)}


def load_partition(name_or_path: str | os.PathLike[str]) -> PartitionConfig:
    """Load and validate a partition: a name in ``deployments/`` or a path to a TOML file.

    Raises ``ConfigError`` naming the file and key for a missing file, bad TOML, unknown keys,
    wrong types or values out of range."""
    raw = str(name_or_path)
    path = Path(raw).expanduser()
    if not (raw.endswith(".toml") or os.sep in raw):
        path = deployments_dir() / f"{raw}.toml"
    if not path.is_file():
        known = ", ".join(list_partitions()) or "none"
        raise ConfigError(f"{path}: no such partition config (known partitions: {known})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    path = path.resolve()
    base = path.parent.parent if path.parent.name == "deployments" else path.parent
    return _parse(data, path, base)


def _parse(data: dict[str, Any], path: Path, base: Path) -> PartitionConfig:
    f = str(path)
    _no_unknown(data, _TOP_KEYS, f, "")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{f}: name: must be a non-empty string")

    ds_raw = data.get("datasets")
    if not isinstance(ds_raw, dict) or not ds_raw:
        raise ConfigError(f"{f}: [datasets]: at least one `name = \"path\"` entry is required")
    datasets: dict[str, Path] = {}
    for ds_name, ds_path in ds_raw.items():
        key = f"datasets.{ds_name}"
        if not ds_name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{f}: {key}: dataset names use letters, digits, '_' and '-'")
        if not isinstance(ds_path, str):
            raise ConfigError(f"{f}: {key}: must be a path string")
        p = _path(ds_path, base)
        if not p.is_file():
            raise ConfigError(f"{f}: {key}: input file {p} does not exist")
        datasets[ds_name] = p

    model = _table(data, "model", f)
    _no_unknown(model, _MODEL_KEYS, f, "model.")
    model_path = model.get("path")
    if not isinstance(model_path, str) or not model_path:
        raise ConfigError(f"{f}: model.path: required (a model directory)")
    model_path = str(_path(model_path, base))
    parser = model.get("reasoning_parser")
    if parser is not None:
        parser = _parser(parser, f, "model.reasoning_parser")

    server = _parse_server(_table(data, "server", f), f)

    sim = None
    if "sim_gpus" in data:
        s = _table(data, "sim_gpus", f)
        _no_unknown(s, _SIM_KEYS, f, "sim_gpus.")
        sim = SimGpuSettings(
            count=_positive_int(s.get("count", 8), f, "sim_gpus.count"),
            total_mib=_positive_int(s.get("total_mib", 97887), f, "sim_gpus.total_mib"),
            name=_opt_str(s.get("name"), f, "sim_gpus.name"),
            release_delay_s=_nonneg_float(s.get("release_delay_s", 0.0), f, "sim_gpus.release_delay_s"),
        )
        if server.backend != "emulator":
            raise ConfigError(f"{f}: sim_gpus: simulated GPUs need server.backend = \"emulator\"")

    run = _table(data, "run", f)
    _no_unknown(run, _RUN_KEYS, f, "run.")
    server_url = _opt_str(run.get("server_url"), f, "run.server_url")
    if server_url is not None and not server_url.startswith(("http://", "https://")):
        raise ConfigError(f"{f}: run.server_url: {server_url!r} is not an http(s) URL")

    sampling = _table(data, "sampling", f)
    for k, v in sampling.items():
        if not isinstance(v, (int, float, str, bool, list)):
            raise ConfigError(f"{f}: sampling.{k}: unsupported value {v!r}")
    validation = _table(data, "validation", f)
    for k, v in validation.items():
        if not isinstance(v, (int, float, bool, str, list)):
            raise ConfigError(f"{f}: validation.{k}: unsupported value {v!r}")

    output = _table(data, "output", f)
    _no_unknown(output, _OUTPUT_KEYS, f, "output.")
    root = output.get("root", f"data/out/{name}")
    if not isinstance(root, str) or not root:
        raise ConfigError(f"{f}: output.root: must be a path string")
    versioned = output.get("versioned", False)
    if not isinstance(versioned, bool):
        raise ConfigError(f"{f}: output.versioned: must be true or false")

    cfg = PartitionConfig(
        name=name,
        source=path,
        datasets=datasets,
        model_path=model_path,
        server=server,
        reasoning_parser=parser,
        shard_size=_positive_int(run.get("shard_size", 100), f, "run.shard_size"),
        concurrency=_positive_int(run.get("concurrency", 32), f, "run.concurrency"),
        max_relaunches=_nonneg_int(run.get("max_relaunches", 3), f, "run.max_relaunches"),
        hygiene_grace_s=_nonneg_float(run.get("hygiene_grace_s", 10.0), f, "run.hygiene_grace_s"),
        hang_timeout_s=_nonneg_float(run.get("hang_timeout_s", 120.0), f, "run.hang_timeout_s"),
        sampling=dict(sampling),
        validation=dict(validation),
        output_root=_path(root, base),
        versioned=versioned,
        sim_gpus=sim,
        server_url=server_url.rstrip("/") if server_url else None,
    )
    _check_model(cfg, f)
    return cfg


def _parse_server(s: dict[str, Any], f: str) -> ServerSettings:
    _no_unknown(s, _SERVER_KEYS, f, "server.")
    backend = s.get("backend", "sglang")
    if backend not in BACKENDS:
        raise ConfigError(f"{f}: server.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    targets = s.get("targets", ["local"])
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{f}: server.targets: a non-empty list of target strings")
    for t in targets:
        _check_target(t, f)
    if len(set(targets)) != len(targets):
        raise ConfigError(f"{f}: server.targets: a target is listed twice (one server per GPU host)")
    gpus = s.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or not all(isinstance(g, int) and g >= 0 for g in gpus):
            raise ConfigError(f"{f}: server.gpus: a list of GPU indices")
        gpus = tuple(gpus)
    extra = s.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ConfigError(f"{f}: server.extra_args: a list of strings")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise ConfigError(f"{f}: server.extra_args: never put --api-key here; use server.api_key_secret")
    env = s.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ConfigError(f"{f}: server.env: a table of string values")
    port = s.get("port", 0)
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{f}: server.port: {port!r} is not a TCP port (0 = a free one)")
    host = s.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{f}: server.host: must be a host string")
    tp = _positive_int(s.get("tp_size", 1), f, "server.tp_size")
    if gpus is not None and len(gpus) < tp:
        raise ConfigError(f"{f}: server.gpus: {len(gpus)} GPUs listed for tp_size {tp}")
    frac = s.get("mem_fraction_static")
    return ServerSettings(
        backend=backend,
        targets=tuple(targets),
        tp_size=tp,
        host=host,
        port=port,
        mem_fraction_static=None if frac is None else _fraction(frac, f, "server.mem_fraction_static"),
        served_model_name=_opt_str(s.get("served_model_name"), f, "server.served_model_name"),
        context_length=_opt_pos_int(s.get("context_length"), f, "server.context_length"),
        max_running_requests=_opt_pos_int(s.get("max_running_requests"), f, "server.max_running_requests"),
        chunked_prefill_size=_opt_pos_int(s.get("chunked_prefill_size"), f, "server.chunked_prefill_size"),
        enable_hierarchical_cache=bool(s.get("enable_hierarchical_cache", False)),
        hicache_size=s.get("hicache_size"),
        hicache_ratio=s.get("hicache_ratio"),
        gpus=gpus,
        extra_args=tuple(extra),
        env=dict(env),
        api_key_secret=_opt_str(s.get("api_key_secret"), f, "server.api_key_secret"),
        hub_token_secret=_opt_str(s.get("hub_token_secret"), f, "server.hub_token_secret"),
        launch_deadline_s=_nonneg_float(s.get("launch_deadline_s", 900.0), f, "server.launch_deadline_s"),
        python=_opt_str(s.get("python"), f, "server.python"),
    )


def _check_model(cfg: PartitionConfig, where: str) -> None:
    # The sglang model dir lives on the target host (maybe remote): only a local emulator's can be checked.
    if cfg.server_url is None and cfg.server.backend == "emulator" and cfg.targets == ("local",):
        if not Path(cfg.model_path, "config.json").is_file():
            raise ConfigError(f"{where}: model.path: {cfg.model_path} has no config.json")


def _check_target(raw: str, f: str) -> None:
    try:
        from tasks.targets import TargetError, parse_target
    except ImportError:  # hygiene module not installed yet: accept the documented shapes
        if raw != "local" and not raw.startswith(("ssh://", "pct://")):
            raise ConfigError(f"{f}: server.targets: {raw!r} is not local, ssh://… or pct://…") from None
        return
    try:
        parse_target(raw)
    except TargetError as exc:
        raise ConfigError(f"{f}: server.targets: {exc}") from exc


def _parser(value: Any, f: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{f}: {key}: must be a parser name")
    try:
        from tasks.reasoning import PARSERS
    except ImportError:
        return value
    if value not in PARSERS:
        raise ConfigError(f"{f}: {key}: unknown reasoning parser {value!r} (known: {', '.join(sorted(PARSERS))})")
    return value


def _table(data: dict[str, Any], key: str, f: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{f}: [{key}]: must be a table")
    return value


def _no_unknown(table: dict[str, Any], allowed: set[str], f: str, prefix: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{f}: {prefix}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})"
        )


def _path(value: str, base: Path) -> Path:
    p = Path(os.path.expandvars(value)).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def _positive_int(value: Any, f: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{f}: {key}: {value!r} is not a positive integer")
    return value


def _nonneg_int(value: Any, f: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a non-negative integer")
    return value


def _opt_pos_int(value: Any, f: str, key: str) -> int | None:
    return None if value is None else _positive_int(value, f, key)


def _nonneg_float(value: Any, f: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a non-negative number")
    return float(value)


def _fraction(value: Any, f: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a fraction between 0 and 1")
    return float(value)


def _opt_str(value: Any, f: str, key: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{f}: {key}: must be a non-empty string")
    return value
