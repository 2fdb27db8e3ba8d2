"""`datagen gpu-sim` and the nvidia-smi stand-in, as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from emulator.simgpu import SimGpus
from tests.support.common import pid_alive
from tests.support.emulator import REPO

SMI = str(REPO / "emulator" / "bin" / "nvidia-smi")


def _datagen(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datagen", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=30)


def _smi(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SMI, *args], capture_output=True, text=True, env=env or dict(os.environ), timeout=30)


def test_init_and_show_json(tmp_path: Path) -> None:
    env = dict(os.environ, DATAGEN_SIM_GPUS=str(tmp_path / "g.json"))
    r = _datagen("gpu-sim", "init", "--count", "2", "--total-mib", "1000", "--name", "Fake H200", env=env)
    assert r.returncode == 0, r.stderr
    r = _datagen("gpu-sim", "show", "--json", env=env)
    snap = json.loads(r.stdout)
    assert [(g["index"], g["name"], g["total_mib"], g["used_mib"], g["processes"]) for g in snap["gpus"]] == [
        (0, "Fake H200", 1000, 0, []), (1, "Fake H200", 1000, 0, [])]
    assert all(g["uuid"].startswith("GPU-") for g in snap["gpus"])


def test_show_without_file_is_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, DATAGEN_SIM_GPUS=str(tmp_path / "missing.json"))
    r = _datagen("gpu-sim", "show", env=env)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_hold_tree_and_nvidia_smi_formats(sim_gpus: SimGpus, reap_pids: list[int]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "datagen", "gpu-sim", "hold", "--gpu", "3", "--mib", "4096", "--children", "2",
         "--child-mib", "10", "--ignore-sigterm"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    reap_pids.append(proc.pid)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    assert line.startswith(f"holding 4096 MiB on GPU 3 pid {proc.pid} children ")
    kids = [int(x) for x in line.split("children ")[1].split()]
    reap_pids.extend(kids)
    assert len(kids) == 2
    gpu = sim_gpus.snapshot()["gpus"][3]
    assert gpu["used_mib"] == 4116
    assert {p["pid"] for p in gpu["processes"]} == {proc.pid, *kids}

    r = _smi("--query-gpu=index,uuid,name,memory.used,memory.total", "--format=csv,noheader,nounits")
    assert r.returncode == 0
    rows = [ln.split(", ") for ln in r.stdout.splitlines()]
    assert len(rows) == 8 and rows[3][0] == "3" and rows[3][3:] == ["4116", "97887"]
    assert rows[3][1] == gpu["uuid"]
    r = _smi("--query-compute-apps=pid,used_memory,gpu_uuid,process_name", "--format=csv,noheader,nounits")
    apps = {int(ln.split(", ")[0]): ln.split(", ") for ln in r.stdout.splitlines()}
    assert apps[proc.pid][1:3] == ["4096", gpu["uuid"]]
    r = _smi("--query-gpu=index,memory.used", "--format=csv")
    assert r.stdout.splitlines()[0] == "index, memory.used [MiB]" and r.stdout.splitlines()[4] == "3, 4116 MiB"
    assert _smi("--query-gpu=bogus", "--format=csv").returncode == 2

    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.2)  # negative check: SIGTERM is ignored
    assert pid_alive(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    # children have no death signal: killing the parent orphans them, still holding memory
    assert all(pid_alive(k) for k in kids)
    assert {p["pid"] for p in sim_gpus.snapshot()["gpus"][3]["processes"]} == set(kids)
    for k in kids:
        os.kill(k, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(k) for k in kids if pid_alive(k)], timeout=0.01)
    deadline = time.monotonic() + 5
    while sim_gpus.snapshot()["gpus"][3]["used_mib"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sim_gpus.snapshot()["gpus"][3]["used_mib"] == 0


def test_nvidia_smi_without_driver(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("DATAGEN_SIM_GPUS", None)
    r = _smi("--query-gpu=index", "--format=csv", env=env)
    assert r.returncode == 9 and "couldn't communicate with the NVIDIA driver" in r.stdout
    env["DATAGEN_SIM_GPUS"] = str(tmp_path / "nope.json")
    assert _smi("-L", env=env).returncode == 9


def test_hold_that_does_not_fit(sim_gpus: SimGpus) -> None:
    r = _datagen("gpu-sim", "hold", "--gpu", "0", "--mib", "200000")
    assert r.returncode == 2 and "cannot allocate 200000 MiB" in r.stderr


def test_hold_refuses_negative_memory(tmp_path: Path) -> None:
    env = dict(os.environ, DATAGEN_SIM_GPUS=str(tmp_path / "g.json"))
    assert _datagen("gpu-sim", "init", "--count", "1", env=env).returncode == 0
    for flag in ("--mib", "--child-mib"):
        args = ["gpu-sim", "hold", "--gpu", "0", "--mib", "5"] if flag == "--child-mib" else ["gpu-sim", "hold", "--gpu", "0"]
        r = _datagen(*args, flag, "-5", env=env)
        assert r.returncode == 2 and "-5 MiB: memory held cannot be negative" in r.stderr, r.stderr
    snap = json.loads(_datagen("gpu-sim", "show", "--json", env=env).stdout)
    assert snap["gpus"][0]["processes"] == []
