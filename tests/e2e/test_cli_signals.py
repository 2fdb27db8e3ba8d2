"""Every `datagen` command, through datagen.cli: a reader that closed the pipe ends it quietly, and a
SIGINT or SIGTERM ends it with one line on stderr and 130 or 143, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.simgpu import ENV_VAR, SimGpus

DATAGEN = str(Path(sys.executable).parent / "datagen")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["gpu-sim", "show"]])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path, argv: list[str]) -> None:
    SimGpus.init(tmp_path / "sim.json", count=8)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has already exited: every write fails with EPIPE
    try:
        proc = subprocess.run([DATAGEN, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=dict(os.environ, **{ENV_VAR: str(tmp_path / "sim.json")}))
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode in (0, 141)  # argparse's help printer drops the error itself: then 0


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_gives_one_line_and_its_exit_code(tmp_path: Path, sig: signal.Signals, code: int, word: str) -> None:
    SimGpus.init(tmp_path / "sim.json", count=2)
    proc = subprocess.Popen([DATAGEN, "gpu-sim", "hold", "--gpu", "0", "--mib", "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, **{ENV_VAR: str(tmp_path / "sim.json")}))
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("holding 100 MiB on GPU 0")
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert err == f"datagen gpu-sim: {word}\n"
    assert proc.returncode == code
