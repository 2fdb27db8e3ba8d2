"""Simulated GPUs: a JSON state file (named by DATAGEN_SIM_GPUS) shared by every process that "uses" a GPU.

An allocation counts while its owner (pid + start time) lives and is not a zombie, then for
``release_delay_s`` after it was first seen dead. Updates happen under ``flock(<file>.lock)`` and
replace the file by rename. File format: docs/emulator.md, "Simulated GPUs".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from tasks.files import atomic_write_json, open_for_write, read_nofollow
from tasks.procs import ProcessIdentity, process_started, same_process

ENV_VAR = "DATAGEN_SIM_GPUS"
DEFAULT_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
DEFAULT_TOTAL_MIB = 97887
FORMAT_VERSION = 1

__all__ = [
    "ENV_VAR",
    "SimGpuError",
    "SimGpuOutOfMemory",
    "SimGpus",
    "sim_path_from_env",
    "use_sim_gpus",
]


class SimGpuError(RuntimeError):
    """The simulated-GPU state file is missing, unreadable or asked for something impossible."""


class SimGpuOutOfMemory(SimGpuError):
    """An allocation would exceed a simulated GPU's total memory (the analogue of cudaMalloc failing)."""

    def __init__(self, gpu: int, requested_mib: int, free_mib: int, total_mib: int) -> None:
        self.gpu = gpu
        self.requested_mib = requested_mib
        self.free_mib = free_mib
        self.total_mib = total_mib
        super().__init__(
            f"simulated GPU {gpu}: cannot allocate {requested_mib} MiB, "
            f"{free_mib} MiB free of {total_mib} MiB"
        )


def use_sim_gpus(path: str | os.PathLike[str], *, count: int, total_mib: int, name: str | None = None,
                 release_delay_s: float = 0.0) -> str:
    """Point this process and its children at the simulated GPUs in ``path`` (``ENV_VAR``),
    creating them when the file does not exist yet; returns the path.

    Raises:
        SimGpuError: ``count`` or ``total_mib`` is out of range.
    """
    if not os.path.exists(path):
        SimGpus.init(path, count=count, total_mib=total_mib, name=name or DEFAULT_NAME,
                     release_delay_s=release_delay_s)
    # The server, its schedulers and hygiene (all children of this process) read the same file.
    os.environ[ENV_VAR] = os.fspath(path)
    return os.fspath(path)


def sim_path_from_env() -> str | None:
    """The state file named by ``DATAGEN_SIM_GPUS``, or None when simulated GPUs are not in use."""
    value = os.environ.get(ENV_VAR, "").strip()
    return value or None


def _owner_alive(alloc: dict[str, Any]) -> bool:
    return same_process(ProcessIdentity(int(alloc["pid"]), alloc.get("create_time")))


