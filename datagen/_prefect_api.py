"""A small HTTP client for the Prefect REST API that retries what the server says is transient.

A Prefect server on SQLite answers 503 ("Service Unavailable") when a write waits too long for the
database lock, which happens on a busy machine while a worker, a flow run and ``datagen up`` all write
at once. Prefect's own client retries 429, 502 and 503 with backoff; ``datagen up`` talks to a few REST
routes directly, so it does the same here instead of failing a deploy half-way.
"""
from __future__ import annotations

import time
from typing import Any

import httpx

RETRY_STATUS = frozenset({429, 502, 503, 504})
MAX_TRIES = 6
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 8.0


def _delay(resp: httpx.Response, attempt: int) -> float:
    after = resp.headers.get("retry-after", "")
    try:
        return min(MAX_DELAY_S, max(0.0, float(after)))
    except ValueError:
        return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** attempt)


class PrefectApi(httpx.Client):
    """``httpx.Client`` on ``api_url`` whose requests are retried on 429/502/503/504 (up to
    ``MAX_TRIES`` sends, backing off 0.5 s, 1 s, 2 s ... or as ``Retry-After`` says). Other statuses
    come back as they are; the caller decides with ``raise_for_status()``."""

    def __init__(self, api_url: str, timeout: float = 30.0, **kwargs: Any) -> None:
        super().__init__(base_url=api_url.rstrip("/"), timeout=timeout, **kwargs)

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        for attempt in range(MAX_TRIES):
            resp = super().send(request, **kwargs)
            if resp.status_code not in RETRY_STATUS or attempt == MAX_TRIES - 1:
                return resp
            resp.close()
            time.sleep(_delay(resp, attempt))
        raise AssertionError("unreachable")  # pragma: no cover
