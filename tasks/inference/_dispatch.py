"""Several servers behind one client: each request goes to whichever server has a free slot.

``ServerPool`` is a run's set of servers as they come and go. It is thread-safe: the server sessions
(one thread each) announce a server (``expect``), add it once ready (``add``: a ``Lane``), and learn
from ``Lane.dropped`` that the dispatcher gave it up; they relaunch it or give up (``give_up``).
``run_dataset`` generates through a ``Dispatcher`` over the pool (one per event loop): a request takes a free slot of a serving lane, and a request
whose server is gone (``ServerGone`` from that lane's client) drops the lane and takes a slot of
another, so a lost server costs only the requests it had in flight; finished rows were returned
(and journaled) once. The dispatcher raises ``ServerGone`` only when no lane serves and no session
can bring one back.

Each lane has ``concurrency`` slots; a request waits (FIFO) only when every slot is taken, and a
freed slot goes straight to a waiting request, so a fast server gets more rows, a slow one fewer, and
the last rows of a run are spread over every server. With prefix-aware dispatch (``affinity``, the
``[run] dispatch = "prefix"`` default) a request prefers the server that last served its prompt's
prefix (the samples of one prompt, the turns of one conversation, a shared system prompt), which has
it in its radix cache; a freed slot never idles while any request waits (``Dispatcher``). Decision
record: docs/decisions/108-prefix-aware-dispatch.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

from tasks.inference._client import (
    ClientConfig,
    ClientStats,
    GenerateClient,
    GenerateResult,
    ServerGone,
    cached_tokens,
    default_concurrency,
)
from tasks.inference._ledger import Bucket, Ledger, Mode
from tasks.inference._settings import Endpoint

__all__ = ["Dispatcher", "Lane", "LaneState", "PrefixRoutes", "ServerPool", "ServerReport"]


class LaneState(enum.StrEnum):
    """Where a lane is: serving, then dropped (the dispatcher gave its server up) or finished (the
    run ended while it served)."""

    SERVING = "serving"
    DROPPED = "dropped"
    FINISHED = "finished"


class Lane:
    """One server's place in a pool, from ``ServerPool.add`` until it is dropped.

    Counters are written by the dispatcher's event loop only and read by reporters (ints: a read
    sees a recent value).
    """

    def __init__(self, name: str, endpoint: Endpoint, concurrency: int | None, recoverable: bool = True,
                 ledger: Ledger | None = None, slots: int | None = None) -> None:
        self.name = name
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.recoverable = recoverable
        self.ledger = ledger if ledger is not None else Ledger(0)  # where its GPU-time goes
        self.slots = slots  # its batch slots (max_running_requests), None: read when the dispatcher opens it
        self.state = LaneState.SERVING
        self.reason = ""
        self.dropped = threading.Event()
        self.rows = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of prompt_tokens, served by its prefix cache (``meta_info``)
        self.completion_tokens = 0
        self.requests = 0
        self.retries = 0
        self.added = time.monotonic()
        self.ended: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.endpoint.url, "state": self.state, "reason": self.reason,
                "rows": self.rows, "completion_tokens": self.completion_tokens, "requests": self.requests,
                "seconds": round((self.ended or time.monotonic()) - self.added, 3)}


class ServerPool:
    """The servers of a run (see the module docstring); one server is a pool of one (``of``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.lanes: list[Lane] = []
        self._pending: dict[str, str] = {}  # session name -> what it is doing (launching, relaunching)
        self._names: list[str] = []  # every session announced, in order
        self.lost: dict[str, str] = {}  # session name -> why it was given up
        self._listeners: list[Callable[[], None]] = []
        self.closed = False
        self.mode = Mode.BETWEEN  # what the run's inference does, for its servers' ledgers

    @classmethod
    def of(cls, endpoint: Endpoint, name: str | None = None) -> ServerPool:
        """A pool of the one server at ``endpoint``, someone else's: once it is gone, the pool is
        exhausted (nothing brings it back)."""
        pool = cls()
        pool.add(name or endpoint.url, endpoint, recoverable=False)
        return pool

    # -- sessions (any thread) ---------------------------------------------------------------------

    def expect(self, name: str, doing: str = "launching") -> None:
        """Session ``name`` is bringing a server up: the dispatcher waits for it rather than fail."""
        with self._lock:
            if name not in self._names:
                self._names.append(name)
            self._pending[name] = doing
            self.lost.pop(name, None)
        self._notify()

    def add(self, name: str, endpoint: Endpoint, concurrency: int | None = None, *,
            recoverable: bool = True, ledger: Ledger | None = None, slots: int | None = None) -> Lane:
        """Server ``name`` is ready at ``endpoint``: requests may go to it now.

        Args:
            concurrency: its requests in flight (None: the run's, else from its /server_info).
            recoverable: whether a session may bring it back once dropped (False: a dropped lane
                is lost at once, e.g. a server someone else runs).
            ledger: its lifecycle's GPU-time ledger, which counts the serving spell from now on
                (None: a ledger of its own, e.g. a pool of one).
            slots: its batch slots, for the ledger (None: read off the server).

        Raises:
            ValueError: its fingerprint differs from the servers' added before (the rows' ``server``).
        """
        lane = Lane(name, endpoint, concurrency, recoverable, ledger, slots)
        with self._lock:
            if self.lanes and endpoint.fingerprint != self.lanes[0].endpoint.fingerprint:
                # A shard holds rows of every server: they must all generate alike.
                raise ValueError(f"server {name} is {endpoint.fingerprint!r}, the run's other servers "
                                 f"{self.lanes[0].endpoint.fingerprint!r}: its rows would differ")
            if name not in self._names:
                self._names.append(name)
            self._pending.pop(name, None)
            lane.ledger.serve(slots, self.mode)
            self.lanes.append(lane)
            if self.closed:  # ready after the run ended: its session stops it at once
                self._drop_locked(lane, "ready after the run ended")
        self._notify()
        return lane

    def give_up(self, name: str, reason: str) -> None:
        """Session ``name`` will bring no server (back): it never became ready, or is lost."""
        with self._lock:
            self._pending.pop(name, None)
            self.lost[name] = reason
            for lane in self.lanes:
                if lane.name == name and lane.state is LaneState.SERVING:
                    self._drop_locked(lane, reason)
        self._notify()

    def drop(self, lane: Lane, reason: str) -> None:
        """Stop sending requests to ``lane``; its session is told (``lane.dropped``) and counts as
        pending until it relaunches or gives up. Idempotent."""
        with self._lock:
            if lane.state is not LaneState.SERVING:
                return
            self._drop_locked(lane, reason)
            if not lane.recoverable:
                self.lost[lane.name] = reason
            elif not self.closed and lane.name not in self.lost:
                self._pending[lane.name] = "recovering"
        self._notify()

    def _drop_locked(self, lane: Lane, reason: str) -> None:
        lane.state, lane.reason, lane.ended = LaneState.DROPPED, reason, time.monotonic()
        # from the drop its session brings it back (or gives it up and stops it)
        lane.ledger.step(Bucket.RELAUNCH if lane.recoverable and not self.closed else Bucket.STOP)
        lane.dropped.set()

    def close(self) -> None:
        """The run is over: sessions stop their servers; waiting ones stop waiting."""
        with self._lock:
            self.closed = True
            self._pending.clear()
            for lane in self.lanes:
                if lane.state is LaneState.SERVING:
                    lane.state, lane.ended = LaneState.FINISHED, time.monotonic()
                    lane.ledger.step(Bucket.STOP)
                lane.dropped.set()  # wakes the sessions
        self._notify()

    def set_mode(self, mode: Mode) -> None:
        """What the run's inference does now (rows to come, draining, between datasets): where its
        serving servers' empty slots go in their ledgers."""
        with self._lock:
            self.mode = mode
            lanes = [lane for lane in self.lanes if lane.state is LaneState.SERVING]
        for lane in lanes:
            lane.ledger.set_mode(mode)

    # -- queries -----------------------------------------------------------------------------------

    def serving(self) -> list[Lane]:
        with self._lock:
            return [lane for lane in self.lanes if lane.state is LaneState.SERVING]

    def exhausted(self) -> bool:
        """Whether no server serves and no session is bringing one (back)."""
        with self._lock:
            return self._exhausted_locked()

    def _exhausted_locked(self) -> bool:
        return not self._pending and not any(lane.state is LaneState.SERVING for lane in self.lanes)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until a server serves (True) or none can (False: every session gave up)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while True:
                if any(lane.state is LaneState.SERVING for lane in self.lanes):
                    return True
                if self._exhausted_locked() or self.closed:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)

    def capacity(self, per_server: int) -> int:
        """Requests in flight the whole pool can take: ``per_server`` for every session announced
        that has not been given up."""
        return max(1, self.size()) * per_server

    def size(self) -> int:
        """Servers announced and not given up (serving, launching or recovering)."""
        with self._lock:
            return sum(1 for name in self._names if name not in self.lost)

    def pending(self) -> dict[str, str]:
        with self._lock:
            return dict(self._pending)

    def why_none(self) -> str:
        """Why no server serves: each session's last reason."""
        with self._lock:
            reasons = dict(self.lost)
            for lane in self.lanes:
                reasons.setdefault(lane.name, lane.reason)
        return "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "no server was added"

    def first(self) -> Endpoint:
        """The first serving server: the run's probe of ``/server_info`` and the rows' fingerprint
        (every server of a pool generates alike, ``add`` checks it).

        Raises:
            ServerGone: none serves.
        """
        lanes = self.serving()
        if not lanes:
            raise ServerGone(f"no server is serving ({self.why_none()})")
        return lanes[0].endpoint

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    def report(self) -> list[ServerReport]:
        """Per session: rows, tokens, requests, time served, state and why it was dropped or lost."""
        with self._lock:
            lanes = list(self.lanes)
            names = list(self._names)
            lost = dict(self.lost)
            pending = dict(self._pending)
        out = []
        for name in names:
            mine = [lane for lane in lanes if lane.name == name]
            seconds = sum((lane.ended or time.monotonic()) - lane.added for lane in mine)
            tokens = sum(lane.completion_tokens for lane in mine)
            prompt = sum(lane.prompt_tokens for lane in mine)
            if name in lost:
                state = "lost" if mine else "never ready"
            elif any(lane.state is not LaneState.DROPPED for lane in mine):
                state = str(mine[-1].state)
            else:
                state = pending.get(name) or ("stopped" if mine else "not started")
            out.append(ServerReport(
                server=name, state=state, rows=sum(lane.rows for lane in mine), completion_tokens=tokens,
                requests=sum(lane.requests for lane in mine),
                tokens_per_s=round(tokens / seconds, 1) if seconds > 0 else 0.0,
                cached_pct=round(100.0 * sum(lane.cached_tokens for lane in mine) / prompt, 1) if prompt else None,
                launches=len(mine), urls=[lane.endpoint.url for lane in mine],
                drops=[lane.reason for lane in mine if lane.reason], lost=lost.get(name),
            ))
        return out


