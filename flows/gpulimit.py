"""One SGLang server per GPU host: a Prefect global concurrency limit ``gpu:<host>`` (limit 1).

Deployment concurrency limits cover one deployment only; two partitions aimed at one host must
still exclude each other, so the flow holds ``gpu:<host>`` (strict: a missing limit is an error,
not a warning) from hygiene until its server is stopped. `datagen up`, `datagen run/demo` and the
tests create the limits with ``ensure_limits``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from uuid import UUID

from flows import runrecord
from tasks.errors import DatagenError
from tasks.targets import host_of

__all__ = [
    "LEASE_S", "SLOT_WAIT_ENV", "SLOT_WAIT_S", "SlotTimeout", "ensure_limits", "gpu_slots", "host_of", "limit_name",
    "release_lease", "seconds_from_env", "slot_holders", "slot_wait_s",
]

LEASE_S = 60.0  # the API's minimum: how long a crashed run without hook can block a host
SLOT_WAIT_ENV = "DATAGEN_SLOT_WAIT_S"
SLOT_WAIT_S = 300.0  # a live run holding the host: wait this long, then fail naming the holder
_LOG_EVERY_S = 30.0


class SlotTimeout(DatagenError, RuntimeError):
    """Another run held ``gpu:<host>`` longer than the slot wait bound; the message names it."""


def limit_name(target: str) -> str:
    return f"gpu:{host_of(target)}"


def ensure_limits(names: Iterable[str]) -> list[str]:
    """Create each missing global concurrency limit with limit 1; existing ones are left as they
    are (an operator may have changed them). Returns the names created. Needs a Prefect API."""
    from prefect.client.orchestration import get_client  # late: PREFECT_* set first
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate  # late: PREFECT_* set first
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound  # late: PREFECT_* set first

    created: list[str] = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
                continue
            except ObjectNotFound:
                pass
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


@contextmanager
def gpu_slots(targets: Iterable[str], timeout_s: float | None = None,
              on_lease: Callable[[str], None] | None = None,
              on_release: Callable[[], None] | None = None,
              holders: Callable[[str], str] | None = None) -> Iterator[list[str]]:
    """Hold ``gpu:<host>`` for every target (strict), renewing a 60 s lease while held.

    Args:
        targets: the run's targets; one slot per distinct host.
        timeout_s: how long to wait for a slot another run holds (default ``slot_wait_s()``).
        on_lease: told the lease id once acquired, so that a crash hook or the next run can release
            it (a SIGKILLed run cannot).
        on_release: called once the lease is really released on the way out.
        holders: describes who holds a limit (e.g. from the run records), for the waiting log.

    Raises:
        SlotTimeout: another run held a host longer than ``timeout_s``.
        ConcurrencySlotAcquisitionError: a limit does not exist.
    """
    names = sorted({limit_name(t) for t in targets})
    if not names:
        yield names
        return
    from prefect.concurrency._leases import maintain_concurrency_lease  # late: PREFECT_* set first

    lease_id = _acquire(names, slot_wait_s() if timeout_s is None else timeout_s, holders)
    if on_lease is not None:
        on_lease(str(lease_id))
    try:
        with maintain_concurrency_lease(lease_id, LEASE_S, raise_on_lease_renewal_failure=False):
            yield names
    finally:
        if release_lease(str(lease_id)) and on_release is not None:
            on_release()


def _acquire(names: list[str], timeout_s: float, holders: Callable[[str], str] | None) -> UUID:
    """Take one slot of every limit in ``names`` with a lease, waiting at most ``timeout_s``.

    Each request is one increment (all limits or none); a 423 answer means another holder, so the
    wait is logged (who holds it, then every ``_LOG_EVERY_S``) and retried. Never cancelled mid-request:
    a request cut off after the server counted the slot would leak it."""
    import httpx  # late: PREFECT_* set first
    from prefect.client.orchestration import get_client  # late: PREFECT_* set first
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError  # late: PREFECT_* set first

    log = _logger()
    started = time.monotonic()
    next_log = started
    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=names, slots=1, mode="concurrency", lease_duration=LEASE_S)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 423:
                    raise ConcurrencySlotAcquisitionError(f"cannot acquire {names!r}: {exc}") from exc
                waited = time.monotonic() - started
                who = "; ".join(f"{n} {holders(n) if holders else 'held by another run'}" for n in names)
                if waited >= timeout_s:
                    raise SlotTimeout(
                        f"gave up waiting for the GPU slot after {waited:.0f} s ({who}); "
                        f"the bound is {SLOT_WAIT_ENV} (now {timeout_s:g} s)") from None
                if time.monotonic() >= next_log:
                    log.warning("waiting for the GPU slot (%s), %.0f s of %g s", who, waited, timeout_s)
                    next_log = time.monotonic() + _LOG_EVERY_S
                retry = _retry_after(exc.response.headers.get("Retry-After"))
                time.sleep(max(0.05, min(retry, timeout_s - waited, 2.0)))
                continue
            body = response.json()
            lease_id = UUID(str(body["lease_id"]))
            if len(body.get("limits") or []) != len(names):
                release_lease(str(lease_id))
                raise ConcurrencySlotAcquisitionError(f"Concurrency limits {names!r} must be created before acquiring slots")
            if next_log > started:  # it waited for another holder
                log.info("got the GPU slot (%s) after %.1f s", ", ".join(names), time.monotonic() - started)
            return lease_id


def slot_holders(name: str, exclude: str | None = None) -> str:
    """Who holds limit ``name``, from the run records of this state directory: host, pid and flow
    run of each run with an unreleased lease on it (not ``exclude``), or a hint when none does."""
    found = []
    for run_id, record in runrecord.records():
        own = record.owner
        if run_id == exclude or not record.lease or record.lease_released:
            continue
        if name not in {limit_name(t) for t in record.targets or []}:
            continue
        if own is not None and own.here() and not own.alive():
            continue  # dead: the next start releases it
        found.append(f"host {own.host if own else None} pid {own.pid if own else None} flow run {run_id}")
    if found:
        return "held by " + ", ".join(found)
    return ("held by no run on record here (another machine or state directory, or a slot whose lease "
            f"its API server lost: once nothing uses the host, `prefect global-concurrency-limit update {name} "
            "--active-slots 0` frees it)")


def _retry_after(value: str | None) -> float:
    try:
        return float(value) if value else 1.0
    except ValueError:
        return 1.0


def _logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    try:
        from prefect import get_run_logger  # late: PREFECT_* set first

        return get_run_logger()
    except Exception:
        return logging.getLogger("datagen.gpulimit")


def slot_wait_s() -> float:
    """How long a run waits for ``gpu:<host>`` held by another run: ``$DATAGEN_SLOT_WAIT_S``,
    default ``SLOT_WAIT_S``.

    Raises:
        ValueError: the variable is not a positive number.
    """
    return seconds_from_env(SLOT_WAIT_ENV, SLOT_WAIT_S)


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable ``name``, ``default`` when unset.

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def release_lease(lease_id: str) -> bool:
    """Release a slot lease: True only when the API held the lease and let it go now.

    The API answers a release of a lease it does not know with success and changes nothing, so
    the lease is renewed first: a lease the API does not know (already released, expired, or kept
    by an API server that has since gone) gives False. Never raises: False on any error.
    """
    from prefect.client.orchestration import get_client  # late: PREFECT_* set first

    try:
        with get_client(sync_client=True) as client:
            try:
                client.renew_concurrency_lease(UUID(lease_id), lease_duration=LEASE_S)
            except Exception:
                return False
            client.release_concurrency_slots_with_lease(UUID(lease_id))
        return True
    except Exception:
        return False
