"""A fleet from one control process: 32 servers x 16 slots at about 1 s per request (issue 22 item 3).

``emulator.minimal`` servers (processes; ``--slots 16 --latency-ms 1000``) serve one
``run_dataset`` through a ``ServerPool`` of all of them, ten requests per slot, in a child process
per case so that its CPU time and peak RSS are its own. Slot occupancy is measured at the servers
(``GET /occupancy``: slot-seconds spent serving over slots x the span from the first slot taken to
the last answer, across all servers). Cases, side by side in one run: 32 servers with prefix-aware
dispatch (the default) and with free-slot dispatch, and 8 servers (peak RSS must stay flat in the
number of servers). Each with the run's default concurrency (``[run] concurrency`` unset: twice the
slots each server reports, so a freed slot takes a request already queued at the server) and, as a
stress case, with exactly the slots in flight (every refill waits for the client's round trip).
Reported: occupancy, every id exactly once, client CPU per row, peak RSS. Target: >= 95% of slots
busy with 32 servers at the default; peak RSS with 32 servers at most 1.5x that with 8.

Run alone: ``.venv/bin/python bench/bench_fleet.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_client import _stop, _write_input  # noqa: E402
from bench.bench_scale import _start  # noqa: E402

SLOTS = 16
LATENCY_MS = 1000
PER_SLOT = 10  # requests per slot: about 10 s of serving


def _child(n: int, dispatch: str, conc: str, tmp: Path) -> dict[str, float]:
    """One run over ``n`` servers, in this process; ``conc``: "auto" (``datagen run``'s default:
    twice the slots each server reports) or a number of requests in flight per server."""
    from tasks.inference import (  # noqa: PLC0415
        ClientConfig,
        DatasetSpec,
        Endpoint,
        InferenceSettings,
        ServerPool,
        run_dataset,
    )

    procs = []
    try:
        urls = []
        for _ in range(n):
            proc, url = _start("minimal", tmp, ["--slots", str(SLOTS), "--latency-ms", str(LATENCY_MS)])
            procs.append(proc)
            urls.append(url)
        rows = n * SLOTS * PER_SLOT
        inp = tmp / "in.jsonl"
        _write_input(inp, rows)
        pool = ServerPool()
        for i, url in enumerate(urls):
            pool.add(f"s{i}", Endpoint(url, "bench"))
        settings = InferenceSettings(shard_size=1000, concurrency=None if conc == "auto" else int(conc), sampling={"max_new_tokens": 16},
                                     reasoning_parser=None, model_dir=REPO / "data" / "models" / "demo",
                                     client=ClientConfig(max_attempts=3), dispatch=dispatch)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        result = run_dataset(DatasetSpec("fleet", inp), tmp / "out", pool, settings)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        occ = [json.loads(urllib.request.urlopen(url + "/occupancy", timeout=10).read()) for url in urls]
    finally:
        for proc in procs:
            _stop(proc)
    ids = pq.read_table(sorted((tmp / "out" / "fleet").glob("shard-*.parquet")), columns=["id"]).column("id").to_pylist()
    first = min(o["first_at"] for o in occ if o["first_at"])
    last = max(o["last_at"] for o in occ if o["last_at"])
    busy = sum(o["busy_slot_s"] for o in occ)
    return {"servers": n, "rows": rows, "generated": result.rows_generated,
            "served": sum(o["served"] for o in occ), "exactly_once": len(ids) == rows == len(set(ids)),
            "occupancy": busy / (n * SLOTS * (last - first)), "span_s": last - first, "elapsed_s": elapsed,
            "cpu_ms_per_row": 1000 * cpu / rows, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _case(n: int, dispatch: str, conc: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), dispatch, conc, tmp], cwd=REPO,
                              capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"fleet child ({n} servers, {dispatch}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool) -> list[dict[str, object]]:
    os.environ.pop("DATAGEN_SIM_GPUS", None)
    cases = [(32, "prefix", "auto"), (32, "free", "auto"), (32, "prefix", str(SLOTS)), (8, "prefix", "auto")]
    got = {case: _case(*case) for case in cases}
    out: list[dict[str, object]] = []
    for (n, d, c), r in got.items():
        once = r["generated"] == r["rows"] == r["served"] and bool(r["exactly_once"])
        target = (n, d, c) == (32, "prefix", "auto")
        inflight = f"{2 * SLOTS} in flight (default)" if c == "auto" else f"{c} in flight"
        out += [
            {"metric": f"{n} servers x {SLOTS} slots, {d} dispatch, {inflight}: slots busy",
             "value": round(100 * r["occupancy"], 1),
             "unit": "%", "target": ">= 95" if target else "", "ok": r["occupancy"] >= 0.95 if target else True,
             "note": f"serving span {r['span_s']:.1f} s (ideal {PER_SLOT * LATENCY_MS / 1000:.0f} s), "
                     f"whole call {r['elapsed_s']:.1f} s"},
            {"metric": f"{n} servers, {d}, {inflight}: every id exactly once", "value": f"{r['generated']}/{r['rows']}",
             "unit": "rows", "target": "all, once", "ok": once},
            {"metric": f"{n} servers, {d}, {inflight}: client CPU per row", "value": round(r["cpu_ms_per_row"], 3),
             "unit": "ms", "target": "", "ok": True},
            {"metric": f"{n} servers, {d}, {inflight}: client peak RSS", "value": round(r["peak_rss_mb"], 1),
             "unit": "MiB", "target": "", "ok": True},
        ]
    flat = got[(32, "prefix", "auto")]["peak_rss_mb"] / got[(8, "prefix", "auto")]["peak_rss_mb"]
    out.append({"metric": "peak RSS, 32 / 8 servers", "value": round(flat, 2), "unit": "x", "target": "<= 1.5",
                "ok": flat <= 1.5, "ratio": round(flat, 2)})
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))))
        sys.exit(0)
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
