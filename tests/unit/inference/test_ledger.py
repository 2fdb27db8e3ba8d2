"""The GPU-time ledger's arithmetic on a clock the test moves: every second in one bucket, shares by
occupancy, discards, drops, modes, goodput and the low-goodput watch."""

from __future__ import annotations

import pytest

from flows.fleet import GoodputWatch
from tasks.inference import Bucket, Capacity, Ledger, LedgerView, Mode, RunLedger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def at(self, t: float) -> None:
        self.t = 100.0 + t


def _ledger(gpus: int = 2) -> tuple[Ledger, Clock]:
    clock = Clock()
    return Ledger(gpus, clock), clock


def _s(ledger: Ledger) -> dict[str, float]:
    return {b: round(s, 6) for b, s in ledger.view().seconds.items() if s}


def test_steps_then_a_full_batch_then_stop_sum_to_the_wall_time() -> None:
    led, clock = _ledger()
    led.step(Bucket.HYGIENE)
    clock.at(1)
    led.step(Bucket.LAUNCH)
    clock.at(3)
    led.step(Bucket.HEALTH)
    clock.at(4)
    led.serve(4, Mode.ROWS)
    tickets = [led.begin() for _ in range(4)]
    clock.at(6)
    shares = [led.finish(t, kept=True, tokens=10) for t in tickets]
    assert shares == pytest.approx([0.5] * 4)  # 2 s of a full batch of 4, a quarter each
    clock.at(7)  # nothing in flight, rows to come: idle
    led.step(Bucket.STOP)
    clock.at(7.5)
    led.end()
    clock.at(50)  # after the end nothing is counted
    assert _s(led) == {"hygiene": 1, "launch": 2, "health": 1, "serving": 2, "idle": 1, "stop": 0.5}
    view = led.view()
    assert view.total_s == pytest.approx(7.5) and view.kept_tokens == 40 and view.gpus == 2


def test_an_under_filled_batch_splits_into_serving_and_empty_slots() -> None:
    led, clock = _ledger()
    led.serve(4, Mode.ROWS)
    a, b = led.begin(), led.begin()
    clock.at(2)
    assert led.finish(a, kept=True) == pytest.approx(0.5)
    assert led.finish(b, kept=True) == pytest.approx(0.5)
    assert _s(led) == {"serving": 1.0, "underfilled": 1.0}


def test_more_requests_than_slots_share_the_whole_time() -> None:
    led, clock = _ledger()
    led.serve(2, Mode.ROWS)
    tickets = [led.begin() for _ in range(4)]  # two queued at the server
    clock.at(2)
    assert sum(led.finish(t, kept=True) for t in tickets) == pytest.approx(2.0)
    assert _s(led) == {"serving": 2.0}


def test_a_discarded_answer_moves_its_share_and_tokens_to_wasted() -> None:
    led, clock = _ledger()
    led.serve(1, Mode.ROWS)
    t = led.begin()
    clock.at(3)
    share = led.finish(t, kept=True, tokens=30)
    led.discard(share, 30)
    view = led.view()
    assert _s(led) == {"wasted": 3.0} and (view.kept_tokens, view.wasted_tokens) == (0, 30)


def test_a_drop_wastes_what_was_in_flight_and_a_late_answer_counts_nothing_more() -> None:
    led, clock = _ledger()
    led.serve(2, Mode.ROWS)
    a, b = led.begin(), led.begin()
    clock.at(1)
    assert led.finish(a, kept=True, tokens=5) == pytest.approx(0.5)
    clock.at(2)
    led.step(Bucket.RELAUNCH)  # the pool dropped the server: b was in flight 2 s at a half slot... less a's
    assert led.finish(b, kept=False, tokens=7) == 0.0
    clock.at(5)
    led.serve(2, Mode.ROWS)
    clock.at(6)
    assert _s(led) == {"serving": 0.5, "underfilled": 0.5, "wasted": 1.0, "relaunch": 3.0, "idle": 1.0}
    assert led.view().wasted_tokens == 7


