"""Real processes that hold simulated GPU memory (children, orphans, SIGTERM-ignorers), for the hygiene
tests and bench/bench_hygiene.py (so no pytest here).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

HOLDER = r"""
import json, os, signal, sys
from emulator.simgpu import SimGpus
cfg = json.loads(sys.argv[1])
if cfg["ignore_term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
r, w = os.pipe()
def hold(gpu, mib):
    if gpu is not None:
        SimGpus().set_allocation(gpu, mib)
def park():
    while True:
        signal.pause()
expected = 0
for _ in range(cfg["children"]):
    expected += 1
    if os.fork() == 0:
        hold(cfg["child_gpu"], cfg["child_mib"])
        os.write(w, b"c%d\n" % os.getpid())
        park()
if cfg["orphan_gpu"] is not None:
    expected += 1
    mid = os.fork()
    if mid == 0:
        if os.fork() == 0:
            hold(cfg["orphan_gpu"], cfg["mib"])
            os.write(w, b"o%d\n" % os.getpid())
            park()
        os._exit(0)
    os.waitpid(mid, 0)
os.close(w)
got, buf = [], b""
while len(got) < expected:
    chunk = os.read(r, 4096)
    if not chunk:
        sys.exit("a holder child died before it was ready")
    buf += chunk
    *lines, buf = buf.split(b"\n")
    got += [x.decode() for x in lines]
for gpu in cfg["gpus"]:
    hold(gpu, cfg["mib"])
print(json.dumps({"pid": os.getpid(), "children": [int(x[1:]) for x in got if x[0] == "c"],
                  "orphan": next((int(x[1:]) for x in got if x[0] == "o"), None)}), flush=True)
park()
"""


@dataclass
class Holder:
    pid: int
    children: list[int]
    orphan: int | None
    proc: subprocess.Popen[bytes] = field(repr=False)
    procs: list[psutil.Process] = field(default_factory=list, repr=False)  # as started (pid + start)

    def __post_init__(self) -> None:
        for pid in self.all_pids:
            with contextlib.suppress(psutil.Error):
                self.procs.append(psutil.Process(pid))

    @property
    def all_pids(self) -> list[int]:
        return [self.pid, *self.children, *([self.orphan] if self.orphan else [])]


def start_holder(gpus: tuple[int, ...] = (0,), mib: int = 1024, *, ignore_term: bool = False,
                 children: int = 0, child_gpu: int | None = None, child_mib: int = 512,
                 orphan_gpu: int | None = None, deadline_s: float = 30.0) -> Holder:
    """Start a holder (env must carry DATAGEN_SIM_GPUS) and return once it holds its memory."""
    cfg = {"gpus": list(gpus), "mib": mib, "ignore_term": ignore_term, "children": children,
           "child_gpu": child_gpu, "child_mib": child_mib, "orphan_gpu": orphan_gpu}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + deadline_s
    line = b""
    try:
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"holder did not become ready (exit {proc.returncode})")
            if sel.select(timeout=min(remaining, 0.5)):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    continue
                line += chunk
    finally:
        sel.close()
        proc.stdout.close()
    info = json.loads(line)
    return Holder(pid=info["pid"], children=info["children"], orphan=info["orphan"], proc=proc)


def stop_holders(holders: list[Holder]) -> None:
    """SIGKILL whatever is left of ``holders`` (never a recycled pid) and reap the holder processes."""
    for h in holders:
        for p in h.procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        h.proc.wait(timeout=10)


def state_of(pid: int) -> str | None:
    """The /proc state letter of ``pid`` or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return state_of(pid) not in (None, "Z", "X")
