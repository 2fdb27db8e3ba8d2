"""Several servers behind one run (tasks.inference ServerPool/Dispatcher) against minimal /generate
servers on loopback: work spreads over every server, a server that dies costs only its requests in
flight (no answered row is asked again), a server that joins late gets rows, and a run with no
server left fails naming why each went."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.minimal import MinimalServer
from tasks.inference import (
    ClientConfig,
    DatasetSpec,
    Dispatcher,
    Endpoint,
    InferenceSettings,
    PrefixRoutes,
    ServerGone,
    ServerPool,
    run_dataset,
)
from tasks.inference._dispatch import _Slot
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import FAST_CLIENT, assert_exactly_once, rows_on_disk, write_input


class Servers:
    """Minimal servers on their own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.started: list[MinimalServer] = []

    def start(self, **kw: object) -> MinimalServer:
        srv = asyncio.run_coroutine_threadsafe(MinimalServer(**kw).start(), self.loop).result(10)  # type: ignore[arg-type]
        self.started.append(srv)
        return srv

    def kill(self, srv: MinimalServer) -> None:
        self.loop.call_soon_threadsafe(srv.die)

    def close(self) -> None:
        for srv in self.started:
            asyncio.run_coroutine_threadsafe(srv.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.close()


def _endpoint(srv: MinimalServer, fp: str = "fp") -> Endpoint:
    return Endpoint(srv.url, fp, alive=lambda: not srv.dead)


def _run(inp: Path, out: Path, pool: ServerPool, conc: int = 8, shard: int = 25):
    return run_dataset(DatasetSpec("ds", inp), out, pool,
                       InferenceSettings(shard_size=shard, concurrency=conc, client=FAST_CLIENT,
                                         sampling={"max_new_tokens": 16}, reasoning_parser=None,
                                         model_dir=DEMO_MODEL))


def _sent(servers: list[MinimalServer]) -> Counter[str]:
    total: Counter[str] = Counter()
    for s in servers:  # by row id: a rid is the row id and the run's tag (``id@tag``)
        total.update({rid.rpartition("@")[0] or rid: n for rid, n in s.requests.items()})
    return total


def test_rows_spread_over_every_server_exactly_once(servers: Servers, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 300)
    srvs = [servers.start(latency_ms=2, slots=4) for _ in range(3)]
    pool = ServerPool()
    for i, s in enumerate(srvs):
        pool.add(f"s{i}", _endpoint(s))
    result = _run(tmp_path / "in.jsonl", tmp_path / "out", pool, conc=4)
    assert result.complete and result.rows_generated == 300
    assert_exactly_once(tmp_path / "out", ids)
    assert set(_sent(srvs).values()) == {1} and sorted(_sent(srvs)) == sorted(ids)
    report = {r.server: r for r in pool.report()}
    assert all(report[f"s{i}"].rows == len(srvs[i].requests) > 0 for i in range(3))
    assert sum(r.rows for r in report.values()) == 300


def test_a_server_that_dies_costs_only_its_requests_in_flight(servers: Servers, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 400)
    a, b = servers.start(slots=4, latency_ms=1), servers.start(slots=4, latency_ms=1)
    dying = servers.start(die_after=60)  # answers at once: every request it counted was answered
    pool = ServerPool()
    pool.add("a", _endpoint(a))
    pool.add("b", _endpoint(b))
    pool.add("dying", _endpoint(dying), recoverable=False)
    _run(tmp_path / "in.jsonl", tmp_path / "out", pool)
    assert_exactly_once(tmp_path / "out", ids)
    sent = _sent([a, b, dying])
    assert sorted(sent) == sorted(ids) and set(sent.values()) == {1}  # no answered row sent twice
    assert sum(dying.requests.values()) == 60
    report = {r.server: r for r in pool.report()}
    assert report["dying"].state == "lost" and report["dying"].rows == 60
    assert "stopped answering" in (report["dying"].lost or "")
    assert report["a"].rows + report["b"].rows == 340


def test_a_server_that_joins_late_gets_rows(servers: Servers, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 300)
    first, late = servers.start(slots=2, latency_ms=5), servers.start(slots=8, latency_ms=1)
    pool = ServerPool()
    pool.expect("late")
    pool.add("first", _endpoint(first))
    threading.Timer(0.2, lambda: pool.add("late", _endpoint(late))).start()
    _run(tmp_path / "in.jsonl", tmp_path / "out", pool)
    assert_exactly_once(tmp_path / "out", ids)
    assert len(late.requests) > 0 and len(first.requests) > 0


def test_no_server_left_fails_naming_each_and_keeps_the_rows_done(servers: Servers, tmp_path: Path) -> None:
    write_input(tmp_path / "in.jsonl", 300)
    srvs = [servers.start(die_after=40), servers.start(die_after=50)]
    pool = ServerPool()
    for i, s in enumerate(srvs):
        pool.add(f"s{i}", _endpoint(s), recoverable=False)
    with pytest.raises(ServerGone) as exc:
        _run(tmp_path / "in.jsonl", tmp_path / "out", pool)
    assert "every server is gone: s0: " in str(exc.value) and "; s1: " in str(exc.value)
    assert rows_on_disk(tmp_path / "out") == 90


def test_a_dropped_server_waits_for_its_session(servers: Servers, tmp_path: Path) -> None:
    # The only server dies; its session relaunches it (a new lane): the run waits, then completes.
    ids = write_input(tmp_path / "in.jsonl", 200)
    dying, relaunched = servers.start(die_after=30), servers.start()
    pool = ServerPool()
    lane = pool.add("s", _endpoint(dying))

    def session() -> None:
        lane.dropped.wait(30)
        pool.expect("s", "relaunching")
        pool.add("s", _endpoint(relaunched))

    t = threading.Thread(target=session)
    t.start()
    _run(tmp_path / "in.jsonl", tmp_path / "out", pool)
    t.join(10)
    assert_exactly_once(tmp_path / "out", ids)
    (report,) = pool.report()
    assert (report.launches, report.rows, report.state) == (2, 200, "serving")
    assert set(_sent([dying, relaunched]).values()) == {1}


# -- prefix-aware dispatch ------------------------------------------------------------------------

def _by_prompt(srvs: list[MinimalServer]) -> dict[str, set[int]]:
    """Prompt id -> the servers its samples were sent to (a rid is ``id[#sN]@tag``)."""
    seen: dict[str, set[int]] = {}
    for k, s in enumerate(srvs):
        for rid in s.requests:
            seen.setdefault(rid.partition("@")[0].partition("#")[0], set()).add(k)
    return seen


def _run_samples(inp: Path, out: Path, pool: ServerPool, dispatch: str) -> None:
    run_dataset(DatasetSpec("ds", inp), out, pool,
                InferenceSettings(shard_size=40, concurrency=4, client=FAST_CLIENT, samples=4,
                                  sampling={"max_new_tokens": 16}, reasoning_parser=None,
                                  model_dir=DEMO_MODEL, dispatch=dispatch))


@pytest.mark.parametrize("dispatch", ["prefix", "free"])
def test_the_samples_of_a_prompt_go_to_one_server_with_prefix_dispatch(
        servers: Servers, tmp_path: Path, dispatch: str) -> None:
    ids = write_input(tmp_path / "in.jsonl", 120)
    srvs = [servers.start(latency_ms=4, slots=4) for _ in range(3)]
    pool = ServerPool()
    for i, s in enumerate(srvs):
        pool.add(f"s{i}", _endpoint(s))
    _run_samples(tmp_path / "in.jsonl", tmp_path / "out", pool, dispatch)
    sent = _sent(srvs)
    assert len(sent) == 480 and set(sent.values()) == {1}  # every (id, sample) exactly once
    assert all(len(s.requests) > 60 for s in srvs)  # every server kept busy either way
    where_sent = _by_prompt(srvs)
    assert sorted(where_sent) == ids
    together = sum(len(where) == 1 for where in where_sent.values())
    if dispatch == "prefix":
        assert together >= 80, together  # all 120 on an idle host; best effort under load
    # Free dispatch is not asserted to spread them: when one server's four answers arrive in one
    # burst (a loaded client), its four freed slots take the next four rows, one prompt's samples
    # (117 of 120 seen beside another suite). The spread shows where answers interleave (the
    # emulators of tests/e2e/test_scale_out.py, bench/bench_dispatch.py).


def test_a_preferred_server_that_is_busy_never_leaves_another_idle(servers: Servers, tmp_path: Path) -> None:
    # Every row shares one long prompt, so every row prefers the server that took the first: the
    # others' slots still go to the rows waiting for it.
    busy = [servers.start(latency_ms=20, slots=2) for _ in range(2)]
    pool = ServerPool()
    for i, s in enumerate(busy):
        pool.add(f"s{i}", _endpoint(s))
    async def go() -> Dispatcher:
        async with Dispatcher(pool, ClientConfig(max_attempts=1), 2, affinity=True) as d:
            prompt = "the same system prompt " * 40
            await asyncio.gather(*(d.generate(prompt, {"max_new_tokens": 4}, f"r{i}") for i in range(40)))
            return d

    d = asyncio.run(go())
    counts = sorted(len(s.requests) for s in busy)
    assert sum(counts) == 40 and counts[0] >= 12, counts  # the other server served its share
    assert d.affine >= 20  # and most rows still met the server they preferred


def test_prefix_routes_match_samples_and_turns_not_a_shared_template_header() -> None:
    routes = PrefixRoutes(block=16, max_blocks=16, min_chars=48)
    a, b = object.__new__(_Slot), object.__new__(_Slot)
    a.live = b.live = True
    header = "<|im_start|>user\n"
    first = header + "What is the capital of France? Answer briefly."
    routes.record(routes.keys(first), a)
    assert routes.lookup(routes.keys(first)) is a  # another sample of the same prompt
    assert routes.lookup(routes.keys(first + "<|im_end|>assistant: Paris.<|im_end|>more")) is a  # a later turn
    assert routes.lookup(routes.keys(header + "Something else entirely, of the same length.")) is None
    a.live = False
    assert routes.lookup(routes.keys(first)) is None  # a dropped server is preferred by nobody
    routes.record(routes.keys(first), b)
    assert routes.lookup(routes.keys(first)) is b
    small = PrefixRoutes(block=16, max_blocks=8, capacity=4)
    small.record(small.keys(first), b)
    assert len(small._owner) == 4  # least recently used keys forgotten
