"""Zombie runs end by themselves: flow-run heartbeats and the automation that crashes a silent run.

A deployment run whose worker (or control host) dies stays Running in Prefect for ever (Prefect
leaves a crashed worker's runs as they are) and keeps its deployment's concurrency slot, so every
later run of the deployment, the nightly schedule's included, is cancelled "Deployment concurrency
limit reached". Prefect's own answer, used here: every flow run emits a ``prefect.flow-run.heartbeat``
event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (the flow-run process does, in a thread of
its own), and a proactive automation marks a run Crashed when neither a heartbeat nor a final state
came within a bound after its last heartbeat. A Crashed run releases the deployment's slot at once
(Prefect's orchestration rules); its ``gpu:<host>`` lease lapses within ``flows.gpulimit.LEASE_S``
and the next run releases it from the run record anyway; the next run resumes from the committed
shards (the output's manifest and journal, not Prefect, say what is done).

The worker decides the frequency: it passes its own ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` (Prefect's
default, 180 s, when unset) to every flow run it starts, over whatever the deployment's job variables
say. So `datagen up` and `datagen worker` start workers with ``HEARTBEAT_S`` (``$DATAGEN_HEARTBEAT_S``,
30 s: Prefect's minimum), and the automation's bound (``CRASH_AFTER_S``, ``$DATAGEN_CRASH_AFTER_S``,
120 s) must be at least twice it. A run whose worker beats slower than the bound allows warns at its
start (flows/heartbeats.py): it would be crashed while alive.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from datagen._prefect_api import PrefectApi
from flows.heartbeats import AUTOMATION_NAME, CRASH_MESSAGE_START, HEARTBEAT_S
from tasks.errors import DatagenError

__all__ = [
    "AUTOMATION_NAME", "CRASH_AFTER_ENV", "CRASH_AFTER_S", "CRASH_MESSAGE_START", "HEARTBEAT_ENV", "HEARTBEAT_S",
    "HeartbeatError", "crash_after_s", "crash_bound_on_server", "crash_message", "ensure_zombie_automation",
    "heartbeat_s", "zombie_automation",
]

HEARTBEAT_ENV = "DATAGEN_HEARTBEAT_S"
CRASH_AFTER_ENV = "DATAGEN_CRASH_AFTER_S"
CRASH_AFTER_S = 120
PREFECT_MIN_HEARTBEAT_S = HEARTBEAT_S


class HeartbeatError(DatagenError, ValueError):
    """A heartbeat frequency or crash bound that cannot work (names the setting)."""


def _int_setting(value: str | int | None, env: str, default: int, what: str) -> int:
    raw = os.environ.get(env, "").strip() if value is None else value
    if raw in ("", None):
        return default
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise HeartbeatError(f"{what} {raw!r} (${env} or its option): give whole seconds") from None
    return n


def heartbeat_s(value: str | int | None = None) -> int:
    """The workers' heartbeat frequency: ``value``, else ``$DATAGEN_HEARTBEAT_S``, else 30.

    Raises:
        HeartbeatError: not a whole number, or under Prefect's minimum of 30 s.
    """
    n = _int_setting(value, HEARTBEAT_ENV, HEARTBEAT_S, "heartbeat frequency")
    if n < PREFECT_MIN_HEARTBEAT_S:
        raise HeartbeatError(f"heartbeat frequency {n} s (${HEARTBEAT_ENV} or --heartbeat-s): Prefect sends "
                             f"at most one every {PREFECT_MIN_HEARTBEAT_S} s; give {PREFECT_MIN_HEARTBEAT_S} or more")
    return n


def crash_after_s(value: str | int | None = None, heartbeat: int | None = None) -> int:
    """How long a run may stay silent before the automation crashes it: ``value``, else
    ``$DATAGEN_CRASH_AFTER_S``, else 120; 0 turns the automation off (it is kept, disabled).

    Raises:
        HeartbeatError: not a whole number, negative, or under twice the heartbeat frequency (one
            late heartbeat on a loaded host would crash a live run).
    """
    n = _int_setting(value, CRASH_AFTER_ENV, CRASH_AFTER_S, "crash bound")
    beat = heartbeat_s() if heartbeat is None else heartbeat
    if n < 0 or 0 < n < 2 * beat:
        raise HeartbeatError(f"crash bound {n} s (${CRASH_AFTER_ENV} or --crash-after-s): give at least twice "
                             f"the heartbeat frequency ({2 * beat} s for heartbeats every {beat} s), or 0 to turn "
                             "the automation off")
    return n


def crash_message(after_s: int) -> str:
    return (f"{CRASH_MESSAGE_START} for {after_s} s: the worker or control host running this flow run stopped "
            "(killed, OOM-killed, rebooted or cut off); marked Crashed by the automation "
            f"{AUTOMATION_NAME!r}. Its deployment's concurrency slot is free; the next run resumes after the "
            "committed shards.")


def zombie_automation(after_s: int) -> dict[str, Any]:
    """The automation document (``POST /automations/`` body): after a heartbeat of a datagen
    deployment run (or its Pending or Running state), expect a heartbeat or a final state within
    ``after_s``; if none comes,
    change the run to Crashed (forced: Running -> Crashed is what the run's own engine would
    propose). ``after_s`` 0: the same document, disabled."""
    final = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    return {
        "name": AUTOMATION_NAME,
        "description": "Marks a datagen deployment run Crashed when its flow-run heartbeats stop (its worker or "
                       "control host died); managed by `datagen up` (--crash-after-s / $DATAGEN_CRASH_AFTER_S).",
        "enabled": after_s > 0,
        "trigger": {
            "type": "event",
            "posture": "Proactive",
            # A run killed before its first heartbeat (about 5 s after its start) is caught too: its
            # Pending or Running event starts the clock as a heartbeat would.
            "after": ["prefect.flow-run.heartbeat", "prefect.flow-run.Pending", "prefect.flow-run.Running"],
            "expect": ["prefect.flow-run.heartbeat", *final],
            "match": {"prefect.resource.id": "prefect.flow-run.*"},
            "match_related": [
                {"prefect.resource.role": "flow", "prefect.resource.name": "datagen"},
                {"prefect.resource.role": "deployment", "prefect.resource.id": "prefect.deployment.*"},
            ],
            "for_each": ["prefect.resource.id"],
            "threshold": 1,
            "within": max(after_s, 2 * HEARTBEAT_S),
        },
        "actions": [{"type": "change-flow-run-state", "state": "CRASHED", "name": "Crashed",
                     "message": crash_message(max(after_s, 2 * HEARTBEAT_S)), "force": True}],
        "actions_on_trigger": [],
        "actions_on_resolve": [],
    }


def ensure_zombie_automation(api_url: str, after_s: int) -> dict[str, Any]:
    """Create the zombie automation, or update it (found by name, never a second) only when its
    document changed: every update gives the trigger a new id, and Prefect then forgets the clocks
    it was running, so a `datagen up` that brings a dead worker back would otherwise let the run that
    worker left behind stay Running for ever. The document's digest, in its description, says whether
    it changed. Returns ``{"id", "created", "updated", "enabled", "within"}``.

    Raises:
        httpx.HTTPError: the API refused or did not answer.
    """
    doc = zombie_automation(after_s)
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]
    doc["description"] += f" [document {digest}]"
    with PrefectApi(api_url) as http:
        found = http.post("/automations/filter",
                          json={"automations": {"name": {"any_": [AUTOMATION_NAME]}}}).raise_for_status().json()
        updated = False
        if not found:
            auto_id = str(http.post("/automations/", json=doc).raise_for_status().json()["id"])
        else:
            auto_id = str(found[0]["id"])
            if found[0].get("description") != doc["description"]:
                http.put(f"/automations/{auto_id}", json=doc).raise_for_status()
                updated = True
    return {"id": auto_id, "created": not found, "updated": updated, "enabled": doc["enabled"],
            "within": doc["trigger"]["within"]}


def crash_bound_on_server(api_url: str) -> int | None:
    """The zombie automation's bound on the server at ``api_url`` (None: absent or disabled).

    Raises:
        httpx.HTTPError: the API refused or did not answer.
    """
    with PrefectApi(api_url, timeout=10.0) as http:
        found = http.post("/automations/filter",
                          json={"automations": {"name": {"any_": [AUTOMATION_NAME]}}}).raise_for_status().json()
    if not found or not found[0].get("enabled"):
        return None
    within = found[0].get("trigger", {}).get("within")
    return int(within) if within is not None else None


if __name__ == "__main__":  # `python -m datagen._heartbeats [BOUND_S]`: the document, for `prefect automation create`
    import sys

    print(json.dumps(zombie_automation(crash_after_s(sys.argv[1] if len(sys.argv) > 1 else None))))
