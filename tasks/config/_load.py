"""Finding and loading partition files: ``deployments/<name>.toml`` (or any path) into a PartitionConfig.

The file layout is documented in tasks.config. Relative paths in a file are resolved against the
project root (the parent of the ``deployments/`` folder holding it, else the file's folder).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from tasks.config._checks import (
    MAX_SAMPLES,
    MAX_SHARD_SIZE,
    ConfigError,
    fraction,
    input_file,
    int_from,
    no_unknown,
    nonneg_float,
    nonneg_int,
    opt_pos_int,
    opt_str,
    parser_name,
    positive_int,
    regenerate_mode,
    resolve_path,
    share,
    table,
    writable_dir,
)
from tasks.config._model import (
    BACKENDS,
    SERVER_GRACE_S,
    SERVER_KEYS,
    PartitionConfig,
    ServerSettings,
    SimGpuSettings,
    check_launch,
    check_servers,
    check_urls,
)
from tasks.config._sampling import check_sampling
from tasks.config._servers import TargetServers, parse_targets
from tasks.inference import DISPATCHES, ORDERS, TruncationPolicy
from tasks.server import ServerConfig, ServerConfigError
from tasks.shards import check_dataset_name
from tasks.validation import ThresholdError, Thresholds

__all__ = ["OWNED_API_ENV", "deployments_dir", "list_partitions", "load_partition", "project_root", "state_dir"]

# Set while `datagen run` serves itself a Prefect API (datagen._api_server.owned_api): its URL, so that
# the run's log (flows/logs.py) says the links into it live only as long as the command.
OWNED_API_ENV = "DATAGEN_OWNED_API_URL"


def _elsewhere(value: str, base: Path) -> str:
    """For a relative path that does not exist from ``base`` (a partition file outside deployments/, e.g.
    a copy of demo.toml) but does from the datagen checkout: how to point at it."""
    there = project_root() / value
    if Path(value).is_absolute() or base == project_root() or not there.exists():
        return ""
    return (f"; a partition outside {deployments_dir()} resolves relative paths against its own folder "
            f"({base}): write {there}, or put the file in {deployments_dir()}")


def project_root() -> Path:
    """The datagen checkout: ``$DATAGEN_HOME`` when set, else the folder above this package."""
    env = os.environ.get("DATAGEN_HOME")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[2]


def deployments_dir() -> Path:
    """The folder of partition files: ``<project root>/deployments``."""
    return project_root() / "deployments"


def state_dir() -> Path:
    """Where datagen keeps state between runs (``$DATAGEN_STATE_DIR``, default
    ``~/.local/state/datagen``), shared with tasks.server._tuner's fraction memory."""
    env = os.environ.get("DATAGEN_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "datagen"


def list_partitions() -> list[str]:
    """Names of the partition files in ``deployments/``."""
    return sorted(p.stem for p in deployments_dir().glob("*.toml"))


_TOP_KEYS = {"name", "datasets", "model", "server", "sim_gpus", "run", "sampling", "validation", "output"}
_MODEL_KEYS = {"path", "reasoning_parser"}
_RUN_KEYS = {"shard_size", "concurrency", "max_relaunches", "hygiene_grace_s", "server_url", "hang_timeout_s",
             "server_grace_s",
             "truncation", "order", "order_window", "dispatch", "host_wait_s", "price_per_gpu_hour",
             "samples", "regenerate", "capacity_probe_tokens", "goodput_warn_below", "goodput_window_s"}
_TRUNCATION_KEYS = {"retries", "factor", "max_new_tokens"}
_OUTPUT_KEYS = {"root", "versioned"}
_SIM_KEYS = {"count", "total_mib", "name", "release_delay_s"}
_LAUNCH_KEYS = SERVER_KEYS - {f.name for f in dataclasses.fields(ServerSettings)}


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
    no_unknown(data, _TOP_KEYS, f, "")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{f}: name: must be a non-empty string")

    ds_raw = data.get("datasets")
    if not isinstance(ds_raw, dict) or not ds_raw:
        raise ConfigError(f"{f}: [datasets]: at least one `name = \"path\"` entry is required")
    datasets: dict[str, Path] = {}
    for ds_name, ds_path in ds_raw.items():
        key = f"datasets.{ds_name}"
        try:
            check_dataset_name(ds_name)  # a directory of the output, beside _journal/ and _rejects/
        except ValueError as exc:
            raise ConfigError(f"{f}: {key}: {exc}") from exc
        if not isinstance(ds_path, str):
            raise ConfigError(f"{f}: {key}: must be a path string")
        p = resolve_path(ds_path, base)
        try:
            datasets[ds_name] = input_file(p, f, f"{key}: {p}")
        except ConfigError as exc:
            raise ConfigError(f"{exc}{_elsewhere(ds_path, base)}") from exc

    model = table(data, "model", f)
    no_unknown(model, _MODEL_KEYS, f, "model.")
    model_path = model.get("path")
    if not isinstance(model_path, str) or not model_path:
        raise ConfigError(f"{f}: model.path: required (a model directory)")
    model_path = str(resolve_path(model_path, base))
    parser = model.get("reasoning_parser")
    if parser is not None:
        parser = parser_name(parser, f, "model.reasoning_parser")

    server = _parse_server(table(data, "server", f), f, model_path)

    sim = None
    if "sim_gpus" in data:
        s = table(data, "sim_gpus", f)
        no_unknown(s, _SIM_KEYS, f, "sim_gpus.")
        sim = SimGpuSettings(
            count=positive_int(s.get("count", 8), f, "sim_gpus.count"),
            total_mib=positive_int(s.get("total_mib", 97887), f, "sim_gpus.total_mib"),
            name=opt_str(s.get("name"), f, "sim_gpus.name"),
            release_delay_s=nonneg_float(s.get("release_delay_s", 0.0), f, "sim_gpus.release_delay_s"),
        )
        if server.launch.backend != "emulator":
            raise ConfigError(f"{f}: sim_gpus: simulated GPUs need server.backend = \"emulator\"")

    run = table(data, "run", f)
    no_unknown(run, _RUN_KEYS, f, "run.")
    raw_urls = run.get("server_url")
    urls = check_urls([raw_urls] if isinstance(raw_urls, str) else raw_urls, f, "run.server_url") if (
        raw_urls is not None) else ()

    order = run.get("order", "prefix")
    if order not in ORDERS:
        raise ConfigError(f"{f}: run.order: {order!r} is not one of {', '.join(ORDERS)}")
    dispatch = run.get("dispatch", "prefix")
    if dispatch not in DISPATCHES:
        raise ConfigError(f"{f}: run.dispatch: {dispatch!r} is not one of {', '.join(DISPATCHES)}")
    order_window = run.get("order_window")
    if order_window is not None:
        order_window = positive_int(order_window, f, "run.order_window")

    sampling = check_sampling(table(data, "sampling", f), f)
    truncation = _check_truncation(run.get("truncation", {}), f, sampling)
    validation = _check_validation(table(data, "validation", f), f)

    output = table(data, "output", f)
    no_unknown(output, _OUTPUT_KEYS, f, "output.")
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
        shard_size=int_from(1, MAX_SHARD_SIZE)(run.get("shard_size", 100), f, "run.shard_size"),
        concurrency=_concurrency(run.get("concurrency"), f),
        max_relaunches=nonneg_int(run.get("max_relaunches", 3), f, "run.max_relaunches"),
        hygiene_grace_s=nonneg_float(run.get("hygiene_grace_s", 10.0), f, "run.hygiene_grace_s"),
        hang_timeout_s=nonneg_float(run.get("hang_timeout_s", 120.0), f, "run.hang_timeout_s"),
        order=order,
        order_window=order_window,
        dispatch=dispatch,
        host_wait_s=nonneg_float(run.get("host_wait_s", 300.0), f, "run.host_wait_s"),
        server_grace_s=nonneg_float(run.get("server_grace_s", SERVER_GRACE_S), f, "run.server_grace_s"),
        price_per_gpu_hour=(nonneg_float(run["price_per_gpu_hour"], f, "run.price_per_gpu_hour")
                            if "price_per_gpu_hour" in run else None),
        capacity_probe_tokens=int_from(0, 1 << 16)(run.get("capacity_probe_tokens", 128), f,
                                                     "run.capacity_probe_tokens"),
        goodput_warn_below=share(run.get("goodput_warn_below", 0.3), f, "run.goodput_warn_below"),
        goodput_window_s=nonneg_float(run.get("goodput_window_s", 900.0), f, "run.goodput_window_s"),
        samples=int_from(1, MAX_SAMPLES)(run.get("samples", 1), f, "run.samples"),
        regenerate=regenerate_mode(run.get("regenerate", "last"), f, "run.regenerate"),
        sampling=sampling,
        truncation=truncation,
        validation=validation,
        output_root=writable_dir(resolve_path(root, base), f, "output.root"),
        versioned=versioned,
        sim_gpus=sim,
        server_urls=urls,
    )
    check_launch(cfg, f)
    check_servers(cfg, f)
    return cfg


