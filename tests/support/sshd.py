"""A real OpenSSH server on a loopback port, for ssh:// and pct:// targets end to end.

Fixtures: ``sshd_server`` (session; its sessions find a ``pct`` stand-in that runs the command on this
host and logs the CTID), ``ssh_env`` (DATAGEN_SSH_KEY / DATAGEN_SSH_KNOWN_HOSTS set for it) and
``remote`` (``ssh_env`` with remote commands pointed at the emulator and simulated GPUs). Needs
openssh-server; tests are skipped with that hint when /usr/sbin/sshd is missing.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tests.support.common import free_port, scaled
from tests.support.paths import REPO_ROOT

SSHD = "/usr/sbin/sshd"

PCT_STUB = """#!/bin/bash
# Stand-in for Proxmox's pct: `pct exec CTID -- cmd...` runs cmd on this host, logging CTID.
if [ "$1" != exec ] || [ -z "$2" ] || [ "$3" != "--" ]; then
  echo "pct stand-in: usage: pct exec CTID -- command..." >&2
  exit 2
fi
echo "$2" >> {log}
shift 3
# A container has a home of its own: the login shell (`bash -lc`) reads its profile, not this host
# user's (whose ~/.bashrc may run `pyenv rehash`: docs/testing.md).
export HOME={home}
exec "$@"
"""


@dataclass
class SshServer:
    host: str
    port: int
    pid: int
    user: str
    key_path: str
    known_hosts: str
    log_path: str
    pct_log: str = ""
    argv: tuple[str, ...] = ()  # how it was started: `restart_sshd` starts it again the same way

    def url(self, kind: str = "ssh", ctid: int | None = None) -> str:
        tail = f"/{ctid}" if kind == "pct" else ""
        return f"{kind}://{self.user}@{self.host}:{self.port}{tail}"


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True,
                   stdin=subprocess.DEVNULL)


def stop_sshd(proc: subprocess.Popen[bytes]) -> None:
    """Stop an sshd started by `start_sshd`, by pid: SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_sshd(workdir: Path, address: str = "127.0.0.1", set_env: dict[str, str] | None = None,
               deadline_s: float = 15.0) -> tuple[SshServer, subprocess.Popen[bytes]]:
    """Start sshd on ``address``:<free port> with fresh host and client keys; returns it once it
    accepts TCP connections.

    Args:
        workdir: where keys, authorized_keys, known_hosts and the log go.
        address: the loopback address to listen on.
        set_env: sshd ``SetEnv`` lines, the environment of every session (as a host's profile would be).
        deadline_s: how long to wait for it to listen.

    Raises:
        RuntimeError: sshd exited or did not listen in time (the message holds its log).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    host_key, client_key = workdir / "host_ed25519", workdir / "client_ed25519"
    _keygen(host_key)
    _keygen(client_key)
    auth = workdir / "authorized_keys"
    auth.write_text((workdir / "client_ed25519.pub").read_text())
    port = free_port(address)
    known = workdir / "known_hosts"
    known.write_text(f"[{address}]:{port} {(workdir / 'host_ed25519.pub').read_text().split(' ')[0]} "
                     f"{(workdir / 'host_ed25519.pub').read_text().split(' ')[1]}\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege-separation dir sshd insists on
    log_path = workdir / "sshd.log"
    opts = [
        f"Port={port}", f"ListenAddress={address}", f"HostKey={host_key}", f"PidFile={workdir / 'sshd.pid'}",
        f"AuthorizedKeysFile={auth}", "StrictModes=no", "PasswordAuthentication=no",
        "KbdInteractiveAuthentication=no", "UsePAM=no", "PermitRootLogin=prohibit-password",
        "Subsystem=sftp internal-sftp", "LogLevel=ERROR",
    ]
    # SHLVL=1 keeps bash from sourcing ~/.bashrc in these sessions (bash sources it for sshd's
    # commands only at shell level 1). This machine's ~/.bashrc runs `pyenv rehash`, which takes a
    # lock file: a test that ends a remote command mid-rehash leaves the lock behind, and every later
    # SSH command on the machine then waits 60 s on it. The product never relies on a login profile.
    session_env = {"SHLVL": "1", **(set_env or {})}
    opts.append("SetEnv=" + " ".join(f"{k}={v}" for k, v in session_env.items()))
    argv = [SSHD, "-D", "-e", "-f", "/dev/null"]
    for o in opts:
        argv += ["-o", o]
    server = SshServer(host=address, port=port, pid=0, user="root", key_path=str(client_key),
                       known_hosts=str(known), log_path=str(log_path), argv=tuple(argv))
    return server, restart_sshd(server, deadline_s)


def restart_sshd(server: SshServer, deadline_s: float = 15.0) -> subprocess.Popen[bytes]:
    """Start ``server``'s sshd (again): same address, port, keys and settings; returns it once it
    accepts TCP connections (``server.pid`` is updated).

    Raises:
        RuntimeError: sshd exited or did not listen in time (the message holds its log).
    """
    log_path = Path(server.log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(server.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + scaled(deadline_s)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection((server.host, server.port), timeout=0.5):
                break
        except OSError as exc:
            if time.monotonic() > deadline:
                stop_sshd(proc)
                raise RuntimeError(
                    f"sshd did not listen on {server.host}:{server.port}: {log_path.read_text()[-2000:]}") from exc
            time.sleep(0.02)
    server.pid = proc.pid
    return proc


@pytest.fixture(scope="session")
def sshd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    if not os.path.exists(SSHD):
        pytest.skip("openssh-server is not installed: apt-get install -y openssh-server")
    workdir = tmp_path_factory.mktemp("sshd")
    hostbin = workdir / "hostbin"
    hostbin.mkdir()
    pct_log = workdir / "pct.log"
    stub = hostbin / "pct"
    pct_home = workdir / "pct-home"
    pct_home.mkdir()
    stub.write_text(PCT_STUB.format(log=pct_log, home=pct_home))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    path = f"{hostbin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    server, proc = start_sshd(workdir, set_env={"PATH": path})
    server.pct_log = str(pct_log)
    try:
        yield server
    finally:
        stop_sshd(proc)


@pytest.fixture
def ssh_env(sshd_server: SshServer, monkeypatch: pytest.MonkeyPatch) -> SshServer:
    """Point datagen's SSH settings at ``sshd_server`` (strict host-key checking on)."""
    monkeypatch.setenv("DATAGEN_SSH_KEY", sshd_server.key_path)
    monkeypatch.setenv("DATAGEN_SSH_KNOWN_HOSTS", sshd_server.known_hosts)
    monkeypatch.setenv("DATAGEN_SSH_CONNECT_TIMEOUT", "5")
    return sshd_server


