"""Targets: parsing, local commands, and ssh:// / pct:// against a real sshd on loopback, including
remote GPU hygiene through the nvidia-smi stand-in."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from datagen.cmd_clean_gpus import main as clean_main
from tasks.hygiene import clean_gpus
from tasks.targets import (
    Target,
    TargetError,
    TargetUnreachable,
    detached_exit_status,
    env_script,
    parse_target,
    remote_command_line,
    run_command,
    start_detached,
)
from tests.support.common import free_port
from tests.support.hygiene import Holder, alive, start_holder, stop_holders
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Append holders here; all their processes are SIGKILLed and reaped after the test."""
    started: list[Holder] = []
    yield started
    stop_holders(started)


def test_parse_targets():
    assert parse_target("local") == Target()
    assert parse_target("ssh://gpu1") == Target("ssh", "gpu1", None, 22)
    assert parse_target("ssh://ubuntu@10.0.0.5:2222") == Target("ssh", "10.0.0.5", "ubuntu", 2222)
    t = parse_target("pct://root@pve.example.org/105")
    assert t == Target("pct", "pve.example.org", "root", 22, 105) and str(t) == "pct://root@pve.example.org/105"
    assert str(parse_target("ssh://u@[::1]:2200")) == "ssh://u@[::1]:2200"


@pytest.mark.parametrize("bad", [
    "ssh://0;touch /tmp/pwned@127.0.0.1", "ssh://root@host;reboot", "ssh://$(id)@h", "ssh://h:99999",
    "pct://root@pve", "pct://root@pve/10;ls", "ftp://h", "ssh://h/path", "ssh://`id`",
])
def test_bad_targets_are_refused_naming_the_input(bad):
    with pytest.raises(TargetError) as exc:
        parse_target(bad)
    assert repr(bad) in str(exc.value)
    assert not os.path.exists("/tmp/pwned")


def test_remote_command_lines_are_quoted_with_timeout_and_closed_stdin(monkeypatch):
    monkeypatch.setenv("DATAGEN_REMOTE_ENV", "A='x y' B=1")
    line = remote_command_line(parse_target("ssh://h"), ["echo", "a b", "$HOME;x"], 7.2)
    assert line == "timeout -k 5 8 env 'A=x y' B=1 echo 'a b' '$HOME;x' </dev/null"
    line = remote_command_line(parse_target("pct://h/101"), ["echo", "it's"], 5)
    words = shlex.split(line)
    assert words[:9] == ["timeout", "-k", "5", "15", "pct", "exec", "101", "--", "bash"]
    assert words[9:11] == ["-lc", "timeout -k 5 5 env 'A=x y' B=1 echo 'it'\"'\"'s' </dev/null"]
    assert line.endswith(" </dev/null")
    monkeypatch.setenv("DATAGEN_REMOTE_ENV", "1BAD=x")
    with pytest.raises(TargetError, match="1BAD=x"):
        remote_command_line(parse_target("ssh://h"), ["true"], 1)


def test_env_values_are_never_on_the_remote_command_line(monkeypatch):
    monkeypatch.setenv("DATAGEN_REMOTE_ENV", "B=1")
    env = {"SECRET_KEY": "sk-'v;$(x)\nnext"}
    for target in ("ssh://h", "pct://h/101"):
        line = remote_command_line(parse_target(target), ["echo", "a"], 5, env=env)
        assert "sk-" not in line and "SECRET_KEY" not in line
        assert "env B=1 sh -c " in line and line.endswith("sh echo a" if target == "ssh://h" else "a'")
    assert remote_command_line(parse_target("ssh://h"), ["true"], 5, env={}).endswith(" </dev/null")
    # the stdin payload round-trips any value through sh literally
    script = env_script(env) + 'printf %s "$SECRET_KEY"'
    assert run_command("local", ["sh", "-c", script], 5).stdout == env["SECRET_KEY"]
    with pytest.raises(TargetError, match="'1X'"):
        remote_command_line(parse_target("ssh://h"), ["true"], 5, env={"1X": "y"})


