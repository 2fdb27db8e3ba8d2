"""Emulator overhead: /generate requests per second at zero modelled latency from a concurrent client.

Run alone: ``.venv/bin/python bench/bench_emulator.py [--quick]``. Target: >= 1,500 req/s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
TARGET_RPS = 1500.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(port: int, log: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "emulator", "--model-path", str(REPO / "data/models/demo"), "--port", str(port),
        "--emu-load-time", "0", "--emu-graph-time", "0", "--emu-warmup-time", "0",
        "--emu-prefill-us-per-token", "0", "--emu-decode-ms-per-step", "0", "--emu-output-tokens", "64",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DATAGEN_SIM_GPUS", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(Path(log).read_text()[-2000:])
        time.sleep(0.05)
    raise RuntimeError("emulator not ready")


async def _load(url: str, seconds: float, concurrency: int) -> tuple[int, float]:
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker(w: int) -> None:
            nonlocal done, errors
            i = 0
            while time.monotonic() < stop_at:
                body = {"text": f"Question {w} {i}: explain the batch scheduler in a few words.",
                        "sampling_params": {"max_new_tokens": 128, "temperature": 0.7}}
                async with s.post(url + "/generate", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        errors += 1
                i += 1

        t0 = time.monotonic()
        await asyncio.gather(*[worker(w) for w in range(concurrency)])
        elapsed = time.monotonic() - t0
    if errors:
        raise RuntimeError(f"{errors} failed requests")
    return done, elapsed


def run(quick: bool) -> list[dict[str, object]]:
    """Rows for bench/run.py: the emulator's /generate rate at zero modelled latency."""
    port = _free_port()
    log = tempfile.mktemp(prefix="bench-emulator-", suffix=".log")
    proc = _start(port, log)
    try:
        done, elapsed = asyncio.run(_load(f"http://127.0.0.1:{port}", 2.0 if quick else 5.0, 64))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.unlink(log)
    rps = done / elapsed
    return [{"metric": "emulator /generate rate (zero latency, 64 concurrent)", "value": round(rps, 1),
             "unit": "req/s", "target": f">= {TARGET_RPS:.0f}", "ok": rps >= TARGET_RPS}]


if __name__ == "__main__":
    rows = run("--quick" in sys.argv)
    print(json.dumps(rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)
