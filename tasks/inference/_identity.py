"""The fingerprint of a server datagen did not launch, from what the server reports about itself.

A shared server is known only by its URL, and its URL changes when it is restarted on another
port; what its answers depend on does not. ``external_fingerprint`` hashes the model and the
parallelism/precision settings from SGLang's ``/model_info`` and ``/server_info``, picked by name:
the port, pid, memory fraction, launch command and API key (which ``/server_info`` reports in
plain text) are never read into it, stored or logged.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import orjson

from tasks.http import client as http_client

__all__ = ["IDENTITY_KEYS", "external_fingerprint"]

# What the generated text depends on; the first endpoint that reports a key wins.
_MODEL_KEYS = ("model_path", "served_model_name", "tokenizer_path", "weight_version", "model_type",
               "architectures")
_SERVER_KEYS = ("model_path", "served_model_name", "tokenizer_path", "revision", "dtype", "quantization",
                "kv_cache_dtype", "context_length", "tp_size", "pp_size")
IDENTITY_KEYS = tuple(dict.fromkeys(_MODEL_KEYS + _SERVER_KEYS))


def external_fingerprint(url: str, api_key: str | None = None, *,
                         timeout_s: float = 30.0) -> tuple[str, dict[str, Any]]:
    """The rows' ``server`` column for the server at ``url``, and the facts it was made from.

    ``external:<hash>`` of the ``IDENTITY_KEYS`` the server reports; ``external:<url>`` (and no
    facts) when it answers neither ``/model_info`` nor ``/server_info`` (nor their older
    ``/get_*`` names).

    Args:
        url: the server's base URL.
        api_key: its ``--api-key`` (sent as a bearer token, never kept).
        timeout_s: per request.

    Raises:
        httpx.TransportError: the server cannot be reached.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    facts: dict[str, Any] = {}
    with http_client(base_url=url, headers=headers, timeout=timeout_s) as http:
        for paths, keys in ((("/model_info", "/get_model_info"), _MODEL_KEYS),
                            (("/server_info", "/get_server_info"), _SERVER_KEYS)):
            info = _first_json(http, paths)
            for key in keys:
                if info.get(key) is not None:
                    facts.setdefault(key, info[key])
    if not facts:
        return f"external:{url}", {}
    digest = hashlib.sha256(orjson.dumps(facts, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
    return f"external:{digest}", facts


def _first_json(http: httpx.Client, paths: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object the first of ``paths`` answers with 200, else an empty dict."""
    for path in paths:
        r = http.get(path)
        if r.status_code != 200:
            continue
        try:
            data = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            continue
        if isinstance(data, dict):
            return data
    return {}
