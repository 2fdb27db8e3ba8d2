"""Value checks for partition configs: each names the file (or "override") and the key it rejects.

Shared by the TOML loader (tasks.config._load) and command-line overrides (tasks.config._model). Each
check takes the value, ``f`` (the file, or "override") and the key; it returns the value with its
checked type and raises ``ConfigError`` ("<f>: <key>: <what is wrong>") otherwise.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.errors import DatagenError
from tasks.prompts import REGENERATE_MODES, check_input
from tasks.reasoning import PARSERS
from tasks.targets import TargetError, parse_target

__all__ = [
    "ConfigError",
    "check_target",
    "fraction",
    "input_file",
    "no_unknown",
    "nonneg_float",
    "nonneg_int",
    "opt_pos_int",
    "opt_str",
    "parser_name",
    "positive_int",
    "resolve_path",
    "table",
    "writable_dir",
]


class ConfigError(DatagenError, ValueError):
    """A partition config (or an override) is missing, unreadable or invalid; the message names
    the file and the key."""


def check_target(raw: str, f: str) -> None:
    """A target string tasks.targets accepts (local, ssh://…, pct://…)."""
    try:
        parse_target(raw)
    except TargetError as exc:
        raise ConfigError(f"{f}: server.targets: {exc}") from exc


def parser_name(value: Any, f: str, key: str) -> str:
    """A reasoning parser name SGLang knows (tasks.reasoning.PARSERS)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{f}: {key}: must be a parser name")
    if value not in PARSERS:
        known = ", ".join(sorted(PARSERS))
        raise ConfigError(f"{f}: {key}: unknown reasoning parser {value!r} (known: {known})")
    return value


def table(data: dict[str, Any], key: str, f: str) -> dict[str, Any]:
    """The TOML table ``[key]`` of ``data`` ({} when absent)."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{f}: [{key}]: must be a table")
    return value


def no_unknown(table: dict[str, Any], allowed: set[str], f: str, prefix: str) -> None:
    """Reject the first key of ``table`` not in ``allowed`` (a typo must not be ignored)."""
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{f}: {prefix}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})"
        )


def resolve_path(value: str, base: Path) -> Path:
    """An absolute path: ``$VARS`` and ``~`` expanded, relative paths taken from ``base``."""
    p = Path(os.path.expandvars(value)).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def positive_int(value: Any, f: str, key: str) -> int:
    """An int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{f}: {key}: {value!r} is not a positive integer")
    return value


MAX_SAMPLES = 1024  # rows per prompt: more is a typo (1e9), not rejection sampling
MAX_SHARD_SIZE = 1_000_000  # rows per shard: one shard's rows are held until it commits


def int_from(lo: int, hi: int) -> Callable[[Any, str, str], int]:
    """A check for an int from ``lo`` (1 or 0) to ``hi`` (bools refused)."""
    def check(value: Any, f: str, key: str) -> int:
        n = positive_int(value, f, key) if lo >= 1 else nonneg_int(value, f, key)
        if n > hi:
            raise ConfigError(f"{f}: {key}: {n!r} is over the limit of {hi:,}")
        return n

    return check


def regenerate_mode(value: Any, f: str, key: str) -> str:
    """One of ``tasks.prompts.REGENERATE_MODES``."""
    if value not in REGENERATE_MODES:
        raise ConfigError(f"{f}: {key}: {value!r} is not one of {', '.join(map(repr, REGENERATE_MODES))} "
                          "(the last assistant turn, or every assistant turn of the conversation)")
    return str(value)


def nonneg_int(value: Any, f: str, key: str) -> int:
    """An int >= 0 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a non-negative integer")
    return value


def opt_pos_int(value: Any, f: str, key: str) -> int | None:
    """None, or an int >= 1."""
    return None if value is None else positive_int(value, f, key)


def nonneg_float(value: Any, f: str, key: str) -> float:
    """A finite number >= 0, as float (TOML's ``nan`` and ``inf`` refused: a grace period or a
    timeout of either would never end or never start)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a finite non-negative number")
    return float(value)


def fraction(value: Any, f: str, key: str) -> float:
    """A number strictly between 0 and 1, as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a fraction between 0 and 1")
    return float(value)


def share(value: Any, f: str, key: str) -> float:
    """A number from 0 to 1, as float (0: the feature it bounds is off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{f}: {key}: {value!r} is not a share between 0 and 1 (0 turns it off)")
    return float(value)


def opt_str(value: Any, f: str, key: str) -> str | None:
    """None, or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{f}: {key}: must be a non-empty string")
    return value


def input_file(path: Path, f: str, key: str) -> Path:
    """A dataset file that exists and can be read as one (``tasks.prompts.check_input``); ``key``
    names it in the message (with its path where the key does not show it)."""
    if not path.exists():
        raise ConfigError(f"{f}: {key}: no such file")
    try:
        check_input(path)
    except ValueError as exc:
        raise ConfigError(f"{f}: {key}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{f}: {key}: cannot be read: {exc.strerror or exc}") from exc
    return path


def writable_dir(path: Path, f: str, key: str) -> Path:
    """A directory datagen can create and write: ``path`` itself when it exists, else its nearest
    existing ancestor, must be a directory in which a directory can be made (tried, then removed:
    permissions alone do not tell a read-only file system or root's limits)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{f}: {key}: {path}: {probe} is not a directory; choose another output directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".datagen-write-test-", dir=probe))
    except OSError as exc:
        raise ConfigError(f"{f}: {key}: {path}: cannot write in {probe} ({exc.strerror or exc}); "
                          "choose another output directory") from exc
    return path
