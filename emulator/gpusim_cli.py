"""``datagen gpu-sim init|show|hold``: manage the simulated-GPU state file named by DATAGEN_SIM_GPUS.

Exit codes: 0 ok; 2 usage error, no or unreadable state file, or (hold) the allocation does not fit.
``hold`` runs until killed (SIGTERM ends it unless --ignore-sigterm).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from emulator.simgpu import DEFAULT_NAME, DEFAULT_TOTAL_MIB, SimGpuError, SimGpus

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datagen gpu-sim", description="simulated GPUs (DATAGEN_SIM_GPUS)")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="create or reset the state file")
    i.add_argument("--count", type=int, default=8)
    i.add_argument("--total-mib", type=int, default=DEFAULT_TOTAL_MIB)
    i.add_argument("--name", default=DEFAULT_NAME)
    i.add_argument("--release-delay", type=float, default=0.0, help="seconds a dead owner's memory stays")
    s = sub.add_parser("show", help="print GPUs, memory and holders")
    s.add_argument("--json", action="store_true")
    h = sub.add_parser("hold", help="hold memory on a GPU until killed")
    h.add_argument("--gpu", type=int, required=True)
    h.add_argument("--mib", type=_non_negative, required=True)
    h.add_argument("--ignore-sigterm", action="store_true")
    h.add_argument("--children", type=int, default=0, help="fork K children (a process tree)")
    h.add_argument("--child-mib", type=_non_negative, default=0, help="MiB each child holds on the same GPU")
    return p


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} MiB: memory held cannot be negative")
    return value


def _show(sim: SimGpus, as_json: bool) -> None:
    snap = sim.snapshot()
    if as_json:
        print(json.dumps(snap, indent=1))
        return
    for g in snap["gpus"]:
        procs = ", ".join(f"{p['pid']}:{p['mib']}MiB" for p in g["processes"]) or "-"
        print(f"{g['index']}  {g['uuid']}  {g['name']}  {g['used_mib']}/{g['total_mib']} MiB  {procs}")


def _hold(sim: SimGpus, gpu: int, mib: int, children: int, child_mib: int, ignore_sigterm: bool) -> int:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        sim.set_allocation(gpu, mib)
    except SimGpuError as exc:
        print(f"datagen gpu-sim hold: {exc}", file=sys.stderr)
        return 2
    kids = []
    ready_r, ready_w = os.pipe()
    for _ in range(children):
        pid = os.fork()
        if pid == 0:  # a child: no PR_SET_PDEATHSIG on purpose, so killing only the parent orphans it
            try:
                if child_mib:
                    sim.set_allocation(gpu, child_mib)
                os.write(ready_w, b"1")
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        kids.append(pid)
    got = 0
    while got < children:  # print "holding" only once every child holds its memory
        chunk = os.read(ready_r, children - got)
        if not chunk:
            break
        got += len(chunk)
    print(f"holding {mib} MiB on GPU {gpu} pid {os.getpid()} children {' '.join(map(str, kids))}".rstrip(),
          flush=True)
    while True:
        signal.pause()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``datagen gpu-sim``; see the module docstring for exit codes."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.cmd == "init":
            sim = SimGpus.init(None, args.count, args.total_mib, args.name, args.release_delay)
            print(f"{sim.path}: {args.count} GPUs of {args.total_mib} MiB ({args.name})")
            return 0
        sim = SimGpus()
        if args.cmd == "show":
            _show(sim, args.json)
            return 0
        sim.total_mib(args.gpu)  # fail fast on a missing file or GPU
        return _hold(sim, args.gpu, args.mib, args.children, args.child_mib, args.ignore_sigterm)
    except SimGpuError as exc:
        print(f"datagen gpu-sim: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
