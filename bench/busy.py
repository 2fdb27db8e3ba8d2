"""Keep one core busy, as another job on a shared host would: 0.9 s of busy loop, then 0.1 s idle.

Used to check that the suite passes on a busy machine (docs/testing.md):
``python bench/busy.py PIDFILE & CI=true .ci/run; kill $(cat PIDFILE)``.
"""

from __future__ import annotations

import os
import sys
import time


def main(pid_file: str) -> None:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    while True:
        until = time.monotonic() + 0.9
        while time.monotonic() < until:
            pass
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1])
