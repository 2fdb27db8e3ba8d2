"""Every spelling of a secret that a log, a report or an answer can hold, and text with them hidden.

SGLang prints its ``server_args`` as a Python repr, ``/server_info`` answers JSON, a URL carries a
key percent-encoded and a command line shell-quoted: redacting only the raw bytes would leave a key
with a backslash, a quote, a newline or a non-ASCII character readable in those forms.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MASK", "redact_text", "secret_forms"]

MASK = "***"


def secret_forms(key: str) -> list[str]:
    """Every spelling of ``key`` a log can hold, longest first: raw, as a Python ``repr`` or ``ascii``
    (SGLang prints ``server_args`` so), as JSON text (escaped and not), URL-quoted, shell-quoted.

    Runs in the server's interpreter too (the API-key bootstrap of tasks.server carries this very
    source): standard library only, imports local.
    """
    import json  # noqa: PLC0415 (the bootstrap carries this function alone)
    import shlex  # noqa: PLC0415
    import urllib.parse  # noqa: PLC0415

    forms = {key, repr(key)[1:-1], ascii(key)[1:-1], json.dumps(key)[1:-1],
             json.dumps(key, ensure_ascii=False)[1:-1], urllib.parse.quote(key, safe=""),
             urllib.parse.quote_plus(key, safe=""), shlex.quote(key)}
    return sorted((f for f in forms if f), key=lambda f: (-len(f), f))


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every spelling (``secret_forms``) of each of ``secrets`` replaced by ``***``."""
    forms = sorted({f for s in secrets if s for f in secret_forms(s)}, key=lambda f: (-len(f), f))
    for f in forms:
        text = text.replace(f, MASK)
    return text
