"""One server's lifecycle as data: its phases, the moves between them, why it was dropped.

A server of a run is in one ``Phase`` at a time and changes phase only by a ``Move`` that
``TRANSITIONS`` allows (anything else is a bug and raises ``IllegalMove``)::

    PENDING --start--> STARTING --ready--> SERVING --stop--> STOPPED
                       |  ^  |               |
              (retry)  +--+  +--refuse--> REFUSED
                          |  +--fail----> NEVER_READY
                          |              drop
                          |               v
                          |           DROPPED --give_up--> LOST
                          |               |
                          |            relaunch
                          |               v
                          |         RELAUNCHING --ready--> SERVING (again)
                          |          |  ^   +--fail / refuse--> LOST / REFUSED
                          |  (retry) +--+

``retry`` is a bring-up that failed with its host unreachable and is tried again once the host
answers; it and ``relaunch`` are the moves that spend the relaunch budget, counted here and nowhere
else. Why a server was dropped is a ``Drop``: a typed kind, with the log's ``Failure`` when it died,
so no caller compares text. flows.fleet drives a ``Lifecycle`` per server (``serve_server``); this
module is pure and imports no Prefect.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tasks.errors import DatagenError
from tasks.server import Failure

__all__ = ["TRANSITIONS", "Drop", "DropKind", "IllegalMove", "Lifecycle", "Move", "Phase"]


class Phase(enum.StrEnum):
    """Where a server's lifecycle is. The last four are terminal."""

    PENDING = "pending"  # announced to the pool, nothing started
    STARTING = "starting"  # first bring-up: hygiene -> launch -> health (a shared server: identify -> health)
    SERVING = "serving"  # in the pool: requests go to it
    DROPPED = "dropped"  # the dispatcher gave it up: it is diagnosed, then relaunched or lost
    RELAUNCHING = "relaunching"  # bring-up after a drop (the old server stopped first)
    STOPPED = "stopped"  # served until the run ended, then stopped
    NEVER_READY = "never ready"  # its first bring-up failed
    REFUSED = "refused"  # it would generate other rows than the run's other servers
    LOST = "lost"  # dropped past its budget, its host gone, or its relaunch failed

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Phase.STOPPED, Phase.NEVER_READY, Phase.REFUSED, Phase.LOST})


class Move(enum.StrEnum):
    START = "start"
    READY = "ready"
    RETRY = "retry"  # the bring-up failed with its host unreachable; the host answered again
    FAIL = "fail"
    REFUSE = "refuse"
    DROP = "drop"
    RELAUNCH = "relaunch"
    GIVE_UP = "give up"
    STOP = "stop"


TRANSITIONS: dict[tuple[Phase, Move], Phase] = {
    (Phase.PENDING, Move.START): Phase.STARTING,
    (Phase.STARTING, Move.READY): Phase.SERVING,
    (Phase.STARTING, Move.RETRY): Phase.STARTING,
    (Phase.STARTING, Move.FAIL): Phase.NEVER_READY,
    (Phase.STARTING, Move.REFUSE): Phase.REFUSED,
    (Phase.SERVING, Move.STOP): Phase.STOPPED,
    (Phase.SERVING, Move.DROP): Phase.DROPPED,
    (Phase.DROPPED, Move.RELAUNCH): Phase.RELAUNCHING,
    (Phase.DROPPED, Move.GIVE_UP): Phase.LOST,
    (Phase.RELAUNCHING, Move.READY): Phase.SERVING,
    (Phase.RELAUNCHING, Move.RETRY): Phase.RELAUNCHING,
    (Phase.RELAUNCHING, Move.FAIL): Phase.LOST,
    (Phase.RELAUNCHING, Move.REFUSE): Phase.REFUSED,
}
_SPENDS_BUDGET = frozenset({Move.RETRY, Move.RELAUNCH})


class IllegalMove(DatagenError, RuntimeError):
    """A move the phase does not allow: a bug in the driver of the lifecycle."""


class DropKind(enum.StrEnum):
    HUNG = "hung"  # /health_generate failed for hang_timeout_s while it ran: the watchdog killed it
    HOST_UNREACHABLE = "host unreachable"
    ROUTE_LOST = "route lost"  # the SSH port forward to it ended
    DIED = "died"  # its process is gone; ``Drop.failure`` is its log's classification
    GONE = "gone"  # a server that is not ours (run.server_url) stopped answering


@dataclass(frozen=True)
class Drop:
    """Why the dispatcher's loss of a server happened, as the lifecycle found it."""

    kind: DropKind
    failure: Failure | None = None
    hang_s: float = 0.0
    node: str = ""  # a server over several nodes: the node whose rank died ("node 1 (gpu2)")

    @property
    def runtime_oom(self) -> bool:
        """It died of an out-of-memory at run time: the relaunch starts at a lower fraction."""
        return self.kind is DropKind.DIED and self.failure is not None and self.failure.kind == "too_high"

    def __str__(self) -> str:
        if self.kind is DropKind.HUNG:
            return f"hung (/health_generate failed for {self.hang_s:g} s while it ran; killed)"
        if self.kind is DropKind.ROUTE_LOST:
            return "connection to its host lost (the SSH port forward ended)"
        if self.kind is DropKind.DIED:
            why = self.failure.kind if self.failure is not None else "unknown"
            if self.node:
                return f"{self.node} died ({why}); the server was ended on every node"
            return f"died ({why})"
        return str(self.kind)


@dataclass
class Lifecycle:
    """One server's phase, its moves so far and its relaunch budget.

    Args:
        budget: relaunches allowed (``run.max_relaunches``); 0 for a server that is not ours.
    """

    budget: int
    phase: Phase = Phase.PENDING
    relaunches: int = 0
    drop: Drop | None = None  # why it was last dropped
    history: list[tuple[Phase, Move, Phase]] = field(default_factory=list)

    @property
    def budget_left(self) -> bool:
        return self.relaunches < self.budget

    def move(self, move: Move) -> Phase:
        """Take ``move``; returns the new phase.

        Raises:
            IllegalMove: the phase does not allow it, or it would spend a budget that is spent.
        """
        to = TRANSITIONS.get((self.phase, move))
        if to is None:
            raise IllegalMove(f"{move} from {self.phase}: not a transition of a server's lifecycle")
        if move in _SPENDS_BUDGET:
            if not self.budget_left:
                raise IllegalMove(f"{move} with the relaunch budget ({self.budget}) spent")
            self.relaunches += 1
        self.history.append((self.phase, move, to))
        self.phase = to
        return to

    def path(self) -> str:
        """The phases so far, e.g. ``pending -> starting -> serving -> dropped -> relaunching -> serving -> stopped``."""
        return " -> ".join([str(self.history[0][0]) if self.history else str(self.phase),
                            *(str(to) for _, _, to in self.history)])

    def dropped(self, drop: Drop) -> None:
        self.drop = drop
        self.move(Move.DROP)
