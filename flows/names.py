"""Flow run names that tell runs apart in the run list.

A name a person gave (``prefect deployment run --flow-run-name``, the custom-run form's name field)
is kept as given. A name Prefect generated (two words from its ``coolname`` vocabulary, e.g.
``mustard-seal``) becomes ``<partition>[-<output>]-<YYYY-MM-DD>-<HHMM>``: the partition, the output
directory's name when the run's ``out`` is set (and not named as the partition), and the
scheduled start in UTC, so that a nightly run's name is its night even when it starts late.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["is_generated", "run_name"]

_WORD = re.compile(r"[a-z]+")


@cache
def _slug_words() -> frozenset[str]:
    """Every word Prefect's generated names can be made of (coolname's word lists)."""
    words: set[str] = set()
    try:
        data = resources.files("coolname.data")
        for f in data.iterdir():
            if f.name.endswith(".txt"):
                for line in f.read_text(encoding="utf-8").splitlines():
                    if not line.lstrip().startswith("#") and "=" not in line:
                        words.update(_WORD.findall(line.lower()))
    except (ModuleNotFoundError, OSError):  # no coolname: every two-word name counts as generated
        return frozenset()
    return frozenset(words)


def is_generated(name: str | None) -> bool:
    """Whether ``name`` is one Prefect made up (no name, or ``adjective-animal``), not a person's."""
    if not name:
        return True
    parts = name.split("-")
    if len(parts) != 2 or not all(_WORD.fullmatch(p) for p in parts):
        return False
    words = _slug_words()
    return not words or all(p in words for p in parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-")[:40] or "out"


def run_name(current: str | None, parameters: dict[str, Any], when: datetime | None) -> str:
    """The run's name: ``current`` when a person gave it, else the module docstring's form."""
    if not is_generated(current):
        return str(current)
    partition = str(parameters.get("partition") or "all")
    if partition.endswith(".toml"):
        partition = Path(partition).stem
    out = Path(str(parameters.get("out") or "")).name
    where = f"-{_slug(out)}" if out and out != partition else ""
    stamp = (when or datetime.now(UTC)).astimezone(UTC)
    return f"{partition}{where}-{stamp:%Y-%m-%d-%H%M}"