@dataclass
class SshHost:
    """One simulated GPU host: a real sshd on its own loopback address with its own simulated GPUs
    (``DATAGEN_SIM_GPUS`` set for its sessions by sshd)."""

    server: SshServer
    proc: subprocess.Popen[bytes]
    sim_gpus: Path

    @property
    def address(self) -> str:
        return self.server.host

    def url(self) -> str:
        return self.server.url()


def start_hosts(workdir: Path, addresses: list[str], gpus: int = 2,
                session_env: dict[str, str] | None = None) -> list[SshHost]:
    """An sshd per address (e.g. 127.0.0.2, .3, .4), each with ``gpus`` simulated GPUs; one client
    key and one known_hosts file reach them all (``hosts_env``). ``session_env`` is set in every
    session too. Stop them with ``stop_hosts``.

    Raises:
        RuntimeError: an sshd did not start (those started are stopped).
    """
    hosts: list[SshHost] = []
    try:
        for addr in addresses:
            sim = workdir / f"sim-gpus-{addr}.json"
            SimGpus.init(sim, count=gpus)
            server, proc = start_sshd(workdir / f"sshd-{addr}", address=addr,
                                      set_env={ENV_VAR: str(sim), **(session_env or {})})
            hosts.append(SshHost(server, proc, sim))
    except BaseException:
        stop_hosts(hosts)
        raise
    key = Path(hosts[0].server.key_path)
    known = workdir / "known_hosts"
    known.write_text("".join(Path(h.server.known_hosts).read_text() for h in hosts))
    for h in hosts:
        # sshd reads authorized_keys per connection: the first host's client key opens every host.
        (Path(h.server.key_path).parent / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        h.server.key_path, h.server.known_hosts = str(key), str(known)
    return hosts


def stop_hosts(hosts: list[SshHost]) -> None:
    for h in hosts:
        stop_sshd(h.proc)


def cut_off(host: SshHost) -> None:
    """Make ``host`` unreachable: SIGKILL its sshd and every connection it serves (port forwards
    die with them); what runs detached on the host (a server) keeps running. ``restart_sshd``
    brings it back."""
    try:
        listener = psutil.Process(host.proc.pid)
        procs = [listener, *listener.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=5)
    host.proc.wait()


def hosts_env(hosts: list[SshHost]) -> dict[str, str]:
    """The environment of a datagen process that reaches ``hosts``: the shared key, known_hosts, a
    short connect timeout and remote commands pointed at this Python and the nvidia-smi stand-in
    (the simulated GPUs come from each host's sshd)."""
    remote = {"PATH": f"{REPO_ROOT / 'emulator' / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
              "DATAGEN_PYTHON": sys.executable}
    return {"DATAGEN_SSH_KEY": hosts[0].server.key_path, "DATAGEN_SSH_KNOWN_HOSTS": hosts[0].server.known_hosts,
            "DATAGEN_SSH_CONNECT_TIMEOUT": "3",
            "DATAGEN_REMOTE_ENV": " ".join(shlex.quote(f"{k}={v}") for k, v in remote.items())}


__all__ = ["SshHost", "SshServer", "cut_off", "hosts_env", "restart_sshd", "start_hosts", "start_sshd",
           "stop_hosts", "stop_sshd", "sshd_server", "ssh_env"]


def stand_in_remote_env() -> str:
    """A DATAGEN_REMOTE_ENV that points remote commands (on this host) at the emulator, nvidia-smi
    stand-in, simulated GPUs and this Python."""
    env = {
        "PATH": f"{REPO_ROOT / 'emulator' / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "DATAGEN_SIM_GPUS": os.environ["DATAGEN_SIM_GPUS"],
        "DATAGEN_PYTHON": sys.executable,
    }
    return " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())


@pytest.fixture
def remote(ssh_env, sim_gpus, monkeypatch):
    """The sshd target with DATAGEN_REMOTE_ENV pointing remote commands at the stand-ins."""
    monkeypatch.setenv("DATAGEN_REMOTE_ENV", stand_in_remote_env())
    return ssh_env