def test_local_run_command_and_timeout(tmp_path):
    res = run_command("local", ["sh", "-c", 'echo "$X"; cat; echo err >&2; exit 3'], 10, env={"X": "1;2"})
    assert (res.exited, res.stdout, res.stderr) == (3, "1;2\n", "err\n")
    t0 = time.monotonic()
    res = run_command("local", ["sleep", "30"], 0.3)
    assert res.exited == 124 and time.monotonic() - t0 < 5
    assert run_command("local", [str(tmp_path / "missing")], 5).exited == 127


def test_start_detached_local_is_a_session_leader(tmp_path, reap_pids):
    pid = start_detached("local", ["sh", "-c", "echo started; exit 7"], str(tmp_path / "log"))
    reap_pids.append(pid)
    deadline = time.monotonic() + 10
    while detached_exit_status(pid) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert detached_exit_status(pid) == 7
    assert (tmp_path / "log").read_text() == "started\n"
    pid = start_detached("local", ["sleep", "30"], str(tmp_path / "log2"))
    reap_pids.append(pid)
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    assert detached_exit_status(pid) is None


# --------------------------------------------------------------------------- over real sshd


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_metacharacters_reach_the_remote_command_literally(remote, kind, tmp_path):
    canary = tmp_path / "pwned"
    hostile = [f"0;touch {canary}", f"$(touch {canary})", f"`touch {canary}`", "it's \"quoted\" | & >x"]
    res = run_command(remote.url(kind, 123), ["printf", "%s\\n", *hostile], 20, env={"V": f"x;touch {canary}"})
    assert res.exited == 0, res.stderr
    assert res.stdout.splitlines() == hostile
    assert not canary.exists()
    res = run_command(remote.url(kind, 123), ["sh", "-c", 'echo "$V"; cat'], 20, env={"V": f"x;touch {canary}"})
    assert res.stdout == f"x;touch {canary}\n"  # and `cat` saw EOF at once: stdin is closed
    assert not canary.exists()
    if kind == "pct":
        assert Path(remote.pct_log).read_text().splitlines()[-1] == "123"


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_test_sessions_never_source_the_users_bashrc(remote, kind):
    """The test hosts' shells skip this machine's ~/.bashrc: a profile's `pyenv rehash` killed mid-way
    by a test's timeout once left its lock behind, and every later SSH command on the machine waited
    60 s on it (docs/testing.md). sshd's sessions get SHLVL=1, so bash (at level 2) skips it; the pct
    stand-in's login shell (`bash -lc`) gets the container's own HOME, as a real container has."""
    res = run_command(remote.url(kind, 7), ["sh", "-c", 'echo "$SHLVL $HOME"'], 20)
    assert res.exited == 0, res.stderr
    shlvl, home = res.stdout.split()
    if kind == "ssh":
        assert shlvl == "2"
    else:
        assert home == str(Path(remote.pct_log).parent / "pct-home")


def test_remote_timeout_stops_the_remote_command(remote, tmp_path):
    marker = tmp_path / "late"
    t0 = time.monotonic()
    res = run_command(remote.url(), ["sh", "-c", f"sleep 3; touch {marker}"], 1)
    assert res.exited == 124 and time.monotonic() - t0 < 3
    assert not marker.exists()


def test_unreachable_host_is_a_clear_error_and_exit_2(ssh_env, capsys):
    port = free_port()
    target = f"ssh://root@127.0.0.1:{port}"
    with pytest.raises(TargetUnreachable) as exc:
        run_command(target, ["true"], 5)
    assert str(exc.value).startswith(f"cannot reach {target}: ")
    assert clean_main(["--host", target]) == 2
    assert f"cannot reach {target}" in capsys.readouterr().err


