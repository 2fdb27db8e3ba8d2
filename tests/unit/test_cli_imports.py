"""`datagen run` and `datagen demo` set Prefect's settings (PREFECT_HOME, PREFECT_API_URL of the
run's own API server) before Prefect is imported: Prefect reads them once, at import."""

from __future__ import annotations

import subprocess
import sys


def test_run_and_demo_modules_do_not_import_prefect() -> None:
    code = "import sys, datagen.cli, datagen.cmd_run, datagen.cmd_demo; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
