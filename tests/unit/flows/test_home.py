"""The deployments' pull step (prefect.yaml) run by Prefect's own step runner, as a worker runs it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.deployments.steps.core import StepExecutionError, run_steps
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.support.common import free_port
from tests.support.paths import REPO_ROOT


def _pull(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, home: str | None) -> dict[str, Any]:
    if home is None:
        monkeypatch.delenv("DATAGEN_HOME", raising=False)
    else:
        monkeypatch.setenv("DATAGEN_HOME", home)
    monkeypatch.chdir(tmp_path)  # restored after the test, whatever the step changes
    steps = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["pull"]
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        return asyncio.run(run_steps(steps, print_function=lambda *_: None))


@pytest.mark.parametrize("home", [None, ""])
def test_a_worker_without_datagen_home_is_told_what_to_set(monkeypatch, tmp_path, home) -> None:
    with pytest.raises(StepExecutionError) as err:
        _pull(monkeypatch, tmp_path, home)
    assert str(err.value.__cause__) == (
        "DATAGEN_HOME is not set in the Prefect worker's environment: set it to the datagen checkout (the "
        "directory holding flows/ and deployments/) before `prefect worker start`, or start the worker with "
        "`datagen up`, which sets it")


def test_datagen_home_that_is_no_checkout_is_named(monkeypatch, tmp_path) -> None:
    with pytest.raises(StepExecutionError) as err:
        _pull(monkeypatch, tmp_path, str(tmp_path))
    assert str(err.value.__cause__) == (
        f"DATAGEN_HOME={tmp_path} is not a datagen checkout (no flows/datagen.py there): set it to the "
        "directory holding flows/ and deployments/")


def test_datagen_home_is_entered(monkeypatch, tmp_path) -> None:
    out = _pull(monkeypatch, tmp_path, str(REPO_ROOT))
    assert out["directory"] == str(REPO_ROOT) == os.getcwd()
