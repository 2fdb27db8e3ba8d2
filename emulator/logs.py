"""SGLang-style log lines, written whole with one ``write`` to stderr so processes never interleave."""

from __future__ import annotations

import os
import time

__all__ = ["log", "raw"]


def log(message: str, tp: int | None = None) -> None:
    """``[YYYY-mm-dd HH:MM:SS TP<tp>] message`` (no TP tag for the main process)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    prefix = f"[{stamp} TP{tp}] " if tp is not None else f"[{stamp}] "
    raw(prefix + message)


def raw(line: str) -> None:
    """Write ``line`` plus a newline to stderr in one system call."""
    data = (line + "\n").encode("utf-8", "replace")
    try:
        os.write(2, data)
    except OSError:
        pass
