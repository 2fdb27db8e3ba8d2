"""The generation budget: fitting ``max_new_tokens`` into the model's context, and regenerating rows
that finished by length with a larger one.

SGLang refuses (HTTP 400) a request whose prompt plus ``max_new_tokens`` exceeds the context length,
and names the three numbers in its message; ``ContextOverflow.parse`` reads them so the client can
resend with the budget that fits. ``TruncationPolicy`` says how often and how much larger a
truncated row is generated again. Nothing here does I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import orjson

__all__ = ["SCHEDULER_RESERVE", "ContextOverflow", "TruncationPolicy", "capped_sampling"]

# SGLang's scheduler bounds a request's budget silently, after the tokenizer manager accepted it:
# ``max_new_tokens <= max_req_len - input_len - 1`` with ``max_req_len = context_len - 1`` (0.5.23,
# managers/scheduler.py and tp_worker.py). So near the context it generates 2 tokens fewer than the
# ``context - prompt`` the 400 message allows; a budget sized with this reserve is one it honours.
SCHEDULER_RESERVE = 2

# SGLang's tokenizer manager (0.5.x), when the prompt fits but prompt + max_new_tokens does not. Proxies
# in front of it have been seen to print the counts as floats ("524288.0"): accepted.
_N = r"(\d+)(?:\.0+)?"
_OVERFLOW = re.compile(
    rf"maximum context length of {_N} tokens\. You requested a total of {_N} tokens: {_N} tokens from "
    rf"the input messages and {_N} tokens for the completion"
)


@dataclass(frozen=True)
class ContextOverflow:
    """The numbers of SGLang's "Requested token count exceeds the model's maximum context length"."""

    context_length: int
    total_tokens: int
    input_tokens: int  # the prompt, plus any tokens the server reserves per request (speculative drafts)
    max_new_tokens: int

    @classmethod
    def parse(cls, message: str) -> ContextOverflow | None:
        """The numbers of an over-budget message; None for any other message."""
        m = _OVERFLOW.search(message)
        if m is None:
            return None
        context, total, given, new = (int(g) for g in m.groups())
        return cls(context, total, given, new)

    @property
    def room(self) -> int:
        """The largest ``max_new_tokens`` the server accepts for this prompt (>= 1: a prompt that
        leaves no room is refused by another message)."""
        return self.context_length - self.input_tokens

    @property
    def generable(self) -> int:
        """The largest budget the server also generates in full: ``room`` less SGLang's scheduler
        reserve (``SCHEDULER_RESERVE``), at least 1."""
        return max(1, self.room - SCHEDULER_RESERVE)


def capped_sampling(sampling: dict[str, Any], budget: int) -> dict[str, Any]:
    """``sampling`` with ``max_new_tokens`` set to ``budget``; ``min_new_tokens`` is lowered to it
    too, since SGLang refuses a minimum above the maximum."""
    out = {**sampling, "max_new_tokens": budget}
    low = out.get("min_new_tokens")
    if isinstance(low, int) and low > budget:
        out["min_new_tokens"] = budget
    return out


@dataclass(frozen=True)
class TruncationPolicy:
    """How rows that finish by length (``finish_reason`` "length") are generated again.

    Args:
        retries: regenerations per row at most (0: a truncated row is stored as it is).
        factor: each regeneration's budget is the previous one times this (> 1), rounded up.
        max_new_tokens: the budget never exceeds this (None: only the model's context bounds it).

    Raises:
        ValueError: a value out of range (on construction).
    """

    retries: int = 0
    factor: float = 2.0
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        if isinstance(self.factor, bool) or not isinstance(self.factor, int | float) or not (
                math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(f"factor must be a number above 1, got {self.factor!r}")
        limit = self.max_new_tokens
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {limit!r}")

    @property
    def enabled(self) -> bool:
        return self.retries > 0

    def next_budget(self, budget: int, prompt_tokens: int, context_length: int | None) -> int | None:
        """The budget of the next generation of a row that used ``budget`` and finished by length;
        None when no larger budget is allowed (the limit, or the context, is reached).

        Args:
            budget: the ``max_new_tokens`` of the generation that was cut.
            prompt_tokens: the row's prompt tokens.
            context_length: the model's context length (None: unknown; the server caps the budget).
        """
        nxt = math.ceil(budget * self.factor)
        if self.max_new_tokens is not None:
            nxt = min(nxt, self.max_new_tokens)
        if context_length is not None:
            nxt = min(nxt, context_length - prompt_tokens - SCHEDULER_RESERVE)
        return nxt if nxt > budget else None

    def to_json(self) -> str | None:
        """The rows' ``truncation_policy`` column: sorted-key JSON, None when disabled."""
        if not self.enabled:
            return None
        return orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS).decode()
