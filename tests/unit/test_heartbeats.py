"""The zombie automation's settings and document (datagen/_heartbeats.py) and the warning a run gives
when its heartbeats cannot satisfy it (flows/heartbeats.py). The automation at work, through `datagen
up` and a killed worker: tests/e2e/test_zombie.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from datagen._heartbeats import HeartbeatError, crash_after_s, heartbeat_s, zombie_automation
from flows.heartbeats import AUTOMATION_NAME, CRASH_MESSAGE_START, heartbeat_warning
from tests.support.paths import REPO_ROOT


def test_defaults_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAGEN_HEARTBEAT_S", raising=False)
    monkeypatch.delenv("DATAGEN_CRASH_AFTER_S", raising=False)
    assert (heartbeat_s(), crash_after_s()) == (30, 120)
    monkeypatch.setenv("DATAGEN_CRASH_AFTER_S", "300")
    assert crash_after_s() == 300 and crash_after_s(0) == 0  # an option wins over the environment


@pytest.mark.parametrize(("beat", "after", "needle"), [
    (20, None, "Prefect sends at most one every 30 s"),
    ("x", None, "give whole seconds"),
    (30, 59, "at least twice the heartbeat frequency (60 s"),
    (60, 90, "(120 s for heartbeats every 60 s)"),
    (30, -1, "or 0 to turn the automation off"),
])
def test_bounds_that_cannot_work_are_refused_naming_the_setting(beat: object, after: object, needle: str) -> None:
    with pytest.raises(HeartbeatError, match=r"\$DATAGEN_") as err:
        crash_after_s(after, heartbeat_s(beat))  # type: ignore[arg-type]
    assert needle in str(err.value)


def test_the_document_crashes_a_silent_datagen_deployment_run() -> None:
    doc = zombie_automation(120)
    trig = doc["trigger"]
    assert doc["name"] == AUTOMATION_NAME and doc["enabled"] is True
    assert (trig["posture"], trig["within"], trig["for_each"]) == ("Proactive", 120, ["prefect.resource.id"])
    assert set(trig["after"]) == {"prefect.flow-run.heartbeat", "prefect.flow-run.Pending", "prefect.flow-run.Running"}
    assert set(trig["expect"]) >= {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                   "prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.Cancelled"}
    assert {"prefect.resource.role": "flow", "prefect.resource.name": "datagen"} in trig["match_related"]
    (action,) = doc["actions"]
    assert (action["type"], action["state"], action["force"]) == ("change-flow-run-state", "CRASHED", True)
    assert action["message"].startswith(f"{CRASH_MESSAGE_START} for 120 s")
    assert zombie_automation(0)["enabled"] is False


def test_the_document_for_the_manual_steps_is_the_one_up_keeps() -> None:
    out = subprocess.run([sys.executable, "-m", "datagen._heartbeats", "180"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == zombie_automation(180)


def test_a_run_warns_when_its_heartbeats_are_too_slow_for_the_bound() -> None:
    assert heartbeat_warning(30, 120) is None and heartbeat_warning(180, None) is None
    slow = heartbeat_warning(180, 120)
    assert slow is not None and "every 180 s" in slow and "PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30" in slow
    assert "--crash-after-s 360" in slow
    off = heartbeat_warning(None, 120)
    assert off is not None and "sends no heartbeats" in off
