"""Cache-aware send order: rows of a window that share a long prompt prefix are sent one after another.

SGLang's radix cache reuses a prefix only while it is resident, and it is evicted (LRU) once the
running requests need the memory; with a client that bounds the requests in flight, the order of
the sends decides whether rows sharing a system prompt meet it in the cache. ``prefix_order`` reorders
one window of rows: the prompts are sorted (rows sharing a prefix become neighbours, deeper shared
prefixes nested inside shallower ones), neighbours whose common prefix is ``min_shared`` characters
longer than what the whole window shares form a group, and the groups are sent in the input order of
their first row. A row that shares no such prefix keeps its place in input order, so an input without
shared prefixes is sent as it is. Pure and deterministic: the same window always gives the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_MIN_SHARED", "ORDERS", "prefix_order"]

ORDERS = ("prefix", "input")
# Characters of common prefix (beyond the window's own) that make two rows a group: about 64 tokens,
# below which the prefill saved is smaller than the reordering is worth.
DEFAULT_MIN_SHARED = 256


def _common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (a binary search over slice comparisons, which
    run in C: long prompts cost a few comparisons, not a Python loop over their characters)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefix_order(prompts: Sequence[str], min_shared: int = DEFAULT_MIN_SHARED) -> list[int]:
    """The send order of a window: a permutation of ``range(len(prompts))`` (module docstring).

    Args:
        prompts: the window's prompts, in input order.
        min_shared: characters of common prefix, beyond the prefix every prompt of the window shares
            (a chat template's header), that put two neighbouring prompts in one group.
    """
    n = len(prompts)
    if n < 2:
        return list(range(n))
    ranked = sorted(range(n), key=lambda i: (prompts[i], i))
    base = _common(prompts[ranked[0]], prompts[ranked[-1]])  # what every prompt shares (sorted ends)
    groups: list[list[int]] = [[ranked[0]]]
    for prev, cur in zip(ranked, ranked[1:], strict=False):
        if _common(prompts[prev], prompts[cur]) - base >= min_shared:
            groups[-1].append(cur)
        else:
            groups.append([cur])
    groups.sort(key=min)
    return [i for g in groups for i in g]
