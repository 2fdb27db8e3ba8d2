"""Real SGLang launch failures, started through datagen's launcher and classified by its log and exit."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from tasks.server import LaunchFailed, ServerConfig, launch
from tests.support.sglang import DEADLINE_S, cpu_config

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]


def _launch_fails(cfg: ServerConfig, log_dir: Path) -> LaunchFailed:
    with pytest.raises(LaunchFailed) as info:
        launch(cfg, "local", None, log_dir, deadline_s=DEADLINE_S)
    return info.value


def test_missing_model_directory_is_model_not_found(tmp_path: Path, sglang_env: Path,
                                                    sglang_logs: Path) -> None:
    missing = tmp_path / "no-such-model"
    exc = _launch_fails(cpu_config(missing), sglang_logs)
    assert exc.failure.kind == "model_not_found"
    assert str(missing) in exc.failure.evidence
    assert exc.exit_status not in (None, 0)


def test_unknown_flag_is_bad_flag_with_exit_status_2(tiny_model: Path, sglang_logs: Path) -> None:
    exc = _launch_fails(cpu_config(tiny_model, extra_args=("--no-such-flag",)), sglang_logs)
    assert exc.failure.kind == "bad_flag"
    assert exc.exit_status == 2
    assert "--no-such-flag" in exc.failure.evidence


def test_config_json_without_model_type_is_model_not_found(tiny_model: Path, tmp_path: Path,
                                                           sglang_logs: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["model_type"], config["architectures"]
    (broken / "config.json").write_text(json.dumps(config))
    exc = _launch_fails(cpu_config(broken), sglang_logs)
    assert exc.failure.kind == "model_not_found"
    assert "Unrecognized model in" in exc.failure.evidence


def test_port_in_use_is_refused_before_anything_starts(tiny_model: Path, sglang_logs: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = cpu_config(tiny_model, port=taken.getsockname()[1])
        exc = _launch_fails(cfg, sglang_logs)
    assert exc.failure.kind == "port_in_use"
    assert exc.failure.evidence == f"127.0.0.1:{cfg.port} is already bound"
    assert exc.exit_status is None
    assert not list(sglang_logs.iterdir())  # no server was started, so no log was written