def test_wrong_host_key_is_refused(remote, tmp_path, monkeypatch):
    other = tmp_path / "known_hosts"
    other.write_text(f"[127.0.0.1]:{remote.port} ssh-ed25519 "
                     "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
    monkeypatch.setenv("DATAGEN_SSH_KNOWN_HOSTS", str(other))
    with pytest.raises(TargetUnreachable, match="cannot reach ssh://root@127.0.0.1"):
        run_command(remote.url(), ["true"], 5)


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_remote_hygiene_over_nvidia_smi(remote, holders, kind):
    polite = start_holder((0,), 4096, children=1, child_gpu=0)
    stubborn = start_holder((1,), 2048, ignore_term=True)
    spared = start_holder((2,), 1024)
    holders += [polite, stubborn, spared]
    report = clean_gpus(remote.url(kind, 200), gpus=[0, 1], grace_s=0.5, deadline_s=10)
    assert report.backend == "nvidia-smi", report.summary()
    assert report.clean, report.summary()
    procs = {p.pid: p for p in report.processes}
    assert procs[polite.pid].ended_by == "SIGTERM" and procs[polite.children[0]].ended_by == "SIGTERM"
    assert procs[stubborn.pid].ended_by == "SIGKILL"
    assert procs[polite.pid].cmdline.startswith(sys.executable) and procs[polite.pid].user == "root"
    assert [(g.index, g.before_mib, g.after_mib) for g in report.gpus] == [(0, 4096 + 512, 0), (1, 2048, 0)]
    assert not any(alive(p) for p in polite.all_pids + stubborn.all_pids)
    assert alive(spared.pid) and procs[spared.pid].action == "spare"
    assert report.target == remote.url(kind, 200)


def test_remote_cli_dry_run_json_and_missing_python(remote, holders, capsys, monkeypatch):
    h = start_holder((3,), 2048)
    holders.append(h)
    assert clean_main(["--host", remote.url(), "--gpus", "3", "--dry-run", "--json"]) == 1
    out = capsys.readouterr().out
    assert f'"pid": {h.pid}' in out and alive(h.pid)
    monkeypatch.setenv("DATAGEN_REMOTE_ENV", "DATAGEN_PYTHON=/nonexistent/python3")
    assert clean_main(["--host", remote.url(), "--gpus", "3"]) == 2
    err = capsys.readouterr().err
    assert f"GPU probe on {remote.url()} failed" in err and "(exit 127)" in err


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_remote_env_travels_over_stdin_not_argv(remote, kind):
    secret = "sk-targets-91be 'q' $(x)"
    env = {"DATAGEN_T_SECRET": secret, "BIG": "x" * 50_000}
    t0 = time.monotonic()
    res = run_command(remote.url(kind, 7), ["sh", "-c", 'printf %s "$DATAGEN_T_SECRET"; cat'], 20, env=env)
    assert (res.exited, res.stdout) == (0, secret), res.stderr
    assert time.monotonic() - t0 < 5  # the payload goes in one piece, not byte by byte
    res = run_command(remote.url(kind, 7), ["sh", "-c", 'printf %s "$BIG" | wc -c'], 20, env=env)
    assert res.stdout.strip() == "50000"
    # `ps` run by the command itself sees every ancestor (sshd session, timeout, sh) while it runs
    res = run_command(remote.url(kind, 7), ["ps", "-eo", "args"], 20, env=env)
    assert res.exited == 0 and "ps -eo args" in res.stdout
    assert "sk-targets" not in res.stdout


def test_start_detached_remote(remote, tmp_path, reap_pids):
    log = tmp_path / "remote.log"
    secret = "sk-detached-33a1"
    pid = start_detached(remote.url(), ["sh", "-c", 'echo "hi $X"; sleep 30'], str(log), env={"X": secret})
    reap_pids.append(pid)
    assert os.getsid(pid) == pid
    deadline = time.monotonic() + 10
    while (not log.exists() or not log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert log.read_text() == f"hi {secret}\n"
    assert secret not in run_command("local", ["ps", "-eo", "args"], 10).stdout
