"""diagnose_server: which server failures are recorded as a runtime OOM (and so lower the fraction)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tasks.server import task as stages


class _Gone:
    """A server that stopped, as diagnose_server sees it."""

    url = "http://127.0.0.1:30000"

    def __init__(self, log: str, fraction: float | None) -> None:
        self.log, self.fraction = log, fraction

    def read_log(self) -> str:
        return self.log

    def exit_status(self) -> int:
        return -9

    def failure(self) -> tuple[None, str, int]:
        return None, self.log, -9


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def record(cfg: Any, target: Any, fraction: float | None, **kw: Any) -> object:
        calls.append({"fraction": fraction, **kw})
        return SimpleNamespace(runtime_oom_at=fraction)

    monkeypatch.setattr(stages, "record_runtime_oom", record)
    monkeypatch.setattr(stages, "get_run_logger", lambda: logging.getLogger("test"))
    return calls


CTX = SimpleNamespace(host="local", target="local", parser=None, run_id=None,
                      cfg=SimpleNamespace(server_config=lambda port, parser: object()))


@pytest.mark.parametrize("line", ["Decode out of memory. Try to lower your batch size.",
                                  "Prefill out of memory. Try to lower your batch size."])
def test_kv_pool_exhaustion_is_not_recorded_as_a_runtime_oom(recorded: list[dict[str, Any]], line: str) -> None:
    assert stages.diagnose_server.fn(CTX, _Gone(f"[2026-12-01] {line}\n", 0.85)).kind == "kv_pool_exhausted"
    assert recorded == []


def test_a_cuda_oom_at_sglangs_default_is_recorded_with_the_log(recorded: list[dict[str, Any]]) -> None:
    log = "server_args={'mem_fraction_static': 0.716}\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    assert stages.diagnose_server.fn(CTX, _Gone(log, None)).kind == "too_high"
    assert recorded == [{"fraction": None, "log_text": log}]
