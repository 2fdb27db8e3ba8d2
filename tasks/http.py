"""datagen's own HTTP clients (health and readiness probes, the hang watchdog, one-off requests to
SGLang and to the Prefect API): one verifying TLS context per process.

httpx builds a new TLS context for every client it makes, loading the CA bundle each time: about
30 ms of CPU, for an http:// URL as much as for https (a `datagen run` made eleven). A probe repeated
every fraction of a second while a server starts then cost more than the probe itself, taken from the
server it waits for on a small host. The inference client keeps its own (one per run). Decision 112.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx

__all__ = ["client", "tls"]


@functools.cache
def tls() -> ssl.SSLContext:
    """This process's verifying TLS context (httpx's defaults: certifi's CA bundle, SSL_CERT_FILE and
    SSL_CERT_DIR from the environment)."""
    return httpx.create_ssl_context()


def client(**kwargs: Any) -> httpx.Client:
    """``httpx.Client(**kwargs)`` on the shared TLS context: close it (``with``) after use."""
    return httpx.Client(verify=tls(), **kwargs)
