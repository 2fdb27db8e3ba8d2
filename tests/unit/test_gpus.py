"""GPU discovery backends: NVML against a fake pynvml, nvidia-smi CSV via a stand-in, /proc scan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from types import SimpleNamespace

import pynvml
import pytest

from tasks import gpus as probe
from tasks.hygiene import clean_gpus
from tests.support.hygiene import alive

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - NVML's own names
    pass


class NVMLError_LibRmVersionMismatch(NVMLError):  # noqa: N801
    pass


class NVMLLibraryMismatchError(Exception):  # a plain Exception in nvidia-ml-py, not an NVMLError
    pass


def _fake_pynvml(init_error: Exception | None = None, procs: list | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # older bindings return bytes
    m.nvmlDeviceGetMinorNumber = lambda h: h
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=(5000 + h) * MIB, total=143771 * MIB, free=0)

    def compute(h: int) -> list:
        return list(procs or []) if h == 0 else []

    def graphics(h: int) -> list:
        raise NVMLError("Not Supported")

    m.nvmlDeviceGetComputeRunningProcesses = compute
    m.nvmlDeviceGetGraphicsRunningProcesses = graphics
    m.calls = calls
    return m


def test_nvml_path_drops_garbage_pids_and_tolerates_missing_memory(monkeypatch):
    entries = [
        SimpleNamespace(pid=0, usedGpuMemory=1 * MIB),
        SimpleNamespace(pid=4294967295, usedGpuMemory=2 * MIB),
        SimpleNamespace(pid=os.getpid(), usedGpuMemory=None),
        SimpleNamespace(pid=1, usedGpuMemory=300 * MIB),
    ]
    fake = _fake_pynvml(procs=entries)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    backend, readings, users, notes = probe.read_gpus()
    assert backend == "nvml" and notes == []
    assert [(g.index, g.uuid, g.name, g.used_mib, g.total_mib, g.minor) for g in readings] == [
        (0, "GPU-fake-0", "NVIDIA H200", 5000, 143771, 0), (1, "GPU-fake-1", "NVIDIA H200", 5001, 143771, 1)]
    assert sorted((u.pid, u.gpu, u.mib, u.source) for u in users) == [
        (1, 0, 300, "nvml"), (os.getpid(), 0, None, "nvml")]
    assert fake.calls == ["init", "shutdown"]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (NVMLError_LibraryNotFound("NVML Shared Library Not Found"), "no NVIDIA driver (libnvidia-ml.so not found)"),
        (NVMLLibraryMismatchError("Unversioned function called"), "nvidia-ml-py is newer than the installed driver"),
        (NVMLError_LibRmVersionMismatch("RM has detected an NVML/RM version mismatch"), "common inside LXC"),
    ],
)
def test_nvml_init_failures_are_explained(monkeypatch, error, expected):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=error))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)
    backend, readings, _, notes = probe.read_gpus()
    assert backend == "none" and readings == []
    assert notes[0].startswith("nvml: ") and expected in notes[0] and type(error).__name__ in notes[0]
    assert notes[1] == "nvidia-smi: nvidia-smi is not on PATH"


def test_simulated_gpus_hide_a_real_driver(monkeypatch, sim_gpus):
    # `make demo` on a real GPU host: the host's GPUs (and whoever holds them) must stay out of reach.
    fake = _fake_pynvml(procs=[SimpleNamespace(pid=1, usedGpuMemory=300 * MIB)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    backend, readings, users, notes = probe.read_gpus()
    assert backend == "sim" and len(readings) == 8 and users == []
    assert fake.calls == []  # NVML was never even initialised
    assert notes == ["DATAGEN_SIM_GPUS is set: simulated GPUs only, the host's real GPUs are not looked at"]
    assert probe._device_pattern() is None  # no /dev/nvidia* scan either


def test_nvml_failure_without_fallback_is_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=NVMLLibraryMismatchError("x")))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)
    report = clean_gpus()
    assert report.verdict == "unknown"
    assert "nvidia-ml-py is newer than the installed driver" in (report.error or "")


SMI_STUB = """#!/bin/sh
case "$1" in
  --query-gpu=*) printf '%s\\n' "0, GPU-a44622e3-2296-6285-0a86-84d0f6c67900, NVIDIA H200, 130004, 143771" \
      "1, GPU-b1, NVIDIA A100-SXM4-80GB, Rev 2, [N/A], 81920" ;;
  --query-compute-apps=*) printf '%s\\n' "1106871, 23342, GPU-a44622e3-2296-6285-0a86-84d0f6c67900, /usr/bin/python3" \
      "0, 5, GPU-b1, garbage" "77, [N/A], GPU-b1, /opt/a, b, c" ;;
