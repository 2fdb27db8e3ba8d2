"""One SGLang server per GPU host: a Prefect global concurrency limit ``gpu:<host>`` (limit 1).

Deployment concurrency limits cover one deployment only; two partitions aimed at one host must
still exclude each other, so the flow holds ``gpu:<host>`` (strict: a missing limit is an error,
not a warning) from hygiene until its server is stopped. `datagen up`, `datagen run/demo` and the
tests create the limits with ``ensure_limits``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

__all__ = ["ensure_limits", "gpu_slots", "host_of", "limit_name"]


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
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

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
def gpu_slots(targets: Iterable[str], timeout_s: float | None = None) -> Iterator[list[str]]:
    """Hold ``gpu:<host>`` for every target (strict). Raises ``TimeoutError`` when another run
    holds a host longer than ``timeout_s`` and ``ConcurrencySlotAcquisitionError`` when a limit
    does not exist."""
    from prefect.concurrency.sync import concurrency

    names = sorted({limit_name(t) for t in targets})
    with concurrency(names, occupy=1, timeout_seconds=timeout_s, strict=True):
        yield names
