"""tasks/http.py: datagen's own HTTP clients share one TLS context per process."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tasks import http


@pytest.fixture
def health_url() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


def test_probes_load_the_ca_bundle_once(monkeypatch: pytest.MonkeyPatch, health_url: str) -> None:
    loads: list[object] = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    http.tls.cache_clear()
    try:
        for trust_env in (True, False, True):
            with http.client(timeout=5, trust_env=trust_env) as c:
                assert c.get(health_url).status_code == 200
        assert len(loads) == 1  # httpx alone loads it for every client: three here
        assert http.tls().verify_mode == ssl.CERT_REQUIRED and http.tls().check_hostname
    finally:
        http.tls.cache_clear()