esac
exit ${SMI_EXIT:-0}
"""


@pytest.fixture
def smi_on_path(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "nvidia-smi"
    stub.write_text(SMI_STUB)
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=NVMLError_LibraryNotFound("gone")))
    return stub


def test_nvidia_smi_csv_parsing(smi_on_path):
    backend, readings, users, _ = probe.read_gpus()
    assert backend == "nvidia-smi"
    assert [(g.index, g.name, g.used_mib, g.total_mib) for g in readings] == [
        (0, "NVIDIA H200", 130004, 143771), (1, "NVIDIA A100-SXM4-80GB, Rev 2", None, 81920)]
    assert sorted((u.pid, u.gpu, u.mib) for u in users) == [(77, 1, None), (1106871, 0, 23342)]


def test_nvidia_smi_without_driver_falls_through(smi_on_path, monkeypatch):
    monkeypatch.setenv("SMI_EXIT", "9")
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)
    backend, _, _, notes = probe.read_gpus()
    assert backend == "none" and notes[1].startswith("nvidia-smi: nvidia-smi exited 9")


def test_device_file_holder_hidden_from_the_gpu_list_is_found_and_ended(sim_gpus, tmp_path, monkeypatch, reap_pids):
    # A process with /dev/nvidia3 open that the GPU backend does not list (another PID namespace's
    # view, or a pre-CUDA-context process): only the /proc fd scan sees it. A regular file stands in
    # for the device node; with simulated GPUs the scan looks under DATAGEN_SIM_DEV_DIR.
    node = tmp_path / "nvidia3"
    node.write_text("")
    monkeypatch.setenv("DATAGEN_SIM_DEV_DIR", str(tmp_path))
    code = f"import signal; f = open({str(node)!r}); print('ok', flush=True); signal.pause()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    reap_pids.append(proc.pid)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
        assert probe.scan_procs()[proc.pid].devices == ["nvidia3"]
        report = clean_gpus(gpus=[3], grace_s=1, deadline_s=1)
        (found,) = [p for p in report.processes if p.pid == proc.pid]
        assert found.action == "kill" and found.sources == ["/dev/nvidia3"] and found.ended_by == "SIGTERM"
        assert report.clean and not alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_terminate_never_signals_a_recycled_pid():
    proc = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    try:
        real_start = probe._stat(proc.pid)[5]
        out = probe.terminate([{"pid": proc.pid, "start": real_start + 1}], grace_s=0.1)
        assert out == [{"pid": proc.pid, "ended_by": "gone before signal", "state": None, "alive": False}]
        assert alive(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_probe_protocol_errors_are_answers_not_exceptions():
    assert probe.handle({"op": "nope"}) == {"error": "unknown probe op 'nope'"}
    assert "failed" in probe.handle({"op": "clean"})["error"]


def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _driver_present(), reason="no NVIDIA driver")
def test_real_nvml_discovery_dry_run():
    backend, readings, _, _ = probe.read_gpus()
    assert backend == "nvml" and readings
    assert all(g.total_mib and g.total_mib > 1000 for g in readings)
    report = clean_gpus(dry_run=True)
    assert report.backend == "nvml" and report.verdict in ("clean", "not_clean")
