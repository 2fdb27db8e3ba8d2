"""Which failures a stage task retries, and which the flow answers by relaunching the server.

The rule, by class, never by name:

- a ``DatagenError`` is retried exactly when its ``retryable`` says so (see tasks.errors for the
  table: GPUs not yet clean, an unreachable target, a transient launch failure are; configuration
  errors, validation failures, a changed input, a locked output, a rejected request are not);
- any other exception is retried only when it is transport-level: ``httpx.TransportError`` (except
  ``UnsupportedProtocol``, a bad URL), ``OSError`` (which covers ``ConnectionError`` and
  ``TimeoutError``); everything else (``TypeError``, ``ValueError``, ``KeyError``,
  ``AttributeError``, ``RuntimeError``, ...) is a bug or a refusal that a retry repeats.

``ServerGone`` is not retryable in place: the flow stops the dead server, relaunches it and resumes
from disk (``needs_relaunch``).
"""

from __future__ import annotations

from typing import Any

import httpx

from tasks.errors import DatagenError
from tasks.inference import ServerGone

__all__ = ["is_retryable", "needs_relaunch", "retry_launch", "retry_transient"]


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
    """``retry_condition_fn`` for stages whose errors follow the rule above (hygiene, inference).

    Args:
        task: the Prefect task (unused).
        task_run: the task run (unused).
        state: the failed state; ``state.data`` is the exception.
    """
    exc = _exception(state)
    return exc is not None and is_retryable(exc)


def retry_launch(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` for the server launch: ``LaunchFailed.retryable`` consults the failure
    kind (a bad flag, a missing model or too little host memory fail again), otherwise the rule above.
    """
    return retry_transient(task, task_run, state)


def needs_relaunch(exc: BaseException) -> bool:
    """Whether the flow should stop the server, relaunch it and resume: the server is gone.

    A task re-raises its own exception in the flow body, so ``exc`` is the ``ServerGone`` itself.
    """
    return isinstance(exc, ServerGone)
