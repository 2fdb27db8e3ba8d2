"""Where a server's GPU-time went: one ledger per server lifecycle, every second in one bucket.

A :class:`Ledger` runs from the start of the server's hygiene to the end of its stop. Outside a
serving spell the time falls in the bucket of the step under way (hygiene, launch, health and
probe, relaunch, stop). While the server serves, each moment is split by its occupancy: the
server's ``slots`` batch slots are taken by the requests sent to it, first come first served (as
SGLang admits them; the others wait behind them), each slot holding ``1 / slots`` of the moment, and
the slots no request holds are empty:

- a request's share goes to **serving** when its answer is kept, to **wasted** when it is thrown
  away (an answer a truncation retry replaced, a request lost with a killed or dropped server, one
  the run cancelled);
- the empty part goes to **idle** (no request in flight while rows are to come: a slow input, a
  prefix group held back, a commit), **under-filled** (some slots empty while rows are to come, or
  fewer requests sent than the server has slots), **drain** (slots empty once every row of the
  input has been sent: the straggler tail of the last shard) or **validation** (nothing in flight
  once every row was sent: the last shard's commit and its validation gate while the server is
  still up).

So the buckets sum to the ledger's wall time (times the server's GPUs: GPU-seconds). With the
server's measured capacity ``C`` (output tokens/s at full batch: tasks/inference/_capacity.py),
goodput is ``kept output tokens / (C x seconds)``; a server that runs at full batch with every
answer kept has goodput close to its serving share. Decision record:
docs/decisions/119-goodput-ledger.md.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["Bucket", "Capacity", "Ledger", "LedgerView", "Mode", "RunLedger", "bar"]


class Bucket(enum.StrEnum):
    """A ledger bucket (its value is the key of the JSON forms; ``label`` says it for people)."""

    HYGIENE = "hygiene"
    LAUNCH = "launch"
    HEALTH = "health"
    SERVING = "serving"
    UNDERFILLED = "underfilled"
    IDLE = "idle"
    RELAUNCH = "relaunch"
    WASTED = "wasted"
    DRAIN = "drain"
    VALIDATION = "validation"
    STOP = "stop"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Bucket.HYGIENE: "hygiene (GPUs cleaned and verified)",
    Bucket.LAUNCH: "launch (weights, graphs, warm-up)",
    Bucket.HEALTH: "health check and capacity probe",
    Bucket.SERVING: "serving at full batch (kept rows)",
    Bucket.UNDERFILLED: "serving under-filled (empty slots)",
    Bucket.IDLE: "idle, waiting for rows",
    Bucket.RELAUNCH: "relaunch (a dropped server brought back)",
    Bucket.WASTED: "wasted (tokens generated and not kept)",
    Bucket.DRAIN: "drain of the last shard (empty slots)",
    Bucket.VALIDATION: "last commit and validation while up",
    Bucket.STOP: "stop",
}
LOSSES = tuple(b for b in Bucket if b is not Bucket.SERVING)


class Mode(enum.StrEnum):
    """What the run's inference is doing, for the empty slots' bucket: rows still to send, every row
    of the input sent (drain), or no dataset generating (between datasets, before the first)."""

    ROWS = "rows"
    DRAIN = "drain"
    BETWEEN = "between"


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A server's output tokens/s at full batch, as its probe measured it.

    Args:
        tokens_per_s: output tokens per second with every batch slot busy.
        slots: the batch slots it was measured with (the server's ``max_running_requests``).
        seconds: how long the probe took.
        others_running: requests someone else had running on the server when the probe began (a
            shared server), None when the server does not say.
    """

    tokens_per_s: float
    slots: int
    seconds: float = 0.0
    others_running: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Capacity | None:
        if not data:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class _Ticket:
    """One request's place in the ledger: the spell it began in, and the share clock when it took a
    batch slot (None while it waits for one behind ``slots`` older requests)."""

    __slots__ = ("spell", "start")

    def __init__(self, spell: int) -> None:
        self.spell = spell
        self.start: float | None = None


