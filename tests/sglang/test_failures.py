"""Real SGLang launch failures, started through datagen's launcher and classified by its log and exit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from emulator.simgpu import ENV_VAR
from tasks.config import ConfigError, load_partition
from tasks.server import LaunchFailed, ServerConfig, launch
from tests.support.common import PortTaker, free_port, impostor_server, pid_alive
from tests.support.paths import REPO_ROOT
from tests.support.sglang import CPU_ARGS, DEADLINE_S, cpu_config, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]


def _launch_fails(cfg: ServerConfig, log_dir: Path) -> LaunchFailed:
    with pytest.raises(LaunchFailed) as info:
        launch(cfg, "local", None, log_dir, deadline_s=DEADLINE_S)
    return info.value


def test_missing_model_directory_is_model_not_found(tmp_path: Path, sglang_env: Path,
                                                    sglang_logs: Path) -> None:
    missing = tmp_path / "no-such-model"
    exc = _launch_fails(cpu_config(missing), sglang_logs)
    assert exc.failure.kind == "model_not_found"
    assert str(missing) in exc.failure.evidence
    assert exc.exit_status not in (None, 0)


def test_unknown_flag_is_bad_flag_with_exit_status_2(tiny_model: Path, sglang_logs: Path) -> None:
    exc = _launch_fails(cpu_config(tiny_model, extra_args=("--no-such-flag",)), sglang_logs)
    assert exc.failure.kind == "bad_flag"
    assert exc.exit_status == 2
    assert "--no-such-flag" in exc.failure.evidence


def test_deterministic_inference_is_refused_on_cpu(tiny_model: Path, sglang_logs: Path) -> None:
    # docs/output.md: same seed, same text needs --enable-deterministic-inference, which SGLang 0.5.23
    # accepts only with a GPU attention backend; CPU runs cannot promise identical resamples
    exc = _launch_fails(cpu_config(tiny_model, extra_args=("--enable-deterministic-inference",)), sglang_logs)
    assert exc.exit_status not in (None, 0)
    # a refused flag combination: permanent (no relaunch, the fraction never moves), named in the evidence
    assert exc.failure.kind == "bad_flag" and not exc.retryable
    assert "attention backends are supported for deterministic inference" in exc.failure.evidence


def test_config_json_without_model_type_is_model_not_found(tiny_model: Path, tmp_path: Path,
                                                           sglang_logs: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["model_type"], config["architectures"]
    (broken / "config.json").write_text(json.dumps(config))
    exc = _launch_fails(cpu_config(broken), sglang_logs)
    assert exc.failure.kind == "model_not_found"
    assert "Unrecognized model in" in exc.failure.evidence


def test_port_in_use_is_refused_before_anything_starts(tiny_model: Path, sglang_logs: Path) -> None:
    port = free_port()
    with impostor_server(port):  # another server whose /health_generate answers 200
        exc = _launch_fails(cpu_config(tiny_model, port=port), sglang_logs)
    assert exc.failure.kind == "port_in_use"
    assert exc.failure.evidence.startswith(f"127.0.0.1:{port} is already in use by pid {os.getpid()} (")
    assert exc.exit_status is None
    assert not list(sglang_logs.iterdir())  # no server was started, so no log was written


def test_a_200_from_another_server_on_the_port_fails_fast_instead_of_passing_readiness(
        tiny_model: Path, sglang_logs: Path) -> None:
    """The port is taken after the pre-check, before SGLang binds it: SGLang 0.5.23 would hang in
    shutdown, and the other server's 200 must not pass for its readiness."""
    port = free_port()
    with PortTaker(port) as taker, pytest.raises(LaunchFailed) as info:
        launch(cpu_config(tiny_model, port=port), "local", None, sglang_logs, deadline_s=DEADLINE_S,
               on_started=taker)
    exc = info.value
    assert exc.failure.kind == "port_in_use"
    assert exc.failure.evidence.startswith(f"127.0.0.1:{port} is held by pid {os.getpid()} (")
    assert f"not by the launched server (pid {taker.pids[0]})" in exc.failure.evidence
    assert not pid_alive(taker.pids[0])
    assert "fired up and ready to roll" not in Path(exc.log_path or "").read_text()


