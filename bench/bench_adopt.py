"""What adopting a dead run's server saves, on real SGLang on CPU (`make sglang-cpu`; the tier's tiny
model, dummy weights), through `datagen run` as a user runs it.

Each round: `datagen run` launches SGLang, is killed with `kill -9` (its process alone) once a shard
is committed, and the same command runs again to the end. With ``run.server_grace_s = 300`` the
rerun adopts the live server (no hygiene, no launch); with 0 the server died with the run and the
rerun launches a new one. The two kinds alternate, side by side, so the machine's load falls on
both. Reported: the rerun's wall time each way, their ratio (target: adopted < relaunched) and the
launches the reruns made. Every round checks every row exactly once and no process left.

Run alone: ``.venv/bin/python bench/bench_adopt.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from emulator.simgpu import ENV_VAR, SimGpus  # noqa: E402
from tasks.shards import OutputDir  # noqa: E402
from tests.support.prefect import migrated_home  # noqa: E402
from tests.support.sglang import SGLANG_PYTHON, SGLANG_VENV, make_model, run_partition, write_prompts  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
ROWS, SHARD, TOKENS = 48, 8, 16


def _env(work: Path) -> dict[str, str]:
    SimGpus.init(work / "sim-gpus.json", count=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update({ENV_VAR: str(work / "sim-gpus.json")}, PREFECT_HOME=str(migrated_home(work / "prefect")),
               DATAGEN_STATE_DIR=str(work / "state"), DATAGEN_RUN_DIR=str(work / "run"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    return env


def _round(work: Path, model: Path, grace_s: float) -> dict[str, float]:
    work.mkdir(parents=True)
    ids = write_prompts(work / "prompts.jsonl", ROWS)
    part = run_partition(work, work / "prompts.jsonl", model, SGLANG_PYTHON, shard=SHARD, max_new_tokens=TOKENS,
                         run_extra=f"server_grace_s = {grace_s:g}")
    out = work / "out"
    cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
    env = _env(work)
    left: list[psutil.Process] = []
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not (out.exists() and OutputDir(out).read_manifest() and OutputDir(out).committed_indices("ds")):
            if first.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the first run exited {first.returncode} or stalled before a shard committed")
            time.sleep(0.1)
        left = psutil.Process(first.pid).children(recursive=True)
        first.send_signal(signal.SIGKILL)
        first.wait()
        t0 = time.perf_counter()
        rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                               stdin=subprocess.DEVNULL)
        took = time.perf_counter() - t0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    text = rerun.stdout + rerun.stderr
    if rerun.returncode != 0:
        raise RuntimeError(f"the rerun exited {rerun.returncode}: {text[-3000:]}")
    got = [i for f in sorted(out.glob("ds/shard-*.parquet")) for i in pq.read_table(f, columns=["id"])["id"].to_pylist()]
    if sorted(got) != sorted(ids):
        raise RuntimeError(f"rows: {len(got)} written, {len(set(got))} distinct, {len(ids)} expected")
    adopted = " adopted: pid " in text
    if adopted != (grace_s > 0):
        raise RuntimeError(f"grace {grace_s:g}: adopted={adopted}:\n{text[-2000:]}")
    def alive() -> list[psutil.Process]:
        found = []
        for p in left:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    end = time.monotonic() + 20  # a guardian looks every second; a stop ends a group within its grace
    while alive() and time.monotonic() < end:
        time.sleep(0.2)
    if stuck := alive():
        names = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in stuck]
        for p in stuck:
            p.kill()
        raise RuntimeError(f"processes of the killed run still alive 20 s after the rerun: {names}")
    return {"rerun_s": took, "launches": float(sum(1 for ln in text.splitlines() if "server up on" in ln))}


def run(quick: bool) -> list[dict[str, object]]:
    if not (SGLANG_VENV / ".installed").is_file():
        return [{"metric": "rerun after kill -9, adopted vs relaunched (real SGLang)", "value": "not run", "unit": "",
                 "target": "< 1.0x", "ok": True, "note": "no SGLang environment: `make sglang-cpu` builds it"}]
    rounds = 1 if quick else 2
    res: dict[str, list[dict[str, float]]] = {"adopted": [], "relaunched": []}
    with tempfile.TemporaryDirectory(prefix="bench-adopt-") as tmp:
        model = make_model(SGLANG_PYTHON, Path(tmp) / "model")
        for k in range(rounds):
            for kind in (("adopted", "relaunched") if k % 2 == 0 else ("relaunched", "adopted")):
                res[kind].append(_round(Path(tmp) / f"{kind}-{k}", model, 300.0 if kind == "adopted" else 0.0))
    adopt = statistics.median(r["rerun_s"] for r in res["adopted"])
    relaunch = statistics.median(r["rerun_s"] for r in res["relaunched"])
    ratio = adopt / relaunch
    return [
        {"metric": "rerun after kill -9 within the grace (adopts the server), real SGLang", "value": round(adopt, 1),
         "unit": "s", "target": "", "ok": True,
         "note": f"{rounds} round(s), {ROWS} rows, launches {sum(r['launches'] for r in res['adopted']):g}"},
        {"metric": "rerun after kill -9 with server_grace_s = 0 (relaunches), real SGLang",
         "value": round(relaunch, 1), "unit": "s", "target": "", "ok": True,
         "note": f"launches {sum(r['launches'] for r in res['relaunched']):g}"},
        {"metric": "adopted / relaunched rerun time (real SGLang)", "value": round(ratio, 2), "unit": "x",
         "target": "< 1.0x", "ok": ratio < 1.0, "ratio": round(ratio, 2),
         "note": f"saved {relaunch - adopt:.1f} s per server on CPU (a large model on GPUs: minutes)"},
    ]


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
