"""A throwaway PostgreSQL cluster from the distribution's server binaries (``initdb``, ``pg_ctl``): the
``postgres`` fixture.

The cluster listens on 127.0.0.1 on a free port with its socket and data in a fresh temporary
directory, runs as an unprivileged user when the tests run as root (PostgreSQL refuses root: the
``postgres`` account the package creates, else ``nobody``), and is stopped by pid at the end even when
the test fails. Without the binaries the test is skipped with a message, except under CI (CI=true),
where .ci/run installs them and the test fails instead.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import psutil
import pytest

from tests.support.common import free_port, kill_trees

__all__ = ["Postgres", "postgres", "postgres_bin"]

USER, DATABASE = "datagen", "prefect"


def postgres_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl`` (PATH, else Debian's /usr/lib/postgresql/N/bin,
    newest first); skips the test (fails it under CI) when there is none."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    if versions:
        return versions[-1].parent
    why = "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI runs the PostgreSQL test; .ci/run installs them)")
    pytest.skip(why)


def _account() -> pwd.struct_passwd | None:
    """The unprivileged account to run the cluster as, or None when the tests do not run as root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.fail("running as root, and neither a 'postgres' nor a 'nobody' account exists to run PostgreSQL as")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Postgres:
    """A running cluster: ``url`` (``postgresql+asyncpg://datagen:PASSWORD@127.0.0.1:PORT/prefect``, the
    form Prefect takes), its ``password``, ``port``, ``pid`` (the postmaster) and ``root`` (data,
    socket, log)."""

    url: str
    password: str
    port: int
    pid: int
    root: Path

    @property
    def dsn(self) -> str:
        """The URL as asyncpg takes it."""
        return self.url.replace("postgresql+asyncpg://", "postgresql://", 1)

    def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """The rows of one query against the ``prefect`` database."""
        async def run() -> list[dict[str, Any]]:
            conn = await asyncpg.connect(self.dsn, timeout=10)
            try:
                return [dict(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        return asyncio.run(run())

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, ...) alive now."""
        try:
            main = psutil.Process(self.pid)
            return [p.pid for p in [main, *main.children(recursive=True)] if _alive(p.pid)]
        except psutil.NoSuchProcess:
            return []


def _run(argv: list[str], account: pwd.struct_passwd | None, cwd: Path) -> None:
    ids: dict[str, Any] = {}
    if account is not None:
        ids = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, **ids)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def _create_database(dsn: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(f"CREATE DATABASE {DATABASE}")
        finally:
            await conn.close()

    asyncio.run(run())


def _stop(bindir: Path, data: Path, pid: int | None, account: pwd.struct_passwd | None, cwd: Path) -> None:
    """``pg_ctl stop -m fast``, then SIGKILL to whatever of the cluster is left, by pid."""
    if data.joinpath("postmaster.pid").exists():
        try:
            _run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"], account, cwd)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
    if pid is not None:
        kill_trees([pid], timeout_s=10)


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    """A fresh cluster with the database ``prefect`` owned by ``datagen`` (password auth over TCP);
    stopped and deleted afterwards, and checked gone."""
    bindir = postgres_bin()
    account = _account()
    # Not pytest's tmp_path: its parents are private to root, and the cluster's account must enter it.
    root = Path(tempfile.mkdtemp(prefix="datagen-pg-"))
    data, sock = root / "data", root / "sock"
    password = secrets.token_urlsafe(12)
    pid: int | None = None
    try:
        sock.mkdir()
        (root / "pw").write_text(password + "\n")
        if account is not None:
            for path in (root, sock, root / "pw"):
                os.chown(path, account.pw_uid, account.pw_gid)
        _run([str(bindir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={root / 'pw'}", "-E", "UTF8",
              "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync"], account, root)
        for _ in range(3):  # the free port may be taken before the postmaster binds it
            port = free_port()
            opts = (f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
                    "-c full_page_writes=off")
            try:
                _run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
                      "-o", opts, "start"], account, root)
                break
            except RuntimeError:
                if "could not bind" not in (root / "log").read_text(errors="replace"):
                    raise
        else:
            raise RuntimeError(f"PostgreSQL found no free port:\n{(root / 'log').read_text()[-2000:]}")
        pid = int((data / "postmaster.pid").read_text().split()[0])
        url = f"postgresql+asyncpg://{USER}:{password}@127.0.0.1:{port}/{DATABASE}"
        _create_database(url.replace("postgresql+asyncpg://", "postgresql://").removesuffix(DATABASE) + "postgres")
        yield Postgres(url, password, port, pid, root)
    finally:
        _stop(bindir, data, pid, account, root)
        shutil.rmtree(root, ignore_errors=True)
    assert pid is None or not _alive(pid), f"PostgreSQL postmaster {pid} still running"
