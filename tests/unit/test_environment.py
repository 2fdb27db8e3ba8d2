"""The processes the tests start run with the product's dependencies only, as a production install
has them: the libraries only pytest imports (tests/requirements-pytest.txt) are on the pytest
processes' path, not in the venv's site-packages (Makefile, `make install`; tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import PYTEST_LIBS
from tests.support.paths import REPO_ROOT

# what the pytest-only libraries pull in, and what made every product process slower when installed:
# httpx imports trio when it can; pyarrow imports numpy, and pandas at its first list conversion
PYTEST_ONLY = ("selenium", "datasets", "duckdb", "trio", "pandas", "numpy")


def _requirements() -> list[str]:
    lines = (REPO_ROOT / "tests" / "requirements-pytest.txt").read_text().splitlines()
    return [Requirement(line).name for line in lines if line and not line.startswith("#")]


def test_a_product_process_finds_none_of_the_pytest_only_libraries() -> None:
    if not PYTEST_LIBS.is_dir():
        pytest.skip(f"{PYTEST_LIBS} is missing: this environment was not made by `make install`")
    code = ("import importlib.util as u, sys, datagen.cmd_run, flows.datagen, pyarrow as pa; pa.array(['x']); "
            f"print(sorted(n for n in {PYTEST_ONLY!r} if u.find_spec(n) or n in sys.modules))")
    # as the tests start `datagen`: the venv's interpreter, the inherited environment
    out = subprocess.run([str(Path(sys.executable).parent / "python"), "-c", code], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"in the venv's site-packages (make install takes them out): {out.stdout}"


def test_the_pytest_processes_find_every_pytest_only_library() -> None:
    assert _requirements() == ["datasets", "duckdb", "selenium"]
    missing = [name for name in _requirements() if importlib.util.find_spec(name) is None]
    assert missing == [], f"not in {PYTEST_LIBS}: run `make install`"
