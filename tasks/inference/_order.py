"""Cache-aware send order: rows of a window that share a long prompt prefix are sent one after another,
and a group's later rows only once its first row's prefix can be in the cache.

SGLang's radix cache reuses a prefix only while it is resident, and it is evicted (LRU) once the
running requests need the memory; with a client that bounds the requests in flight, the order of
the sends decides whether rows sharing a system prompt meet it in the cache. ``prefix_groups`` groups
one window of rows: the prompts are sorted (rows sharing a prefix become neighbours, deeper shared
prefixes nested inside shallower ones), neighbours whose common prefix is ``min_shared`` characters
longer than what the whole window shares form a group, and the groups are sent in the input order of
their first row. A row that shares no such prefix keeps its place in input order, so an input without
shared prefixes is sent as it is. Pure and deterministic: the same window always gives the same order.

Sending a group at once is not enough: real SGLang matches a request's prefix when it schedules it and
inserts the prompt into the tree only after its prefill, so rows prefilled in one batch share nothing
(measured on SGLang 0.5.23: a whole group sent at once got half the hits of input order).
``SendQueue`` therefore holds a group's siblings until its leader (the first row) has answered, or
``HOLD_S`` after the leader was sent, whichever comes first; meanwhile workers take the next eligible
rows (other groups' leaders, rows of no group), so slots idle only when nothing else is queued. A
group whose prefix a leader already answered recently is not held again. Decision record:
docs/decisions/01-prefix-order-on-real-sglang.md.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_MIN_SHARED", "HOLD_S", "ORDERS", "Gate", "SendQueue", "prefix_groups", "prefix_order"]

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


def prefix_groups(prompts: Sequence[str], min_shared: int = DEFAULT_MIN_SHARED) -> list[tuple[list[int], int]]:
    """The window's groups in send order: ``(indices, shared)`` with ``shared`` the characters every
    prompt of the group has in common (a group of one: its whole prompt). See the module docstring.

    Args:
        prompts: the window's prompts, in input order.
        min_shared: characters of common prefix, beyond the prefix every prompt of the window shares
            (a chat template's header), that put two neighbouring prompts in one group.
    """
    n = len(prompts)
    if n < 2:
        return [([i], len(prompts[i])) for i in range(n)]
    ranked = sorted(range(n), key=lambda i: (prompts[i], i))
    base = _common(prompts[ranked[0]], prompts[ranked[-1]])  # what every prompt shares (sorted ends)
    groups: list[list[int]] = [[ranked[0]]]
    shared: list[int] = [len(prompts[ranked[0]])]
    for prev, cur in zip(ranked, ranked[1:], strict=False):
        common = _common(prompts[prev], prompts[cur])
        if common - base >= min_shared:
            groups[-1].append(cur)
            shared[-1] = min(shared[-1], common)
        else:
            groups.append([cur])
            shared.append(len(prompts[cur]))
    paired = sorted(zip(groups, shared, strict=True), key=lambda gs: min(gs[0]))
    return [(sorted(g), k) for g, k in paired]


def prefix_order(prompts: Sequence[str], min_shared: int = DEFAULT_MIN_SHARED) -> list[int]:
    """The send order of a window: a permutation of ``range(len(prompts))`` (module docstring)."""
    return [i for g, _ in prefix_groups(prompts, min_shared) for i in g]


# How long a group's siblings wait for their leader's answer at most: long enough for a prefill to
# finish on a loaded server, short against a generation (seconds to minutes), so a slot that has
# nothing else to send idles this long at most once per group.
HOLD_S = 1.0
_KNOWN_PREFIXES = 4096  # prefixes remembered as answered (LRU), so a later window does not hold them


class Gate:
    """Opened when a group's leader has answered (``open()``), or at ``deadline`` (loop time)."""

    __slots__ = ("deadline", "is_open", "key")

    def __init__(self, deadline: float, key: bytes) -> None:
        self.deadline = deadline
        self.is_open = False
        self.key = key


class _Held:
    """A group's siblings behind its gate."""

    __slots__ = ("gate", "items")

    def __init__(self, gate: Gate, items: list[Any]) -> None:
        self.gate = gate
        self.items = deque(items)


class SendQueue:
    """The workers' queue: rows in send order, where a group's siblings wait behind their leader's
    ``Gate`` while later rows that are not held go first. ``None`` (a worker's stop) is handed out
    only once nothing is queued before it. One event loop; ``put``/``put_window`` block while the
    queue holds ``maxsize`` rows or more.
    """

    def __init__(self, maxsize: int, hold_s: float = HOLD_S) -> None:
        self.maxsize = max(1, maxsize)
        self.hold_s = hold_s
        self._entries: deque[Any] = deque()  # items, None stops and _Held groups
        self._count = 0
        # one lock, two waits: getters wake one at a time (a put wakes one, each get passes the turn
        # on while rows remain), so a thousand workers are not all woken for every row
        lock = asyncio.Lock()
        self._readable = asyncio.Condition(lock)
        self._room = asyncio.Condition(lock)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self.held_groups = 0  # groups whose siblings were held (for the run's report and tests)

    async def put(self, item: Any) -> None:
        """Queue one row (or ``None``) as it is, behind everything queued."""
        async with self._room:
            await self._room.wait_for(lambda: self._count < self.maxsize)
            self._entries.append(item)
            self._count += 1
            self._readable.notify()

    async def put_window(self, items: Sequence[Any], prompts: Sequence[str]) -> None:
        """Queue a window of rows in ``prefix_groups`` order; each group of several rows sends its
        first row at once and holds the others behind a gate, unless its prefix was answered before.
        The leader of a held group carries its gate as ``item.gate`` (the worker opens it)."""
        groups = prefix_groups(prompts)
        loop = asyncio.get_running_loop()
        async with self._room:
            await self._room.wait_for(lambda: self._count == 0 or self._count + len(items) <= self.maxsize)
            for members, shared in groups:
                rows = [items[i] for i in members]
                if len(rows) == 1:
                    self._entries.append(rows[0])
                    continue
                key = hashlib.blake2b(prompts[members[0]][:shared].encode("utf-8", "surrogatepass"),
                                      digest_size=16).digest()
                if key in self._known:
                    self._known.move_to_end(key)
                    self._entries.extend(rows)  # answered before: likely cached, nothing to wait for
                    continue
                gate = Gate(loop.time() + self.hold_s, key)
                rows[0].gate = gate
                self._entries.append(rows[0])
                self._entries.append(_Held(gate, rows[1:]))
                self.held_groups += 1
            self._count += len(items)
            self._readable.notify(len(items))

    async def open(self, gate: Gate) -> None:
        """The leader behind ``gate`` answered: release its siblings and remember its prefix."""
        async with self._readable:
            gate.is_open = True
            self._known[gate.key] = None
            self._known.move_to_end(gate.key)
            while len(self._known) > _KNOWN_PREFIXES:
                self._known.popitem(last=False)
            self._readable.notify_all()  # rare (once per group): every waiter may now find a sibling

    async def get(self) -> Any:
        """The first row not held (a held group's next sibling once its gate is open or due)."""
        loop = asyncio.get_running_loop()
        async with self._readable:
            while True:
                found, wake = self._take(loop.time())
                if found is not _NOTHING:
                    self._count -= 1
                    self._room.notify_all()  # the reader, the only putter
                    if self._entries:
                        self._readable.notify()  # pass the turn on: a stop may now be first
                    return found
                if wake is None:
                    await self._readable.wait()
                    continue
                try:
                    await asyncio.wait_for(self._readable.wait(), timeout=max(0.0, wake - loop.time()))
                except TimeoutError:
                    pass

    def _take(self, now: float) -> tuple[Any, float | None]:
        """Remove and return the first eligible row, else (``_NOTHING``, the earliest gate deadline
        among the held groups, None when there is none)."""
        wake: float | None = None
        for k, entry in enumerate(self._entries):
            if isinstance(entry, _Held):
                gate = entry.gate
                if gate.is_open or now >= gate.deadline:
                    item = entry.items.popleft()
                    if not entry.items:
                        del self._entries[k]
                    return item, None
                wake = gate.deadline if wake is None else min(wake, gate.deadline)
                continue
            if entry is None and k > 0:
                break  # a stop waits for the rows queued before it
            del self._entries[k]
            return entry, None
        return _NOTHING, wake


_NOTHING = object()