@dataclasses.dataclass(frozen=True)
class ServerReport:
    """What one server of a run did: the one report the fleet's artifacts, the run's summary (as
    ``to_dict``) and ``datagen run``'s closing lines (``from_dict``) are written from."""

    server: str
    state: str  # serving, finished, stopped, launching, relaunching, never ready, lost, not started
    rows: int = 0
    completion_tokens: int = 0
    requests: int = 0
    tokens_per_s: float = 0.0
    cached_pct: float | None = None  # of prompt tokens, served from its prefix cache
    launches: int = 0
    urls: list[str] = dataclasses.field(default_factory=list)
    drops: list[str] = dataclasses.field(default_factory=list)  # why each of its servers was dropped
    lost: str | None = None  # why it was given up
    left_running: str = ""  # what could not be stopped

    def why(self) -> str:
        """Its drops, why it was lost and what was left running, in one line ("" when none)."""
        return "; ".join([*self.drops, *([f"lost: {self.lost}"] if self.lost else []),
                          *([f"not stopped: {self.left_running}"] if self.left_running else [])])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class PrefixRoutes:
    """Which server last served each prompt prefix, so rows that share one go where it is cached.

    A prompt's first ``max_blocks`` blocks of ``block`` characters are hashed as a chain (a block's
    key covers every character before it), and each key remembers the slot the last row with that
    prefix was sent to (``record``). ``lookup`` finds the deepest key of a prompt that is remembered
    and names its slot when the prefix it covers is at least ``min_match`` of the hashed prompt or
    ``min_chars`` characters (about 256 tokens): the samples of one prompt, the turns of one
    conversation and a long shared system prompt match, a chat template's header that every row
    shares does not. At most ``capacity`` keys are kept,
    the least recently used forgotten first. A hash collision only sends a row to a server that has
    not cached it; the row is generated the same.
    """

    def __init__(self, block: int = 64, max_blocks: int = 64, min_match: float = 0.5,
                 min_chars: int = 1024, capacity: int = 1 << 17) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self.min_match = min_match
        self.min_chars = min_chars
        self.capacity = capacity
        self._owner: OrderedDict[int, _Slot] = OrderedDict()

    def keys(self, text: str) -> list[tuple[int, int]]:
        """``(key, characters covered)`` of each block of ``text``'s hashed prefix, shallow first."""
        n = min(len(text), self.block * self.max_blocks)
        out: list[tuple[int, int]] = []
        h = 0
        for start in range(0, n, self.block):
            end = min(start + self.block, n)
            h = hash((h, text[start:end]))
            out.append((h, end))
        return out

    def lookup(self, keys: list[tuple[int, int]]) -> _Slot | None:
        """The live slot that served the deepest remembered prefix, when it covers enough."""
        if not keys:
            return None
        enough = min(self.min_match * keys[-1][1], self.min_chars)
        for key, covered in reversed(keys):
            if covered < enough:
                return None
            slot = self._owner.get(key)
            if slot is not None and slot.live:
                return slot
        return None

    def record(self, keys: list[tuple[int, int]], slot: _Slot) -> None:
        owner = self._owner
        for key, _ in keys:
            owner[key] = slot
            owner.move_to_end(key)
        while len(owner) > self.capacity:
            owner.popitem(last=False)


