"""A rank killed on node 1 of a server over two nodes, through `datagen run` as a user runs it: how long
until the whole server is ended, and until it serves again, and what that costs in rows.

Two hosts, each a real sshd on its own loopback address with its own simulated GPUs (as
tests/e2e/test_multinode.py), one emulated server with tp 2 over both. Each round: `datagen run` of
ROWS rows; once KILL_AFTER rows are done, the rank on node 1 is killed with SIGKILL (its process
group); the run goes on to the end. Reported per round, from the run's own log and the emulator's
request log: seconds from the kill to "ending the server on every node" (the rank watch looks every
`RANK_EVERY_S`; without it node 0 would hang until `run.hang_timeout_s`, here 30 s), seconds from
the kill to the relaunched server serving, and the rows sent twice (only those in flight at the kill
may be). Every round checks every row exactly once and no rank left on either node.

Run alone: ``.venv/bin/python bench/bench_multinode.py [--rounds N]`` (needs openssh-server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402

from tasks.server._watchdog import RANK_EVERY_S  # noqa: E402
from tests.support.common import free_port, pid_alive  # noqa: E402
from tests.support.hosts import emulator_partition, sim_clean  # noqa: E402
from tests.support.prefect import migrated_home  # noqa: E402
from tests.support.sshd import hosts_env, start_hosts, stop_hosts  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS, KILL_AFTER = 240, 40
ADDRESSES = ["127.0.0.2", "127.0.0.3"]
_STAMP = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \|")


def _at(text: str, needle: str, after: float = 0.0) -> float:
    """Seconds of the day of the first log line holding ``needle`` at or after ``after``."""
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m and needle in line:
            t = datetime.strptime(m[1], "%H:%M:%S.%f")
            s = t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
            if s >= after:
                return s
    raise AssertionError(f"no log line with {needle!r}")


def _round(work: Path) -> dict[str, float]:
    hosts = start_hosts(work / "hosts", ADDRESSES)
    try:
        head = hosts[0].address
        nodes = ", ".join(f'"{h.url()}"' for h in hosts)
        entry = (f'{{ nodes = [{nodes}], gpus = [0], tp_size = 2, port = {free_port(head)}, flags = {{ host = '
                 f'"{head}", env = {{ DATAGEN_EMU_REQUEST_LOG = "{work / "requests.log"}" }} }} }}')
        part, ids = emulator_partition(work, ROWS, [entry], 8, "max_relaunches = 2\nhang_timeout_s = 30",
                                       name="two-nodes")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
        env.update(hosts_env(hosts), PREFECT_HOME=str(migrated_home(work / "prefect")),
                   DATAGEN_STATE_DIR=str(work / "state"), DATAGEN_RUN_DIR=str(work / "run"),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
        log = work / "run.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([DATAGEN, "run", "--partition", str(part), "--out", str(work / "out")],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        requests = work / "requests.log"
        while sum(line.startswith("done ") for line in (requests.read_text().splitlines() if requests.exists() else [])) \
                < KILL_AFTER:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.02)
        (record,) = [json.loads(p.read_text()) for p in (work / "state" / "runs").glob("*.json")]
        node1 = record["servers"][1]
        os.killpg(node1["pgid"], signal.SIGKILL)
        now = datetime.now()
        killed = now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(log.read_text()[-3000:])
        text = log.read_text()
        ended = _at(text, "ending the server on every node", killed)
        serving = _at(text, "serving at http://", ended)
        seen = Counter(i for f in sorted((work / "out" / "ds").glob("shard-*.parquet"))
                       for i in pq.read_table(f, columns=["id"]).column("id").to_pylist())
        assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}, "rows lost or duplicated"
        sent = Counter(line.split(" ", 1)[1].rpartition("@")[0] for line in requests.read_text().splitlines()
                       if line.startswith("recv "))
        servers = json.loads(next((work / "state" / "runs").glob("*.json")).read_text())["servers"]
        assert not any(pid_alive(s["pid"]) for s in servers), "a rank outlived its run"
        assert all(sim_clean(h) for h in hosts), "GPU memory left on a node"
        return {"to_ended_s": ended - killed, "to_serving_s": serving - killed,
                "sent_twice": float(sum(1 for n in sent.values() if n > 1))}
    finally:
        stop_hosts(hosts)


CONCURRENCY = 6  # emulator_partition's run.concurrency: the most rows in flight at the kill


def run(quick: bool) -> list[dict[str, object]]:
    """``make bench``'s rows: 1 round quick, else 3 (medians)."""
    rounds = []
    for i in range(1 if quick else 3):
        with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
            rounds.append(_round(Path(tmp) / f"round-{i}"))

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    ended, serving, twice = median("to_ended_s"), median("to_serving_s"), median("sent_twice")
    return [
        {"metric": "rank killed on node 1 -> server ended on every node", "value": ended, "unit": "s",
         "target": f"< {RANK_EVERY_S + 2:g} (watch every {RANK_EVERY_S:g} s)", "ok": ended < RANK_EVERY_S + 2},
        {"metric": "rank killed on node 1 -> relaunched server serving", "value": serving, "unit": "s",
         "target": "< 30 (run.hang_timeout_s)", "ok": serving < 30},
        {"metric": "rows sent twice after the kill", "value": twice, "unit": "rows",
         "target": f"<= {CONCURRENCY} (in flight)", "ok": twice <= CONCURRENCY},
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
            rounds.append(_round(Path(tmp) / f"round-{i}"))
            print(f"round {i + 1}: {rounds[-1]}", flush=True)
    for key in ("to_ended_s", "to_serving_s", "sent_twice"):
        values = [r[key] for r in rounds]
        print(f"{key}: median {statistics.median(values):.2f}, max {max(values):.2f} (of {len(values)})")
    print(f"rank watch every {RANK_EVERY_S:g} s; run.hang_timeout_s 30 s; {ROWS} rows, kill after {KILL_AFTER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
