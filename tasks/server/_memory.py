"""Remembered ``--mem-fraction-static`` values of tasks.server._tuner, per host, model and flags.

``FractionMemory`` keeps per key (``memory_key``: host + model + tp + GPU model + memory-relevant
flags) the fraction that worked, the headroom SGLang reported, and the lowest fraction seen to OOM
at run time. One function, ``FractionMemory.default()``, picks the store: a Prefect Variable per key
(``PrefectStore``) when ``PREFECT_API_URL`` is set and its ``/health`` answers, else the JSON file
``$DATAGEN_STATE_DIR/fractions.json`` (``FileStore``, default ``~/.local/state/datagen``), written
atomically under an flock.

Errors: ``MemoryStoreError`` when the state file is unreadable garbage; a Prefect store raises what
the Prefect client raises.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from tasks import http
from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.hygiene import gpu_names
from tasks.server._launch import ServerConfig, format_fraction, server_flags

__all__ = [
    "FileStore",
    "FractionMemory",
    "MemoryEntry",
    "MemoryKey",
    "MemoryStoreError",
    "PrefectStore",
    "Store",
    "describe_key",
    "gpu_model_name",
    "list_remembered",
    "memory_key",
    "prefect_api_reachable",
    "state_dir",
    "variable_name",
]

# The tuner's logger: these records are part of what tasks.server._tuner reports.
log = logging.getLogger("tasks.server._tuner")

HISTORY_KEPT = 10  # events kept per entry, newest last


class MemoryStoreError(DatagenError, RuntimeError):
    """The remembered-fractions store exists but cannot be read or written."""


# Flags that change neither weights nor KV cache: output parsing, names, address, auth. A key
# without them means switching, say, the reasoning parser keeps what was learned for the model.
_NOT_MEMORY = {"--host", "--port", "--served-model-name", "--model-path", "--tp-size", "--reasoning-parser",
               "--tool-call-parser", "--nnodes", "--node-rank", "--dist-init-addr"}  # the shape is in the key
# The same set before parsers were left out: keys made then still name their entries (MemoryKey.legacy).
_NOT_MEMORY_LEGACY = {"--host", "--port", "--served-model-name", "--model-path", "--tp-size"}


class MemoryKey(str):
    """A memory key (``host|model|tpN|GPU|flags-digest``) that also knows the key the same launch had
    when the reasoning parser was part of it (``legacy``), so entries learned then are still found."""

    legacy: str | None

    def __new__(cls, value: str, legacy: str | None = None) -> MemoryKey:
        key = super().__new__(cls, value)
        key.legacy = legacy if legacy != value else None
        return key


def _flags_digest(cfg: ServerConfig, dropped: set[str]) -> str:
    kept: list[str] = []
    skip = False
    for a in server_flags(cfg, None):
        if skip:
            skip = False
            continue
        if a in dropped:
            skip = True
            continue
        kept.append(a)
    return hashlib.sha256(json.dumps([cfg.backend, kept]).encode()).hexdigest()[:12]


def memory_key(cfg: ServerConfig, target: Any, gpu_name: str) -> MemoryKey:
    """Key of a remembered fraction: host | model | tp | GPU model | digest of memory-relevant flags.

    Host/port, the fraction itself, names, the API key and output parsers (reasoning, tool call) do
    not change memory use and are left out.
    """
    def host_of(t: Any) -> str:
        tname = t if isinstance(t, str) else str(t)
        return socket.gethostname() if tname.strip() in ("", "local") else tname

    # a server over several nodes is its own shape: every node named, tp over the node count (what
    # fits one node's GPUs at tp 16 over 2 nodes says nothing of tp 8 on one)
    host = "+".join(host_of(t) for t in (target, *cfg.peer_nodes))
    shape = f"tp{cfg.tp_size}" + (f"/{cfg.nnodes}nodes" if cfg.nnodes > 1 else "")
    head = f"{host}|{os.path.normpath(cfg.model_path)}|{shape}|{gpu_name}|"
    return MemoryKey(head + _flags_digest(cfg, _NOT_MEMORY), legacy=head + _flags_digest(cfg, _NOT_MEMORY_LEGACY))


def describe_key(key: str) -> str:
    """``host, model, tp N, GPU`` for people (the flags digest left out)."""
    parts = key.split("|")
    if len(parts) != 5:
        return key
    host, model, tp, gpu, _ = parts
    return f"{host}, {model}, tp {tp.removeprefix('tp')}, {gpu}"


@dataclass
class MemoryEntry:
    """What is remembered for one key."""

    key: str
    fraction: float | None = None  # last fraction that launched and ran (None: SGLang's default did)
    headroom_gib: float | None = None
    runtime_oom_at: float | None = None  # lowest fraction seen to OOM during inference
    updated_at: str = ""
    history: list[str] = field(default_factory=list)  # last few events, newest last

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryEntry:
        """Raises:
            MemoryStoreError: ``d`` is not an entry (e.g. a hand edit left a number as text).
        """
        if not isinstance(d, dict) or not isinstance(d.get("key"), str):
            raise MemoryStoreError(f"not a remembered fraction (no 'key' text): {d!r}")
        for name in ("fraction", "headroom_gib", "runtime_oom_at"):
            value = d.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise MemoryStoreError(f"{name} is {value!r}, not a number or null, in the entry for {d['key']}")
        history = d.get("history") or []
        if not isinstance(history, list):
            raise MemoryStoreError(f"history is {history!r}, not a list, in the entry for {d['key']}")
        return cls(key=d["key"], fraction=d.get("fraction"), headroom_gib=d.get("headroom_gib"),
                   runtime_oom_at=d.get("runtime_oom_at"), updated_at=str(d.get("updated_at") or ""),
                   history=[_gib(str(h)) for h in history])


class Store(Protocol):
    """Where entries live: ``FileStore`` or ``PrefectStore``."""

    kind: str

    def get(self, key: str) -> MemoryEntry | None: ...

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry: ...

    def named_entries(self) -> list[tuple[str, MemoryEntry]]: ...


def _gib(line: str) -> str:
    # Lines written before the unit was spelt GiB said "GB" for the same GiB figure.
    return line[:-3] + " GiB" if line.endswith(" GB") else line


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _apply(entry: MemoryEntry, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
    """Run one update on ``entry``, stamp it and trim its history (every store does the same)."""
    fn(entry)
    entry.updated_at = _now()
    entry.history = entry.history[-HISTORY_KEPT:]
    return entry


def _entry(raw: Any, where: str) -> MemoryEntry | None:
    """``raw`` as an entry, or None with a warning when it is not one (a hand edit gone wrong): the
    tuner then starts as if nothing were remembered, and its next success overwrites ``where``."""
    if raw is None:
        return None
    try:
        return MemoryEntry.from_dict(raw)
    except MemoryStoreError as exc:
        log.warning("ignoring the remembered fraction in %s: %s (fix or delete it)", where, exc)
        return None


def _legacy(key: str) -> str | None:
    return getattr(key, "legacy", None)


class FileStore:
    """JSON file ``{"version": 1, "entries": {key: entry}}``; read-modify-write under an flock, atomic rename."""

    kind = "file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": 1, "entries": {}}
        except (OSError, ValueError) as exc:
            raise MemoryStoreError(f"cannot read remembered fractions from {self.path}: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise MemoryStoreError(f"{self.path} is not a fractions file (no 'entries' object)")
        return data

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)

    def _write(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.path, data, indent=2, sort_keys=True)

    def _find(self, entries: dict[str, Any], key: str) -> tuple[str | None, MemoryEntry | None]:
        """(the key it is stored under, the entry): under ``key``, else under its legacy key."""
        for k in (key, _legacy(key)):
            if k is not None and (entry := _entry(entries.get(k), f"{self.path} [{k}]")) is not None:
                return k, entry
        return None, None

    def get(self, key: str) -> MemoryEntry | None:
        return self._find(self._read()["entries"], key)[1]

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        with self._locked():
            data = self._read()
            found, entry = self._find(data["entries"], key)
            if found is not None and found != key:  # learned under the legacy key: moved to the new one
                del data["entries"][found]
            entry = MemoryEntry(key=key) if entry is None else entry
            entry.key = str(key)
            _apply(entry, fn)
            data["entries"][str(key)] = entry.to_dict()
            self._write(data)
            return entry

    def named_entries(self) -> list[tuple[str, MemoryEntry]]:
        out = []
        for k, v in sorted(self._read()["entries"].items()):
            if (entry := _entry(v, f"{self.path} [{k}]")) is not None:
                out.append((str(self.path), entry))
        return out


def variable_name(key: str) -> str:
    """The Prefect Variable of ``key``: ``datagen_fraction_<host>_<model>_tp<N>_<gpu>_<hash>``, lowercase
    with dashes (what Prefect allows), the hash telling apart two models of one name or other flags."""
    parts = key.split("|")
    words = [parts[0], Path(parts[1]).name, parts[2], parts[3]] if len(parts) == 5 else []
    slug = "_".join(filter(None, (re.sub(r"[^a-z0-9]+", "-", w.lower()).strip("-") for w in words)))
    digest = hashlib.sha256(str(key).encode()).hexdigest()[:8]
    name = f"{PrefectStore.prefix}{slug[:200]}_{digest}" if slug else f"{PrefectStore.prefix}{digest}"
    return name


_PREFECT_UPDATES = threading.Lock()


class PrefectStore:
    """One Prefect Variable per key, named by ``variable_name`` (host, model, tp, GPU); entries learned
    under the older hashed names (``datagen_fraction_<24 hex>``) are read, and moved to the readable
    name on their next update."""

    kind = "prefect"
    prefix = "datagen_fraction_"

    def _legacy_name(self, legacy_key: str) -> str:
        return self.prefix + hashlib.sha256(legacy_key.encode()).hexdigest()[:24]

    def _find(self, key: str) -> tuple[str | None, MemoryEntry | None]:
        from prefect.variables import Variable  # noqa: PLC0415 (Prefect only when its store is used)

        legacy = _legacy(key)
        names = [variable_name(key)] + ([self._legacy_name(legacy)] if legacy else [])
        for name in names:
            if (entry := _entry(Variable.get(name, default=None), f"Prefect Variable {name}")) is not None:
                return name, entry
        return None, None

    def get(self, key: str) -> MemoryEntry | None:
        return self._find(key)[1]

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415 (as above)
        from prefect.variables import Variable  # noqa: PLC0415 (Prefect only when its store is used)

        # Last writer wins across runs (one run per host: the gpu:<host> limit). The servers of one
        # run on one host share a key and launch at once: their updates take turns here, and a
        # variable another process created between our read and our write is read again.
        with _PREFECT_UPDATES:
            tries = 3
            while True:
                found, entry = self._find(key)
                entry = MemoryEntry(key=key) if entry is None else entry
                entry.key = str(key)
                _apply(entry, fn)
                name = variable_name(key)
                try:
                    Variable.set(name, entry.to_dict(), tags=["datagen", "mem-fraction"], overwrite=True)
                except ObjectAlreadyExists:
                    tries -= 1
                    if not tries:
                        raise
                    continue
                if found is not None and found != name:  # moved from its legacy name
                    Variable.unset(found)
                return entry

    def named_entries(self) -> list[tuple[str, MemoryEntry]]:
        from prefect.client.orchestration import get_client  # noqa: PLC0415 (as above)

        with get_client(sync_client=True) as client:
            variables = client.read_variables()
        out = [(v.name, e) for v in variables if v.name.startswith(self.prefix)
               and (e := _entry(v.value, f"Prefect Variable {v.name}")) is not None]
        return sorted(out, key=lambda ne: ne[1].key)


def state_dir() -> Path:
    """``$DATAGEN_STATE_DIR``, default ``~/.local/state/datagen``."""
    return Path(os.environ.get("DATAGEN_STATE_DIR") or Path.home() / ".local" / "state" / "datagen")


def prefect_api_reachable(timeout_s: float = 2.0) -> bool:
    """Whether ``PREFECT_API_URL`` is set and its ``/health`` answers 200 within ``timeout_s``."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        try:
            from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 (as above)

            url = (PREFECT_API_URL.value() or "").strip()
        except Exception:
            url = ""
    if not url:
        return False
    try:
        with http.client(timeout=timeout_s) as c:
            return c.get(url.rstrip("/") + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def default_file() -> Path:
    """This host's fractions file: the store without a Prefect API, and the copy of the Variables."""
    return state_dir() / "fractions.json"


class FractionMemory:
    """Remembered fractions per key, over one store (see module docstring for which)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @classmethod
    def default(cls) -> FractionMemory:
        """The ONE place that picks the store: Prefect Variables when the API answers, else the file."""
        if prefect_api_reachable():
            return cls(PrefectStore())
        return cls(FileStore(default_file()))

    @property
    def kind(self) -> str:
        return self.store.kind

    def get(self, key: str) -> MemoryEntry | None:
        return self.store.get(key)

    def remember_success(self, key: str, fraction: float | None, headroom_gib: float | None) -> MemoryEntry:
        def fn(e: MemoryEntry) -> None:
            e.fraction = fraction
            e.headroom_gib = headroom_gib
            frac = "default" if fraction is None else format_fraction(fraction)
            e.history.append(f"{_now()} launched at {frac}, headroom {headroom_gib} GiB")

        return self._mirrored(self.store.update(key, fn))

    def remember_runtime_oom(self, key: str, fraction: float, step: float) -> MemoryEntry:
        def fn(e: MemoryEntry) -> None:
            e.runtime_oom_at = fraction if e.runtime_oom_at is None else min(e.runtime_oom_at, fraction)
            # The next launch starts a step below what OOMed (or lower, if something lower already worked).
            lower = round(fraction - step, 3)
            e.fraction = lower if e.fraction is None else min(e.fraction, lower)
            e.history.append(f"{_now()} runtime OOM at {format_fraction(fraction)}")

        return self._mirrored(self.store.update(key, fn))

    def _mirrored(self, entry: MemoryEntry) -> MemoryEntry:
        """A Prefect Variable's new value, copied into this host's file too: ``datagen status``
        without ``PREFECT_API_URL`` (or with the server down) still tells what this host's runs
        learned. Best effort: the Variable is the one the tuner reads."""
        if self.store.kind != "file":
            def copy(e: MemoryEntry) -> None:
                for name in ("fraction", "headroom_gib", "runtime_oom_at", "history"):
                    setattr(e, name, getattr(entry, name))

            try:
                FileStore(default_file()).update(entry.key, copy)
            except (OSError, MemoryStoreError) as exc:
                log.warning("fraction not copied to %s: %s", default_file(), exc)
        return entry

    def entries(self) -> list[MemoryEntry]:
        return [e for _, e in self.store.named_entries()]


def list_remembered(memory: FractionMemory | None = None) -> list[dict[str, Any]]:
    """For ``datagen status``: every remembered entry as a dict, plus ``store`` ("prefect"/"file"),
    ``where`` (the Prefect Variable's name, or the file) and ``what`` (host, model, tp, GPU)."""
    memory = memory or FractionMemory.default()
    return [dict(e.to_dict(), store=memory.kind, where=where, what=describe_key(e.key))
            for where, e in memory.store.named_entries()]


def gpu_model_name(target: Any, gpus: list[int]) -> str:
    """The GPU model of the first selected GPU on ``target`` (the same discovery hygiene uses: NVML,
    nvidia-smi or simulated GPUs); "unknown-gpu" when it cannot be read."""
    try:
        name = gpu_names(target).get(gpus[0] if gpus else 0)
    except Exception as exc:  # discovery trouble must not stop a launch; the key just gets coarser
        log.warning("cannot read the GPU model on %s (%s): the remembered fraction is keyed without it",
                    target, exc)
        return "unknown-gpu"
    return name or "unknown-gpu"

