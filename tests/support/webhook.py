"""A loopback webhook endpoint for the notification tests (a Prefect custom-webhook block posts to it)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Hook:
    """A loopback HTTP endpoint that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with hook.cond:
                    hook.bodies.append(json.loads(body or b"{}"))
                    hook.cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait(self, needle: str, timeout_s: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                hit = [b for b in self.bodies if needle in json.dumps(b)]
                if hit:
                    return hit[0]
                left = deadline - time.monotonic()
                assert left > 0, f"no notification mentioning {needle!r}; got {self.bodies}"
                self.cond.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def save_block(api_url: str, name: str, url: str) -> None:
    """A Prefect custom-webhook notification block ``name`` on the server at ``api_url`` that posts
    ``{"subject", "body"}`` to ``url`` (a :class:`Hook`)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock  # after the test set PREFECT_*
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        CustomWebhookNotificationBlock(
            name=name, url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"},
        ).save(name, overwrite=True)
