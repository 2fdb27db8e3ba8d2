"""Memory-fraction tuning: launch, classify the failure, move ``--mem-fraction-static``, remember.

The state machine (``next_fraction``): a "too_high" failure lowers the fraction, "too_low" raises it,
by ``step`` while only one side is known; once a too-low and a too-high value bracket the answer it
bisects. A "too_low" failure whose log names the least fraction that fits ("Raise
--mem-fraction-static above Y") moves to just above Y instead. Every value stays within ``bounds``; a
value already tried, a bracket narrower than ``min_gap``, or ``max_attempts`` ends the search with a
message naming every attempt. Failures that no fraction fixes (port in use, bad flag, missing model,
host memory, KV pool exhausted, unknown, timeout) end it at once.

Memory (``FractionMemory`` and its stores, in tasks.server._memory; importable from here) keeps per
key (host + model + tp + GPU model + memory-relevant flags) the fraction that worked, its headroom and
the lowest fraction seen to OOM at run time: a Prefect Variable per key when the Prefect API answers,
else ``$DATAGEN_STATE_DIR/fractions.json``.

Errors: ``LaunchFailed`` (from tasks.server; on give-up its ``attempts`` lists every Attempt),
``MemoryStoreError`` when the state file is unreadable garbage.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tasks.hygiene import clean_gpus
from tasks.server._launch import (
    Failure,
    LaunchFailed,
    ServerConfig,
    ServerHandle,
    classify_failure,
    effective_fraction,
    format_fraction,
    launch,
)
from tasks.server._memory import (
    FileStore,
    FractionMemory,
    MemoryEntry,
    MemoryStoreError,
    PrefectStore,
    gpu_model_name,
    list_remembered,
    memory_key,
    prefect_api_reachable,
    state_dir,
)

__all__ = [
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

RETRYABLE = frozenset({"too_high", "too_low"})


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

    ``ceiling``: a fraction known to OOM at run time; the search stays below it. A failed attempt
    whose fraction is unknown (SGLang's default, not found in its log) gives no direction to step
    from, unless SGLang named the fraction that fits.
    """
    last = attempts[-1]
    if last.failure is None or last.failure.kind not in RETRYABLE:
        return None
    suggested = last.failure.suggested_fraction if last.failure.kind == "too_low" else None
    if last.effective is None and suggested is None:
        return None
    lo_b, hi_b = policy.bounds
    highs = [a.effective for a in attempts if a.failure and a.failure.kind == "too_high" and a.effective]
    lows = [a.effective for a in attempts if a.failure and a.failure.kind == "too_low" and a.effective]
    if ceiling is not None:
        highs.append(ceiling)
    too_high = min(highs) if highs else None
    too_low = max(lows) if lows else None
    current = last.effective if last.effective is not None else suggested
    assert current is not None
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
    if suggested is not None:
        # SGLang computed the least fraction that fits: go just above it, not a guessed step.
        if suggested >= hi_b:
            return None
        candidate = suggested + policy.min_gap
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
# The tuned launch