def _uuid_for(seed: str, index: int) -> str:
    h = hashlib.sha1(f"{seed}:{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class SimGpus:
    """Handle on one simulated-GPU state file. Cheap to create; every call re-reads the file."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        resolved = os.fspath(path) if path is not None else sim_path_from_env()
        if not resolved:
            raise SimGpuError(
                f"no simulated-GPU state file: set {ENV_VAR} to a path and run `datagen gpu-sim init`"
            )
        self.path = resolved

    # ----------------------------------------------------------------- creation
    @classmethod
    def init(
        cls,
        path: str | os.PathLike[str] | None = None,
        count: int = 8,
        total_mib: int = DEFAULT_TOTAL_MIB,
        name: str = DEFAULT_NAME,
        release_delay_s: float = 0.0,
    ) -> SimGpus:
        """Create (or reset) the state file with ``count`` idle GPUs.

        Args:
            path: the state file (default: DATAGEN_SIM_GPUS).
            count: number of GPUs.
            total_mib: memory of each GPU.
            name: the GPU model name NVML would report.
            release_delay_s: how long a dead owner's memory still counts.

        Raises:
            SimGpuError: no path, or a count or size below 1.
        """
        if count < 1:
            raise SimGpuError(f"--count must be at least 1, got {count}")
        if total_mib < 1:
            raise SimGpuError(f"--total-mib must be positive, got {total_mib}")
        sim = cls(path)
        parent = os.path.dirname(os.path.abspath(sim.path))
        os.makedirs(parent, exist_ok=True)
        seed = os.path.abspath(sim.path)
        state = {
            "version": FORMAT_VERSION,
            "release_delay_s": float(release_delay_s),
            "gpus": [
                {"index": i, "uuid": _uuid_for(seed, i), "name": name, "total_mib": int(total_mib)}
                for i in range(count)
            ],
            "allocations": [],
        }
        with sim._locked():
            sim._write(state)
        return sim

    # ----------------------------------------------------------------- low level
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # O_NOFOLLOW, relative to the directory's handle: a lock planted as a link is refused, no file
        # is created through it
        fd = open_for_write(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read(self) -> dict[str, Any]:
        try:
            state = json.loads(read_nofollow(self.path))
        except FileNotFoundError:
            raise SimGpuError(
                f"simulated-GPU state file {self.path} does not exist: run `datagen gpu-sim init`"
            ) from None
        except (OSError, ValueError) as exc:
            raise SimGpuError(f"cannot read simulated-GPU state file {self.path}: {exc}") from exc
        if state.get("version") != FORMAT_VERSION or "gpus" not in state:
            raise SimGpuError(f"{self.path} is not a version-{FORMAT_VERSION} simulated-GPU state file")
        state.setdefault("allocations", [])
        return state

    def _write(self, state: dict[str, Any]) -> None:
        atomic_write_json(self.path, state, indent=1)

    def _reap(self, state: dict[str, Any], now: float) -> bool:
        """Mark newly dead owners and drop allocations past the release delay. True if changed."""
        delay = float(state.get("release_delay_s", 0.0))
        kept: list[dict[str, Any]] = []
        changed = False
        for alloc in state["allocations"]:
            if alloc.get("dead_since") is None:
                if _owner_alive(alloc):
                    kept.append(alloc)
                    continue
                alloc["dead_since"] = now
                changed = True
            if now - float(alloc["dead_since"]) < delay:
                kept.append(alloc)
            else:
                changed = True
        state["allocations"] = kept
        return changed

    def _gpu(self, state: dict[str, Any], index: int) -> dict[str, Any]:
        for gpu in state["gpus"]:
            if gpu["index"] == index:
                return gpu
        raise SimGpuError(f"simulated GPU {index} does not exist (have {len(state['gpus'])} GPUs)")

    @staticmethod
    def _used(state: dict[str, Any], index: int) -> int:
        return sum(int(a["mib"]) for a in state["allocations"] if a["gpu"] == index)

    # ----------------------------------------------------------------- public API
    def set_allocation(self, gpu: int, mib: int, pid: int | None = None) -> None:
        """Set ``pid``'s allocation on ``gpu`` to ``mib`` (0 frees it).

        Args:
            gpu: GPU index.
            mib: the allocation's new size.
            pid: the owner (default: this process).

        Raises:
            SimGpuOutOfMemory: the GPU does not have that much memory free.
            SimGpuError: ``pid`` names no process, or the state file is unreadable.
        """
        pid = os.getpid() if pid is None else int(pid)
        create_time = process_started(pid)
        if create_time is None:
            raise SimGpuError(f"cannot allocate simulated GPU memory for pid {pid}: no such process")
        with self._locked():
            state = self._read()
            self._reap(state, time.time())
            target = self._gpu(state, gpu)
            mine = [
                a for a in state["allocations"]
                if a["gpu"] == gpu and a["pid"] == pid and a.get("dead_since") is None
            ]
            current = sum(int(a["mib"]) for a in mine)
            free = int(target["total_mib"]) - self._used(state, gpu) + current
            if mib > free:
                raise SimGpuOutOfMemory(gpu, mib - current, free - current, int(target["total_mib"]))
            state["allocations"] = [a for a in state["allocations"] if not any(a is m for m in mine)]
            if mib > 0:
                state["allocations"].append(
                    {"gpu": gpu, "pid": pid, "create_time": create_time, "mib": int(mib), "dead_since": None}
                )
            self._write(state)

    def add_allocation(self, gpu: int, mib: int, pid: int | None = None) -> None:
        """Grow ``pid``'s allocation on ``gpu`` by ``mib``.

        Raises:
            SimGpuOutOfMemory, SimGpuError: as :meth:`set_allocation`.
        """
        pid = os.getpid() if pid is None else int(pid)
        self.set_allocation(gpu, self.allocation_of(gpu, pid) + mib, pid)

    def allocation_of(self, gpu: int, pid: int) -> int:
        state = self._read()
        return sum(
            int(a["mib"]) for a in state["allocations"]
            if a["gpu"] == gpu and a["pid"] == pid and a.get("dead_since") is None
        )

    def release_pid(self, pid: int) -> None:
        """Free everything ``pid`` holds at once (a clean cudaFree/exit, no teardown lag)."""
        with self._locked():
            state = self._read()
            state["allocations"] = [a for a in state["allocations"] if a["pid"] != pid]
            self._write(state)

    def set_release_delay(self, seconds: float) -> None:
        with self._locked():
            state = self._read()
            state["release_delay_s"] = float(seconds)
            self._write(state)

    def snapshot(self) -> dict[str, Any]:
        """The `datagen gpu-sim show --json` shape:
        ``{"gpus": [{"index", "uuid", "name", "total_mib", "used_mib", "processes": [{"pid", "mib"}]}]}``.
        """
        with self._locked():
            state = self._read()
            if self._reap(state, time.time()):
                self._write(state)
        gpus = []
        for gpu in sorted(state["gpus"], key=lambda g: g["index"]):
            allocs = [a for a in state["allocations"] if a["gpu"] == gpu["index"]]
            procs: dict[int, int] = {}
            for a in allocs:
                if a.get("dead_since") is None:
                    procs[int(a["pid"])] = procs.get(int(a["pid"]), 0) + int(a["mib"])
            gpus.append(
                {
                    "index": gpu["index"],
                    "uuid": gpu["uuid"],
                    "name": gpu["name"],
                    "total_mib": int(gpu["total_mib"]),
                    "used_mib": sum(int(a["mib"]) for a in allocs),
                    "processes": [{"pid": p, "mib": m} for p, m in sorted(procs.items())],
                }
            )
        return {"gpus": gpus}

    def gpu_count(self) -> int:
        return len(self._read()["gpus"])

    def total_mib(self, gpu: int) -> int:
        return int(self._gpu(self._read(), gpu)["total_mib"])


class _Registered:
    """What datagen finds under its ``datagen.sim_gpus`` entry point (tasks.gpus.sim_gpu_backend)."""

    env_var = ENV_VAR

    def snapshot(self) -> dict[str, Any]:
        return SimGpus().snapshot()

    def create(self, path: str | os.PathLike[str], *, count: int, total_mib: int, name: str | None = None,
               release_delay_s: float = 0.0) -> str:
        return use_sim_gpus(path, count=count, total_mib=total_mib, name=name, release_delay_s=release_delay_s)


REGISTERED = _Registered()
