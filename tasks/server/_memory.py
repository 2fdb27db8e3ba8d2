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
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.hygiene import gpu_names
from tasks.server._launch import ServerConfig, format_fraction, server_flags

__all__ = [
    "FileStore",
    "FractionMemory",
    "MemoryEntry",
    "MemoryStoreError",
    "PrefectStore",
    "Store",
    "gpu_model_name",
    "list_remembered",
    "memory_key",
    "prefect_api_reachable",
    "state_dir",
]

# The tuner's logger: these records are part of what tasks.server._tuner reports.
log = logging.getLogger("tasks.server._tuner")

HISTORY_KEPT = 10  # events kept per entry, newest last


class MemoryStoreError(DatagenError, RuntimeError):
    """The remembered-fractions store exists but cannot be read or written."""


def memory_key(cfg: ServerConfig, target: Any, gpu_name: str) -> str:
    """Key of a remembered fraction: host | model | tp | GPU model | hash of memory-relevant flags.

    Host/port, the fraction itself, names and the API key do not change memory use and are left out.
    """
    tname = target if isinstance(target, str) else str(target)
    host = socket.gethostname() if tname.strip() in ("", "local") else tname
    flags = server_flags(cfg, None)
    drop_with_value = {"--host", "--port", "--served-model-name", "--model-path", "--tp-size"}
    kept: list[str] = []
    skip = False
    for a in flags:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        kept.append(a)
    digest = hashlib.sha256(json.dumps([cfg.backend, kept]).encode()).hexdigest()[:12]
    model = os.path.normpath(cfg.model_path)
    return f"{host}|{model}|tp{cfg.tp_size}|{gpu_name}|{digest}"


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
        known = {k: d[k] for k in ("key", "fraction", "headroom_gib", "runtime_oom_at", "updated_at", "history")
                 if k in d}
        return cls(**known)


class Store(Protocol):
    """Where entries live: ``FileStore`` or ``PrefectStore``."""

    kind: str

    def get(self, key: str) -> MemoryEntry | None: ...

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry: ...

    def entries(self) -> list[MemoryEntry]: ...


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _apply(entry: MemoryEntry, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
    """Run one update on ``entry``, stamp it and trim its history (every store does the same)."""
    fn(entry)
    entry.updated_at = _now()
    entry.history = entry.history[-HISTORY_KEPT:]
    return entry


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

    def get(self, key: str) -> MemoryEntry | None:
        raw = self._read()["entries"].get(key)
        return MemoryEntry.from_dict(raw) if raw else None

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        with self._locked():
            data = self._read()
            raw = data["entries"].get(key)
            entry = MemoryEntry.from_dict(raw) if raw else MemoryEntry(key=key)
            _apply(entry, fn)
            data["entries"][key] = entry.to_dict()
            self._write(data)
            return entry

    def entries(self) -> list[MemoryEntry]:
        return [MemoryEntry.from_dict(v) for _, v in sorted(self._read()["entries"].items())]


_PREFECT_UPDATES = threading.Lock()


class PrefectStore:
    """One Prefect Variable per key, named ``datagen_fraction_<hash>`` (names are short; values < 5000 chars)."""

    kind = "prefect"
    prefix = "datagen_fraction_"

    def _name(self, key: str) -> str:
        return self.prefix + hashlib.sha256(key.encode()).hexdigest()[:24]

    def get(self, key: str) -> MemoryEntry | None:
        from prefect.variables import Variable  # noqa: PLC0415 (Prefect only when its store is used)

        raw = Variable.get(self._name(key), default=None)
        return MemoryEntry.from_dict(raw) if isinstance(raw, dict) else None

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415 (as above)
        from prefect.variables import Variable  # noqa: PLC0415 (Prefect only when its store is used)

        # Last writer wins across runs (one run per host: the gpu:<host> limit). The servers of one
        # run on one host share a key and launch at once: their updates take turns here, and a
        # variable another process created between our read and our write is read again.
        with _PREFECT_UPDATES:
            tries = 3
            while True:
                entry = _apply(self.get(key) or MemoryEntry(key=key), fn)
                try:
                    Variable.set(self._name(key), entry.to_dict(), tags=["datagen", "mem-fraction"], overwrite=True)
                    return entry
                except ObjectAlreadyExists:
                    tries -= 1
                    if not tries:
                        raise

    def entries(self) -> list[MemoryEntry]:
        from prefect.client.orchestration import get_client  # noqa: PLC0415 (as above)

        with get_client(sync_client=True) as client:
            variables = client.read_variables()
        out = [MemoryEntry.from_dict(v.value) for v in variables
               if v.name.startswith(self.prefix) and isinstance(v.value, dict)]
        return sorted(out, key=lambda e: e.key)


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
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class FractionMemory:
    """Remembered fractions per key, over one store (see module docstring for which)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @classmethod
    def default(cls) -> FractionMemory:
        """The ONE place that picks the store: Prefect Variables when the API answers, else the file."""
        if prefect_api_reachable():
            return cls(PrefectStore())
        return cls(FileStore(state_dir() / "fractions.json"))

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
            e.history.append(f"{_now()} launched at {frac}, headroom {headroom_gib} GB")

        return self.store.update(key, fn)

    def remember_runtime_oom(self, key: str, fraction: float, step: float) -> MemoryEntry:
        def fn(e: MemoryEntry) -> None:
            e.runtime_oom_at = fraction if e.runtime_oom_at is None else min(e.runtime_oom_at, fraction)
            # The next launch starts a step below what OOMed (or lower, if something lower already worked).
            lower = round(fraction - step, 3)
            e.fraction = lower if e.fraction is None else min(e.fraction, lower)
            e.history.append(f"{_now()} runtime OOM at {format_fraction(fraction)}")

        return self.store.update(key, fn)

    def entries(self) -> list[MemoryEntry]:
        return self.store.entries()


def list_remembered(memory: FractionMemory | None = None) -> list[dict[str, Any]]:
    """For ``datagen status``: every remembered entry as a dict, plus ``store`` ("prefect"/"file")."""
    memory = memory or FractionMemory.default()
    return [dict(e.to_dict(), store=memory.kind) for e in memory.entries()]


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

