"""The suite's schedule (tests/conftest.py): the files it names first exist, and `make test` keeps
their order."""

from __future__ import annotations

import re

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
