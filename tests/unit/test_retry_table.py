"""The retry table of docs/architecture.md says what the code does: every budget and worst case it
names is read here and compared with the code's own values, so changing one without the other fails."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from flows import retry
from flows.datagen import datagen
from tasks.config._model import PartitionConfig
from tasks.inference import ClientConfig, GenerateClient
from tasks.inference.task import infer_dataset
from tasks.server import LaunchFailed
from tasks.server._log import Failure
from tasks.server._tuner import TuningPolicy, launch_tuned

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
LAYERS = ["request", "overload", "failover", "relaunch", "fraction", "stage", "run"]


def _table() -> dict[str, list[str]]:
    text = DOC.read_text()
    start = text.index("## Retries: one owner per layer")
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("layer", "---"):
            rows[cells[0]] = cells
    return rows


def _settings(cell: str) -> dict[str, float]:
    """``name = number`` code spans of a cell."""
    return {m[1]: float(m[2]) for m in re.finditer(r"`(\w+) = ([\d.]+)`", cell)}


def _seconds(cell: str) -> list[float]:
    """``N s`` code spans of a cell, in order."""
    return [float(m) for m in re.findall(r"`([\d.]+) s`", cell)]


def _backoff_ceilings(cfg: ClientConfig, first: int, count: int) -> list[float]:
    return [min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (k - 1)) for k in range(first, first + count)]


def _param_default(fn: object, name: str) -> float:
    return float(inspect.signature(fn).parameters[name].default)  # type: ignore[arg-type]


def test_the_table_has_one_row_per_layer_in_order() -> None:
    assert list(_table()) == LAYERS


def test_request_and_overload_budgets_are_the_clients() -> None:
    rows, cfg = _table(), ClientConfig()
    request = _settings(rows["request"][3] + rows["request"][4])
    assert request == {"max_attempts": cfg.max_attempts, "backoff_base_s": cfg.backoff_base_s,
                       "backoff_max_s": cfg.backoff_max_s, "connect_timeout_s": cfg.connect_timeout_s,
                       "request_timeout_s": cfg.request_timeout_s}
    # backoff comes before each retry: max_attempts - 1 of them, each at most its ceiling
    assert _seconds(rows["request"][4]) == [sum(_backoff_ceilings(cfg, 1, cfg.max_attempts - 1))]
    assert _settings(rows["overload"][3]) == {"max_overload_retries": cfg.max_overload_retries}
    # GenerateClient.generate backs off by attempt + min(overloaded, 6): 16 s once overloaded six times
    per_retry = _backoff_ceilings(cfg, 6, 1)[0]
    assert "backoff to 16 s" in rows["overload"][3] and per_retry == 16
    assert _seconds(rows["overload"][4]) == [cfg.max_overload_retries * per_retry]
    assert "attempt + min(overloaded, 6)" in inspect.getsource(GenerateClient.generate)


def test_relaunch_budgets_are_the_partitions_defaults() -> None:
    row = _table()["relaunch"]
    fields = {f: PartitionConfig.__dataclass_fields__[f].default for f in
              ("max_relaunches", "host_wait_s", "hang_timeout_s")}
    assert _settings(row[2] + row[3]) == fields
    assert _seconds(row[4]) == [fields["max_relaunches"] * fields["host_wait_s"]]


def test_fraction_search_budget_is_the_tuners() -> None:
    row, policy = _table()["fraction"], TuningPolicy()
    deadline = _param_default(launch_tuned, "deadline_s")
    assert _settings(row[3]) == {"max_attempts": policy.max_attempts, "deadline_s": deadline}
    assert _seconds(row[4]) == [policy.max_attempts * deadline]


def test_stage_budgets_are_the_retried_tasks() -> None:
    row = _table()["stage"]
    tasks = {"hygiene": retry.hygiene, "launch": retry.launch_server, "health": retry.health_check,
             "identify": retry.identify_server}
    assert _settings(row[3]) == {name: t.retries for name, t in tasks.items()}
    delays = {name: list(t.retry_delay_seconds) for name, t in tasks.items()}  # type: ignore[arg-type]
    for name, d in delays.items():
        assert f"`{name} = {len(d)}` ({', '.join(f'{x:g}' for x in d)} s)" in row[3], name
    assert _seconds(row[4]) == [sum(d) for d in delays.values()]


def test_no_other_task_is_retried_and_the_flow_is_not() -> None:
    assert datagen.retries == 0 and "`retries = 0`" in _table()["run"][1]
    assert infer_dataset.retries == 0


@pytest.mark.parametrize("kind", ["too_high", "too_low"])
def test_a_launch_whose_fraction_search_gave_up_is_not_retried_by_the_stage(kind: str) -> None:
    assert retry.is_retryable(LaunchFailed(Failure(kind, "why"), "")) is False  # type: ignore[arg-type]
    assert f"`{kind}`" in _table()["fraction"][2]
