"""On-target GPU probe: which GPUs exist, who holds them, ending processes, waiting for memory.

It runs on the GPU host: ``tasks.hygiene`` imports it for the local target and ships this source
whole (one ``python3 -c`` argument) to remote ones, calling :func:`main` there. So it stays one file,
standard library only at import time (``pynvml`` and the simulated GPUs are optional, lazy), with
no imports from the rest of datagen, and speaks plain JSON (:func:`handle`):
``{"op": "discover", "gpus"}`` -> GPUs, their users, the /proc table and the probe's own pids;
``{"op": "clean", "targets": [{"pid", "start"}], ...}`` -> ``{"terminated", "wait"}``;
``{"op": "listeners", "port"}`` -> ``{"listeners"}``, the TCP sockets listening on that port and the
processes holding them (a server's port pre-check and readiness proof); errors come back as
``{"error": "..."}``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SIM_GPUS_ENV",
    "SIM_GPUS_GROUP",
    "SIM_GPUS_NOTE",
    "sim_gpu_backend",
    "GpuReading",
    "GpuUser",
    "ProcInfo",
    "PROTECTED_NAMES",
    "read_gpus",
    "scan_procs",
    "protected_pids",
    "terminate",
    "wait_clean",
    "port_listeners",
    "handle",
    "main",
]

MIB = 1024 * 1024
SIM_GPUS_ENV = "DATAGEN_SIM_GPUS"
# The stand-in registry: an installed package (the emulator) registers its simulated GPUs under this
# entry-point group; datagen names no such module, so a production install may leave it out.
SIM_GPUS_GROUP = "datagen.sim_gpus"
SIM_GPUS_NOTE = "DATAGEN_SIM_GPUS is set: simulated GPUs only, the host's real GPUs are not looked at"
PF_KTHREAD = 0x00200000  # task flag of kernel threads (include/linux/sched.h)
SMI_TIMEOUT_S = 20.0
# Daemons that legitimately keep /dev/nvidia* open and must survive hygiene. Matched on the process
# name (comm, at most 15 chars) and on the basename of argv[0].
PROTECTED_NAMES = frozenset(
    {"nvidia-persistenced", "nv-hostengine", "dcgm", "dcgmi", "dcgm-exporter", "Xorg", "X", "Xwayland"}
)
_DEV_RE = re.compile(r"^/dev/(nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset))$")


@dataclass(frozen=True)
class GpuReading:
    """One GPU's memory at one moment (MiB; None when the backend could not tell)."""

    index: int
    uuid: str
    name: str
    used_mib: int | None
    total_mib: int | None
    minor: int | None  # the N of /dev/nvidiaN


@dataclass(frozen=True)
class GpuUser:
    """A process the GPU backend lists on a GPU (its pid may not exist in our namespace)."""

    pid: int
    gpu: int
    mib: int | None
    source: str  # "nvml" | "nvidia-smi" | "sim"


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about one process (``start`` is clock ticks since boot: its identity)."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    uid: int
    user: str
    name: str
    cmdline: str
    state: str
    start: int
    kernel_thread: bool
    devices: list[str] = field(default_factory=list)


class _Unavailable(Exception):
    """A GPU backend cannot be used here; the message says why."""


