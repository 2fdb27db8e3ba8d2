"""Write, once and before the tests, the bytecode that the suite's processes read (`make bytecode`).

The environment is installed without bytecode (`uv pip install` writes none unless told, and compiling
all of site-packages cost about 30 CPU-s, most of it for packages no process here imports). The
Makefile keeps PYTHONDONTWRITEBYTECODE out of its recipes, so each module is compiled the first time a
process imports it and read from its `.pyc` after that. Left to the tests, four pytest-xdist workers
would each compile the same modules at the same moment while they collect; this one process compiles
them first: the project's modules, everything they import, and what the suite's other processes import
(the Prefect server, worker and flow engine); and it collects the tests, so that pytest's rewritten test
modules are cached too (each worker rewrote every test module: about 3.5 CPU-s apiece).

    python -m tests.support.bytecode      (make bytecode, once per environment)
"""

from __future__ import annotations

import compileall
import contextlib
import importlib
import io
import os
import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("datagen", "tasks", "flows", "emulator", "deployments")
# imported by processes that no project module's import reaches: the Prefect API server (`prefect
# server start`, and the ephemeral one a run starts), `prefect worker` and its flow runs, `prefect
# deploy`
OTHERS = ("prefect.cli", "prefect.server.api.server", "prefect.engine", "prefect.flow_engine",
          "prefect.workers.process", "prefect.deployments.steps", "uvicorn", "aiosqlite")


def main() -> int:
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("tests/support/bytecode.py: PYTHONDONTWRITEBYTECODE is set: no bytecode would be written",
              file=sys.stderr)
        return 2
    ok = all(compileall.compile_dir(ROOT / name, quiet=1, workers=1) for name in (*PACKAGES, "tests", "bench"))
    said = io.StringIO()  # first: pytest must import its plugins itself (it rewrites their asserts)
    with contextlib.redirect_stdout(said):
        collected = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")])
    if collected != 0:
        print(said.getvalue()[-5000:], file=sys.stderr)
        return int(collected)
    names = list(OTHERS)
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names += [info.name for info in pkgutil.walk_packages(mod.__path__, f"{pkg}.")
                  if not info.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