def _concurrency(value: Any, f: str) -> int | None:
    """``[run] concurrency``: requests in flight per server; omitted or ``"auto"``: twice the running
    slots each server reports (SGLang's resolved ``max_running_requests``), 16..1024."""
    if value is None or value == "auto":
        return None
    return positive_int(value, f, "run.concurrency")


def _check_truncation(values: Any, f: str, sampling: dict[str, Any]) -> TruncationPolicy:
    """``[run.truncation]`` as a tasks.inference.TruncationPolicy (each key checked and named)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{f}: run.truncation: must be a table (retries, factor, max_new_tokens)")
    no_unknown(values, _TRUNCATION_KEYS, f, "run.truncation.")
    out: dict[str, Any] = {}
    if "retries" in values:
        out["retries"] = nonneg_int(values["retries"], f, "run.truncation.retries")
    if "factor" in values:
        factor = values["factor"]
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 < factor < math.inf:
            raise ConfigError(f"{f}: run.truncation.factor: {factor!r} is not a number above 1")
        out["factor"] = float(factor)
    if "max_new_tokens" in values:
        limit = out["max_new_tokens"] = positive_int(values["max_new_tokens"], f, "run.truncation.max_new_tokens")
        first = sampling.get("max_new_tokens")
        if isinstance(first, int) and limit <= first:
            raise ConfigError(f"{f}: run.truncation.max_new_tokens: {limit} is not above sampling.max_new_tokens "
                              f"({first}): no regeneration could have a larger budget")
    return TruncationPolicy(**out)


def _check_validation(values: dict[str, Any], f: str) -> Thresholds:
    """``[validation]`` as tasks.validation.Thresholds (each key checked and named, then together)."""
    for key, value in values.items():
        try:
            Thresholds.from_dict({key: value})
        except ThresholdError as exc:
            raise ConfigError(f"{f}: validation.{key}: {exc}") from exc
    try:
        return Thresholds.from_dict(values)
    except ThresholdError as exc:  # limits that contradict each other
        raise ConfigError(f"{f}: [validation]: {exc}") from exc


def _target_flags(entry: TargetServers, i: int, s: dict[str, Any], f: str, model_path: str) -> TargetServers:
    """``entry`` with its flags checked as ``[server]`` keys and converted as the loader does."""
    merged = {k: v for k, v in s.items() if k != "targets"} | dict(entry.flags)
    if entry.gpu_groups and not entry.nodes:  # a server over nodes: its GPUs per node (_check_nodes_launch)
        merged["gpus"] = list(entry.gpu_groups[0])
    where = f"{f}: server.targets[{i}].flags"
    try:
        launch = _parse_server(merged, where, model_path).launch
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{where}: server.", f"{where}.", 1)) from exc
    return dataclasses.replace(entry, flags={k: getattr(launch, k) for k in entry.flags})


def _entry_tp_size(s: dict[str, Any], entries: tuple[TargetServers, ...], f: str) -> dict[str, Any]:
    """``[server]`` with the ``tp_size`` a targets entry gives (a multi-node server's spans its
    nodes); it is the partition's, since every server of a run generates alike."""
    given = [(i, e.tp_size) for i, e in enumerate(entries) if e.tp_size is not None]
    if not given:
        return s
    i, tp = given[0]
    for j, other in given[1:]:
        if other != tp:
            raise ConfigError(f"{f}: server.targets[{j}].tp_size: {other} differs from server.targets[{i}]."
                              f"tp_size {tp}: every server of a run generates alike (one tp_size per partition)")
    if "tp_size" in s and s["tp_size"] != tp:
        raise ConfigError(f"{f}: server.targets[{i}].tp_size: {tp} differs from server.tp_size {s['tp_size']!r}: "
                          "every server of a run generates alike; give it once")
    return {**s, "tp_size": tp}


