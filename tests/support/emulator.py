"""The SGLang emulator as a real process on a free loopback port: ``start_emulator`` and the
``emulator_factory`` fixture, which stops every emulator it started by process group (and any
descendant that left the group).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.support.common import free_port, scaled
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
DEMO_MODEL = REPO / "data" / "models" / "demo"

_LOG_DIR: Path | None = None


def _log_dir() -> Path:
    """One folder per test process for emulator logs nobody asked to keep; removed when it exits
    (the logs stay readable to the test after ``stop``, and /tmp is not littered)."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = Path(tempfile.mkdtemp(prefix="datagen-emulator-logs-"))
        atexit.register(shutil.rmtree, _LOG_DIR, True)
    return _LOG_DIR


# fast startup phases; tests that care about a phase pass their own value (later flags win)
FAST_ARGS = ["--emu-load-time", "0.05", "--emu-graph-time", "0.02", "--emu-warmup-time", "0.05"]

__all__ = ["EmulatorProc", "start_emulator", "emulator_factory", "FAST_ARGS", "DEMO_MODEL", "http_status"]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when the connection is refused / fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class EmulatorProc:
    """A running emulator: ``pid`` (main process, its own session leader), ``url``, ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log_path: Path
    descendants: dict[int, psutil.Process] = field(default_factory=dict)  # as first seen (pid + start)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        if self.proc.poll() is not None:  # reaped: its pid may name another process by now
            return []
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for k in kids:
            self.descendants.setdefault(k.pid, k)
        return kids

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll /health_generate until 200 (``timeout`` stretched by the machine's load). Raises
        RuntimeError (with the log) on exit or timeout."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.children()
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            if http_status(self.url + "/health_generate", timeout=1.0) == 200:
                self.children()
                return
            time.sleep(0.02)
        raise RuntimeError(f"emulator not ready after {timeout} s:\n{self.log_text()[-3000:]}")

    def wait_exit(self, timeout: float = 15.0) -> int:
        """Wait for the main process to exit; returns its returncode (-9 for SIGKILL)."""
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGKILL the process group and every descendant seen; reap the main process.

        The group is signalled only while the main process is unreaped or a descendant first seen is
        still in it (either way its id cannot have been recycled), and each descendant only while it
        is the process first seen."""
        self.children()
        if self.proc.poll() is None or any(_in_group(p, self.pid) for p in self.descendants.values()):
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        procs = []
        for p in self.descendants.values():
            try:
                p.send_signal(signal.SIGKILL)
                procs.append(p)
            except psutil.Error:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # descendants were reparented: a zombie awaiting its new parent's reap is already dead
        deadline = time.monotonic() + 5
        while procs and time.monotonic() < deadline:
            procs = [p for p in procs if _alive(p)]
            if procs:
                time.sleep(0.01)


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return p.is_running() and os.getpgid(p.pid) == pgid
    except (psutil.Error, ProcessLookupError):
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_emulator(
    args: list[str],
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    *,
    wait_ready: bool = True,
    timeout: float = 30.0,
    fast: bool = True,
) -> EmulatorProc:
    """Start ``python -m emulator`` with ``args``. ``env`` entries are added to os.environ.

    Raises RuntimeError when ``wait_ready`` and the emulator exits or is not ready within ``timeout``.
    """
    args = list(args)
    if "--port" not in args:
        args += ["--port", str(free_port())]
    if "--model-path" not in args and "--model" not in args:
        args += ["--model-path", str(DEMO_MODEL)]
    if fast:
        args = FAST_ARGS + args
    port = int(args[args.index("--port") + 1])
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="emulator-", suffix=".log", dir=_log_dir())
        os.close(fd)
        log_path = name
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "emulator", *args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=str(REPO), start_new_session=True,
        )
    em = EmulatorProc(proc=proc, url=f"http://127.0.0.1:{port}", port=port, log_path=Path(log_path))
    if wait_ready:
        try:
            em.wait_ready(timeout)
        except BaseException:
            em.stop()
            raise
    return em


@pytest.fixture
def emulator_factory() -> Iterator[object]:
    """``start_emulator`` that stops everything it started when the test ends."""
    started: list[EmulatorProc] = []

    def factory(args: list[str], env: dict[str, str] | None = None,
                log_path: str | os.PathLike[str] | None = None, **kw: object) -> EmulatorProc:
        em = start_emulator(args, env=env, log_path=log_path, **kw)  # type: ignore[arg-type]
        started.append(em)
        return em

    yield factory
    for em in started:
        em.stop()
