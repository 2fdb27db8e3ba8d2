"""The collector's young generation while rows stream (tasks.inference._gc, decision 114)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from tasks.inference._gc import GEN0_WHILE_STREAMING, young_generation
from tests.support.inference import EMU_ARGS, assert_exactly_once, run, write_input


@pytest.fixture(autouse=True)
def default_thresholds() -> Iterator[None]:
    """Every test starts from CPython's defaults and leaves the process as it found it."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def test_raised_inside_and_put_back_after_even_on_error():
    with young_generation():
        assert gc.get_threshold() == (GEN0_WHILE_STREAMING, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(KeyError), young_generation():
        raise KeyError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_nested_and_concurrent_streams_share_one_raise():
    inside = threading.Barrier(3)
    leave = threading.Event()
    seen: list[tuple[int, int, int]] = []

    def stream() -> None:
        with young_generation():
            inside.wait(timeout=10)
            leave.wait(timeout=10)
            seen.append(gc.get_threshold())

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(timeout=10)
    with young_generation():  # a nested one in this thread too
        pass
    assert gc.get_threshold()[0] == GEN0_WHILE_STREAMING  # the two threads still stream
    leave.set()
    for t in threads:
        t.join(timeout=10)
    assert seen == [(GEN0_WHILE_STREAMING, 10, 10)] * 2
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("user", [(0, 10, 10), (50_000, 5, 5)], ids=["collection-off", "already-higher"])
def test_a_users_threshold_is_left_alone(user):
    gc.set_threshold(*user)
    with young_generation():
        assert gc.get_threshold() == user
    assert gc.get_threshold() == user


def test_a_threshold_changed_meanwhile_is_not_overwritten():
    with young_generation():
        gc.set_threshold(2000, 10, 10)  # something else in the process chose its own
    assert gc.get_threshold() == (2000, 10, 10)


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS)


def test_run_dataset_streams_with_the_raise_and_puts_it_back(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 40)
    during: list[int] = []

    def stop_at_second(rec):
        during.append(gc.get_threshold()[0])
        if rec.index == 1:
            raise RuntimeError("validation failed")

    with pytest.raises(RuntimeError, match="validation failed"):
        run(inp, out, emulator.url, on_shard_committed=stop_at_second)
    assert during and set(during) == {GEN0_WHILE_STREAMING}
    assert gc.get_threshold() == (700, 10, 10)
    r = run(inp, out, emulator.url)
    assert r.complete
    assert_exactly_once(out, ids)
    assert gc.get_threshold() == (700, 10, 10)
