"""Several servers behind one run (tasks.inference ServerPool): the dispatcher's rows/s against
zero-latency servers side by side with a bare aiohttp loop, speed-up of three servers over one
with modelled latency (and with one of three killed at 30 %), and the unit handed out: rows from
one queue versus whole shards per server when one server is slow.

Servers are ``emulator.minimal`` processes (a raw asyncio /generate server, so the client's own
cost shows) and, for comparison, the emulator. Run alone: ``.venv/bin/python bench/bench_scale.py [--quick]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_client import _prompts, _start_emulator, _stop, _write_input  # noqa: E402
from tasks.inference import (  # noqa: E402 - bench scripts run as files: the repo goes on sys.path first
    ClientConfig,
    DatasetSpec,
    Dispatcher,
    Endpoint,
    GenerateClient,
    InferenceSettings,
    ServerPool,
    run_dataset,
)

DEMO = REPO / "data" / "models" / "demo"
CONC = 64  # requests in flight per server
SAMPLING = {"max_new_tokens": 16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(kind: str, tmp: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    if kind == "emulator":
        return _start_emulator(extra, tmp / f"emulator-{len(list(tmp.glob('emulator-*')))}.log")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "emulator.minimal", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=str(REPO))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # it prints this once it listens
    proc.stdout.close()
    if not line.startswith("minimal server on "):
        _stop(proc)
        raise RuntimeError(f"minimal server did not start: {line!r}")
    return proc, line.split()[-1]


async def _bare(urls: list[str], prompts: list[str]) -> float:
    """A bare aiohttp + orjson loop: CONC workers per server, each server its own session."""
    it = iter(enumerate(prompts))
    t0 = time.perf_counter()
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONC)) for _ in urls]
    try:
        async def worker(s: aiohttp.ClientSession, url: str) -> None:
            for i, p in it:
                body = orjson.dumps({"text": p, "sampling_params": SAMPLING, "rid": f"bare{i}"})
                async with s.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as r:
                    data = orjson.loads(await r.read())
                    assert r.status == 200 and data["text"]

        await asyncio.gather(*(worker(s, u) for s, u in zip(sessions, urls, strict=True) for _ in range(CONC)))
    finally:
        for s in sessions:
            await s.close()
    return len(prompts) / (time.perf_counter() - t0)


def _pool(procs: list[subprocess.Popen[bytes]], urls: list[str]) -> ServerPool:
    pool = ServerPool()
    for i, (proc, url) in enumerate(zip(procs, urls, strict=True)):
        pool.add(f"s{i}", Endpoint(url, "bench", alive=lambda p=proc: p.poll() is None), recoverable=False)
    return pool


def _settings(shard: int = 1000) -> InferenceSettings:
    return InferenceSettings(model_dir=DEMO, shard_size=shard, concurrency=CONC, sampling=SAMPLING,
                             client=ClientConfig(max_attempts=3, backoff_base_s=0.05, backoff_max_s=0.2))


def _pipeline(pool: ServerPool, inp: Path, out: Path, shard: int = 1000) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    r = run_dataset(DatasetSpec("bench", inp), out, pool, _settings(shard))
    wall = time.perf_counter() - t0
    assert r.complete, r
    return r.rows_generated / r.elapsed_s, r.rows_generated, wall


async def _dispatch_only(pool: ServerPool, prompts: list[str]) -> float:
    """The dispatcher alone: generate() over the pool, no input reading, journal or Parquet."""
    it = iter(enumerate(prompts))
    t0 = time.perf_counter()
    async with Dispatcher(pool, ClientConfig(), CONC) as d:
        async def worker() -> None:
            for i, p in it:
                await d.generate(p, SAMPLING, rid=f"d{i}")

        await asyncio.gather(*(worker() for _ in range(CONC * len(pool.serving()))))
    return len(prompts) / (time.perf_counter() - t0)


async def _drain(client: GenerateClient, rows: Any) -> None:
    for i, p in rows:
        await client.generate(p, SAMPLING, rid=f"u{i}")


async def _shard_units(urls: list[str], prompts: list[str], shard: int) -> float:
    """Whole shards handed to whichever server is free (each server works its shard with CONC in
    flight): the alternative to one row queue. Returns the makespan in seconds."""
    shards = [prompts[k:k + shard] for k in range(0, len(prompts), shard)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for s in shards:
        queue.put_nowait(s)
    t0 = time.perf_counter()

    async def server(url: str) -> None:
        async with GenerateClient(url, ClientConfig(concurrency=CONC)) as c:
            while not queue.empty():
                rows = iter(enumerate(queue.get_nowait()))
                await asyncio.gather(*(_drain(c, rows) for _ in range(CONC)))

    await asyncio.gather(*(server(u) for u in urls))
    return time.perf_counter() - t0


def _row(metric: str, value: float, unit: str, target: str, ok: bool, note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"metric": metric, "value": round(value, 3), "unit": unit, "target": target, "ok": ok}
    if note:
        row["note"] = note
    return row


@contextlib.contextmanager
def _collections(counts: list[float]) -> Any:
    """Count the cyclic collector's runs by generation into ``counts[0:3]`` and their CPU seconds
    into ``counts[3]`` while the block runs (decision 114: they were a tenth of the client's CPU)."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.process_time())
        elif started:
            counts[info["generation"]] += 1
            counts[3] += time.process_time() - started.pop()

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def _client_cost(tmp: Path, kind: str, n: int, extra: list[str], rows: list[dict[str, Any]], gated: bool) -> None:
    started = [_start(kind, tmp, extra) for _ in range(3)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        prompts = _prompts(n)
        inp = tmp / f"cost-{kind}.jsonl"
        _write_input(inp, n)
        asyncio.run(_bare(urls, prompts[:500]))  # warm both sides
        bares, pipes, disp = [], [], []
        cpu: dict[str, list[float]] = {"bare": [], "run_dataset": [], "dispatcher": []}  # client CPU s per 1,000 rows
        collected = [0.0, 0.0, 0.0, 0.0]  # run_dataset's collections: young, middle, full; their CPU s
        for rep in range(3):  # interleaved, best of 3: a shared 2-core host skews single runs
            c0 = time.process_time()
            bares.append(asyncio.run(_bare(urls, prompts)))
            c1 = time.process_time()
            with _collections(collected):
                pipes.append(_pipeline(_pool(procs, urls), inp, tmp / f"out-cost-{kind}-{rep}")[0])
            c2 = time.process_time()
            disp.append(asyncio.run(_dispatch_only(_pool(procs, urls), prompts)))
            c3 = time.process_time()
            for key, spent in (("bare", c1 - c0), ("run_dataset", c2 - c1), ("dispatcher", c3 - c2)):
                cpu[key].append(spent / n * 1000)
        bare, pipe, d = max(bares), max(pipes), max(disp)
        # The client process's own CPU per 1,000 rows (least of 3): what the rows/s ratios hide when
        # the client and the servers share two cores.
        rows.append(_row(f"{kind}_client_cpu_per_1000_rows", min(cpu["run_dataset"]), "s", "informational", True,
                         "least of 3; bare loop {:.3f} s, Dispatcher.generate alone {:.3f} s".format(
                             min(cpu["bare"]), min(cpu["dispatcher"]))))
        rows.append(_row(f"{kind}_gc_cpu_per_1000_rows", collected[3] / (3 * n) * 1000, "s", "informational", True,
                         "the cyclic collector inside run_dataset, 3 runs: {:.0f} young, {:.0f} middle, {:.0f} full "
                         "collections".format(*collected[:3])))
        rows.append(_row(f"{kind}_bare_rows_per_s", bare, "rows/s", "reference", True,
                         f"aiohttp+orjson, {CONC} in flight per server, 3 servers, best of {[round(b) for b in bares]}"))
        rows.append(_row(f"{kind}_dispatcher_vs_bare", d / bare, "x", "informational", True,
                         f"Dispatcher.generate alone {d:.0f} rows/s, best of {[round(x) for x in disp]}"))
        target = ">= 0.5" if gated else "informational"
        rows.append(_row(f"{kind}_run_vs_bare", pipe / bare, "x", target, pipe / bare >= 0.5 or not gated,
                         f"run_dataset over a ServerPool of 3 (input, template, journal, Parquet) {pipe:.0f} rows/s, "
                         f"best of {[round(p) for p in pipes]}"))
    finally:
        for p in procs:
            _stop(p)


def _speedup(tmp: Path, n: int, rows: list[dict[str, Any]]) -> None:
    # Modelled latency: each server serves 32 requests at a time, 100 ms each (320 rows/s per server,
    # still far more rows/s than an LLM server: the client is not what limits three of them).
    extra = ["--latency-ms", "100", "--slots", "32"]
    inp = tmp / "speed.jsonl"
    _write_input(inp, n)
    started = [_start("minimal", tmp, extra) for _ in range(3)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        _, _, one = _pipeline(_pool(procs[:1], urls[:1]), inp, tmp / "out-one", shard=250)
        _, _, three = _pipeline(_pool(procs, urls), inp, tmp / "out-three", shard=250)
        rows.append(_row("three_vs_one_server", one / three, "x", ">= 2.7", one / three >= 2.7,
                         f"{n} rows: one server {one:.1f} s, three {three:.1f} s (100 ms per request, 32 slots each)"))
    finally:
        for p in procs:
            _stop(p)
    started = [_start("minimal", tmp, extra) for _ in range(3)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        pool = _pool(procs, urls)

        def killer() -> None:
            while sum(lane.rows for lane in pool.lanes) < 0.3 * n:
                time.sleep(0.01)
            _stop(procs[1])

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        _, _, lost = _pipeline(pool, inp, tmp / "out-kill", shard=250)
        t.join(5)
        rows.append(_row("three_one_killed_at_30pct_vs_one", one / lost, "x", ">= 1.8", one / lost >= 1.8,
                         f"{n} rows: one server {one:.1f} s, three with one SIGKILLed at 30 % {lost:.1f} s"))
    finally:
        for p in procs:
            _stop(p)


def _unit(tmp: Path, n: int, shard: int, rows: list[dict[str, Any]]) -> None:
    """Rows from one queue versus whole shards, with one server 4x slower than the other two."""
    fast, slow = ["--latency-ms", "20", "--slots", "16"], ["--latency-ms", "80", "--slots", "16"]
    started = [_start("minimal", tmp, fast), _start("minimal", tmp, fast), _start("minimal", tmp, slow)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        prompts = _prompts(n)
        by_shard = asyncio.run(_shard_units(urls, prompts, shard))
        t0 = time.perf_counter()
        asyncio.run(_dispatch_only(_pool(procs, urls), prompts))
        by_row = time.perf_counter() - t0
        rows.append(_row("unit_rows_vs_shards", by_shard / by_row, "x", "> 1 (rows chosen)", by_shard / by_row > 1,
                         f"{n} rows, shards of {shard}, one server 4x slower: whole shards {by_shard:.2f} s, "
                         f"rows from one queue {by_row:.2f} s"))
    finally:
        for p in procs:
            _stop(p)


def run(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp_s:
        tmp = Path(tmp_s)
        n = 6000 if quick else 20000
        _client_cost(tmp, "minimal", n, [], rows, gated=True)
        _client_cost(tmp, "emulator", n // 2, ["--emu-prefill-us-per-token", "0", "--emu-decode-ms-per-step", "0",
                                               "--emu-output-tokens", "16"], rows, gated=False)
        _speedup(tmp, 3000 if quick else 8000, rows)
        _unit(tmp, 1500 if quick else 3000, 250 if quick else 500, rows)
    return rows


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(json.dumps(r))