@dataclasses.dataclass(frozen=True)
class LedgerView:
    """A ledger read at one moment: seconds per bucket, tokens kept and wasted, the capacity."""

    seconds: Mapping[str, float]
    gpus: int
    kept_tokens: int
    wasted_tokens: int
    capacity: Capacity | None

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float | None:
        """Kept output tokens over what the capacity would have made in the ledger's time."""
        if self.capacity is None or self.capacity.tokens_per_s <= 0 or self.total_s <= 0:
            return None
        return self.kept_tokens / (self.capacity.tokens_per_s * self.total_s)

    def minus(self, earlier: LedgerView) -> LedgerView:
        """What happened between ``earlier`` and this view (a window of the run)."""
        return LedgerView({b: self.seconds.get(b, 0.0) - earlier.seconds.get(b, 0.0) for b in self.seconds},
                          self.gpus, self.kept_tokens - earlier.kept_tokens,
                          self.wasted_tokens - earlier.wasted_tokens, self.capacity)

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": {b: round(s, 3) for b, s in self.seconds.items()}, "gpus": self.gpus,
                "kept_tokens": self.kept_tokens, "wasted_tokens": self.wasted_tokens,
                "capacity": self.capacity.to_dict() if self.capacity else None,
                "total_s": round(self.total_s, 3), "goodput": self.goodput}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LedgerView:
        return cls({str(b): float(s) for b, s in (data.get("seconds") or {}).items()}, int(data.get("gpus") or 0),
                   int(data.get("kept_tokens") or 0), int(data.get("wasted_tokens") or 0),
                   Capacity.from_dict(data.get("capacity")))


class Ledger:
    """One server lifecycle's GPU-time, bucket by bucket (see the module docstring). Thread-safe:
    the lifecycle's thread moves its steps, the dispatcher's event loop its requests, reporters read.

    Args:
        gpus: the server's GPUs (0: a server someone else runs; its seconds are then the server's).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, gpus: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.gpus = gpus
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds = {b: 0.0 for b in Bucket}
        self._step: Bucket | None = None  # the step under way outside a serving spell
        self._mark = 0.0
        self._ended = False
        self.capacity: Capacity | None = None
        self.kept_tokens = 0
        self.wasted_tokens = 0
        # the serving spell: its slots, the share clock (seconds / slots), the requests holding a
        # slot (and the sum of their clocks at the start) and those waiting for one, oldest first
        self._serving = False
        self._slots = 1
        self._slots_known = False
        self._clock_s = 0.0
        self._running: set[_Ticket] = set()
        self._started = 0.0
        self._waiting: collections.deque[_Ticket] = collections.deque()
        self._spell = 0
        self._mode = Mode.BETWEEN

    # -- the lifecycle's steps (its thread) --------------------------------------------------------

    def step(self, bucket: Bucket) -> None:
        """From now the time is ``bucket``'s (a serving spell under way ends first: its requests
        still in flight are wasted)."""
        with self._lock:
            self._advance()
            if self._serving:
                self._end_spell()
            if not self._ended:
                self._step = bucket

    def serve(self, slots: int | None, mode: Mode) -> None:
        """A serving spell begins: ``slots`` batch slots (None: known once the dispatcher opens the
        server, ``set_slots``), the run's inference in ``mode``."""
        with self._lock:
            self._advance()
            if self._ended:
                return
            self._serving, self._slots, self._slots_known = True, max(1, slots or 1), slots is not None
            self._mode, self._clock_s, self._started = mode, 0.0, 0.0
            self._running, self._waiting = set(), collections.deque()
            self._spell += 1
            self._step = None

    def set_slots(self, slots: int) -> None:
        """The batch slots of a spell begun without them (the dispatcher read them off the server)."""
        with self._lock:
            if self._serving and not self._slots_known:
                self._advance()
                self._slots, self._slots_known = max(1, slots), True
                self._admit()

    def end(self) -> None:
        """The lifecycle is over (its stop returned): nothing more is counted."""
        with self._lock:
            self._advance()
            if self._serving:
                self._end_spell()
            self._step, self._ended = None, True

    # -- the run's inference (the dispatcher's loop) -----------------------------------------------

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            self._advance()
            self._mode = mode

    def begin(self) -> _Ticket | None:
        """A request is sent to this server; None when it does not serve (nothing to count)."""
        with self._lock:
            if not self._serving:
                return None
            self._advance()
            ticket = _Ticket(self._spell)
            self._waiting.append(ticket)
            self._admit()
            return ticket

    def finish(self, ticket: _Ticket | None, *, kept: bool, tokens: int = 0) -> float:
        """The request of ``ticket`` is answered (``kept``: its answer is used) or failed; returns
        its share in seconds: the share clock's advance while it held a slot (0 when its spell had
        ended: it was counted wasted then; 0 when it never held one by this ledger's reckoning)."""
        with self._lock:
            if not kept:
                self.wasted_tokens += tokens
            if ticket is None or ticket.spell != self._spell or not self._serving:
                return 0.0
            self._advance()
            share = 0.0
            if ticket in self._running:
                assert ticket.start is not None
                share = self._clock_s - ticket.start
                self._running.discard(ticket)
                self._started -= ticket.start
                self._admit()
            else:
                self._waiting.remove(ticket)
            self._seconds[Bucket.SERVING if kept else Bucket.WASTED] += share
            if kept:
                self.kept_tokens += tokens
            return share

    def discard(self, share: float, tokens: int) -> None:
        """An answer counted kept is thrown away after all (a truncation retry replaced it)."""
        with self._lock:
            self._seconds[Bucket.SERVING] -= share
            self._seconds[Bucket.WASTED] += share
            self.kept_tokens -= tokens
            self.wasted_tokens += tokens

    # -- reading -----------------------------------------------------------------------------------

    def view(self) -> LedgerView:
        """The ledger now; requests in flight count as serving so far."""
        with self._lock:
            self._advance()
            seconds = dict(self._seconds)
            if self._serving:
                seconds[Bucket.SERVING] += self._held()
            return LedgerView({str(b): s for b, s in seconds.items()}, self.gpus, self.kept_tokens,
                              self.wasted_tokens, self.capacity)

    # -- internals (the lock held) -----------------------------------------------------------------

    def _advance(self) -> float:
        now = self._clock()
        dt = max(0.0, now - self._mark)
        self._mark = now
        if self._ended or dt == 0.0:
            return now
        if self._serving:
            slots = self._slots
            empty = (slots - len(self._running)) / slots
            if empty:
                self._seconds[self._empty_bucket(len(self._running) + len(self._waiting))] += dt * empty
            self._clock_s += dt / slots
        elif self._step is not None:
            self._seconds[self._step] += dt
        return now

    def _empty_bucket(self, k: int) -> Bucket:
        if self._mode is Mode.DRAIN:
            return Bucket.DRAIN if k else Bucket.VALIDATION
        return Bucket.UNDERFILLED if k and self._mode is Mode.ROWS else Bucket.IDLE

    def _admit(self) -> None:
        """The oldest waiting requests take the free slots (the server admits first come, first
        served: a request waits while ``slots`` older ones run)."""
        while self._waiting and len(self._running) < self._slots:
            ticket = self._waiting.popleft()
            ticket.start = self._clock_s
            self._running.add(ticket)
            self._started += self._clock_s

    def _held(self) -> float:
        """The shares of the requests holding a slot now, so far."""
        return len(self._running) * self._clock_s - self._started

    def _end_spell(self) -> None:
        """Requests still in flight when a spell ends are lost with it: their shares are wasted."""
        self._seconds[Bucket.WASTED] += self._held()
        self._serving, self._running, self._waiting, self._started = False, set(), collections.deque(), 0.0


