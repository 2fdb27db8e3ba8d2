"""`datagen run` / `datagen status` / `datagen up|down` exit codes without a Prefect server."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen import cmd_run, cmd_status, cmd_up


def test_run_config_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cmd_run.main(["--partition", "nosuch"]) == 2
    assert "no such partition config" in capsys.readouterr().err
    assert cmd_run.main(["--partition", "demo", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert cmd_run.main(["--partition", "demo", "--backend", "tgi"]) == 2
    assert cmd_run.main(["--shard-size", "x"]) == 2


def test_status_of_non_output_is_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_status.main([str(tmp_path)]) == 2
    assert "no _manifest.json" in capsys.readouterr().err


def test_down_without_up_stops_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_up.main(["down", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker: not running" in out and "server: not running" in out
    assert cmd_up.main(["sideways"]) == 2
