"""An ``nvidia-smi`` stand-in over the simulated GPUs (DATAGEN_SIM_GPUS), for the SSH hygiene path.

Exit 9 with the driver error when there is no state file, 2 for an unknown query field.
"""

from __future__ import annotations

import os
import sys

from emulator.simgpu import SimGpuError, SimGpus

__all__ = ["main"]

NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")

GPU_FIELDS = {
    "index": ("index", None), "uuid": ("uuid", None), "gpu_uuid": ("uuid", None), "name": ("name", None),
    "gpu_name": ("name", None), "memory.used": ("memory.used [MiB]", "MiB"),
    "memory.total": ("memory.total [MiB]", "MiB"), "memory.free": ("memory.free [MiB]", "MiB"),
    "pci.bus_id": ("pci.bus_id", None), "driver_version": ("driver_version", None),
    "utilization.gpu": ("utilization.gpu [%]", "%"), "count": ("count", None),
}
APP_FIELDS = {
    "pid": ("pid", None), "used_memory": ("used_gpu_memory [MiB]", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"), "gpu_uuid": ("gpu_uuid", None),
    "gpu_name": ("gpu_name", None), "process_name": ("process_name", None), "name": ("process_name", None),
    "gpu_bus_id": ("gpu_bus_id", None),
}


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace")
        return first or "[Not Found]"
    except OSError:
        return "[Not Found]"


def _gpu_value(g: dict, field: str, count: int) -> object:
    key = GPU_FIELDS[field][0].split(" ")[0]
    return {
        "index": g["index"], "uuid": g["uuid"], "name": g["name"], "memory.used": g["used_mib"],
        "memory.total": g["total_mib"], "memory.free": g["total_mib"] - g["used_mib"],
        "pci.bus_id": f"00000000:{0x18 + g['index']:02X}:00.0", "driver_version": "570.86.15",
        "utilization.gpu": 0, "count": count,
    }[key]


def _emit(rows: list[list[object]], fields: list[str], table: dict, fmt: set[str]) -> None:
    if "noheader" not in fmt:
        print(", ".join(table[f][0] if "nounits" not in fmt else table[f][0].split(" [")[0] for f in fields))
    for row in rows:
        out = []
        for f, v in zip(fields, row, strict=True):
            unit = table[f][1]
            out.append(f"{v} {unit}" if unit and "nounits" not in fmt else str(v))
        print(", ".join(out))


def main(argv: list[str] | None = None) -> int:
    """Print the simulated GPUs the way nvidia-smi does. Exit 0, 2 (bad query) or 9 (no 'driver')."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = os.environ.get("DATAGEN_SIM_GPUS", "").strip()
    if not path or not os.path.exists(path):
        print(NO_DRIVER)
        return 9
    try:
        snap = SimGpus(path).snapshot()
    except SimGpuError:
        print(NO_DRIVER)
        return 9
    gpus = snap["gpus"]
    opts: dict[str, str] = {}
    it = iter(argv)
    for a in it:
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            opts[k] = v
        elif a in ("-i", "--id", "--format", "--query-gpu", "--query-compute-apps"):
            opts[{"-i": "--id"}.get(a, a)] = next(it, "")
        else:
            opts[a] = ""
    if "--id" in opts:
        wanted = {x.strip() for x in opts["--id"].split(",")}
        gpus = [g for g in gpus if str(g["index"]) in wanted or g["uuid"] in wanted]
    fmt = set(opts.get("--format", "").split(","))
    if "-L" in opts or "--list-gpus" in opts:
        for g in gpus:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        return 0
    for key, table in (("--query-gpu", GPU_FIELDS), ("--query-compute-apps", APP_FIELDS)):
        if key not in opts:
            continue
        fields = [f.strip() for f in opts[key].split(",") if f.strip()]
        for f in fields:
            if f not in table:
                print(f'Field "{f}" is not a valid field to query.\n')
                return 2
        if "csv" not in fmt:
            print('"--format" must be specified with "csv" when querying.')
            return 2
        rows: list[list[object]] = []
        if key == "--query-gpu":
            rows = [[_gpu_value(g, f, len(snap["gpus"])) for f in fields] for g in gpus]
        else:
            for g in gpus:
                for p in g["processes"]:
                    vals = {"pid": p["pid"], "used_memory": p["mib"], "used_gpu_memory": p["mib"],
                            "gpu_uuid": g["uuid"], "gpu_name": g["name"], "process_name": _proc_name(p["pid"]),
                            "name": _proc_name(p["pid"]), "gpu_bus_id": f"00000000:{0x18 + g['index']:02X}:00.0"}
                    rows.append([vals[f] for f in fields])
        _emit(rows, fields, table, fmt)
        return 0
    for g in gpus:
        print(f"| {g['index']:>3}  {g['name'][:40]:<40} | {g['used_mib']:>6}MiB / {g['total_mib']:>6}MiB |")
        for p in g["processes"]:
            print(f"|      pid {p['pid']:>8}  {_proc_name(p['pid'])[:30]:<30} {p['mib']:>8}MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