def _check_nodes_launch(launch: ServerConfig, entry: TargetServers, i: int, f: str) -> None:
    """A server over several nodes makes a launch SGLang accepts; else one line naming the key."""
    flags = dict(entry.flags)
    gpus = entry.gpu_groups[0] if entry.gpu_groups else launch.gpus
    try:
        dataclasses.replace(launch, **flags, gpus=gpus, peer_nodes=entry.nodes[1:])
    except ServerConfigError as exc:
        where = {"tp_size": f"server.targets[{i}].tp_size", "gpus": f"server.targets[{i}].gpus",
                 "peer_nodes": f"server.targets[{i}].nodes"}.get(exc.field or "", f"server.{exc.field}")
        raise ConfigError(f"{f}: {where}: {str(exc).removeprefix('server config: ')}") from exc


def _parse_server(s: dict[str, Any], f: str, model_path: str) -> ServerSettings:
    no_unknown(s, set(SERVER_KEYS), f, "server.")
    backend = s.get("backend", "sglang")
    if backend not in BACKENDS:
        raise ConfigError(f"{f}: server.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    entries = parse_targets(s.get("targets", ["local"]), f)
    s = _entry_tp_size(s, entries, f)
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
    tp = positive_int(s.get("tp_size", 1), f, "server.tp_size")
    if gpus is not None and len(gpus) < tp:
        raise ConfigError(f"{f}: server.gpus: {len(gpus)} GPUs listed for tp_size {tp}")
    frac = s.get("mem_fraction_static")
    for key in ("context_length", "max_running_requests", "chunked_prefill_size"):
        opt_pos_int(s.get(key), f, f"server.{key}")
    for key in ("served_model_name", "python"):
        opt_str(s.get(key), f, f"server.{key}")
    # Every other launch setting goes to ServerConfig as it is, under its own name; ServerConfig
    # checks it. TOML arrays become tuples (ServerConfig's sequences are).
    launch: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in s.items() if k in _LAUNCH_KEYS}
    launch.update(backend=backend, tp_size=tp, host=host, gpus=gpus, extra_args=tuple(extra), env=dict(env),
                  mem_fraction_static=None if frac is None else fraction(frac, f, "server.mem_fraction_static"),
                  enable_hierarchical_cache=bool(s.get("enable_hierarchical_cache", False)))
    try:
        launch_cfg = ServerConfig(model_path=model_path, **launch)
    except ServerConfigError as exc:
        raise ConfigError(f"{f}: {'server.' + exc.field if exc.field else '[server]'}: {exc}") from exc
    except TypeError as exc:  # a value of the wrong type compared
        raise ConfigError(f"{f}: [server]: {exc}") from exc
    allow_open = s.get("allow_unauthenticated_bind", False)
    if not isinstance(allow_open, bool):
        raise ConfigError(f"{f}: server.allow_unauthenticated_bind: must be true or false")
    if any(e.flags for e in entries):
        entries = tuple(_target_flags(e, i, s, f, model_path) for i, e in enumerate(entries))
    for i, e in enumerate(entries):
        if e.nodes:
            _check_nodes_launch(launch_cfg, e, i, f)
    return ServerSettings(
        launch=launch_cfg,
        targets=tuple(e.target for e in entries),
        target_servers=entries if any(e != TargetServers(e.target) for e in entries) else (),
        port=port,
        api_key_secret=opt_str(s.get("api_key_secret"), f, "server.api_key_secret"),
        hub_token_secret=opt_str(s.get("hub_token_secret"), f, "server.hub_token_secret"),
        launch_deadline_s=nonneg_float(s.get("launch_deadline_s", 900.0), f, "server.launch_deadline_s"),
        allow_unauthenticated_bind=allow_open,
    )
