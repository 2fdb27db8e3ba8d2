"""What a deployment run checks of its own heartbeats at its start (the zombie automation that `datagen
up` keeps: datagen/_heartbeats.py).

The worker sets the flow run's heartbeat frequency; the automation crashes a run silent for its
bound. A run whose heartbeats are too slow for the bound would be marked Crashed while alive (its
output lock keeps a second run out, but the deployment's slot would be given to one), so it says so,
once, at its start.
"""

from __future__ import annotations

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import deployment
from prefect.settings import get_current_settings

__all__ = ["AUTOMATION_NAME", "CRASH_MESSAGE_START", "HEARTBEAT_S", "check_heartbeats", "heartbeat_warning"]

AUTOMATION_NAME = "datagen: crash runs whose heartbeats stopped"
HEARTBEAT_S = 30  # Prefect's minimum (prefect.flow_engine.MINIMUM_HEARTBEAT_INTERVAL)
# The Crashed state's message starts so: `datagen status`, the notification and the tests tell a run
# crashed for silence from one whose own process reported its crash.
CRASH_MESSAGE_START = "datagen: no heartbeat"


def heartbeat_warning(frequency_s: int | None, bound_s: int | None) -> str | None:
    """What a run says when its heartbeats (``frequency_s``, None: off) cannot satisfy the zombie
    automation's bound (``bound_s``, None: no automation): it may be crashed while alive, or never."""
    if bound_s is None:
        return None
    if frequency_s is None:
        return (f"this flow run sends no heartbeats, so the automation {AUTOMATION_NAME!r} cannot tell it is "
                f"alive: start its worker with PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_S} (`datagen worker` "
                "does)")
    if 2 * frequency_s > bound_s:
        return (f"this flow run sends a heartbeat every {frequency_s} s, but the automation {AUTOMATION_NAME!r} "
                f"crashes a run silent for {bound_s} s: it may be marked Crashed while alive; start its worker "
                f"with PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_S} (`datagen worker` does) or raise the "
                f"bound (`datagen up --crash-after-s {2 * frequency_s}`)")
    return None


def check_heartbeats() -> str | None:
    """In a deployment run: warn in the run's log (and return the warning) when this run's heartbeat
    frequency does not fit the server's zombie automation. Outside one, or when the API cannot say:
    None."""
    logger = get_run_logger()
    if not deployment.id:
        return None  # ad hoc runs are not watched by the automation (it matches deployment runs)
    try:
        with get_client(sync_client=True) as client:
            found = client.read_automations_by_name(AUTOMATION_NAME)
    except Exception as exc:  # observability must never fail the run
        logger.debug("zombie automation not read: %s", exc)
        return None
    auto = found[0] if found else None
    bound = getattr(auto.trigger, "within", None) if auto is not None and auto.enabled else None
    bound_s = int(bound.total_seconds()) if bound is not None else None
    warning = heartbeat_warning(get_current_settings().flows.heartbeat_frequency, bound_s)
    if warning:
        logger.warning("%s", warning)
    return warning
