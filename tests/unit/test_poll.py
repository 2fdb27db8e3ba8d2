"""The one poll loop: waits double up to their cap, never pass the deadline, and the check runs first."""

from __future__ import annotations

import time

from tasks.poll import Backoff, poll_until


def test_waits_double_to_their_cap_and_stop_at_the_deadline() -> None:
    waits: list[float] = []
    backoff = Backoff(timeout_s=60.0, first_s=1.0, max_s=4.0)
    for _ in range(5):
        assert backoff.wait(waits.append)  # a recording "sleep": no time passes
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.deadline = time.monotonic()  # the deadline has passed: no more waiting
    assert backoff.wait(waits.append) is False and len(waits) == 5


def test_a_wait_never_goes_past_the_deadline() -> None:
    waits: list[float] = []
    backoff = Backoff(timeout_s=0.5, first_s=10.0, max_s=10.0)
    assert backoff.wait(waits.append) and 0.0 < waits[0] <= 0.5


def test_poll_until_checks_first_and_reports_the_outcome() -> None:
    looks: list[int] = []

    def third_time() -> bool:
        looks.append(1)
        return len(looks) == 3

    slept: list[float] = []
    assert poll_until(third_time, 60.0, 0.1, 0.2, slept.append) is True
    assert (len(looks), slept) == (3, [0.1, 0.2])
    assert poll_until(lambda: True, 0.0, 1.0, 1.0, slept.append) is True  # true at once: no wait at all
    started = time.monotonic()
    assert poll_until(lambda: False, 0.2, 0.05, 0.05) is False
    assert time.monotonic() - started >= 0.2  # it looked until the deadline


def test_a_slower_growth_is_kept_to_its_factor() -> None:
    waits: list[float] = []
    backoff = Backoff(timeout_s=60.0, first_s=0.4, max_s=1.0, factor=1.5)
    for _ in range(4):
        backoff.wait(waits.append)
    assert [round(w, 3) for w in waits] == [0.4, 0.6, 0.9, 1.0]