@dataclass
class LaunchReport:
    """How a tuned launch went: every attempt, where the start came from, what was remembered."""

    key: str
    start_source: str  # explicit | remembered | configured | default
    attempts: list[Attempt]
    fraction: float | None
    headroom_gib: float | None
    store: str
    remembered: float | None = None  # what memory held for the key at the start (shown when not used)

    def summary(self) -> str:
        return "; ".join(a.describe() for a in self.attempts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attempts"] = [a.to_dict() for a in self.attempts]
        return d


def _default_hygiene(target: Any, gpus: list[int]) -> Any:
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
    pinned: float | None = None,
) -> tuple[ServerHandle, LaunchReport]:
    """Launch ``cfg`` on ``target``, moving ``--mem-fraction-static`` until the server comes up.

    Start: the remembered fraction for ``memory_key`` (below a remembered runtime OOM), else
    ``cfg.mem_fraction_static``, else SGLang's default (flag omitted). ``hygiene(target, gpus)`` runs
    between attempts (the failed server is already stopped by then). Remembers the fraction that
    worked and its headroom. ``on_started(pid, pgid)`` is handed to the launcher and called for
    every attempt as soon as its server process exists (see ``tasks.server.launch``). ``pinned``:
    a fraction the user asked for explicitly for this launch: the start, whatever memory holds
    (the search still moves from it when the launch fails). Raises
    LaunchFailed (``attempts`` = every Attempt, message names each fraction and failure) when no
    attempt worked; whatever ``on_started`` raises.
    """
    policy = policy or TuningPolicy()
    memory = memory or FractionMemory.default()
    gpus = cfg.gpu_indexes()
    key = memory_key(cfg, target, gpu_name or gpu_model_name(target, gpus))
    entry = memory.get(key)
    ceiling = entry.runtime_oom_at if entry else None
    fraction: float | None
    if pinned is not None:
        fraction, source, ceiling = pinned, "explicit", None
    elif entry is not None and (entry.fraction is not None or entry.runtime_oom_at is None):
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
            # SGLang's own default differs by version and GPU: only its log says what it was.
            eff = fraction if fraction is not None else (exc.effective or effective_fraction(exc.log_tail))
            attempts.append(Attempt(fraction, eff, exc.failure, exc.log_path, time.monotonic() - t0,
                                    exc.exit_status))
            log.warning("launch attempt %d failed: %s", len(attempts), attempts[-1].describe())
            nxt = next_fraction(attempts, policy, ceiling) if len(attempts) < policy.max_attempts else None
            if nxt is None:
                raise _give_up(attempts, policy, exc, key) from exc
            if hygiene is not None:
                for node in (target, *cfg.peer_nodes):  # a server over several nodes: each node's GPUs
                    hygiene(node, gpus)
            fraction = nxt
            continue
        worked = fraction if fraction is not None else effective_fraction(handle.read_log(1 << 20))
        attempts.append(Attempt(fraction, worked, None, handle.log_path, time.monotonic() - t0))
        memory.remember_success(key, worked, handle.headroom_gib)
        report = LaunchReport(key, source, attempts, worked, handle.headroom_gib, memory.kind,
                              remembered=entry.fraction if entry is not None else None)
        log.info("server ready after %d attempt(s): %s", len(attempts), report.summary())
        return handle, report


def _give_up(attempts: list[Attempt], policy: TuningPolicy, last: LaunchFailed, key: str) -> LaunchFailed:
    tried = ", ".join(a.describe() for a in attempts)
    kind = last.failure.kind
    if kind == "kv_pool_exhausted":
        why = f"{kind} is not a memory-fraction failure the tuner searches: {last.failure.explanation}"
    elif kind not in RETRYABLE:
        why = f"{kind} is not fixed by changing --mem-fraction-static: {last.failure.explanation}"
    elif attempts[-1].effective is None and attempts[-1].fraction is None:
        why = ("SGLang's log does not say which --mem-fraction-static it chose by default, so no step is "
               "known to go the right way: set [server] mem_fraction_static")
    elif len(attempts) >= policy.max_attempts:
        why = f"no fraction worked within {policy.max_attempts} attempts"
    else:
        lo, hi = policy.bounds
        why = (f"no fraction in [{lo:g}, {hi:g}] fits: the model needs more memory than these GPUs have "
               "with these flags (fewer running requests, a shorter context, more GPUs or a smaller model)")
    msg = (f"gave up launching the server after {len(attempts)} attempt(s) [{tried}]: {why}\n"
           f"  key: {key}\n  last failure: {last}")
    return LaunchFailed(last.failure, last.log_tail, attempts, exit_status=last.exit_status,
                        log_path=last.log_path, command=last.command, fraction=last.fraction, message=msg,
                        effective=last.effective)


def record_runtime_oom(
    cfg: ServerConfig,
    target: Any,
    fraction: float | None,
    *,
    log_text: str = "",
    memory: FractionMemory | None = None,
    gpu_name: str | None = None,
    policy: TuningPolicy | None = None,
) -> MemoryEntry | None:
    """A server launched at ``fraction`` OOMed during inference: count it as too high for next time.

    The next ``launch_tuned`` for the same key starts a step lower and never goes back up to it.

    Args:
        fraction: the fraction the server was launched at; None for SGLang's default, which is then
            read from ``log_text``.
        log_text: the server's log (only read when ``fraction`` is None).

    Returns the updated entry, or None (with a warning, nothing recorded) when the fraction is
    unknown.
    """
    if fraction is None:
        fraction = effective_fraction(log_text)
        if fraction is None:
            log.warning("runtime OOM at SGLang's default fraction, which its log does not name: not recorded")
            return None
    policy = policy or TuningPolicy()
    memory = memory or FractionMemory.default()
    key = memory_key(cfg, target, gpu_name or gpu_model_name(target, cfg.gpu_indexes()))
    return memory.remember_runtime_oom(key, fraction, policy.step)


def runtime_failure(log_text: str) -> Failure | None:
    """The failure a running server's log shows, when it is an OOM (flows call record_runtime_oom then)."""
    f = classify_failure(log_text, None)
    return f if f.kind == "too_high" else None