class RunLedger:
    """A run's ledgers, one per server, read as one: GPU-seconds per bucket (a shared server's
    seconds count as one GPU's) and goodput over the servers whose capacity is known."""

    def __init__(self, views: Mapping[str, LedgerView]) -> None:
        self.servers = dict(views)

    @staticmethod
    def weight(view: LedgerView) -> int:
        return max(1, view.gpus)

    @property
    def gpu_seconds(self) -> dict[str, float]:
        total = {str(b): 0.0 for b in Bucket}
        for v in self.servers.values():
            for b, s in v.seconds.items():
                total[b] = total.get(b, 0.0) + s * self.weight(v)
        return total

    @property
    def total_gpu_s(self) -> float:
        return sum(self.gpu_seconds.values())

    @property
    def kept_tokens(self) -> int:
        return sum(v.kept_tokens for v in self.servers.values())

    @property
    def capacity_tokens_per_s(self) -> float | None:
        """The servers' capacities summed (None: one is unknown)."""
        caps = [v.capacity for v in self.servers.values()]
        if not caps or any(c is None for c in caps):
            return None
        return sum(c.tokens_per_s for c in caps if c is not None)

    @property
    def goodput(self) -> float | None:
        """Kept tokens over each server's capacity times its time, summed (None: a capacity is unknown)."""
        if not self.servers or any(v.capacity is None for v in self.servers.values()):
            return None
        possible = sum(v.capacity.tokens_per_s * v.total_s for v in self.servers.values() if v.capacity)
        return self.kept_tokens / possible if possible > 0 else None

    def biggest_loss(self) -> tuple[str, float] | None:
        """The bucket other than serving that holds most GPU-seconds (None: none holds any)."""
        seconds = self.gpu_seconds
        name, worst = max(((str(b), seconds.get(b, 0.0)) for b in LOSSES), key=lambda x: x[1])
        return (name, worst) if worst > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_seconds": {b: round(s, 3) for b, s in self.gpu_seconds.items()},
                "total_gpu_s": round(self.total_gpu_s, 3), "kept_tokens": self.kept_tokens,
                "capacity_tokens_per_s": self.capacity_tokens_per_s, "goodput": self.goodput,
                "servers": {name: v.to_dict() for name, v in self.servers.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RunLedger | None:
        if not data or not isinstance(data.get("servers"), dict):
            return None
        return cls({name: LedgerView.from_dict(v) for name, v in data["servers"].items()})

    def rows(self) -> Iterable[tuple[Bucket, float, float]]:
        """``(bucket, GPU-seconds, share of the total)`` for each bucket, in the ledger's order."""
        total = self.total_gpu_s
        seconds = self.gpu_seconds
        for b in Bucket:
            s = seconds.get(str(b), 0.0)
            yield b, s, (s / total if total > 0 else 0.0)

    def headline(self) -> str:
        """One line: goodput, capacity and the biggest loss."""
        good = self.goodput
        cap = self.capacity_tokens_per_s
        worst = self.biggest_loss()
        parts = [f"goodput {100 * good:.0f}%" if good is not None else "goodput unknown (no capacity measured)",
                 f"capacity {cap:,.0f} tokens/s" if cap is not None else "",
                 f"biggest loss: {Bucket(worst[0]).label} {100 * worst[1] / self.total_gpu_s:.0f}%"
                 if worst and self.total_gpu_s > 0 else ""]
        return ", ".join(p for p in parts if p)

    def markdown(self) -> list[str]:
        """The ledger as markdown: goodput, then a table of the buckets with a bar each, then one row
        per server (its capacity, goodput and biggest loss)."""
        shared = all(v.gpus == 0 for v in self.servers.values())
        unit = "server-seconds" if shared else "GPU-seconds"
        lines = ["## GPU-time ledger", "", f"**{self.headline()}**", "",
                 "Goodput: output tokens kept / (each server's measured capacity x its time). Every "
                 f"{unit[:-1]} from the start of hygiene to the end of the stop is in one bucket.", "",
                 f"| where the time went | {unit} | share | |", "|---|---:|---:|---|"]
        for bucket, seconds, share in self.rows():
            lines.append(f"| {bucket.label} | {seconds:,.1f} | {100 * share:.1f}% | {bar(share)} |")
        lines.append(f"| **total** | **{self.total_gpu_s:,.1f}** | 100% | |")
        lines += ["", "| server | capacity (tokens/s at full batch) | kept tokens | goodput | biggest loss |",
                  "|---|---:|---:|---:|---|"]
        for name, view in self.servers.items():
            one = RunLedger({name: view})
            cap = view.capacity
            worst = one.biggest_loss()
            others = f" ({cap.others_running} others' requests running)" if cap and cap.others_running else ""
            lines.append(f"| {name} | {f'{cap.tokens_per_s:,.0f} ({cap.slots} slots){others}' if cap else 'not measured'} "
                         f"| {view.kept_tokens:,} | {f'{100 * g:.0f}%' if (g := view.goodput) is not None else '-'} | "
                         f"{f'{worst[0]} {100 * worst[1] / one.total_gpu_s:.0f}%' if worst and one.total_gpu_s else '-'} |")
        return lines

    def text_lines(self, indent: str = "  ") -> list[str]:
        """The ledger as plain text lines (``datagen run``, ``datagen status``)."""
        shared = all(v.gpus == 0 for v in self.servers.values())
        unit = "server-s" if shared else "GPU-s"
        lines = [f"{indent}{self.headline()}"]
        width = max(len(b.label) for b in Bucket)
        for bucket, seconds, share in self.rows():
            if seconds > 0:  # a bucket that holds nothing is not a line (a shared server has no hygiene)
                lines.append(f"{indent}  {bucket.label:<{width}} {seconds:>10,.1f} {unit} {100 * share:5.1f}% "
                             f"{bar(share, 20)}")
        lines.append(f"{indent}  {'total':<{width}} {self.total_gpu_s:>10,.1f} {unit}")
        return lines


def bar(share: float, width: int = 20) -> str:
    """``share`` (0..1) as a bar of block characters, eighths included."""
    eighths = int(round(max(0.0, min(1.0, share)) * width * 8))
    full, part = divmod(eighths, 8)
    return "\u2588" * full + ("" if not part else chr(0x2590 - part))
