"""Memory-fraction tuning: launch, classify the failure, move ``--mem-fraction-static``, remember.

The state machine (``next_fraction``): a "too_high" failure lowers the fraction, "too_low" raises it,
by ``step`` while only one side is known; once a too-low and a too-high value bracket the answer it
bisects. Every value stays within ``bounds``; a value already tried, a bracket narrower than
``min_gap``, or ``max_attempts`` ends the search with a message naming every attempt. Failures that
no fraction fixes (port in use, bad flag, missing model, host memory, unknown, timeout) end it at once.

Memory (``FractionMemory``) keeps per key (host + model + tp + GPU model + memory-relevant flags) the
fraction that worked, the headroom SGLang reported, and the lowest fraction seen to OOM at run time.
One function, ``FractionMemory.default()``, picks the store: a Prefect Variable per key when
``PREFECT_API_URL`` is set and its ``/health`` answers, else the JSON file
``$DATAGEN_STATE_DIR/fractions.json`` (default ``~/.local/state/datagen``), written atomically
under an flock.

Errors: ``LaunchFailed`` (from tasks.server; on give-up its ``attempts`` lists every Attempt),
``MemoryStoreError`` when the state file is unreadable garbage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from tasks.server import (
    Failure,
    LaunchFailed,
    ServerConfig,
    ServerHandle,
    classify_failure,
    effective_fraction,
    format_fraction,
    launch,
    server_flags,
)

__all__ = [
    "DEFAULT_FRACTION",
    "Attempt",
    "FileStore",
    "Failure",
    "FractionMemory",
    "LaunchReport",
    "MemoryEntry",
    "MemoryStoreError",
    "PrefectStore",
    "TuningPolicy",
    "classify_failure",
    "launch_tuned",
    "list_remembered",
    "memory_key",
    "gpu_model_name",
    "next_fraction",
    "prefect_api_reachable",
    "record_runtime_oom",
    "runtime_failure",
    "state_dir",
]

log = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.88  # SGLang's default when it cannot compute one from the GPU
RETRYABLE = frozenset({"too_high", "too_low"})


class MemoryStoreError(RuntimeError):
    """The remembered-fractions store exists but cannot be read or written."""


# --------------------------------------------------------------------------------------------------
# State machine


@dataclass(frozen=True)
class TuningPolicy:
    """Bounds and steps of the search. ``step`` is the first move; later unbracketed moves shrink."""

    bounds: tuple[float, float] = (0.5, 0.95)
    step: float = 0.05
    min_step: float = 0.02
    min_gap: float = 0.01
    max_attempts: int = 5


@dataclass
class Attempt:
    """One launch: the fraction asked for (None = SGLang's default), what it turned out to be, the result."""

    fraction: float | None
    effective: float | None
    failure: Failure | None
    log_path: str | None
    duration_s: float
    exit_status: int | None = None

    def describe(self) -> str:
        frac = "default" if self.fraction is None else format_fraction(self.fraction)
        if self.fraction is None and self.effective is not None:
            frac += f" ({format_fraction(self.effective)})"
        if self.failure is None:
            return f"{frac} -> ok"
        return f"{frac} -> {self.failure.kind}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failure"] = self.failure.to_dict() if self.failure else None
        return d


def next_fraction(attempts: list[Attempt], policy: TuningPolicy, ceiling: float | None = None) -> float | None:
    """The fraction to try after ``attempts`` (the last one failed), or None when the search is over.

    ``ceiling``: a fraction known to OOM at run time; the search stays below it.
    """
    last = attempts[-1]
    if last.failure is None or last.failure.kind not in RETRYABLE:
        return None
    lo_b, hi_b = policy.bounds
    highs = [a.effective for a in attempts if a.failure and a.failure.kind == "too_high" and a.effective]
    lows = [a.effective for a in attempts if a.failure and a.failure.kind == "too_low" and a.effective]
    if ceiling is not None:
        highs.append(ceiling)
    too_high = min(highs) if highs else None
    too_low = max(lows) if lows else None
    current = last.effective if last.effective is not None else DEFAULT_FRACTION
    same_dir = sum(1 for a in attempts if a.failure and a.failure.kind == last.failure.kind)
    # First move a full step; further moves the same way shrink (0.05, 0.035, 0.025, ...).
    step = max(policy.min_step, policy.step * (0.7 ** (same_dir - 1)))
    if too_high is not None and too_low is not None:
        if too_high - too_low < policy.min_gap * 2:
            return None
        candidate = (too_high + too_low) / 2
    elif last.failure.kind == "too_high":
        candidate = current - step
    else:
        candidate = current + step
        if too_high is not None:
            candidate = min(candidate, (current + too_high) / 2)
    candidate = round(min(max(candidate, lo_b), hi_b), 3)
    tried = {round(a.effective, 3) for a in attempts if a.effective is not None}
    if candidate in tried:
        return None
    if too_high is not None and candidate >= too_high:
        return None
    if too_low is not None and candidate <= too_low:
        return None
    return candidate