# --------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int, int, int, int, int, str] | None:
    """(state, ppid, pgid, sid, flags, start, comm) from /proc/<pid>/stat, or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm may contain spaces and parentheses: it ends at the *last* ')'.
    lpar, rpar = raw.find("("), raw.rfind(")")
    if lpar < 0 or rpar < 0:
        return None
    comm = raw[lpar + 1 : rpar]
    rest = raw[rpar + 2 :].split()
    try:
        return rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[6]), int(rest[19]), comm
    except (IndexError, ValueError):
        return None


_USERS: dict[int, str] = {}


def _user(uid: int) -> str:
    if uid not in _USERS:
        try:
            _USERS[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            _USERS[uid] = str(uid)
    return _USERS[uid]


def _uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])  # real uid, as ps and psutil.username() use
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return " ".join(p.decode("utf-8", "replace") for p in raw.rstrip(b"\0").split(b"\0") if p)


def _device_pattern() -> re.Pattern[str] | None:
    """What a GPU device node looks like here: the real /dev/nvidia* nodes, or with simulated GPUs
    stand-in files under ``DATAGEN_SIM_DEV_DIR`` (None: no device scan at all)."""
    if not os.environ.get(SIM_GPUS_ENV, "").strip():
        return _DEV_RE
    sim_dir = os.environ.get("DATAGEN_SIM_DEV_DIR", "").strip()
    if not sim_dir:
        return None
    return re.compile(rf"^{re.escape(sim_dir.rstrip('/'))}/(nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset))$")


def _nvidia_devices(pid: int) -> list[str]:
    """Names of /dev/nvidia* nodes ``pid`` has open; [] when none or not permitted to look."""
    found: set[str] = set()
    dev_re = _device_pattern()
    if dev_re is None:
        return []
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # gone, or another user's process we may not inspect
        return []
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        m = dev_re.match(link)
        if m:
            found.add(m.group(1))
    return sorted(found)


def _info(pid: int) -> ProcInfo | None:
    st = _stat(pid)
    uid = _uid(pid)
    if st is None or uid is None:
        return None
    state, ppid, pgid, sid, flags, start, comm = st
    return ProcInfo(
        pid=pid,
        ppid=ppid,
        pgid=pgid,
        sid=sid,
        uid=uid,
        user=_user(uid),
        name=comm,
        cmdline=_cmdline(pid),
        state=state,
        start=start,
        kernel_thread=bool(flags & PF_KTHREAD) or pid == 2 or ppid == 2,
        devices=_nvidia_devices(pid),
    )


def scan_procs() -> dict[int, ProcInfo]:
    """Every process visible in /proc (our PID namespace), with its /dev/nvidia* holdings."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _info(int(entry))
            if info is not None:
                table[info.pid] = info
    return table


def protected_pids(table: dict[int, ProcInfo] | None = None) -> list[int]:
    """This process and all its ancestors (never to be signalled), from /proc ppid links."""
    pids = [os.getpid()]
    pid = os.getppid()
    while pid > 0 and pid not in pids:
        pids.append(pid)
        if table is not None and pid in table:
            pid = table[pid].ppid
        else:
            st = _stat(pid)
            pid = st[1] if st else 0
    return pids


def _pid_max() -> int:
    # The kernel's PID_MAX_LIMIT, not this host's current pid_max: a pid from another namespace
    # or an old driver may legitimately exceed ours. It only has to reject garbage.
    return 4194304


def _valid_pid(pid: Any, pid_max: int) -> bool:
    # Mismatched NVML versions have reported 0 and 4294967295: not processes.
    return isinstance(pid, int) and 0 < pid <= pid_max


# --------------------------------------------------------------------------- GPU backends


