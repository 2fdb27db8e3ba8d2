"""The error hierarchy by class: every public exception of tasks/, flows/ and datagen/ has the root
``DatagenError``, says whether a retry can help, and maps to one exit code of the command line."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

from datagen._api_server import ApiServerError
from datagen._cli import EXIT_FAILED, EXIT_USAGE, exit_code_for, exit_codes, reports_errors
from datagen._database import DatabaseUnreachable
from datagen._heartbeats import HeartbeatError
from datagen._notify import NotifyError
from datagen.cli import COMMANDS
from datagen.cmd_up import UpError
from flows.gpulimit import SlotTimeout
from flows.lifecycle import IllegalMove
from tasks.config import ConfigError
from tasks.errors import DatagenError
from tasks.export import ExportError
from tasks.files import UnsafeFile, WriteFailed
from tasks.hygiene import GpusNotClean, NoGpus, ProbeFailed
from tasks.inference import ClientError, PromptTooLong, RequestRejected, ServerGone
from tasks.prompts import TemplateError
from tasks.server import (
    Failure,
    LaunchFailed,
    MemoryStoreError,
    ServerConfigError,
    ServerError,
    StopFailed,
)
from tasks.shards import (
    DamagedShards,
    InputChanged,
    ManifestError,
    OutputLocked,
    ShardsError,
    UnrecordedShards,
)
from tasks.targets import TargetError, TargetUnreachable
from tasks.validation import BadOutput, ThresholdError, ValidationFailed

PACKAGES = ("tasks", "flows", "datagen")

RETRYABLE: set[type[DatagenError]] = {GpusNotClean, ProbeFailed, StopFailed, TargetUnreachable}
NOT_RETRYABLE: set[type[DatagenError]] = {
    DatagenError, ConfigError, TemplateError, TargetError, ServerError, ServerConfigError, MemoryStoreError, ClientError,
    ServerGone, RequestRejected, PromptTooLong, ShardsError, OutputLocked, InputChanged, ManifestError,
    ExportError, ThresholdError, BadOutput, ValidationFailed, UpError, DamagedShards, UnrecordedShards, UnsafeFile,
    SlotTimeout, ApiServerError, NotifyError, DatabaseUnreachable, WriteFailed, NoGpus, HeartbeatError, IllegalMove,
}
BY_KIND = {LaunchFailed}  # retryable depends on the instance's failure kind

USAGE: set[type[DatagenError]] = {
    ConfigError, TemplateError, TargetError, ServerConfigError, ThresholdError, ShardsError, OutputLocked,
    InputChanged, ManifestError, ExportError, BadOutput, TargetUnreachable, ProbeFailed, DamagedShards,
    UnrecordedShards, UnsafeFile, NotifyError, DatabaseUnreachable, HeartbeatError,
}
FAILED: set[type[DatagenError]] = {
    DatagenError, GpusNotClean, NoGpus, ServerError, LaunchFailed, StopFailed, MemoryStoreError, ClientError, ServerGone,
    RequestRejected, PromptTooLong, ValidationFailed, UpError, SlotTimeout, ApiServerError, WriteFailed, IllegalMove,
}


def _public_exceptions() -> set[type[BaseException]]:
    """Every public exception class defined in a module of PACKAGES (private modules included)."""
    found: set[type[BaseException]] = set()
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg_name}."):
            if info.name.endswith(".__main__"):  # runs the command line when imported
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (isinstance(obj, type) and issubclass(obj, BaseException)
                        and obj.__module__ == module.__name__ and not name.startswith("_")):
                    found.add(obj)
    return found


def _bare(cls: type[BaseException]) -> BaseException:
    """An instance without running ``__init__`` (the class decides retryable and the exit code)."""
    return cls.__new__(cls)


def _launch_failed(kind: str) -> LaunchFailed:
    return LaunchFailed(Failure(kind, "why"), "log tail")  # type: ignore[arg-type]


def test_every_public_exception_has_the_root() -> None:
    found = _public_exceptions()
    assert len(found) >= 24, sorted(c.__qualname__ for c in found)  # the walk really found them
    without = sorted(f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, DatagenError))
    assert without == []


def test_every_public_exception_has_a_retry_decision_and_an_exit_code() -> None:
    found = _public_exceptions()
    assert found == RETRYABLE | NOT_RETRYABLE | BY_KIND
    assert found == USAGE | FAILED
    assert not RETRYABLE & NOT_RETRYABLE and not USAGE & FAILED


def test_the_root_is_not_retryable_by_default() -> None:
    assert DatagenError.retryable is False
    assert DatagenError("x").retryable is False


@pytest.mark.parametrize("cls", sorted(RETRYABLE, key=lambda c: c.__name__))
def test_retryable(cls: type[DatagenError]) -> None:
    assert _bare(cls).retryable is True


@pytest.mark.parametrize("cls", sorted(NOT_RETRYABLE, key=lambda c: c.__name__))
def test_not_retryable(cls: type[DatagenError]) -> None:
    assert _bare(cls).retryable is False


@pytest.mark.parametrize(("kind", "retryable"), [
    ("bad_flag", False), ("model_not_found", False), ("host_memory", False),
    ("too_high", False), ("too_low", False),  # the fraction search owns these (docs/architecture.md)
    ("port_in_use", True), ("timeout", True), ("unknown", True),
])
def test_launch_failed_is_retryable_unless_its_kind_cannot_change(kind: str, retryable: bool) -> None:
    assert _launch_failed(kind).retryable is retryable


def test_built_in_bases_callers_catch_are_kept() -> None:
    for cls in (ConfigError, TemplateError, TargetError, ServerConfigError, ThresholdError):
        assert issubclass(cls, ValueError), cls
    assert issubclass(TargetUnreachable, ConnectionError) and issubclass(DatabaseUnreachable, ConnectionError)
    for cls in (GpusNotClean, ProbeFailed, ServerError, MemoryStoreError, UpError):
        assert issubclass(cls, RuntimeError), cls


def test_gpus_not_clean_carries_its_message_and_report() -> None:
    exc = GpusNotClean("GPUs on h not verified clean")
    assert str(exc) == "GPUs on h not verified clean" and exc.report is None
    report = object()
    assert GpusNotClean("m", report).report is report  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", sorted(USAGE, key=lambda c: c.__name__))
def test_exit_code_2_when_the_caller_must_change_something(cls: type[DatagenError]) -> None:
    assert exit_code_for(_bare(cls)) == EXIT_USAGE == 2


@pytest.mark.parametrize("cls", sorted(FAILED, key=lambda c: c.__name__))
def test_exit_code_1_when_the_operation_failed(cls: type[DatagenError]) -> None:
    assert exit_code_for(_bare(cls)) == EXIT_FAILED == 1


@pytest.mark.parametrize(("exc", "code"), [
    (ValueError("bad --gpus"), 2), (FileNotFoundError("no such file"), 2), (PermissionError("denied"), 2),
    (RuntimeError("bug"), 1), (TypeError("bug"), 1), (KeyError("k"), 1),
])
def test_exit_code_of_built_in_errors(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code


def test_reports_errors_prints_the_message_and_returns_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    @reports_errors("datagen x")
    def locked(argv: list[str]) -> int:
        raise OutputLocked(Path("/out/_lock"), {"host": "h", "pid": 7})

    @reports_errors("datagen x")
    def gone(argv: list[str]) -> int:
        raise ServerGone("the server stopped answering")

    assert locked([]) == 2
    assert capsys.readouterr().err.startswith("datagen x: output /out is being written by another run (host=h, pid=7)")
    assert gone([]) == 1
    assert capsys.readouterr().err == "datagen x: the server stopped answering\n"


@pytest.mark.parametrize("name", [n for n, (module, _) in COMMANDS.items() if module.startswith("datagen.")])
def test_every_command_documents_its_exit_codes_in_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(COMMANDS[name][0])
    argv = [name, "--help"] if name in ("up", "down", "worker") else ["--help"]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "\nExit codes" in out and exit_codes(module.__doc__) in out, out


def test_reports_errors_lets_a_bug_keep_its_traceback() -> None:
    @reports_errors("datagen x")
    def buggy(argv: list[str]) -> int:
        raise TypeError("a bug")

    with pytest.raises(TypeError, match="a bug"):
        buggy([])