# --------------------------------------------------------------------------------------------------
# Memory


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
    kind: str

    def get(self, key: str) -> MemoryEntry | None: ...

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry: ...

    def entries(self) -> list[MemoryEntry]: ...


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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
        fd, tmp = tempfile.mkstemp(prefix=".fractions-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def get(self, key: str) -> MemoryEntry | None:
        raw = self._read()["entries"].get(key)
        return MemoryEntry.from_dict(raw) if raw else None

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        with self._locked():
            data = self._read()
            raw = data["entries"].get(key)
            entry = MemoryEntry.from_dict(raw) if raw else MemoryEntry(key=key)
            fn(entry)
            entry.updated_at = _now()
            entry.history = entry.history[-10:]
            data["entries"][key] = entry.to_dict()
            self._write(data)
            return entry

    def entries(self) -> list[MemoryEntry]:
        return [MemoryEntry.from_dict(v) for _, v in sorted(self._read()["entries"].items())]


class PrefectStore:
    """One Prefect Variable per key, named ``datagen_fraction_<hash>`` (names are short; values < 5000 chars)."""

    kind = "prefect"
    prefix = "datagen_fraction_"

    def _name(self, key: str) -> str:
        return self.prefix + hashlib.sha256(key.encode()).hexdigest()[:24]

    def get(self, key: str) -> MemoryEntry | None:
        from prefect.variables import Variable

        raw = Variable.get(self._name(key), default=None)
        return MemoryEntry.from_dict(raw) if isinstance(raw, dict) else None

    def update(self, key: str, fn: Callable[[MemoryEntry], None]) -> MemoryEntry:
        from prefect.variables import Variable

        # Last writer wins: two runs tuning the same key at once is already prevented by the
        # one-server-per-host limit, so no compare-and-swap here.
        entry = self.get(key) or MemoryEntry(key=key)
        fn(entry)
        entry.updated_at = _now()
        entry.history = entry.history[-10:]
        Variable.set(self._name(key), entry.to_dict(), tags=["datagen", "mem-fraction"], overwrite=True)
        return entry

    def entries(self) -> list[MemoryEntry]:
        from prefect.client.orchestration import get_client

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
            from prefect.settings import PREFECT_API_URL

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


# --------------------------------------------------------------------------------------------------
# GPU model (part of the key)


def gpu_model_name(target: Any, gpus: list[int]) -> str:
    """The GPU model of the first selected GPU on ``target`` (the same discovery hygiene uses: NVML,
    nvidia-smi or simulated GPUs); "unknown-gpu" when it cannot be read."""
    from tasks.hygiene import gpu_names

    try:
        name = gpu_names(target).get(gpus[0] if gpus else 0)
    except Exception as exc:  # discovery trouble must not stop a launch; the key just gets coarser
        log.warning("cannot read the GPU model on %s (%s): the remembered fraction is keyed without it",
                    target, exc)
        return "unknown-gpu"
    return name or "unknown-gpu"


# --------------------------------------------------------------------------------------------------
# The tuned launch


@dataclass
class LaunchReport:
    """How a tuned launch went: every attempt, where the start came from, what was remembered."""

    key: str
    start_source: str  # remembered | configured | default
    attempts: list[Attempt]
    fraction: float | None
    headroom_gib: float | None
    store: str

    def summary(self) -> str:
        return "; ".join(a.describe() for a in self.attempts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attempts"] = [a.to_dict() for a in self.attempts]
        return d


def _default_hygiene(target: Any, gpus: list[int]) -> Any:
    from tasks.hygiene import clean_gpus

    return clean_gpus(target, gpus=gpus)


def launch_tuned(
    cfg: ServerConfig,
    target: Any = "local",
    log_dir: str | os.PathLike[str] = ".",
    *,
    deadline_s: float = 1800.0,
    memory: FractionMemory | None = None,
    policy: TuningPolicy | None = None,
    gpu_name: str | None = None,
    hygiene: Callable[[Any, list[int]], Any] | None = _default_hygiene,
    launcher: Callable[..., ServerHandle] = launch,
    on_started: Callable[[int, int], None] | None = None,
) -> tuple[ServerHandle, LaunchReport]:
    """Launch ``cfg`` on ``target``, moving ``--mem-fraction-static`` until the server comes up.

    Start: the remembered fraction for ``memory_key`` (below a remembered runtime OOM), else
    ``cfg.mem_fraction_static``, else SGLang's default (flag omitted). ``hygiene(target, gpus)`` runs
    between attempts (the failed server is already stopped by then). Remembers the fraction that
    worked and its headroom. ``on_started(pid, pgid)`` is handed to the launcher and called for
    every attempt as soon as its server process exists (see ``tasks.server.launch``). Raises
    LaunchFailed (``attempts`` = every Attempt, message names each fraction and failure) when no
    attempt worked; whatever ``on_started`` raises.
    """
    policy = policy or TuningPolicy()
    memory = memory or FractionMemory.default()
    gpus = cfg.gpu_indexes()
    key = memory_key(cfg, target, gpu_name or gpu_model_name(target, gpus))
    entry = memory.get(key)
    ceiling = entry.runtime_oom_at if entry else None
    if entry is not None and (entry.fraction is not None or entry.runtime_oom_at is None):
        fraction, source = entry.fraction, "remembered"
    elif cfg.mem_fraction_static is not None:
        fraction, source = cfg.mem_fraction_static, "configured"
    else:
        fraction, source = None, "default"
    if fraction is not None and ceiling is not None and fraction >= ceiling:
        fraction = round(max(policy.bounds[0], ceiling - policy.step), 3)
    attempts: list[Attempt] = []
    while True:
        t0 = time.monotonic()
        try:
            # Only when given: a custom launcher need not know the keyword.
            extra = {} if on_started is None else {"on_started": on_started}
            handle = launcher(cfg, target, fraction, log_dir, deadline_s, **extra)
        except LaunchFailed as exc:
            eff = fraction if fraction is not None else (effective_fraction(exc.log_tail) or DEFAULT_FRACTION)
            attempts.append(Attempt(fraction, eff, exc.failure, exc.log_path, time.monotonic() - t0,
                                    exc.exit_status))
            log.warning("launch attempt %d failed: %s", len(attempts), attempts[-1].describe())
            nxt = next_fraction(attempts, policy, ceiling) if len(attempts) < policy.max_attempts else None
            if nxt is None:
                raise _give_up(attempts, policy, exc, key) from exc
            if hygiene is not None:
                hygiene(target, gpus)
            fraction = nxt
            continue
        worked = fraction if fraction is not None else effective_fraction(handle.read_log(1 << 20))
        attempts.append(Attempt(fraction, worked, None, handle.log_path, time.monotonic() - t0))
        memory.remember_success(key, worked, handle.headroom_gib)
        report = LaunchReport(key, source, attempts, worked, handle.headroom_gib, memory.kind)
        log.info("server ready after %d attempt(s): %s", len(attempts), report.summary())
        return handle, report


def _give_up(attempts: list[Attempt], policy: TuningPolicy, last: LaunchFailed, key: str) -> LaunchFailed:
    tried = ", ".join(a.describe() for a in attempts)
    kind = last.failure.kind
    if kind not in RETRYABLE:
        why = f"{kind} is not fixed by changing --mem-fraction-static: {last.failure.explanation}"
    elif len(attempts) >= policy.max_attempts:
        why = f"no fraction worked within {policy.max_attempts} attempts"
    else:
        lo, hi = policy.bounds
        why = (f"no fraction in [{lo:g}, {hi:g}] fits: the model needs more memory than these GPUs have "
               "with these flags (fewer running requests, a shorter context, more GPUs or a smaller model)")
    msg = (f"gave up launching the server after {len(attempts)} attempt(s) [{tried}]: {why}\n"
           f"  key: {key}\n  last failure: {last}")
    return LaunchFailed(last.failure, last.log_tail, attempts, exit_status=last.exit_status,
                        log_path=last.log_path, command=last.command, fraction=last.fraction, message=msg)


def record_runtime_oom(
    cfg: ServerConfig,
    target: Any,
    fraction: float,
    *,
    memory: FractionMemory | None = None,
    gpu_name: str | None = None,
    policy: TuningPolicy | None = None,
) -> MemoryEntry:
    """A server launched at ``fraction`` OOMed during inference: count it as too high for next time.

    The next ``launch_tuned`` for the same key starts a step lower and never goes back up to it.
    """
    policy = policy or TuningPolicy()
    memory = memory or FractionMemory.default()
    key = memory_key(cfg, target, gpu_name or gpu_model_name(target, cfg.gpu_indexes()))
    return memory.remember_runtime_oom(key, fraction, policy.step)


def runtime_failure(log_text: str) -> Failure | None:
    """The failure a running server's log shows, when it is an OOM (flows call record_runtime_oom then)."""
    f = classify_failure(log_text, None)
    return f if f.kind == "too_high" else None
