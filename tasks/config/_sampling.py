"""``[sampling]``: the sampling parameters sent with every /generate request, checked at load.

The keys and their ranges are those of SGLang's ``SamplingParams`` (its API fields, with the bounds
its ``verify`` enforces), so a typo or a value the server would answer 400 to is a configuration
error naming the file and the key, found before any GPU is touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from tasks.config._checks import ConfigError

__all__ = ["SAMPLING_KEYS", "check_sampling"]

_MAX_STOPS = 32  # SGLang's limit on stop strings and on stop_regex patterns
_MAX_STOP_REGEX_BYTES = 256
_INT64 = (-(2**63), 2**63 - 1)
# Names people carry over from other APIs, and the SGLang name they mean.
_RENAMED = {"seed": "sampling_seed", "max_tokens": "max_new_tokens", "stop_sequences": "stop"}


def _number(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return "is not a number"
        if v < lo or (lo_open and v == lo) or v > hi:
            left = "(" if lo_open else "["
            return f"is out of range {left}{lo:g}, {hi:g}]"
        return None

    return check


def _integer(lo: int, hi: int = _INT64[1]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return "is not an integer"
        if not lo <= v <= hi:
            return f"must be at least {lo}" if hi == _INT64[1] else f"is out of range [{lo}, {hi}]"
        return None

    return check


def _top_k(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int):
        return "is not an integer"
    return None if v == -1 or v >= 1 else "must be -1 (the whole vocabulary) or at least 1"


def _one(v: Any) -> str | None:
    # Samples are separate requests, each with its own seed and row ([run] samples).
    return None if v == 1 and not isinstance(v, bool) else "must be 1 (for several samples per prompt set run.samples)"


def _flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def _stops(v: Any) -> str | None:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        return "must be a non-empty string or a list of them"
    return f"has more than {_MAX_STOPS} entries" if len(items) > _MAX_STOPS else None


def _stop_regex(v: Any) -> str | None:
    bad = _stops(v)
    if bad:
        return bad
    for pattern in [v] if isinstance(v, str) else v:
        if len(pattern.encode()) > _MAX_STOP_REGEX_BYTES:
            return f"pattern {pattern[:40]!r} is over {_MAX_STOP_REGEX_BYTES} bytes"
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"pattern {pattern!r} is not a regular expression: {exc}"
    return None


def _token_ids(v: Any) -> str | None:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        return "must be a list of token ids (integers >= 0)"
    return None


def _logit_bias(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be a table of token id = bias"
    for token, bias in v.items():
        if not token.isdigit():
            return f"key {token!r} is not a token id"
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            return f"bias of token {token} is not a number"
    return None


def _table(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be a table"


# SGLang's SamplingParams API fields -> the check of a value.
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "max_new_tokens": _integer(0),
    "min_new_tokens": _integer(0),
    "stop": _stops,
    "stop_token_ids": _token_ids,
    "stop_regex": _stop_regex,
    "temperature": _number(0.0, math.inf),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "top_k": _top_k,
    "min_p": _number(0.0, 1.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "presence_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(0.0, 2.0, lo_open=True),
    "n": _one,
    "beam_width": _integer(1),
    "json_schema": _text,
    "regex": _text,
    "ebnf": _text,
    "structural_tag": _text,
    "ignore_eos": _flag,
    "skip_special_tokens": _flag,
    "spaces_between_special_tokens": _flag,
    "no_stop_trim": _flag,
    "stream_interval": _integer(1),
    "logit_bias": _logit_bias,
    "sampling_seed": _integer(*_INT64),
    "custom_params": _table,
    "watermark": _table,
}
SAMPLING_KEYS = frozenset(_CHECKS)
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def check_sampling(values: dict[str, Any], f: str) -> dict[str, Any]:
    """The ``[sampling]`` table, checked against SGLang's sampling parameters.

    Args:
        values: the table as read from the file.
        f: the file, for the message.

    Raises:
        ConfigError: an unknown key (a known misnomer names the SGLang key), a value of the wrong
            type or out of SGLang's range, ``min_new_tokens`` above ``max_new_tokens``, or more
            than one grammar constraint.
    """
    for key, value in values.items():
        check = _CHECKS.get(key)
        if check is None:
            hint = (f"SGLang calls it {_RENAMED[key]}" if key in _RENAMED
                    else f"SGLang's sampling parameters: {', '.join(sorted(SAMPLING_KEYS))}")
            raise ConfigError(f"{f}: sampling.{key}: unknown key ({hint})")
        why = check(value)
        if why:
            raise ConfigError(f"{f}: sampling.{key}: {value!r} {why}")
    lo, hi = values.get("min_new_tokens", 0), values.get("max_new_tokens")
    if hi is not None and lo > hi:
        raise ConfigError(f"{f}: sampling.min_new_tokens: {lo} is above sampling.max_new_tokens ({hi})")
    grammars = [g for g in _GRAMMARS if g in values]
    if len(grammars) > 1:
        raise ConfigError(f"{f}: sampling.{grammars[1]}: only one of {', '.join(_GRAMMARS)} may be set "
                          f"(also set: {grammars[0]})")
    return dict(values)
