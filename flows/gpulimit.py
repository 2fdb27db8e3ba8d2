"""One SGLang server per GPU host: a Prefect global concurrency limit ``gpu:<host>`` (limit 1).

Deployment concurrency limits cover one deployment only; two partitions aimed at one host must
still exclude each other, so the flow holds ``gpu:<host>`` (strict: a missing limit is an error,
not a warning) from hygiene until its server is stopped. `datagen up`, `datagen run/demo` and the
tests create the limits with ``ensure_limits``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

# Prefect's public `concurrency()` hides the lease id; these are the pieces it is built from.
from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.concurrency._sync import (
    acquire_concurrency_slots_with_lease,
    release_concurrency_slots_with_lease,
)
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

__all__ = ["LEASE_S", "ensure_limits", "gpu_slots", "host_of", "limit_name", "release_lease"]

LEASE_S = 60.0  # the API's minimum: how long a crashed run without hook can block a host


def host_of(target: str) -> str:
    """The physical GPU host of a target string (``local`` is this machine; a pct container's
    GPUs belong to its Proxmox host)."""
    if target == "local":
        return socket.gethostname()
    parts = urlsplit(target)
    return parts.hostname or target


def limit_name(target: str) -> str:
    return f"gpu:{host_of(target)}"


def ensure_limits(names: Iterable[str]) -> list[str]:
    """Create each missing global concurrency limit with limit 1; existing ones are left as they
    are (an operator may have changed them). Returns the names created. Needs a Prefect API."""
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
              on_lease: Callable[[str], None] | None = None) -> Iterator[list[str]]:
    """Hold ``gpu:<host>`` for every target (strict), renewing a 60 s lease while held.

    ``on_lease(lease_id)`` is told the lease so that a crash hook can release it: a SIGKILLed run
    cannot, and the next run would otherwise wait for the lease to expire. Raises ``TimeoutError``
    when another run holds a host longer than ``timeout_s`` and ``ConcurrencySlotAcquisitionError``
    when a limit does not exist."""
    names = sorted({limit_name(t) for t in targets})
    if not names:
        yield names
        return
    lease = acquire_concurrency_slots_with_lease(names, 1, timeout_seconds=timeout_s, strict=True,
                                                 lease_duration=LEASE_S)
    if on_lease is not None:
        on_lease(str(lease.lease_id))
    try:
        with maintain_concurrency_lease(lease.lease_id, LEASE_S, raise_on_lease_renewal_failure=False):
            yield names
    finally:
        release_concurrency_slots_with_lease(lease.lease_id)


def release_lease(lease_id: str) -> bool:
    """Release a lease a dead run left behind (crash hook). False when it was already gone."""
    try:
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(UUID(lease_id))
        return True
    except Exception:
        return False
