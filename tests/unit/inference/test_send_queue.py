"""The workers' send queue in prefix order: a group's siblings wait for their leader's answer (or the
hold bound) while other rows go first, a worker's stop waits for the rows before it, and a prefix a
leader already answered is not held again."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tasks.inference._order import SendQueue, prefix_groups

SYSTEM_A = "A" * 400
SYSTEM_B = "B" * 400


@dataclass
class Row:
    name: str
    gate: object = None


def _window() -> tuple[list[Row], list[str]]:
    prompts = [SYSTEM_A + "q0", SYSTEM_B + "q1", SYSTEM_A + "q2", "lonely q3", SYSTEM_B + "q4", SYSTEM_A + "q5"]
    return [Row(f"r{i}") for i in range(len(prompts))], prompts


def test_groups_keep_input_order_of_their_first_row_and_say_what_they_share() -> None:
    _, prompts = _window()
    groups = prefix_groups(prompts)
    assert [g for g, _ in groups] == [[0, 2, 5], [1, 4], [3]]
    assert [k for _, k in groups] == [401, 401, len("lonely q3")]  # the system prompt and the "q"


def test_siblings_wait_for_their_leader_while_other_rows_go_first() -> None:
    async def go() -> list[str]:
        q = SendQueue(maxsize=100, hold_s=30.0)
        rows, prompts = _window()
        await q.put_window(rows, prompts)
        first = [await q.get() for _ in range(3)]  # both leaders and the row of no group; siblings held
        assert [r.name for r in first] == ["r0", "r1", "r3"]
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # r2, r5, r4 are held: nothing else is eligible
        await q.open(first[1].gate)  # group B's leader answered
        got = [await waiting]
        await q.open(first[0].gate)
        got += [(await q.get()).name for _ in range(2)]
        return [got[0].name, *got[1:]]

    assert asyncio.run(go()) == ["r4", "r2", "r5"]


def test_a_held_group_is_released_at_the_hold_bound_without_an_answer() -> None:
    async def go() -> float:
        q = SendQueue(maxsize=100, hold_s=0.3)
        rows, prompts = _window()
        await q.put_window(rows, prompts)
        for _ in range(3):
            await q.get()
        t0 = time.monotonic()
        await q.get()
        return time.monotonic() - t0

    waited = asyncio.run(go())
    assert 0.2 <= waited < 2.0


def test_a_stop_waits_for_the_rows_queued_before_it_and_a_known_prefix_is_not_held() -> None:
    async def go() -> tuple[list[str], list[str]]:
        q = SendQueue(maxsize=100, hold_s=30.0)
        rows, prompts = _window()
        await q.put_window(rows, prompts)
        await q.put(None)
        taken = [await q.get() for _ in range(3)]
        for r in taken:
            if r.gate is not None:
                await q.open(r.gate)
        rest = [await q.get() for _ in range(4)]
        order = [r.name for r in taken] + [r.name if r is not None else "stop" for r in rest]
        # a later window of the same prefixes: answered before, so sent as it is
        again, _ = _window()
        await q.put_window(again, prompts)
        later = [(await q.get()).name for _ in range(6)]
        return order, later

    order, later = asyncio.run(go())
    assert order == ["r0", "r1", "r3", "r2", "r5", "r4", "stop"]
    assert later == ["r0", "r2", "r5", "r1", "r4", "r3"]
