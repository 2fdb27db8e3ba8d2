"""flows.gpulimit: the slot wait bound from the environment."""

from __future__ import annotations

import pytest

from flows.gpulimit import SLOT_WAIT_S, seconds_from_env, slot_wait_s


def test_seconds_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAGEN_SLOT_WAIT_S", raising=False)
    assert slot_wait_s() == SLOT_WAIT_S == 300.0
    monkeypatch.setenv("DATAGEN_SLOT_WAIT_S", " 2.5 ")
    assert slot_wait_s() == 2.5
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("X_S", bad)
        with pytest.raises(ValueError, match=f"X_S={bad!r}: expected a positive number of seconds"):
            seconds_from_env("X_S", 1.0)
