"""Recovery cost after a ``kill -9`` of the inference driver at a seeded random moment, against a live
emulator (its load time excluded): rows regenerated (requests the server finished for the killed run
that never reached the journal, plus rerun requests beyond the missing rows, from its request
counter), restart to first new row, and every input id exactly once after the rerun (else it fails).

Run alone: ``.venv/bin/python bench/bench_recovery.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL_DIR = ROOT / "data" / "models" / "demo"
SEED = 20240917
CONCURRENCY = 32
SHARD_SIZE = 100

_DRIVER = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from tasks.inference import DatasetSpec, Endpoint, InferenceSettings, ServerPool, run_dataset
r = run_dataset(DatasetSpec("bench", Path({path!r})), {out!r}, ServerPool.of(Endpoint({url!r}, "bench-recovery")),
                InferenceSettings(model_dir={model!r}, shard_size={shard}, concurrency={conc},
                                  sampling={{"max_new_tokens": 512}}, reasoning_parser="qwen3", model_name="demo"))
print("complete", r.complete, r.rows_generated, r.rows_resumed, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^sglang:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _start_emulator(port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "emulator", "--model-path", str(MODEL_DIR), "--port", str(port),
           "--host", "127.0.0.1", "--emu-load-time", "0.2", "--emu-graph-time", "0.05",
           "--emu-warmup-time", "0.1", "--emu-output-tokens", "64", "--emu-decode-ms-per-step", "2"]
    env = {k: v for k, v in os.environ.items() if k != "DATAGEN_SIM_GPUS"}  # a private modelled GPU
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited {proc.returncode}: {log.read_text()[-500:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        time.sleep(0.1)
    raise RuntimeError("emulator not healthy within 60 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _write_input(path: Path, rows: int, rng: random.Random) -> list[str]:
    words = "cache shard token prefill decode parquet journal kernel queue batch commit lock".split()
    ids = []
    with path.open("w") as f:
        for i in range(rows):
            rid = f"rec-{i:06d}"
            ids.append(rid)
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            f.write(json.dumps({"id": rid, "messages": [{"role": "user", "content": f"{text} ({rid})"}]}) + "\n")
    return ids


def _done_ids(out: Path) -> set[str]:
    """Ids in committed shards and in journals (rows only; torn lines skipped)."""
    ids: set[str] = set()
    for f in (out / "bench").glob("shard-*.parquet") if (out / "bench").is_dir() else []:
        ids.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    jdir = out / "_journal" / "bench"
    for j in jdir.glob("*.jsonl") if jdir.is_dir() else []:
        for line in j.read_bytes().split(b"\n"):
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and not rec.get("_reject") and rec.get("id") is not None:
                    ids.add(str(rec["id"]))
    return ids


def _journal_rows(out: Path) -> int:
    """Cheap progress count for polling: journal lines + committed shard rows from the manifest."""
    n = 0
    with contextlib.suppress(OSError, ValueError):
        man = json.loads((out / "_manifest.json").read_text())
        n += sum(int(s.get("rows", 0)) for s in man["datasets"]["bench"]["shards"].values())
    jdir = out / "_journal" / "bench"
    for j in jdir.glob("*.jsonl") if jdir.is_dir() else []:
        with contextlib.suppress(OSError):
            n += j.read_bytes().count(b"\n")
    return n


def _quiesce(url: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _metric(url, "num_running_reqs") == 0 and _metric(url, "num_queue_reqs") == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("server still busy 60 s after the kill")


def _trial(k: int, url: str, work: Path, inp: Path, ids: list[str], rng: random.Random) -> dict[str, float]:
    out = work / f"out-{k}"
    code = _DRIVER.format(root=str(ROOT), path=str(inp), out=str(out), url=url, model=str(MODEL_DIR),
                          shard=SHARD_SIZE, conc=CONCURRENCY)
    kill_at = rng.randint(int(len(ids) * 0.15), int(len(ids) * 0.85))
    base = _metric(url, "num_requests_total")
    log = open(work / f"driver-{k}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 300
        while _journal_rows(out) < kill_at:
            if proc.poll() is not None:
                raise RuntimeError(f"driver exited {proc.returncode} before the kill; see {log.name}")
            if time.monotonic() > end:
                raise RuntimeError("driver made no progress")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _quiesce(url)
    served_first = _metric(url, "num_requests_total") - base
    done = _done_ids(out)
    wasted = served_first - len(done)

    sizes = _journal_sizes(out)
    base2 = _metric(url, "num_requests_total")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    first_new: float | None = None
    try:
        end = time.monotonic() + 300
        while proc.poll() is None:
            if first_new is None and _journal_grew(out, sizes):
                first_new = time.monotonic() - t0
            if time.monotonic() > end:
                raise RuntimeError("rerun did not finish in 300 s")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"rerun exited {proc.returncode}; see {work}/driver-{k}.log")
    rerun_requests = _metric(url, "num_requests_total") - base2
    missing = len(ids) - len(done)
    extra = rerun_requests - missing
    seen: Counter[str] = Counter()
    for f in sorted((out / "bench").glob("shard-*.parquet")):
        seen.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    lost = len(set(ids) - seen.keys())
    dup = sum(c - 1 for c in seen.values() if c > 1)
    if lost or dup or set(seen) != set(ids):
        raise RuntimeError(f"trial {k}: {lost} rows lost, {dup} duplicated after the rerun")
    if first_new is None:  # finished between two polls
        first_new = time.monotonic() - t0
    return {"kill_at": kill_at, "done": len(done), "wasted": wasted, "extra": extra,
            "regenerated": wasted + max(0.0, extra), "first_new_s": first_new}


def _journal_sizes(out: Path) -> dict[str, int]:
    jdir = out / "_journal" / "bench"
    return {j.name: j.stat().st_size for j in jdir.glob("*.jsonl")} if jdir.is_dir() else {}


def _journal_grew(out: Path, before: dict[str, int]) -> bool:
    """A journal got longer than at the kill, or a new one appeared with data: a new row. (Recovery
    only removes journals; it never appends.)"""
    with contextlib.suppress(OSError):
        return any(size > before.get(name, 0) for name, size in _journal_sizes(out).items())
    return False


def run(quick: bool) -> list[dict]:
    rng = random.Random(SEED)
    rows = 800 if quick else 2000
    trials = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = Path(tmp)
        inp = work / "input.jsonl"
        ids = _write_input(inp, rows, rng)
        port = _free_port()
        emu = _start_emulator(port, work / "emulator.log")
        try:
            results = [_trial(k, f"http://127.0.0.1:{port}", work, inp, ids, rng) for k in range(trials)]
        finally:
            _stop(emu)
    regen = max(r["regenerated"] for r in results)
    first = statistics.median(r["first_new_s"] for r in results)
    detail = "; ".join(f"kill@{int(r['kill_at'])} done {int(r['done'])} lost-work {int(r['wasted'])} "
                       f"extra {int(r['extra'])} first {r['first_new_s']:.2f}s" for r in results)
    return [
        {"metric": f"rows regenerated after kill -9 (max of {trials}, concurrency {CONCURRENCY})",
         "value": float(regen), "unit": "rows", "target": f"<= {CONCURRENCY}", "ok": regen <= CONCURRENCY,
         "note": detail},
        {"metric": "restart -> first new row (median, server already up)", "value": first, "unit": "s",
         "target": "<= 5", "ok": first <= 5.0, "note": detail},
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row))