def _nvml_reason(exc: BaseException) -> str:
    kind = type(exc).__name__
    hints = {
        "NVMLError_LibraryNotFound": "no NVIDIA driver (libnvidia-ml.so not found)",
        "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
        "NVMLError_LibRmVersionMismatch": (
            "user-space driver and kernel module versions differ (common inside LXC: install the "
            "host's driver version in the container)"
        ),
        "NVMLLibraryMismatchError": "nvidia-ml-py is newer than the installed driver",
    }
    hint = hints.get(kind, "NVML failed")
    return f"{hint} ({kind}: {exc})"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read_nvml() -> tuple[list[GpuReading], list[GpuUser]]:
    try:
        import pynvml  # nvidia-ml-py; optional on remote hosts
    except ImportError as exc:
        raise _Unavailable("nvidia-ml-py (pynvml) is not installed") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLLibraryMismatchError is a plain Exception, not an NVMLError
        raise _Unavailable(_nvml_reason(exc)) from exc
    gpus: list[GpuReading] = []
    users: list[GpuUser] = []
    pid_max = _pid_max()
    try:
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            used = total = minor = None
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                used, total = int(mem.used) // MIB, int(mem.total) // MIB
            except Exception:  # a wedged GPU answers nothing; its memory is then unknown
                pass
            try:
                minor = int(pynvml.nvmlDeviceGetMinorNumber(h))
            except Exception:
                minor = None
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(h))
                name = _text(pynvml.nvmlDeviceGetName(h))
            except Exception:
                uuid, name = f"GPU-index-{i}", "unknown"
            gpus.append(GpuReading(i, uuid, name, used, total, minor))
            seen: dict[int, int | None] = {}
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    entries = getattr(pynvml, getter)(h) or []
                except Exception:
                    continue
                for p in entries:
                    pid = getattr(p, "pid", None)
                    if not isinstance(pid, int) or not _valid_pid(pid, pid_max):
                        continue
                    raw = getattr(p, "usedGpuMemory", None)
                    mib = int(raw) // MIB if isinstance(raw, int) else None
                    prev = seen.get(pid)
                    seen[pid] = mib if prev is None else prev + (mib or 0)
            users.extend(GpuUser(pid, i, mib, "nvml") for pid, mib in seen.items())
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return gpus, users


