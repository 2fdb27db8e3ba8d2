"""The emulator's prefix cache: a radix tree of prompt tokens with reference counts and LRU eviction.

As in SGLang's RadixCache: a request matches its longest cached prefix when it is admitted to a
prefill batch, its prompt is inserted once its prefill is done and stays locked while it runs, and
unlocked leaves are evicted least recently used first when the pool needs room. Tokens are whatever
hashable items the engine uses (the toy tokenizer's strings, or input ids).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

__all__ = ["Node", "RadixCache"]

Key = tuple[Hashable, ...]


class Node:
    """A tree node: the edge ``key`` from its parent, children by first token."""

    __slots__ = ("key", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: Key, parent: Node | None, now: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.lock_ref = 0
        self.last_access = now


def _shared(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Cached token prefixes, ``size`` tokens in all.

    Args:
        enabled: False models ``--disable-radix-cache``: nothing matches, nothing is kept.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._clock = itertools.count(1)
        self.root = Node((), None, 0)
        self.root.lock_ref = 1  # never evicted
        self.size = 0

    def clear(self) -> None:
        """Drop every cached prefix (``/flush_cache``, which SGLang performs only when idle)."""
        self.root = Node((), None, 0)
        self.root.lock_ref = 1
        self.size = 0

    def match(self, tokens: Sequence[Hashable]) -> int:
        """Tokens of ``tokens`` already cached as a prefix; the path is marked used."""
        if not self.enabled:
            return 0
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _shared(child.key, tokens[pos:pos + len(child.key)])
            child.last_access = now
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[Hashable]) -> Node:
        """Cache ``tokens`` and lock the path (``unlock`` it when the request finishes); the node
        returned stands for the whole prompt."""
        if not self.enabled:
            return self.root
        now = next(self._clock)
        node, pos = self.root, 0
        key = tuple(tokens)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = Node(key[pos:], node, now)
                node.children[key[pos]] = leaf
                self.size += len(leaf.key)
                node = leaf
                break
            n = _shared(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n, now)
            child.last_access = now
            node, pos = child, pos + n
        self._lock(node, +1)
        return node

    def unlock(self, node: Node) -> None:
        """Release a finished request's prompt: its nodes may be evicted once no request holds them."""
        if self.enabled:
            self._lock(node, -1)

    def evict(self, over: int, slack: int = 0) -> int:
        """Evict unlocked leaves, least recently used first, until ``over`` tokens (plus ``slack``,
        so that a pool under pressure does not search the tree for every request) are freed or
        nothing more can go; returns the tokens evicted."""
        if over <= 0 or not self.enabled:
            return 0
        goal = over + slack
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < goal:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            freed += len(node.key)
            self.size -= len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    # ------------------------------------------------------------------ internals
    def _split(self, child: Node, n: int, now: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:n], parent, now)
        upper.lock_ref = child.lock_ref
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _lock(self, node: Node, delta: int) -> None:
        cur: Node | None = node
        while cur is not None and cur is not self.root:
            cur.lock_ref += delta
            cur = cur.parent

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
