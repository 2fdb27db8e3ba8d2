"""Every `datagen` command, through datagen.cli: a reader that closed the pipe ends it quietly, and a
SIGINT ends it with one line on stderr and 130, never a traceback (SIGTERM: test_run_interrupts)."""

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


def test_ctrl_c_gives_one_line_and_130(tmp_path: Path) -> None:
    SimGpus.init(tmp_path / "sim.json", count=2)
    proc = subprocess.Popen([DATAGEN, "gpu-sim", "hold", "--gpu", "0", "--mib", "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, **{ENV_VAR: str(tmp_path / "sim.json")}))
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("holding 100 MiB on GPU 0")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert err == "datagen gpu-sim: interrupted\n"
    assert proc.returncode == 130