def _smi_int(value: str) -> int | None:
    value = value.strip()
    try:
        return int(float(value))
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _run_smi(exe: str, query: str) -> str:
    try:
        proc = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=SMI_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _Unavailable(f"nvidia-smi failed: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        raise _Unavailable(f"nvidia-smi exited {proc.returncode}: {tail[-1] if tail else ''}")
    return proc.stdout


def _smi_is_stand_in() -> bool:
    """Whether the nvidia-smi on PATH is the emulator's stand-in script (the real one is a binary)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        with open(exe, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"emulator.nvidia_smi" in head


def _read_smi() -> tuple[list[GpuReading], list[GpuUser]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise _Unavailable("nvidia-smi is not on PATH")
    gpus: list[GpuReading] = []
    by_uuid: dict[str, int] = {}
    for line in _run_smi(exe, "--query-gpu=index,uuid,name,memory.used,memory.total").splitlines():
        if not line.strip():
            continue
        # The name sits in the middle and may contain commas: two fields from each end.
        head = line.split(",", 2)
        tail = head[2].rsplit(",", 2) if len(head) == 3 else []
        if len(tail) != 3:
            raise _Unavailable(f"unexpected nvidia-smi --query-gpu line: {line!r}")
        index = _smi_int(head[0])
        if index is None:
            continue
        uuid = head[1].strip()
        by_uuid[uuid] = index
        gpus.append(GpuReading(index, uuid, tail[0].strip(), _smi_int(tail[1]), _smi_int(tail[2]), index))
    users: dict[tuple[int, int], int | None] = {}
    pid_max = _pid_max()
    out = _run_smi(exe, "--query-compute-apps=pid,used_memory,gpu_uuid,process_name")
    for line in out.splitlines():
        parts = line.split(",", 3)
        if len(parts) < 3:
            continue
        pid, mib, gpu = _smi_int(parts[0]), _smi_int(parts[1]), by_uuid.get(parts[2].strip())
        if gpu is None or not _valid_pid(pid, pid_max):
            continue
        assert pid is not None
        prev = users.get((pid, gpu))
        users[(pid, gpu)] = mib if prev is None else prev + (mib or 0)
    return gpus, [GpuUser(pid, gpu, mib, "nvidia-smi") for (pid, gpu), mib in users.items()]


def sim_gpu_backend() -> Any:
    """The simulated GPUs registered under the ``datagen.sim_gpus`` entry-point group (the
    emulator's: ``snapshot()`` and ``create(path, count=, total_mib=, name=, release_delay_s=)``).

    Raises:
        LookupError: none is installed.
    """
    from importlib.metadata import entry_points

    found = sorted(entry_points(group=SIM_GPUS_GROUP), key=lambda ep: ep.name)
    if not found:
        raise LookupError(f"no simulated GPUs are installed (entry-point group {SIM_GPUS_GROUP}; the emulator "
                          "package provides them)")
    try:
        return found[0].load()
    except Exception as exc:  # an installed but broken stand-in
        raise LookupError(f"simulated GPUs {found[0].value} cannot be loaded: {exc}") from exc


def _read_sim() -> tuple[list[GpuReading], list[GpuUser]]:
    if not os.environ.get(SIM_GPUS_ENV, "").strip():
        raise _Unavailable("DATAGEN_SIM_GPUS is not set")
    try:
        backend = sim_gpu_backend()
    except LookupError as exc:
        raise _Unavailable(f"DATAGEN_SIM_GPUS is set but {exc}") from exc
    try:
        snap = backend.snapshot()
    except Exception as exc:  # SimGpuError: missing or corrupt state file
        raise _Unavailable(f"simulated GPUs: {exc}") from exc
    gpus: list[GpuReading] = []
    users: list[GpuUser] = []
    for g in snap["gpus"]:
        gpus.append(GpuReading(g["index"], g["uuid"], g["name"], g["used_mib"], g["total_mib"], g["index"]))
        users.extend(GpuUser(p["pid"], g["index"], p["mib"], "sim") for p in g["processes"])
    return gpus, users


_BACKENDS = (("nvml", _read_nvml), ("nvidia-smi", _read_smi), ("sim", _read_sim))


def read_gpus() -> tuple[str, list[GpuReading], list[GpuUser], list[str]]:
    """(backend, GPUs, their processes, notes) from the first backend that works.

    backend is "none" and GPUs empty when nothing works; the notes then say why for each backend.
    """
    notes: list[str] = []
    backends: tuple[tuple[str, Any], ...] = _BACKENDS
    if os.environ.get(SIM_GPUS_ENV, "").strip():
        # The emulator's nvidia-smi stand-in prints the simulated GPUs (the remote path in tests);
        # a real nvidia-smi or NVML would show the host's real GPUs.
        backends = tuple(b for b in _BACKENDS if b[0] == "sim" or (b[0] == "nvidia-smi" and _smi_is_stand_in()))
        notes.append(SIM_GPUS_NOTE)
    for name, reader in backends:
        try:
            gpus, users = reader()
        except _Unavailable as exc:
            notes.append(f"{name}: {exc}")
            continue
        return name, gpus, users, notes
    return "none", [], [], notes


# --------------------------------------------------------------------------- termination


def _alive(pid: int, start: int) -> bool:
    """True while ``pid`` is the same process (same start time) and not a zombie."""
    st = _stat(pid)
    return st is not None and st[5] == start and st[0] not in ("Z", "X", "x")


def _signal(pid: int, start: int, sig: int) -> None:
    if _alive(pid, start):  # never signal a recycled pid
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _new_descendants(roots: set[int], known: set[int]) -> list[tuple[int, int]]:
    """Children forked by ``roots`` since the plan was made (e.g. a respawning parent)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[1], []).append((int(entry), st[5]))
    found: list[tuple[int, int]] = []
    todo = list(roots)
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in known and child != os.getpid():
                known.add(child)
                found.append((child, start))
                todo.append(child)
    return found


def _wait_dead(procs: dict[int, int], timeout_s: float) -> set[int]:
    """Poll until every (pid, start) is dead or ``timeout_s`` passes; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = {p for p, s in procs.items() if _alive(p, s)}
    delay = 0.005
    while alive and time.monotonic() < deadline:
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)
        alive = {p for p in alive if _alive(p, procs[p])}
    return alive


def terminate(targets: list[dict[str, int]], grace_s: float, kill_wait_s: float = 5.0) -> list[dict[str, Any]]:
    """End every ``{"pid", "start"}`` target: SIGTERM, wait ``grace_s``, SIGKILL survivors.

    A process is identified by pid and start time (clock ticks, ``/proc/<pid>/stat``), so a recycled
    pid is never signalled; a zombie counts as dead. This is the stdlib twin of ``tasks.procs``: the
    probe runs on hosts where psutil and the rest of datagen may be missing.

    Args:
        targets: the processes, as ``{"pid", "start"}``.
        grace_s: seconds between SIGTERM and SIGKILL.
        kill_wait_s: seconds to wait after SIGKILL.

    Returns one ``{"pid", "ended_by", "state", "alive"}`` per process (targets plus descendants
    forked meanwhile): ended_by is "SIGTERM", "SIGKILL", "gone before signal" or None when it
    survived; state is the final /proc state letter (e.g. "D" for uninterruptible) or None if gone.
    """
    procs = {int(t["pid"]): int(t["start"]) for t in targets}
    result: dict[int, dict[str, Any]] = {}
    for pid, start in procs.items():
        if _alive(pid, start):
            _signal(pid, start, signal.SIGTERM)
        else:
            result[pid] = {"pid": pid, "ended_by": "gone before signal", "state": None, "alive": False}
    pending = {p: s for p, s in procs.items() if p not in result}
    survivors = _wait_dead(pending, grace_s)
    for pid in pending:
        if pid not in survivors:
            result[pid] = {"pid": pid, "ended_by": "SIGTERM", "state": None, "alive": False}
    if survivors:
        late = _new_descendants(survivors, set(procs))
        for pid, start in late:
            procs[pid] = start
            survivors.add(pid)
        for pid in survivors:
            _signal(pid, procs[pid], signal.SIGKILL)
        still = _wait_dead({p: procs[p] for p in survivors}, kill_wait_s)
        for pid in survivors:
            st = _stat(pid)
            same = st is not None and st[5] == procs[pid]
            state = st[0] if same and st is not None else None
            if pid in still:
                result[pid] = {"pid": pid, "ended_by": None, "state": state, "alive": True}
            else:
                result[pid] = {"pid": pid, "ended_by": "SIGKILL", "state": state, "alive": False}
    return [result[p] for p in procs if p in result]


def wait_clean(gpus: list[int] | None, threshold_mib: int, deadline_s: float,
               interval_s: float = 0.1) -> dict[str, Any]:
    """Poll GPU memory until every selected GPU uses at most ``threshold_mib`` or ``deadline_s`` passes.

    Returns ``{"reached", "waited_s", "backend", "gpus": [GpuReading], "error"}``. A GPU whose memory
    cannot be read never counts as under the threshold.

    Args:
        gpus: the GPU indices to watch (None: all).
        threshold_mib: the most memory a clean GPU may use.
        deadline_s: seconds to keep polling.
        interval_s: seconds between readings.
    """
    t0 = time.monotonic()
    while True:
        backend, readings, _, notes = read_gpus()
        if backend == "none":
            return {"reached": False, "waited_s": time.monotonic() - t0, "backend": backend,
                    "gpus": [], "error": "; ".join(notes)}
        chosen = [g for g in readings if gpus is None or g.index in gpus]
        reached = all(g.used_mib is not None and g.used_mib <= threshold_mib for g in chosen)
        remaining = deadline_s - (time.monotonic() - t0)
        if reached or remaining <= 0:
            return {"reached": reached, "waited_s": time.monotonic() - t0, "backend": backend,
                    "gpus": [asdict(g) for g in chosen], "error": None}
        time.sleep(min(interval_s, remaining))


# --------------------------------------------------------------------------- listening sockets

_TCP_LISTEN = "0A"  # st column of /proc/net/tcp{,6} (include/net/tcp_states.h)


def _proc_net_address(hexaddr: str) -> str:
    """``0100007F`` / a 32-digit IPv6 field of /proc/net/tcp{,6} (host byte order words) as text."""
    raw = bytes.fromhex(hexaddr)
    # Each 4-byte word is in the host's (little-endian here) order.
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    addr = ipaddress.ip_address(swapped)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def _socket_owners(inodes: set[str]) -> dict[str, list[int]]:
    """socket inode -> pids with it open, for the processes whose fds this user may read."""
    owners: dict[str, list[int]] = {}
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            if link in wanted:
                pids = owners.setdefault(link[8:-1], [])
                if int(entry) not in pids:
                    pids.append(int(entry))
    return owners


def port_listeners(port: int) -> list[dict[str, Any]]:
    """The TCP sockets listening on ``port`` in this network namespace, on any address.

    Each: ``address``, ``port``, ``uid``, ``user`` and ``holders``, the processes with the socket open
    (``pid``, ``ppid``, ``pgid``, ``sid``, ``cmdline``), empty when none can be seen (another user's,
    unless run as root). Raises OSError when /proc/net/tcp cannot be read.
    """
    found: list[tuple[str, int, str]] = []
    read = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 here, or no /proc/net at all (checked below)
            continue
        read += 1
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != _TCP_LISTEN:
                continue
            addr, _, hexport = cols[1].partition(":")
            if int(hexport, 16) == port:
                found.append((_proc_net_address(addr), int(cols[7]), cols[9]))
    if not read:
        raise OSError("cannot read /proc/net/tcp: the sockets of this host cannot be listed")
    owners = _socket_owners({inode for _, _, inode in found}) if found else {}
    out = []
    for address, uid, inode in found:
        holders = []
        for pid in sorted(owners.get(inode, [])):
            st = _stat(pid)
            if st is not None:
                holders.append({"pid": pid, "ppid": st[1], "pgid": st[2], "sid": st[3], "cmdline": _cmdline(pid)})
        out.append({"address": address, "port": port, "uid": uid, "user": _user(uid), "holders": holders})
    return out


# --------------------------------------------------------------------------- protocol


def _discover() -> dict[str, Any]:
    backend, readings, users, notes = read_gpus()
    table = scan_procs()
    error = None
    if backend == "none":
        error = "no NVIDIA driver and no simulated GPUs (" + "; ".join(notes) + ")"
    return {
        "backend": backend,
        "notes": notes,
        "error": error,
        "gpus": [asdict(g) for g in readings],
        "gpu_users": [asdict(u) for u in users],
        "procs": {str(pid): asdict(info) for pid, info in table.items()},
        "self": {"pid": os.getpid(), "euid": os.geteuid(), "protected": protected_pids(table)},
    }


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one protocol request (see the module docstring). Never raises for a bad request."""
    op = request.get("op")
    try:
        if op == "discover":
            return _discover()
        if op == "clean":
            terminated = terminate(request.get("targets", []), float(request["grace_s"]),
                                   float(request.get("kill_wait_s", 5.0)))
            waited = wait_clean(request.get("gpus"), int(request["threshold_mib"]),
                                float(request["deadline_s"]))
            return {"terminated": terminated, "wait": waited}
        if op == "listeners":
            return {"listeners": port_listeners(int(request["port"]))}
    except (KeyError, TypeError, ValueError, OSError) as exc:
        return {"error": f"probe op {op!r} failed: {type(exc).__name__}: {exc}"}
    return {"error": f"unknown probe op {op!r}"}


def main(argv: list[str]) -> int:
    """Remote entry: ``argv[0]`` is the JSON request; the JSON answer goes to stdout."""
    try:
        request = json.loads(argv[0])
    except (IndexError, ValueError) as exc:
        print(json.dumps({"error": f"bad probe request: {exc}"}))
        return 2
    print(json.dumps(handle(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
