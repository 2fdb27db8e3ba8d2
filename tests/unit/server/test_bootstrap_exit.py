"""The API-key bootstrap mirrors its server's end: same exit code, or death by the same signal."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import urllib.parse
from pathlib import Path

import pytest

from tasks.redact import secret_forms
from tasks.server import ServerConfig, launch_argv, launch_env, redact


def _run_bootstrapped(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "fake_server.py").write_text(body)
    cfg = ServerConfig(model_path="m", api_key="sk-secret-key", backend="emulator")
    argv = launch_argv(cfg, None)
    argv[3] = "fake_server"  # the module the bootstrap runs, in place of the emulator
    env = launch_env(cfg)
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_exit_code_and_redacted_output_are_mirrored(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    assert done.returncode == 3
    assert "sk-secret-key" not in done.stdout and "'--api-key', '***'" in done.stdout


def test_death_by_sigkill_is_mirrored_without_an_oserror(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert "OSError" not in done.stderr + done.stdout
    assert done.returncode == -9


def test_sigterm_to_the_bootstrap_reaches_the_server_which_drains(tmp_path: Path) -> None:
    (tmp_path / "fake_server.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda n, f: (print('drained', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    cfg = ServerConfig(model_path="m", api_key="sk-secret-key", backend="emulator")
    argv = launch_argv(cfg, None)
    argv[3] = "fake_server"
    env = launch_env(cfg)
    env["PYTHONPATH"] = str(tmp_path)
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            proc.send_signal(signal.SIGTERM)  # the leader only, as a stop does first
            assert proc.wait(timeout=20) == 0
            assert proc.stdout.read() == "drained\n"
        finally:
            proc.kill()


def test_death_by_sigterm_is_mirrored(tmp_path: Path) -> None:
    done = _run_bootstrapped(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert done.returncode == -15 and done.stderr == ""


HOSTILE_KEYS = ["sk-back\\slash", "sk-new\nline", "sk-quote'\"both", "sk-tab\tand\x07bell", "sk-ünïcode-€",
                "sk-url&=?/ +%", "sk-$(touch x)"]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_every_spelling_of_a_hostile_key_is_redacted_from_the_server_output(tmp_path: Path, key: str) -> None:
    """What SGLang and its libraries print: server_args as a repr (a dataclass, a dict), JSON, a URL,
    a shell-quoted command line, the raw bytes; split across reads and lines."""
    body = textwrap.dedent("""
        import json, shlex, sys, time, urllib.parse
        key = sys.argv[sys.argv.index("--api-key") + 1]
        print("server_args=ServerArgs(api_key=%r, port=1)" % key, flush=True)
        print("server_args=" + str({"api_key": key, "port": 1}), flush=True)
        print("ascii " + ascii(key), flush=True)
        print(json.dumps({"api_key": key}), json.dumps({"api_key": key}, ensure_ascii=False), flush=True)
        print("GET /generate?key=" + urllib.parse.quote(key, safe="") + "&k2=" + urllib.parse.quote_plus(key),
              flush=True)
        print("launch_command: python -m sglang --api-key " + shlex.quote(key), flush=True)
        half = len(key) // 2
        sys.stdout.write("raw " + key[:half]); sys.stdout.flush(); time.sleep(0.3)
        sys.stdout.write(key[half:] + " end\\n"); sys.stdout.flush()
        print("raw again " + key, flush=True)
    """)
    (tmp_path / "fake_server.py").write_text(body)
    cfg = ServerConfig(model_path="m", api_key=key, backend="emulator")
    argv = launch_argv(cfg, None)
    argv[3] = "fake_server"
    env = launch_env(cfg)
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(argv, env=env, capture_output=True, timeout=60, cwd=tmp_path)
    text = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0, done.stderr
    for form in secret_forms(key):
        assert form not in text, (form, text)
    assert "server_args=ServerArgs(api_key=" in text and "server_args={'api_key': " in text, text
    assert text.count("***") >= 10 and "raw *** end" in text and "raw again ***" in text, text
    assert not (tmp_path / "x").exists()


def test_redact_covers_the_forms_in_argv_and_reports() -> None:
    key = "sk-a\\b'c\nd"
    shown = redact(["--api-key", key, f"--url=http://h/?k={urllib.parse.quote(key, safe='')}", repr(key)], key)
    assert shown == ["--api-key", "***", "--url=http://h/?k=***", '"***"']
