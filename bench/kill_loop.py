"""Kill loop: N rounds of `datagen run` with no Prefect server (the run's own API server), each
SIGKILLed at a random moment and then rerun to completion on the same output; every id must be in
the Parquet exactly once and no process of the killed run may be alive afterwards (its API server
and SGLang stand-in included, found as its descendants just before the kill).

    python bench/kill_loop.py [--rounds 20] [--seed 1] [--rows 200] [--work-dir DIR] [--json PATH]

The moment of each kill is uniform over 0 .. the duration of an uninterrupted run (measured first),
so start-up, slot wait, launch, inference and commit are all hit; a run that finishes before its
kill is started again on a fresh output with half the delay. Prints one line per
round and a summary (rounds, lost, duplicated, leftover processes, reruns that hung or failed).

Exit codes: 0 every round passed; 1 a round lost or duplicated an id, a rerun failed or hung, or a
process was left alive; 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATAGEN = str(Path(sys.executable).parent / "datagen")
EMU = ["--emu-load-time", "0.5", "--emu-graph-time", "0.05", "--emu-warmup-time", "0.1", "--emu-output-tokens", "24",
       "--emu-decode-ms-per-step", "10", "--emu-health-timeout", "1"]


def _setup(work: Path, rows: int) -> tuple[Path, list[str]]:
    ids = [f"k-{i:05d}" for i in range(rows)]
    (work / "ds.jsonl").write_text("".join(
        json.dumps({"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n" for i in ids))
    part = work / "partition.toml"
    part.write_text(f"""name = "killloop"
[datasets]
ds = "{work / 'ds.jsonl'}"
[model]
path = "{ROOT / 'data' / 'models' / 'demo'}"
reasoning_parser = "qwen3"
[server]
backend = "emulator"
targets = ["local"]
tp_size = 1
extra_args = {json.dumps(EMU)}
[run]
shard_size = 25
concurrency = 8
max_relaunches = 1
hygiene_grace_s = 1
[output]
root = "{work / 'out'}"
""")
    return part, ids


def _env(work: Path) -> dict[str, str]:
    from emulator.simgpu import ENV_VAR, SimGpus

    SimGpus.init(work / "sim-gpus.json", count=2)
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", DATAGEN_STATE_DIR=str(work / "state"), DATAGEN_RUN_DIR=str(work / "run"),
               **{ENV_VAR: str(work / "sim-gpus.json")})
    env.pop("PREFECT_API_URL", None)
    return env


def _count(out: Path) -> Counter[str]:
    return Counter(i for f in sorted((out / "ds").glob("shard-*.parquet"))
                   for i in pq.read_table(f, columns=["id"]).column("id").to_pylist())


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            continue
    return left


def _phase(work: Path, out: Path) -> str:
    """Where the killed run was, from what it left on disk."""
    runs = [json.loads(p.read_text()) for p in (work / "state" / "runs").glob("*.json")] \
        if (work / "state" / "runs").is_dir() else []
    latest = max(runs, key=lambda r: (r.get("owner") or {}).get("started") or 0, default={})
    if not latest:
        return "start-up"
    if not latest.get("lease"):
        return "before slot"
    if not latest.get("servers"):
        return "slot held"
    shards = len(list((out / "ds").glob("shard-*.parquet")))
    return f"inference ({shards} shards committed)" if shards or list(out.glob("_journal/*/*.jsonl")) else "launch"


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
            proc.wait()
            return None, time.monotonic() - t0


def one_round(k: int, work: Path, rng: random.Random, reference_s: float, rows: int) -> dict[str, object]:
    work.mkdir(parents=True)
    part, ids = _setup(work, rows)
    env = _env(work)
    out = work / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    family: list[int] = []
    delay, phase, tries = rng.uniform(0.0, reference_s), "", 0
    while True:  # a run that finished before its kill is no kill: again, with half the delay
        tries += 1
        with open(work / "killed.log", "wb") as fh:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        t0 = time.monotonic()
        family.append(proc.pid)
        while time.monotonic() < t0 + delay and proc.poll() is None:
            try:
                family = sorted({*family, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))})
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        if proc.poll() is None:
            phase = _phase(work, out)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            break
        proc.wait()
        shutil.rmtree(out, ignore_errors=True)  # start over: this round is about a killed run
        delay /= 2
    code, took = _run(cmd, env, work / "rerun.log", 300)
    seen = _count(out)
    lost = len(set(ids) - set(seen))
    dup = sum(n - 1 for n in seen.values() if n > 1)
    time.sleep(1.0)
    left = _alive(family)
    for pid in left:  # report, then end by pid
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    ok = code == 0 and lost == 0 and dup == 0 and not left
    return {"round": k, "kill_at_s": round(delay, 2), "tries": tries, "phase": phase, "rerun_exit": code, "rerun_s": round(took, 1),
            "lost": lost, "duplicated": dup, "leftover": len(left), "ok": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--work-dir", help="keep round directories here (default: a temp dir, removed)")
    ap.add_argument("--json", help="write the results here")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    if args.rounds < 1 or args.rows < 1:
        print("kill_loop: --rounds and --rows must be positive", file=sys.stderr)
        return 2
    base = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kill-loop-"))
    base.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref = base / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    part, _ = _setup(ref, args.rows)
    code, reference_s = _run([DATAGEN, "run", "--partition", str(part), "--out", str(ref / "out")], _env(ref),
                             ref / "run.log", 300)
    if code != 0:
        print(f"kill_loop: the uninterrupted run failed ({code}); see {ref / 'run.log'}", file=sys.stderr)
        return 1
    print(f"uninterrupted run: {reference_s:.1f} s", flush=True)
    results = []
    for k in range(args.rounds):
        r = one_round(k, base / f"round-{k:02d}", rng, reference_s, args.rows)
        results.append(r)
        print(f"round {k:2d}: kill at {r['kill_at_s']:6.2f} s ({r['phase']}); rerun exit {r['rerun_exit']} in "
              f"{r['rerun_s']} s; lost {r['lost']} duplicated {r['duplicated']} leftover {r['leftover']}"
              f"{'' if r['ok'] else '  FAIL'}", flush=True)
    summary = {"rounds": len(results), "passed": sum(bool(r["ok"]) for r in results),
               "lost": sum(int(str(r["lost"])) for r in results),
               "duplicated": sum(int(str(r["duplicated"])) for r in results),
               "leftover_processes": sum(int(str(r["leftover"])) for r in results),
               "reruns_not_completed": sum(r["rerun_exit"] != 0 for r in results),
               "uninterrupted_run_s": round(reference_s, 1)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": results}, indent=1))
    if not args.work_dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if summary["passed"] == summary["rounds"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
