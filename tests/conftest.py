"""Shared fixtures live in tests/support/*, one module per area, loaded as plugins here."""

import psutil

pytest_plugins = [
    "tests.support.common",
    "tests.support.emulator",
    "tests.support.sshd",
    "tests.support.prefect",
    "tests.support.postgres",
    "tests.support.sglang",
    "tests.support.browser",
]


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    """Last line of defence: report, then end by pid, any process a test left running."""
    left = []
    for p in psutil.Process().children(recursive=True):
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
