"""Whether a run's error is a person stopping it: the run ends CANCELLED (progress, summary, logs),
never as a crash or an error.

- ``prefect flow-run cancel`` or the UI's Cancel: the worker announces the cancel on Prefect's control
  channel, then sends SIGTERM, which Prefect raises as ``TerminationSignal`` in the flow. Without the
  channel (another kind of worker), the run's state in the API, Cancelling, tells it.
- Ctrl-C on ``datagen run``: ``KeyboardInterrupt``; a SIGTERM to ``datagen run`` (``kill``, a
  supervisor stopping it), which that command declares with :func:`sigterm_stops_the_run`.

In a worker's flow-run process, a SIGTERM nobody announced (the worker killed, the machine shutting
down) stays a crash.
"""

from __future__ import annotations

import logging
import signal

from prefect.client.orchestration import get_client

try:
    from prefect._internal.control_listener import get_intent
except ImportError:  # another Prefect: the API state still tells it
    get_intent = None  # type: ignore[assignment]

__all__ = ["cancel_announced", "declared_sigterm", "sigterm_stops_the_run", "stop_cause"]

_LOG = logging.getLogger(__name__)
_SIGTERM_CAUSE: list[str] = []


def sigterm_stops_the_run(cause: str) -> None:
    """Declare that a SIGTERM to this process is a person (or a supervisor) stopping the run."""
    _SIGTERM_CAUSE[:] = [cause]


def declared_sigterm() -> str | None:
    """The cause :func:`sigterm_stops_the_run` declared (None: a SIGTERM here is a crash)."""
    return _SIGTERM_CAUSE[0] if _SIGTERM_CAUSE else None


def cancel_announced() -> bool:
    """Whether Prefect's worker told this process, before its SIGTERM, that the run is cancelled."""
    return get_intent is not None and get_intent() == "cancel"


def _state_is_cancel(run_id: str | None) -> bool:
    if not run_id:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state  # type: ignore[arg-type]
    except Exception as exc:  # the API gone: the SIGTERM stays a crash
        _LOG.debug("flow run state not read: %s", exc)
        return False
    return state is not None and state.type.value in ("CANCELLING", "CANCELLED")


def stop_cause(error: BaseException | None, run_id: str | None = None) -> str | None:
    """How a person stopped the run (``None``: nobody did; the error is the run's own)."""
    if error is None:
        return None
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if getattr(error, "signal", None) != signal.SIGTERM:
        return None
    if cancel_announced() or _state_is_cancel(run_id):
        return "cancelled in Prefect (flow-run cancel or the UI)"
    return declared_sigterm()
