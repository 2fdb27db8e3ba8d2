"""flows.retry decides by class, through the Failed state Prefect hands a ``retry_condition_fn``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prefect.states import Completed, Failed

from flows import retry
from flows.retry import is_retryable, retry_transient
from tasks.config import ConfigError
from tasks.hygiene import GpusNotClean
from tasks.inference import PromptTooLong, RequestRejected, ServerGone
from tasks.server import Failure, LaunchFailed
from tasks.shards import InputChanged, OutputLocked
from tasks.targets import TargetUnreachable
from tasks.validation import ValidationFailed


class ConfigErrorOfAStage(ConfigError):
    """A subclass a stage might define: it must not be retried either."""


class ValidationFailedHard(ValidationFailed):
    pass


class ServerGoneForGood(ServerGone):
    pass


def _failed(exc: BaseException) -> Failed:
    return Failed(data=exc, message=f"Task run encountered an exception: {exc!r}")


def _launch_failed(kind: str) -> LaunchFailed:
    return LaunchFailed(Failure(kind, "why"), "log tail")  # type: ignore[arg-type]


NEVER_RETRIED = [
    ConfigError("bad key"),
    ConfigErrorOfAStage("bad key"),
    ValidationFailed("shard 3 failed", report=None),  # type: ignore[arg-type]
    ValidationFailedHard("shard 3 failed", report=None),  # type: ignore[arg-type]
    InputChanged("shard size", 10, 20, "choose another --out"),
    OutputLocked(Path("/out/_lock"), {"pid": 1}),
    RequestRejected(400, "bad request"),
    PromptTooLong(400, "too long"),
    ServerGone("the server stopped answering"),
    ServerGoneForGood("gone"),
    _launch_failed("bad_flag"),
    _launch_failed("model_not_found"),
    _launch_failed("host_memory"),
    _launch_failed("too_high"),  # the fraction search owns these: a stage retry would repeat it
    _launch_failed("too_low"),
    TypeError("a bug"),
    ValueError("a bug"),
    KeyError("a bug"),
    AttributeError("a bug"),
    RuntimeError("not transport-level"),
    httpx.UnsupportedProtocol("ftp://x"),
]
RETRIED = [
    GpusNotClean("GPUs on h not verified clean"),
    TargetUnreachable("ssh://h", "connection refused"),  # type: ignore[arg-type]
    _launch_failed("timeout"),
    _launch_failed("unknown"),
    httpx.ConnectError("refused"),
    httpx.ReadTimeout("slow"),
    httpx.RemoteProtocolError("peer closed"),
    ConnectionResetError("reset"),
    TimeoutError("timed out"),
    OSError("disk hiccup"),
]


def _id(exc: BaseException) -> str:
    kind = getattr(getattr(exc, "failure", None), "kind", None)
    return f"{type(exc).__name__}({kind})" if kind else type(exc).__name__


@pytest.mark.parametrize("exc", NEVER_RETRIED, ids=_id)
def test_never_retried(exc: BaseException) -> None:
    assert is_retryable(exc) is False
    assert retry_transient(None, None, _failed(exc)) is False


@pytest.mark.parametrize("exc", RETRIED, ids=_id)
def test_retried(exc: BaseException) -> None:
    assert is_retryable(exc) is True
    assert retry_transient(None, None, _failed(exc)) is True


def test_a_state_without_an_exception_is_not_retried() -> None:
    assert retry_transient(None, None, Completed(data=3)) is False
    assert retry_transient(None, None, Failed(message="crashed")) is False


def test_the_retried_stages_carry_the_table_of_the_module_docstring() -> None:
    table = {t.name: (t.retries, t.retry_condition_fn) for t in
             (retry.hygiene, retry.launch_server, retry.health_check, retry.identify_server)}
    assert {name: r for name, (r, _) in table.items()} == {
        "hygiene": 2, "launch_server": 2, "health_check": 3, "identify-server": 3}
    assert {name for name, (_, fn) in table.items() if fn is retry_transient} == {"hygiene", "launch_server"}
    assert {name for name, (_, fn) in table.items() if fn is None} == {"health_check", "identify-server"}
