"""The throughput model: batch slots, FIFO admission as prefill batches, one decode step per running batch.

Requests that arrive in the same event-loop tick share a prefill batch even at zero latency, so the
activation memory model applies either way (docs/emulator.md, "Throughput model"). A radix cache
(emulator/radix.py) serves prompt prefixes: a request admitted to a prefill batch matches its longest
cached prefix, which costs no prefill time, activation memory or chunked-prefill budget, and is
reported as ``cached_tokens``; prompts stay cached while the KV pool has room.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from emulator.logs import log
from emulator.radix import Node, RadixCache
from emulator.textgen import Output

__all__ = ["Engine", "EngineConfig", "Req", "QueueFull"]


class QueueFull(Exception):
    """``--max-queued-requests`` waiting requests already: SGLang answers 503."""


@dataclass
class Req:
    """One generation in the engine."""

    rid: str
    prompt_tokens: int
    output: Output
    created: float
    key: tuple[object, ...] = ()  # the prompt's tokens, for the prefix cache
    cached: int = 0  # prompt tokens served by the prefix cache
    node: Node | None = field(default=None, repr=False)
    generated: int = 0
    finished_at: float | None = None
    done: asyncio.Future[None] | None = None
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return self.output.completion_tokens

    def notify(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int
    chunked_prefill_size: int
    max_queued_requests: int | None
    prefill_us_per_token: float
    decode_ms_per_step: float
    headroom_mib: float
    activation_mib_per_token: float
    total_gib: float
    held_gib: float
    kv_tokens: int
    decode_log_interval: int = 40
    radix_cache: bool = True  # False: --disable-radix-cache


class Engine:
    """Owns the queue, the running batch and the counters /metrics reports."""

    def __init__(self, cfg: EngineConfig, on_oom: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.on_oom = on_oom
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.halted = False  # crashed or hung: nothing advances any more
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.cache = RadixCache(enabled=cfg.radix_cache)
        # prefilled prompts not yet in the tree: SGLang's overlap scheduler processes a batch's result
        # (and inserts its prompts) only after it has scheduled the next batch (_insert_prefilled)
        self._prefilled: list[Req] = []
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.busy_slot_seconds = 0.0
        self._busy_mark = time.monotonic()
        self.last_gen_throughput = 0.0
        self._tp_window: collections.deque[tuple[float, int]] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._scheduled = False
        self._task: asyncio.Task[None] | None = None
        self.instant = cfg.prefill_us_per_token <= 0 and cfg.decode_ms_per_step <= 0
        self._steps = 0

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        self._wake = asyncio.Event()
        if not self.instant:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def submit(self, reqs: list[Req]) -> None:
        """Queue ``reqs``, all or none.

        Raises:
            QueueFull: more than ``max_queued_requests`` would be waiting.
        """
        limit = self.cfg.max_queued_requests
        if limit is not None and len(self.waiting) + len(reqs) > limit:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        for r in reqs:
            r.done = loop.create_future()
        self.waiting.extend(reqs)
        if self.instant:
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._instant_tick)
        elif self._wake is not None:
            self._wake.set()

    def token_usage(self) -> float:
        used = sum(r.prompt_tokens + r.generated for r in self.running)
        return used / self.cfg.kv_tokens if self.cfg.kv_tokens else 0.0

    def busy_seconds(self) -> float:
        self._account()
        return self.busy_slot_seconds

    # ------------------------------------------------------------------ internals
    def _account(self) -> None:
        now = time.monotonic()
        self.busy_slot_seconds += len(self.running) * (now - self._busy_mark)
        self._busy_mark = now

    def _record_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generation_tokens_total += n
        win = self._tp_window
        win.append((now, n))
        while win and now - win[0][0] > 5.0:
            win.popleft()
        span = now - win[0][0] if len(win) > 1 else 0.0
        if span > 0:
            self.last_gen_throughput = sum(x for _, x in win) / span

    def _take_batch(self) -> list[Req]:
        """Admit a prefill batch from the queue (slots and chunked prefill size permitting)."""
        batch: list[Req] = []
        tokens = 0
        free = self.cfg.max_running_requests - len(self.running)
        while self.waiting and len(batch) < free:
            nxt = self.waiting[0]
            # SGLang matches at scheduling time and always computes the last prompt token itself.
            nxt.cached = min(self.cache.match(nxt.key), max(0, nxt.prompt_tokens - 1))
            new = nxt.prompt_tokens - nxt.cached
            if batch and tokens + new > self.cfg.chunked_prefill_size:
                break
            batch.append(self.waiting.popleft())
            tokens += new
            if tokens >= self.cfg.chunked_prefill_size:
                break
        return batch

    def _cache_prompts(self, batch: list[Req]) -> None:
        """After a prefill: the batch's prompts are counted, and join the cache once the next batch
        has been scheduled (``_insert_prefilled``)."""
        for r in batch:
            self.prompt_tokens_total += r.prompt_tokens
            self.cached_tokens_total += r.cached
        self._prefilled.extend(batch)

    def flush_cache(self) -> None:
        """``/flush_cache`` on an idle engine: the radix tree is emptied (nothing runs, nothing is locked)."""
        self._insert_prefilled()
        self.cache.clear()

    def _insert_prefilled(self) -> None:
        """The prompts of the last prefill join the cache, locked while they run; unlocked prompts
        are evicted (LRU) while the cache and the running requests' outputs overflow the pool.

        Called after the next batch was scheduled, as SGLang 0.5.23's overlap scheduler
        (``event_loop_overlap``: ``get_next_batch_to_run``, then ``process_batch_result`` of the
        previous batch, which inserts into the radix tree): a request scheduled right after a prefill
        does not match that prefill's prompts, so rows sent together share nothing.
        """
        batch, self._prefilled = self._prefilled, []
        for r in batch:
            node = self.cache.insert(r.key)
            if r.finished_at is None:
                r.node = node
            else:  # finished before its result was processed: cached, but held by nobody
                self.cache.unlock(node)
        if not batch:
            return
        over = self.cache.size + sum(r.generated for r in self.running) - self.cfg.kv_tokens
        if over > 0:
            self.cache.evict(over, slack=self.cfg.kv_tokens // 32)

    def _prefill_fits(self, batch: list[Req]) -> bool:
        """Check the batch's activation memory against the headroom; crash the server if not."""
        # a chunked prefill never processes more than chunked_prefill_size tokens at once
        tokens = min(sum(r.prompt_tokens - r.cached for r in batch), self.cfg.chunked_prefill_size)
        need_mib = tokens * self.cfg.activation_mib_per_token
        if need_mib <= self.cfg.headroom_mib:
            return True
        self.halted = True
        self.on_oom(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{need_mib / 1024:.2f} GiB. GPU 0 has a total capacity of {self.cfg.total_gib:.2f} GiB of which "
            f"{self.cfg.headroom_mib:.2f} MiB is free. Including non-PyTorch memory, this process has "
            f"{self.cfg.held_gib:.2f} GiB memory in use. Of the allocated memory "
            f"{self.cfg.held_gib - 0.5:.2f} GiB is allocated by PyTorch, and 512.00 MiB is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
            "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
        return False

    def _log_prefill(self, batch: list[Req]) -> None:
        log(
            f"Prefill batch. #new-seq: {len(batch)}, #new-token: {sum(r.prompt_tokens - r.cached for r in batch)}, "
            f"#cached-token: {sum(r.cached for r in batch)}, token usage: {self.token_usage():.2f}, #running-req: {len(self.running)}, "
            f"#queue-req: {len(self.waiting)}, ",
            tp=0,
        )

    def _finish(self, r: Req, now: float) -> None:
        r.finished_at = now
        self.requests_total += 1
        if r.node is not None:
            self.cache.unlock(r.node)
            r.node = None
        if r.done is not None and not r.done.done():
            r.done.set_result(None)
        r.notify()

    def _instant_tick(self) -> None:
        self._scheduled = False
        while self.waiting and not self.halted:
            batch = self._take_batch()
            self._insert_prefilled()
            if not batch:
                break
            self._log_prefill(batch)
            if not self._prefill_fits(batch):
                return
            now = time.monotonic()
            gen = 0
            self._cache_prompts(batch)
            for r in batch:
                r.generated = r.total
                gen += r.total
                self._finish(r, now)
            self._record_tokens(gen)
        self._insert_prefilled()  # idle again: the last result is processed

    async def _loop(self) -> None:
        assert self._wake is not None
        cfg = self.cfg
        while True:
            if self.halted:
                return
            if not self.running and not self.waiting:
                self._insert_prefilled()  # an idle scheduler processes its last result
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take_batch() if self.waiting else []
            self._insert_prefilled()
            if batch:
                self._log_prefill(batch)
                if not self._prefill_fits(batch):
                    return
                tokens = sum(r.prompt_tokens - r.cached for r in batch)  # cached prefixes cost nothing
                self._account()
                self.running.extend(batch)
                if cfg.prefill_us_per_token > 0:
                    await asyncio.sleep(tokens * cfg.prefill_us_per_token / 1e6)
                if self.halted:
                    return
                self._cache_prompts(batch)
                now = time.monotonic()
                first = 0
                for r in batch:
                    if r.total > 0:
                        r.generated = 1
                        first += 1
                    r.notify()
                self._record_tokens(first)
                self._retire(now)
                continue
            if cfg.decode_ms_per_step > 0:
                await asyncio.sleep(cfg.decode_ms_per_step / 1000.0)
            if self.halted:
                return
            for r in self.running:
                r.generated += 1
                r.notify()
            self._record_tokens(len(self.running))
            self._steps += 1
            if self._steps % cfg.decode_log_interval == 0:
                log(
                    f"Decode batch. #running-req: {len(self.running)}, "
                    f"#token: {sum(r.prompt_tokens + r.generated for r in self.running)}, "
                    f"token usage: {self.token_usage():.2f}, cuda graph: True, "
                    f"gen throughput (token/s): {self.last_gen_throughput:.2f}, #queue-req: {len(self.waiting)}, ",
                    tp=0,
                )
            self._retire(time.monotonic())

    def _retire(self, now: float) -> None:
        if not any(r.generated >= r.total for r in self.running):
            return
        self._account()
        keep = []
        for r in self.running:
            if r.generated >= r.total:
                self._finish(r, now)
            else:
                keep.append(r)
        self.running = keep
