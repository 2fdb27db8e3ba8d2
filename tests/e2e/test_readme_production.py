"""The README's production steps run as written.

The fenced block between ``<!-- production-steps ... -->`` and ``<!-- /production-steps -->`` runs line
by line in one bash shell in the project root, with PREFECT_HOME, the run and state dirs and the
simulated GPUs under tmp and a free Prefect port in place of 4200; ``datagen down`` runs at the end
whatever happens, and an existing data/out/demo is moved aside and restored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.support.common import free_port
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
DEMO_OUT = ROOT / "data" / "out" / "demo"
MARK = "__datagen_step_rc__"


def production_steps(readme: str) -> list[str]:
    """The commands of the README's production block, comments and blank lines stripped."""
    m = re.search(r"<!-- production-steps[^>]*-->\s*```[^\n]*\n(.*?)```\s*<!-- /production-steps -->", readme, re.S)
    assert m, "README.md has no <!-- production-steps --> fenced block"
    steps = []
    for line in m.group(1).splitlines():
        # A comment starts at a `#` preceded by whitespace (none of the commands quote one).
        cmd = re.sub(r"(^|\s)#.*$", "", line).strip()
        if cmd:
            steps.append(cmd)
    return steps


def test_readme_block_is_what_this_test_expects() -> None:
    steps = production_steps((ROOT / "README.md").read_text())
    assert "make up" in steps and "make down" in steps
    assert "export PREFECT_API_URL=http://127.0.0.1:4200/api" in steps
    assert any(s.startswith(".venv/bin/prefect deployment run datagen/demo") for s in steps)
    assert ".venv/bin/datagen status data/out/demo" in steps


def _env(tmp: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        DATAGEN_RUN_DIR=str(tmp / "run"),
        DATAGEN_STATE_DIR=str(tmp / "state"),
        DATAGEN_SIM_GPUS=str(tmp / "sim-gpus.json"),
        DATAGEN_PREFECT_PORT=str(port),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_WORKER_QUERY_SECONDS="1",  # the worker picks the run up at once
    )
    return env


def _pids(run_dir: Path) -> dict[str, psutil.Process]:
    """The processes `datagen up` recorded, still alive (pid and start time match)."""
    found = {}
    for f in run_dir.glob("*.pid"):
        info = json.loads(f.read_text())
        try:
            p = psutil.Process(int(info["pid"]))
            if abs(p.create_time() - float(info["create_time"])) < 0.05:
                found[f.stem] = p
        except psutil.NoSuchProcess:
            continue
    return found


class UpWatcher:
    """While the block runs, remember every process `make up` recorded in its pid files and their
    descendants (pid and start time), so that after `make down` none of them may be alive."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.3):
            for proc in _pids(self.run_dir).values():
                try:
                    for p in [proc, *proc.children(recursive=True)]:
                        self.seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def alive(self) -> list[int]:
        left = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.05 and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                continue
        return left


def _run_block(steps: list[str], env: dict[str, str], log: Path, deadline_s: float) -> list[int]:
    """Run the steps in one bash shell; returns each step's exit status (stops at the first failure)."""
    script = "\n".join(f'{s}\nrc=$?; echo "{MARK} {i} $rc"; [ "$rc" = 0 ] || exit "$rc"'
                       for i, s in enumerate(steps)) + "\n"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", script], cwd=ROOT, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [int(m) for m in re.findall(rf"^{MARK} \d+ (\d+)$", log.read_text(errors="replace"), re.M)]


def _section(log_text: str, index: int) -> str:
    """What step ``index`` printed."""
    start = 0 if index == 0 else log_text.index(f"{MARK} {index - 1} ")
    end = log_text.find(f"{MARK} {index} ")
    return log_text[start:end if end >= 0 else None].split("\n", 1)[-1] if index else log_text[:end]


def test_production_steps_run_as_written(tmp_path: Path) -> None:
    steps = production_steps((ROOT / "README.md").read_text())
    port = free_port()
    env = _env(tmp_path, port)
    SimGpus.init(Path(env["DATAGEN_SIM_GPUS"]), count=8)
    run_dir = Path(env["DATAGEN_RUN_DIR"])
    steps = [s.replace("127.0.0.1:4200", f"127.0.0.1:{port}") for s in steps]

    if OutputDir(DEMO_OUT).lock_holder() is not None:
        pytest.skip(f"a run is writing {DEMO_OUT} right now")
    backup = None
    if DEMO_OUT.exists():
        backup = DEMO_OUT.with_name(f".demo.before-readme-test-{os.getpid()}")
        DEMO_OUT.rename(backup)
    log = tmp_path / "steps.log"
    watcher = UpWatcher(run_dir)
    try:
        codes = _run_block(steps, env, log, deadline_s=300)
        watcher.stop()
        text = log.read_text(errors="replace")
        assert codes == [0] * len(steps), f"exit codes {codes} for {steps}:\n{text[-6000:]}"

        up = _section(text, steps.index("make up"))
        assert f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in up, up

        ids = {}
        for ds in ("glaive_like", "opencode_like"):
            shards = sorted((DEMO_OUT / ds).glob("shard-*.parquet"))
            ids[ds] = [i for f in shards for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
        assert {ds: (len(v), len(set(v))) for ds, v in ids.items()} == {
            "glaive_like": (300, 300), "opencode_like": (300, 300)}

        status = _section(text, steps.index(".venv/bin/datagen status data/out/demo"))
        assert f"output {DEMO_OUT} (shard size 100)" in status or "output data/out/demo (shard size 100)" in status
        for line in ("  glaive_like: 3/3 shards, 300 of 300 rows and rejects (300 rows, 0 rejects)",
                     "  opencode_like: 3/3 shards, 300 of 300 rows and rejects (300 rows, 0 rejects)",
                     "lock: free"):
            assert line in status.splitlines(), status
        assert any(x.startswith("validation: pass (600 rows, validated ") for x in status.splitlines()), status
        assert "learned memory fraction: " in status

        # After `make down` nothing `make up` started is alive, and its pid files are gone.
        up_pids = _up_pids_from_log(up)
        assert len(up_pids) == 2 and set(up_pids) <= set(watcher.seen), (up_pids, watcher.seen)
        assert watcher.alive() == []
        assert sorted(p.name for p in run_dir.glob("*.pid")) == []
    finally:
        watcher.stop()
        subprocess.run([str(Path(sys.executable).parent / "datagen"), "down"], cwd=ROOT, env=env,
                       capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        if DEMO_OUT.exists() and (backup is not None or (DEMO_OUT / "_manifest.json").exists()):
            shutil.rmtree(DEMO_OUT)
        if backup is not None:
            backup.rename(DEMO_OUT)


def _up_pids_from_log(text: str) -> list[int]:
    """The pids `datagen up` printed (``prefect server: pid N``, ``worker: pid N``)."""
    return [int(m) for m in re.findall(r"^(?:prefect server|worker): pid (\d+)", text, re.M)]