def test_empty_slots_after_the_input_ended_are_drain_then_validation_and_between_datasets_idle() -> None:
    led, clock = _ledger()
    led.serve(4, Mode.ROWS)
    t = led.begin()
    led.set_mode(Mode.DRAIN)
    clock.at(4)
    led.finish(t, kept=True)
    clock.at(5)
    led.set_mode(Mode.BETWEEN)
    clock.at(7)
    assert _s(led) == {"serving": 1.0, "drain": 3.0, "validation": 1.0, "idle": 2.0}


def test_slots_learned_after_the_spell_began_and_requests_in_flight_read_as_serving() -> None:
    led, clock = _ledger()
    led.serve(None, Mode.ROWS)
    led.set_slots(4)
    led.set_slots(9)  # only the first is taken
    t = led.begin()
    clock.at(2)
    assert _s(led) == {"serving": 0.5, "underfilled": 1.5}
    assert led.view().total_s == pytest.approx(2.0)
    assert led.finish(t, kept=True) == pytest.approx(0.5)


def test_goodput_is_kept_tokens_over_capacity_times_time_and_the_run_weighs_gpus() -> None:
    led, clock = _ledger(gpus=2)
    led.capacity = Capacity(tokens_per_s=100.0, slots=4)
    led.serve(4, Mode.ROWS)
    t = led.begin()
    clock.at(10)
    led.finish(t, kept=True, tokens=250)
    assert led.view().goodput == pytest.approx(0.25)
    other, clock2 = _ledger(gpus=0)  # a shared server: its seconds count as one GPU's
    other.step(Bucket.HEALTH)
    clock2.at(5)
    run = RunLedger({"a": led.view(), "b": other.view()})
    assert run.total_gpu_s == pytest.approx(25.0)
    assert run.goodput is None  # b's capacity is unknown: no run figure stands in for it
    other.capacity = Capacity(tokens_per_s=50.0, slots=1)
    run = RunLedger({"a": led.view(), "b": other.view()})
    assert run.goodput == pytest.approx(250 / (100 * 10 + 50 * 5))
    assert run.biggest_loss() == ("underfilled", pytest.approx(15.0))
    back = RunLedger.from_dict(run.to_dict())
    assert back is not None and back.to_dict() == run.to_dict()
    text = "\n".join(run.markdown())
    assert "| serving at full batch (kept rows) | 5.0 | 20.0% |" in text
    assert "| **total** | **25.0** | 100% | |" in text


def _view(kept: int, seconds: float, serving: float) -> LedgerView:
    return LedgerView({"serving": serving, "idle": seconds - serving}, 1, kept, 0, Capacity(10.0, 1))


def test_the_watch_warns_once_per_low_spell_naming_the_biggest_loss() -> None:
    watch = GoodputWatch(0.5, 10.0)
    assert watch.observe(RunLedger({"s": _view(0, 0, 0)}), now=0.0) is None
    assert watch.observe(RunLedger({"s": _view(20, 5, 2)}), now=5.0) is None  # not a whole window yet
    warning = watch.observe(RunLedger({"s": _view(30, 10, 3)}), now=10.0)
    assert warning == ("goodput 30% over the last 0m10s, below run.goodput_warn_below 50%; the biggest loss is "
                       "idle, waiting for rows: 70% of the GPU-time")
    assert watch.observe(RunLedger({"s": _view(40, 15, 4)}), now=15.0) is None  # said once
    # the window [10, 20]: 90 tokens in 10 s of capacity 10 -> 90%: above, then low again warns again
    assert watch.observe(RunLedger({"s": _view(120, 20, 12)}), now=20.0) is None
    assert watch.observe(RunLedger({"s": _view(125, 30, 12.5)}), now=30.0) is not None
    assert GoodputWatch(0.0, 10.0).observe(RunLedger({"s": _view(0, 99, 0)}), now=99.0) is None


def test_a_request_waiting_behind_the_slots_holds_nothing_until_one_frees() -> None:
    led, clock = _ledger()
    led.serve(1, Mode.ROWS)
    a, b = led.begin(), led.begin()  # b waits at the server behind a
    clock.at(2)
    assert led.finish(a, kept=True) == pytest.approx(2.0)
    clock.at(3)
    assert led.finish(b, kept=False, tokens=4) == pytest.approx(1.0)  # it ran from 2 to 3 only
    c = led.begin()
    assert led.finish(c, kept=True) == 0.0
    assert _s(led) == {"serving": 2.0, "wasted": 1.0}
