"""The `datagen` command line as a user types it: a mistyped command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATAGEN = str(Path(sys.executable).parent / "datagen")


def test_a_mistyped_command_names_the_closest_one_in_one_line_and_exits_2() -> None:
    out = subprocess.run([DATAGEN, "stauts"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("datagen: unknown command 'stauts' (did you mean 'status'?); "
                           "`datagen --help` lists the commands: ")
    assert line.endswith("run, demo, clean-gpus, validate, status, repair, resplit, export, up, worker, down, emulator, gpu-sim")
    far = subprocess.run([DATAGEN, "zzz"], capture_output=True, text=True, timeout=60)
    assert far.returncode == 2 and "did you mean" not in far.stderr