class _StopAtServerArgs:
    """An ``on_started`` for tasks.server.launch: SIGKILLs the server's process group as soon as its
    log holds SGLang's parsed ``server_args=`` line, which the main process writes before it spawns
    the scheduler (a scheduler's start costs 20-25 CPU-s here). ``join()`` waits for the watcher."""

    def __init__(self, log_dir: Path, deadline_s: float = DEADLINE_S) -> None:
        self.log_dir, self.deadline_s = log_dir, deadline_s
        self.seen = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, pid: int, pgid: int) -> None:
        self._thread = threading.Thread(target=self._watch, args=(pgid,), daemon=True)
        self._thread.start()

    def _watch(self, pgid: int) -> None:
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            if any("server_args=" in f.read_text(errors="replace") for f in self.log_dir.glob("*.log")):
                self.seen.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                return
            if not pid_alive(pgid):
                return
            time.sleep(0.1)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(30)


def test_trust_remote_code_and_speculative_flags_reach_the_real_server_args(tiny_model: Path,
                                                                            sglang_logs: Path) -> None:
    """[server] trust_remote_code and speculative_* end in SGLang's own parsed server_args. The launch is
    stopped once SGLang has logged them: the scheduler would only fail next (NGRAM needs sgl_kernel,
    which the CPU build lacks), after a start of its own."""
    cfg = cpu_config(tiny_model, trust_remote_code=True, speculative_algorithm="NGRAM",
                     speculative_num_draft_tokens=4)
    stop = _StopAtServerArgs(sglang_logs)
    try:
        with pytest.raises(LaunchFailed) as info:
            launch(cfg, "local", None, sglang_logs, deadline_s=DEADLINE_S, on_started=stop)
    finally:
        stop.join()
    assert stop.seen.is_set()
    log = Path(info.value.log_path or "").read_text()
    args = re.search(r"server_args=(\{.*\})", log)
    assert args is not None
    for said in ("'trust_remote_code': True", "'speculative_algorithm': 'NGRAM'",
                 "'speculative_num_draft_tokens': 4"):
        assert said in args.group(1)
    assert info.value.failure.kind not in ("too_low", "too_high", "kv_pool_exhausted")


# Shapes SGLang refuses when it parses its flags: (its flags, SGLang's last line, the partition's
# tp_size and extra_args, what datagen's load says). datagen refuses each at load, before any launch.
NODE_SHAPES = [
    (["--tp-size", "1"], "AssertionError: tp_size must be divisible by number of nodes", 1, [],
     "server.targets[0].tp_size: tp_size=1: tp_size x pp_size = 1 is not a multiple of the 2 nodes"),
    (["--tp-size", "2", "--dp-size", "2"],
     "AssertionError: multi-node data-parallel replicas are not supported; use attention DP (--attn-dp-size) "
     "across nodes", 2, ["--dp-size", "2"], "server.extra_args: extra_args=('--dp-size', '2'): --dp-size 2 over 2 nodes"),
]


def test_node_shapes_sglang_refuses_are_refused_alike_by_the_emulator_and_at_load(
        tiny_model: Path, tmp_path: Path) -> None:
    def flags(extra: list[str]) -> list[str]:
        return ["--model-path", str(tiny_model), "--host", "127.0.0.1", "--port", str(free_port()), *extra,
                "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{free_port()}"]

    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    # the real servers at once: each pays SGLang's import (about 10 s here) before it refuses
    real = [subprocess.Popen([str(sglang_python()), "-m", "sglang.launch_server", *flags(shape[0]), *CPU_ARGS],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for shape in NODE_SHAPES]
    try:
        outs = [p.communicate(timeout=300)[0] for p in real]
    finally:
        for p in real:
            if p.poll() is None:
                p.kill()
                p.wait()
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for (extra, line, tp, extra_args, said), proc, out in zip(NODE_SHAPES, real, outs, strict=True):
        assert proc.returncode == 1 and out.rstrip().splitlines()[-1] == line, out[-2000:]
        emu = subprocess.run([sys.executable, "-m", "emulator", *flags(extra)], capture_output=True, text=True,
                             timeout=60, cwd=REPO_ROOT, env=env)
        assert emu.returncode == 1 and emu.stderr.rstrip().splitlines()[-1] == line, emu.stderr
        part = tmp_path / "p.toml"
        part.write_text(f'[datasets]\nx = "in.jsonl"\n[model]\npath = "{tiny_model}"\n[server]\n'
                        f'extra_args = {json.dumps(extra_args)}\n'
                        f'targets = [{{ nodes = ["ssh://gpu1", "ssh://gpu2"], tp_size = {tp} }}]\n'
                        '[output]\nroot = "o"\n')
        with pytest.raises(ConfigError) as refused:
            load_partition(part)
        assert str(refused.value).startswith(f"{part}: {said}"), str(refused.value)
