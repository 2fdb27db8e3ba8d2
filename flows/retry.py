"""Which failures a stage task retries: the "stage" layer of the retry table in
docs/architecture.md ("Retries: one owner per layer"), which also names the layers below it (the
client's request retries, the dispatcher's failover, the fraction search, the fleet's relaunches).

The rule, by class, never by name:

- a ``DatagenError`` is retried exactly when its ``retryable`` says so (see tasks.errors for the
  table: GPUs not yet clean, an unreachable target, a transient launch failure are; configuration
  errors, validation failures, a changed input, a locked output, a rejected request, a gone server,
  a fraction search that gave up are not);
- any other exception is retried only when it is transport-level: ``httpx.TransportError`` (except
  ``UnsupportedProtocol``, a bad URL), ``OSError`` (which covers ``ConnectionError`` and
  ``TimeoutError``); everything else (``TypeError``, ``ValueError``, ``KeyError``,
  ``AttributeError``, ``RuntimeError``, ...) is a bug or a refusal that a retry repeats.

The stage tasks are declared in ``tasks/<stage>/task.py`` without retries, and the flows call the
retried versions below. No other task is retried: ``infer-<dataset>`` leaves a lost server to its
lifecycle (flows.fleet relaunches it) and a failed request to the client, and what any other stage
raises a rerun of the same step would raise again.

=============== ======= ============================ ==============================================
task            retries delay between tries (s)      retried when
=============== ======= ============================ ==============================================
hygiene         2       2, 4                         ``retry_transient`` (GPUs not yet clean)
launch          2       3, 6                         ``retry_transient`` (a transient launch failure)
health          3       1, 2, 4                      always (``/health_generate`` not yet 200)
identify-server 3       1, 2, 4                      always (the shared server not yet answering)
=============== ======= ============================ ==============================================
"""

from __future__ import annotations

from typing import Any

import httpx
from prefect.tasks import exponential_backoff

from tasks.errors import DatagenError
from tasks.hygiene.task import hygiene as _hygiene
from tasks.server.task import health_check as _health_check
from tasks.server.task import identify_server as _identify_server
from tasks.server.task import launch_server as _launch_server

__all__ = [
    "health_check",
    "hygiene",
    "identify_server",
    "is_retryable",
    "launch_server",
    "retry_transient",
]


def is_retryable(exc: BaseException) -> bool:
    """Whether running the step that raised ``exc`` again, unchanged, can succeed (the rule above)."""
    if isinstance(exc, DatagenError):
        return exc.retryable
    if isinstance(exc, httpx.UnsupportedProtocol):
        return False
    return isinstance(exc, httpx.TransportError | OSError)


def _exception(state: Any) -> BaseException | None:
    # Prefect hands a retry condition the Failed state built around the exception (``state.data``).
    data = getattr(state, "data", None)
    return data if isinstance(data, BaseException) else None


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` of the retried stages (hygiene, launch, inference): the rule above. For
    the launch, ``LaunchFailed.retryable`` consults the failure kind (a bad flag, a missing model or
    too little host memory fail again).

    Args:
        task: the Prefect task (unused).
        task_run: the task run (unused).
        state: the failed state; ``state.data`` is the exception.
    """
    exc = _exception(state)
    return exc is not None and is_retryable(exc)


hygiene = _hygiene.with_options(retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2),
                                retry_condition_fn=retry_transient)
launch_server = _launch_server.with_options(retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=3),
                                            retry_condition_fn=retry_transient)
health_check = _health_check.with_options(retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1))
identify_server = _identify_server.with_options(retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=1))