class _Slot:
    """A lane as one event loop sees it: its open client, its free request slots and the requests
    waiting for one of them (those that prefer this server)."""

    __slots__ = ("lane", "client", "live", "free", "concurrency", "waiting")

    def __init__(self, lane: Lane, client: GenerateClient) -> None:
        self.lane = lane
        self.client = client
        self.live = True
        self.free = 0
        self.concurrency = 0
        self.waiting: deque[asyncio.Future[_Slot]] = deque()


class Dispatcher:
    """``generate`` over a ``ServerPool``, as ``GenerateClient.generate`` over one server; use it as
    ``async with`` in one event loop.

    A request takes a free slot of a serving server. With ``affinity`` (prefix-aware dispatch) it
    takes the slot of the server that last served its prompt's prefix (``PrefixRoutes``) when that
    server has one free (else any free slot: none idles). When every slot is taken it waits in the
    queue of that server, or, for a prefix no server has served, of the server with the shortest
    queue, which the rows sharing the prefix then follow; a queue holds at most as many requests
    as its server has slots, the rest wait in the shared queue. A slot that frees goes to its
    server's own queue first, then to the shared queue, then to the longest queue of another server:
    no slot idles while a request waits, whatever the preferences. Without ``affinity`` every request
    waits in the shared queue (free-slot dispatch). Queues are FIFO.

    Args:
        pool: the servers.
        config: client settings of every lane (its concurrency and API key are set per lane).
        concurrency: requests in flight per server (None: from each server's /server_info).
        affinity: route rows that share a prompt prefix to one server (see above).
    """

    def __init__(self, pool: ServerPool, config: ClientConfig, concurrency: int | None,
                 affinity: bool = False) -> None:
        self.pool = pool
        self.config = config
        self.concurrency = concurrency
        self.routes = PrefixRoutes() if affinity else None
        self._slots: dict[int, _Slot] = {}  # id(lane) -> slot
        self._shared: deque[asyncio.Future[_Slot]] = deque()
        self._gone: ServerGone | None = None  # set once no server serves and none is coming
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: set[asyncio.Task[None]] = set()
        self._closed_stats = ClientStats()
        self._last_error = ""
        self.affine = 0  # requests sent to the server their prefix preferred

    @property
    def stats(self) -> ClientStats:
        """Requests and retries over every lane (those closed included)."""
        total = ClientStats(self._closed_stats.requests, self._closed_stats.retries)
        for slot in self._slots.values():
            total.requests += slot.client.stats.requests
            total.retries += slot.client.stats.retries
        return total

    async def __aenter__(self) -> Dispatcher:
        self._loop = asyncio.get_running_loop()
        self.pool.subscribe(self._wake)
        self._sync()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.pool.unsubscribe(self._wake)
        for task in list(self._opening):
            task.cancel()
        for slot in self._slots.values():
            await slot.client.aclose()

    def _wake(self) -> None:
        """Called by the pool from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._sync)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _sync(self) -> None:
        """Open a client for each new serving lane; forget dropped ones (their waiting requests move
        to the shared queue); fail waiters when no server is left and none is coming."""
        for lane in self.pool.serving():
            if id(lane) not in self._slots:
                cfg = dataclasses.replace(self.config, api_key=lane.endpoint.api_key or self.config.api_key)
                slot = _Slot(lane, GenerateClient(lane.endpoint.url, cfg, server_alive=lane.endpoint.alive))
                self._slots[id(lane)] = slot
                task = asyncio.ensure_future(self._open(slot))
                self._opening.add(task)
                task.add_done_callback(self._opening.discard)
        for slot in self._slots.values():
            if slot.live and slot.lane.state is not LaneState.SERVING:
                slot.live = False
            if not slot.live and slot.waiting:
                self._shared.extendleft(reversed(slot.waiting))  # they waited longest
                slot.waiting.clear()
        if self._gone is None and self.pool.exhausted():
            self._gone = ServerGone(f"every server is gone: {self.pool.why_none()}", last_error=self._last_error)
        if self._gone is not None:
            for queue in [self._shared, *(slot.waiting for slot in self._slots.values())]:
                while queue:
                    fut = queue.popleft()
                    if not fut.done():
                        fut.set_exception(self._gone)

    async def _open(self, slot: _Slot) -> None:
        conc = self.concurrency or slot.lane.concurrency
        try:
            if conc is None:
                async with GenerateClient(slot.lane.endpoint.url, slot.client.config) as probe:
                    conc = default_concurrency(await probe.server_info())
            slot.client.config = dataclasses.replace(slot.client.config, concurrency=conc)
            await slot.client.__aenter__()
        except Exception as exc:  # an unusable lane is dropped like a dead one
            self._lost(slot, ServerGone(f"{slot.lane.endpoint.url}: cannot open a client: {exc}"))
            return
        slot.concurrency = conc
        slot.lane.ledger.set_slots(slot.lane.slots or conc)
        for _ in range(conc):
            self._release(slot)

    def _pick(self, pref: _Slot | None) -> _Slot | None:
        """A free slot now: the preferred server's, else the server with the most free."""
        if pref is not None and pref.live and pref.free > 0:
            pref.free -= 1
            return pref
        best = None
        for slot in self._slots.values():
            if slot.live and slot.free > 0 and (best is None or slot.free > best.free):
                best = slot
        if best is not None:
            best.free -= 1
        return best

    def _queue_for(self, pref: _Slot | None) -> _Slot | None:
        """The server a waiting request queues for: its preferred one, else (a prefix not seen
        yet) the one with the shortest queue; None (the shared queue) when that queue already holds
        as many requests as the server has slots."""
        if pref is None:
            live = [s for s in self._slots.values() if s.live]
            pref = min(live, key=lambda s: len(s.waiting)) if live else None
        if pref is None or len(pref.waiting) >= (pref.concurrency or self.concurrency or 1):
            return None
        return pref

    def _release(self, slot: _Slot) -> None:

        """A slot of ``slot``'s server is free: hand it to the next waiting request (its server's
        own queue, the shared queue, the longest queue of another server), else keep it free."""
        if not slot.live:
            return  # a dropped server's slot: gone with it
        for queue in (slot.waiting, self._shared):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(slot)
                    return
        while True:
            longest = max((s.waiting for s in self._slots.values() if s.waiting), key=len, default=None)
            if longest is None:
                slot.free += 1
                return
            fut = longest.popleft()
            if not fut.done():
                fut.set_result(slot)
                return

    async def _take(self, text: str) -> _Slot:
        if self._gone is not None:
            raise self._gone
        keys = self.routes.keys(text) if self.routes is not None else None
        pref = self.routes.lookup(keys) if self.routes is not None and keys else None
        slot = self._pick(pref)
        queue = None
        if slot is None:
            fut: asyncio.Future[_Slot] = asyncio.get_running_loop().create_future()
            queue = self._queue_for(pref) if keys else None
            if queue is not None:
                queue.waiting.append(fut)
                self.routes.record(keys, queue)  # type: ignore[arg-type, union-attr]  # siblings follow
            else:
                self._shared.append(fut)
            try:
                slot = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._release(fut.result())  # handed over as this request was cancelled
                raise
        if keys:
            self.affine += slot is pref
            if slot is not queue:  # a queued row was remembered for its queue's server already
                self.routes.record(keys, slot)  # type: ignore[union-attr]
        return slot

    async def generate(self, text: str, sampling_params: dict[str, Any], rid: str) -> GenerateResult:
        """Generate on some serving server; a server gone mid-request is dropped and the request
        goes to another.

        Raises:
            ServerGone: no server serves and none is coming back (the message says why each went).
            PromptTooLong, RequestRejected: as ``GenerateClient.generate``.
        """
        while True:
            slot = await self._take(text)
            ledger = slot.lane.ledger
            ticket = ledger.begin()
            try:
                res = await slot.client.generate(text, sampling_params, rid)
            except ServerGone as exc:
                ledger.finish(ticket, kept=False)
                self._lost(slot, exc)
                continue
            except BaseException:
                ledger.finish(ticket, kept=False)
                self._release(slot)
                raise
            share = ledger.finish(ticket, kept=True, tokens=res.completion_tokens)
            res = dataclasses.replace(res, server_s=share, ledger=ledger)
            self._release(slot)
            lane = slot.lane
            lane.rows += 1
            lane.prompt_tokens += res.prompt_tokens
            lane.cached_tokens += cached_tokens(res.meta_info)
            lane.completion_tokens += res.completion_tokens
            lane.requests = slot.client.stats.requests
            return res

    @staticmethod
    def discard(res: GenerateResult) -> None:
        """``res`` is thrown away (a truncation retry replaced it): its server time and tokens are
        wasted in its server's ledger."""
        if res.ledger is not None:
            res.ledger.discard(res.server_s, res.completion_tokens)

    async def context_limit(self) -> int | None:
        """The model's context length, as ``GenerateClient.context_limit``: every server of a
        partition serves one model, so the first serving server that reports one answers (None:
        none does). Used by truncation retries, which size the next budget with it."""
        for slot in list(self._slots.values()):
            if slot.live:
                limit = await slot.client.context_limit()
                if limit is not None:
                    return limit
        return None

    def _lost(self, slot: _Slot, exc: ServerGone) -> None:
        self._last_error = str(exc)
        if slot.live:
            slot.live = False
            slot.lane.requests = slot.client.stats.requests
            self.pool.drop(slot.lane, str(exc))
        self._sync()
