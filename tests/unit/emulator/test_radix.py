"""The emulator's radix cache and how the engine reports and charges cached prompt tokens."""

from __future__ import annotations

import asyncio

from emulator.engine import Engine, EngineConfig, Req
from emulator.radix import RadixCache
from emulator.textgen import Output


def toks(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def test_match_insert_split_and_lock() -> None:
    c = RadixCache()
    assert c.match(toks("sys a b q1")) == 0
    n1 = c.insert(toks("sys a b q1"))
    assert c.size == 4 and c.match(toks("sys a b q2")) == 3 and c.match(toks("sys a")) == 2
    n2 = c.insert(toks("sys a b q2"))  # splits the edge after "b"
    assert c.size == 5 and c.match(toks("sys a b q2 more")) == 4
    # both prompts are locked while their requests run: nothing can be evicted
    assert c.evict(5) == 0 and c.size == 5
    c.unlock(n1)
    assert c.evict(1) == 1 and c.size == 4  # the unlocked leaf "q1" only
    assert c.match(toks("sys a b q1")) == 3
    c.unlock(n2)
    assert c.evict(10) == 4 and c.size == 0 and c.match(toks("sys a b q2")) == 0


def test_eviction_is_least_recently_used_first() -> None:
    c = RadixCache()
    for p in ("a x", "b x", "c x"):
        c.unlock(c.insert(toks(p)))
    c.match(toks("a x"))  # a is now the most recently used
    assert c.evict(2) == 2
    assert (c.match(toks("a x")), c.match(toks("b x")), c.match(toks("c x"))) == (2, 0, 2)


def test_disabled_cache_matches_nothing() -> None:
    c = RadixCache(enabled=False)
    c.unlock(c.insert(toks("sys a")))
    assert (c.match(toks("sys a")), c.size) == (0, 0)


def _engine(kv_tokens: int = 10_000, radix: bool = True) -> Engine:
    cfg = EngineConfig(max_running_requests=8, chunked_prefill_size=8192, max_queued_requests=None,
                       prefill_us_per_token=0, decode_ms_per_step=0, headroom_mib=1e9,
                       activation_mib_per_token=0.0, total_gib=80, held_gib=70, kv_tokens=kv_tokens,
                       radix_cache=radix)
    return Engine(cfg, on_oom=lambda msg: None)


def _req(rid: str, prompt: str) -> Req:
    key = toks(prompt)
    return Req(rid=rid, prompt_tokens=len(key), output=Output([], {"type": "stop"}), created=0.0, key=key)


def _serve(engine: Engine, batches: list[list[Req]]) -> None:
    async def go() -> None:
        engine.start()
        for batch in batches:  # one batch per tick: each is a prefill batch of its own
            engine.submit(batch)
            await asyncio.gather(*[r.done for r in batch if r.done is not None])

    asyncio.run(go())


def test_engine_reports_cached_tokens_per_request_and_in_total() -> None:
    e = _engine()
    first = [_req("a", "s1 s2 s3 s4 u1"), _req("b", "s1 s2 s3 s4 u2")]  # one batch: no sharing
    second = [_req("c", "s1 s2 s3 s4 u3"), _req("d", "s1 s2 s3 s4 u1")]
    _serve(e, [first, second])
    # the same batch shares nothing; later ones hit the prefix, an identical prompt all but its last token
    assert [r.cached for r in first + second] == [0, 0, 4, 4]
    assert (e.prompt_tokens_total, e.cached_tokens_total) == (20, 8)


def test_engine_evicts_when_the_pool_is_full_and_without_radix_cache_reports_none() -> None:
    e = _engine(kv_tokens=6)
    _serve(e, [[_req("a", "p1 p2 p3 p4 p5")], [_req("b", "q1 q2 q3 q4 q5")], [_req("c", "p1 p2 p3 p4 x")]])
    assert e.cached_tokens_total == 0 and e.cache.size <= 6  # "p..." was evicted to make room for "q..."
    off = _engine(radix=False)
    _serve(off, [[_req("a", "s1 s2 u1")], [_req("b", "s1 s2 u1")]])
    assert off.cached_tokens_total == 0
