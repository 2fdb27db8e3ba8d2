"""Shared fixtures live in tests/support/*, one module per area, loaded as plugins here."""

import gc
import os
import shutil
import signal
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import psutil
import pytest

# The libraries only these processes import (selenium, datasets, duckdb: tests/requirements-pytest.txt),
# installed by `make install` outside the venv's site-packages: appended here, to this process's path
# only, so the `datagen`, Prefect and emulator processes the tests start have the product's
# dependencies only (tests/unit/test_environment.py).
PYTEST_LIBS = Path(sys.prefix) / "pytest-libs"
if PYTEST_LIBS.is_dir() and str(PYTEST_LIBS) not in sys.path:
    sys.path.append(str(PYTEST_LIBS))

pytest_plugins = [
    "tests.support.common",
    "tests.support.emulator",
    "tests.support.sshd",
    "tests.support.prefect",
    "tests.support.postgres",
    "tests.support.sglang",
    "tests.support.browser",
]

# Each test session (each xdist worker) gets its own datagen state and run directories unless the
# caller set them: slot leases, learned fractions and API-server records of one session's tests must
# not meet another session's, nor the developer's own (~/.local/state/datagen, the checkout's .run).
# An xdist worker inherits the controller's environment: a directory made here (marked) is made anew.
_SESSION_DIRS: list[str] = []
for _name in ("DATAGEN_STATE_DIR", "DATAGEN_RUN_DIR"):
    if not os.environ.get(_name) or os.environ.get(f"DATAGEN_TESTS_MADE_{_name}") == os.environ[_name]:
        _SESSION_DIRS.append(tempfile.mkdtemp(prefix=f"datagen-tests-{_name[8:].lower()}-"))
        os.environ[_name] = os.environ[f"DATAGEN_TESTS_MADE_{_name}"] = _SESSION_DIRS[-1]


# A suite started in the background by a non-interactive shell (`cmd &`, as some CI runners do) inherits
# SIGINT ignored, and so would every `datagen` it starts: the Ctrl-C tests would see a command that
# cannot be interrupted. A Python handler here makes the tests' children start with the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every process this session's tests start inherits this mark (set anew in each xdist worker, which
# imports this file itself), so that the sweep below finds them even when they left the process tree:
# a daemon that double-forked, a child reparented when its parent was SIGKILLed. Named outside the
# DATAGEN_/PREFECT_ prefixes, which the tests' subprocess environments drop.
SESSION_MARK = "DGTEST_SESSION_MARK"
os.environ[SESSION_MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


# The test files that take longest, heaviest first (worker seconds of a three-worker run, from
# `--durations=0`; docs/testing-history.md). `make test` runs whole files per xdist worker (--dist loadfile)
# and hands them out in collection order (--no-loadscope-reorder): the longest go first and the many
# short files fill in behind them. xdist's own reorder (most tests first) sent the one-test files that
# run a minute or more last, and a single worker ran the suite's last 2-3 minutes alone.
HEAVIEST_FIRST = (
    "tests/e2e/test_zombie.py",  # about 120 s, most of it waiting for the automation: its idle time overlaps the rest
    "tests/e2e/test_prefect.py",  # 294 s
    "tests/e2e/test_run_interrupts.py",  # 204 s
    "tests/sglang/test_differential.py",  # about 110 s: the probes, the real-only checks and the --server-url runs
    "tests/sglang/test_user_path.py",  # about 100 s (the --server-url runs moved to test_differential.py)
    "tests/e2e/test_ui.py",  # 171 s
    "tests/e2e/test_scale_out.py",  # 142 s
    "tests/e2e/test_multinode.py",  # about 70 s: three `datagen run`s of a server over two sshd hosts
    "tests/e2e/test_multinode_faults.py",  # about 85 s: two failed launches and a node lost for 15 s
    "tests/e2e/test_flow_recovery.py",  # 103 s
    "tests/e2e/test_goodput_faults.py",  # about 40 s: a kill -9 and its relaunch, a stalled reader
    "tests/e2e/test_goodput.py",  # about 40 s: two `datagen run`s with a long tail
    "tests/e2e/test_adopt.py",  # about 100 s
    "tests/e2e/test_swap_races.py",  # about 110 s on 4 workers: 9 `datagen run`s and 24 quick commands
    "tests/e2e/test_chaos_quick.py",  # 84 s
    "tests/e2e/test_readme_production.py",  # 72 s
    "tests/sglang/test_failures.py",  # 71 s
    "tests/e2e/test_postgres.py",  # 66 s
    "tests/e2e/test_server_emulator.py",  # 65 s
    "tests/e2e/test_damaged_output.py",  # 63 s
    "tests/e2e/test_ui_story.py",  # 48 s
    "tests/e2e/test_hostile_output.py",  # 45 s
    "tests/e2e/test_cli_server_url.py",  # 45 s
    "tests/e2e/test_cli_adhoc.py",  # 40 s
    "tests/e2e/test_reasoning_bug.py",  # 39 s
)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of parametrized fixtures
def pytest_collection_modifyitems(session, config, items):  # type: ignore[no-untyped-def]
    """The files of HEAVIEST_FIRST first, in its order; every other file after them, as collected.
    Within a file the order is kept (a stable sort), except that the tests marked ``last`` (they
    stop a server the file's other tests share) run after the rest of their file."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item):  # type: ignore[no-untyped-def]
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank)), first[path], item.get_closest_marker("last") is not None

    items.sort(key=key)


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):  # type: ignore[no-untyped-def]
    """After a failed test's fixtures ended its processes: drop the traceback pytest keeps for
    post-mortem debugging (``sys.last_*``, deleted only when the next test starts) and collect what
    it held. Otherwise a `subprocess.Popen` the failed test never waited for is collected during the
    next test, and its ResourceWarning ("subprocess N is still running", an error under
    ``filterwarnings = error``) fails that test too: one failure reported as two (cjt, cjv)."""
    yield
    if item.stash.get(_FAILED, False):
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    """Last line of defence: report, then end by pid, any process a test left running. Under xdist
    each worker checks its own tests' processes (the controller's only children are the workers)."""
    controller = bool(getattr(session.config.option, "numprocesses", None)) and not hasattr(session.config, "workerinput")
    if not controller:
        _end_leftovers(session)
    for d in _SESSION_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def _marked() -> list[psutil.Process]:
    """Processes outside this one's tree that carry this session's mark."""
    mark, me = os.environ[SESSION_MARK], os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(SESSION_MARK) == mark:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _end_leftovers(session) -> None:  # type: ignore[no-untyped-def]
    left = []
    seen: set[int] = set()
    for p in [*psutil.Process().children(recursive=True), *_marked()]:
        if p.pid in seen:
            continue
        seen.add(p.pid)
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append((p, " ".join(p.cmdline())[:200]))
        except psutil.NoSuchProcess:
            continue
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for p, cmd in left:
        line = f"left running by the tests: pid {p.pid}: {cmd}"
        if reporter is not None:
            reporter.write_line(line, yellow=True)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs([p for p, _ in left], timeout=5)
