"""The suite's schedule (tests/conftest.py): the files it names first exist, and `make test` keeps
their order; a failed test's leftovers do not fail the test after it."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import HEAVIEST_FIRST
from tests.support.paths import REPO_ROOT


def test_every_file_scheduled_first_exists_once() -> None:
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)
    missing = [p for p in HEAVIEST_FIRST if not (REPO_ROOT / p).is_file()]
    assert not missing, f"HEAVIEST_FIRST names files that are gone: {missing}"


def test_make_test_hands_out_files_in_collection_order() -> None:
    recipe = re.search(r"^test: .*\n((?:\t.+\n)+)", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None
    pytest_line = [line for line in recipe.group(1).splitlines() if " -m pytest " in line]
    assert len(pytest_line) == 1, recipe.group(1)
    assert "--dist loadfile" in pytest_line[0] and "--no-loadscope-reorder" in pytest_line[0]


CASCADE = '''
import gc, os, signal, subprocess

def test_fails_with_a_popen_it_never_waited_for():
    proc = subprocess.Popen(["sleep", "30"])
    os.kill(proc.pid, signal.SIGKILL)
    assert False, "the one failure"

def test_after_it():
    gc.collect()  # as the collector may at any moment
'''


def test_a_failed_tests_unwaited_subprocess_does_not_fail_the_next_test(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """tests/conftest.py collects what a failed test held before the next test starts: a `Popen` it
    never waited for warns when collected, an error under ``filterwarnings = error``."""
    (tmp_path / "test_cascade.py").write_text(CASCADE)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-W", "error", "--rootdir", str(tmp_path), str(tmp_path / "test_cascade.py")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout[-3000:]
    assert "1 failed, 1 passed" in res.stdout, res.stdout[-3000:]
