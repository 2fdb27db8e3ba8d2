"""The API-key bootstrap mirrors its server's end: same exit code, or death by the same signal."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tasks.server import ServerConfig, launch_argv, launch_env


def _run_bootstrapped(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "fake_server.py").write_text(body)
    cfg = ServerConfig(model_path="m", api_key="sk-secret-key", backend="emulator")
    argv = launch_argv(cfg, None)
    argv[3] = "fake_server"  # the module the bootstrap runs, in place of the emulator
    env = launch_env(cfg)
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_exit_code_and_redacted_output_are_mirrored(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    assert done.returncode == 3
    assert "sk-secret-key" not in done.stdout and "'--api-key', '***'" in done.stdout


def test_death_by_sigkill_is_mirrored_without_an_oserror(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert "OSError" not in done.stderr + done.stdout
    assert done.returncode == -9


def test_sigterm_to_the_bootstrap_reaches_the_server_which_drains(tmp_path: Path) -> None:
    (tmp_path / "fake_server.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda n, f: (print('drained', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    cfg = ServerConfig(model_path="m", api_key="sk-secret-key", backend="emulator")
    argv = launch_argv(cfg, None)
    argv[3] = "fake_server"
    env = launch_env(cfg)
    env["PYTHONPATH"] = str(tmp_path)
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            proc.send_signal(signal.SIGTERM)  # the leader only, as a stop does first
            assert proc.wait(timeout=20) == 0
            assert proc.stdout.read() == "drained\n"
        finally:
            proc.kill()


def test_death_by_sigterm_is_mirrored(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert done.returncode == -15 and done.stderr == ""
