"""Run logs a person can read: a filter on Prefect's run loggers, installed by the flow module.

- ``Finished in state Completed()`` of each task run is dropped (the task run's state says it; the
  flow run's own final line stays).
- An expected failure, a ``DatagenError`` (classified: a retry decision and an exit code), is told
  once, by the flow run, as ``<Error>: <message>`` without a traceback: the task run's failure
  lines about it are dropped, the flow run's final state line points up to it, and the engine's
  ``Engine execution exited with unexpected exception`` (a worker's flow-run process) is dropped. Any other
  exception, a bug, keeps Prefect's lines and traceback.
- ``View at <url>`` of a run on the API ``datagen run`` started for itself says that the link lives
  only while the command runs.
- A cancelled run (flows/cancel.py: the worker announced it) is not a crash: the task run's
  ``Crash detected! ... termination signal`` becomes one line saying the task stopped for the cancel,
  its ``Finished in state Crashed(...)`` is dropped, and the flow run's ``Finished in state Running()``
  (the worker, not this process, records Cancelled) says ``Finished: cancelled``. Ctrl-C, or a
  SIGTERM to ``datagen run``, likewise: ``Crash detected! ...`` says ``stopped: interrupted (Ctrl-C)``
  and the task runs' ``Finished in state Crashed(...)`` are dropped (the flow run's final state line,
  Crashed in Prefect, stays).
"""

from __future__ import annotations

import logging
import os
import re

from flows.cancel import cancel_announced, declared_sigterm
from tasks.config import OWNED_API_ENV
from tasks.errors import DatagenError

__all__ = ["RunLogFilter", "install", "is_expected"]

_TASK_FAILED = re.compile(r"encountered an exception (\w+):")
_FLOW_FAILED = re.compile(r"^Finished in state (\w+)\('Flow run encountered an exception: (\w+):")


def _error_names() -> set[str]:
    names, todo = set(), [DatagenError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def is_expected(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a classified datagen error (told once, without a traceback)."""
    return isinstance(exc, DatagenError)


class RunLogFilter(logging.Filter):
    """The rules of the module docstring, for ``prefect.task_runs`` and ``prefect.flow_runs``."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        exc = record.exc_info[1] if record.exc_info else None
        cause = _stopped_by(msg)
        if cause is not None:
            return self._stopped(record, msg, cause)
        if msg.startswith("View at ") and (own := os.environ.get(OWNED_API_ENV)) and \
                msg.removeprefix("View at ").startswith(own.removesuffix("/api")):
            record.msg = f"{msg} (while this command runs: its own Prefect API stops when it ends; " \
                         "`make up` keeps a server and its UI)"
            record.args = None
            return True
        if record.name == "prefect.task_runs":
            if msg.startswith("Finished in state Completed("):
                return False
            if is_expected(exc):
                return False  # "Task run failed with exception": the flow run tells it
            found = _TASK_FAILED.search(msg) if msg.startswith("Finished in state ") else None
            return not (found and found.group(1) in _error_names())
        if is_expected(exc) and msg == "Engine execution exited with unexpected exception":
            return False  # the worker's flow-run process: told above, its traceback is noise
        if is_expected(exc) and msg.startswith("Encountered exception during execution"):
            assert exc is not None
            record.msg, record.args = "%s: %s", (type(exc).__name__, exc)
            record.exc_info, record.exc_text = None, None
            return True
        found = _FLOW_FAILED.match(msg)
        if found and found.group(2) in _error_names():
            record.msg, record.args = "Finished in state %s: %s (above)", (found.group(1), found.group(2))
        return True

    @staticmethod
    def _stopped(record: logging.LogRecord, msg: str, cause: str) -> bool:
        if msg.startswith("Crash detected! "):
            record.msg, record.args = f"stopped: {cause}", None
        elif msg == "Finished in state Running()":
            record.msg, record.args = "Finished: cancelled (the worker records the Cancelled state)", None
        else:  # Finished in state Crashed(...): the task run's is dropped, the flow run's stays
            return record.name != "prefect.task_runs"
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        return True


def _stopped_by(msg: str) -> str | None:
    """Who stopped the run, for Prefect's lines about the signal that did (None: another line)."""
    if not msg.startswith(("Crash detected! ", "Finished in state Crashed(", "Finished in state Running()")):
        return None
    if "aborted by an interrupt signal" in msg:
        return "interrupted (Ctrl-C)"
    if "termination signal" in msg or msg == "Finished in state Running()":
        if cancel_announced():
            return "the flow run was cancelled"
        if "termination signal" in msg:
            return declared_sigterm()
    return None


_FILTER = RunLogFilter()


def install() -> None:
    """Add the filter to Prefect's run loggers (once per process)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
