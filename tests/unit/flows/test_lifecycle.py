"""A server's lifecycle: every transition of the table taken once, every other move refused, the
relaunch budget counted in one place, and why a server was dropped typed rather than spelled."""

from __future__ import annotations

import itertools

import pytest

from flows.lifecycle import TRANSITIONS, Drop, DropKind, IllegalMove, Lifecycle, Move, Phase
from tasks.server import Failure

# The shortest way from PENDING to each phase, so every transition can be taken from a real path.
PATHS: dict[Phase, list[Move]] = {
    Phase.PENDING: [],
    Phase.STARTING: [Move.START],
    Phase.SERVING: [Move.START, Move.READY],
    Phase.DROPPED: [Move.START, Move.READY, Move.DROP],
    Phase.RELAUNCHING: [Move.START, Move.READY, Move.DROP, Move.RELAUNCH],
}


def _at(phase: Phase, budget: int = 3) -> Lifecycle:
    life = Lifecycle(budget=budget)
    for move in PATHS[phase]:
        life.move(move)
    assert life.phase is phase
    return life


@pytest.mark.parametrize(("start", "move"), list(TRANSITIONS), ids=lambda x: str(x))
def test_each_transition_leads_where_the_table_says(start: Phase, move: Move) -> None:
    life = _at(start)
    before = life.relaunches
    assert life.move(move) is TRANSITIONS[start, move]
    assert life.phase is TRANSITIONS[start, move] and life.history[-1] == (start, move, life.phase)
    assert life.relaunches == before + (move in (Move.RETRY, Move.RELAUNCH))


NOT_ALLOWED = [(p, m) for p, m in itertools.product(Phase, Move) if (p, m) not in TRANSITIONS]


@pytest.mark.parametrize(("start", "move"), [(p, m) for p, m in NOT_ALLOWED if p in PATHS], ids=lambda x: str(x))
def test_any_other_move_is_refused_and_changes_nothing(start: Phase, move: Move) -> None:
    life = _at(start)
    history = list(life.history)
    with pytest.raises(IllegalMove, match=f"{move} from {start}"):
        life.move(move)
    assert life.phase is start and life.history == history


@pytest.mark.parametrize("end", [Phase.STOPPED, Phase.NEVER_READY, Phase.REFUSED, Phase.LOST])
def test_a_terminal_phase_has_no_way_out(end: Phase) -> None:
    assert end.terminal
    assert not [m for (p, m) in TRANSITIONS if p is end]


def test_every_phase_is_reachable_and_every_live_phase_can_end() -> None:
    reached = {Phase.PENDING} | set(TRANSITIONS.values())
    assert reached == set(Phase)
    for phase in Phase:
        if not phase.terminal:
            assert any(p is phase for p, _ in TRANSITIONS), phase


def test_the_budget_is_spent_by_retries_and_relaunches_and_then_refused() -> None:
    life = _at(Phase.STARTING, budget=2)
    life.move(Move.RETRY)  # the first bring-up failed with its host lost; the host came back
    life.move(Move.READY)
    life.dropped(Drop(DropKind.DIED, Failure("too_high", "OOM")))
    life.move(Move.RELAUNCH)
    assert (life.relaunches, life.budget_left) == (2, False)
    life.move(Move.READY)
    life.dropped(Drop(DropKind.HOST_UNREACHABLE))
    with pytest.raises(IllegalMove, match="budget"):
        life.move(Move.RELAUNCH)
    assert life.move(Move.GIVE_UP) is Phase.LOST and life.relaunches == 2


def test_a_server_that_is_not_ours_has_no_budget() -> None:
    life = _at(Phase.DROPPED, budget=0)
    assert not life.budget_left
    with pytest.raises(IllegalMove):
        life.move(Move.RELAUNCH)


@pytest.mark.parametrize(("drop", "text", "oom"), [
    (Drop(DropKind.HUNG, hang_s=120), "hung (/health_generate failed for 120 s while it ran; killed)", False),
    (Drop(DropKind.HOST_UNREACHABLE), "host unreachable", False),
    (Drop(DropKind.ROUTE_LOST), "connection to its host lost (the SSH port forward ended)", False),
    (Drop(DropKind.DIED, Failure("too_high", "OOM")), "died (too_high)", True),
    (Drop(DropKind.DIED, Failure("kv_pool_exhausted", "pool")), "died (kv_pool_exhausted)", False),
    (Drop(DropKind.DIED), "died (unknown)", False),
    (Drop(DropKind.GONE), "gone", False),
], ids=lambda x: str(x)[:20])
def test_a_drop_says_why_and_only_a_runtime_oom_lowers_the_fraction(drop: Drop, text: str, oom: bool) -> None:
    assert (str(drop), drop.runtime_oom) == (text, oom)
