"""Cache-aware send order against input order on a shared-system-prompt mix, side by side in one run.

The same input (rows drawing one of many long system prompts at random) is generated twice through
``run_dataset`` against one emulator whose KV pool holds the running requests and a few spare
prompts: once in input order, once in ``prefix`` order. Reported for each: prefix-cache hit rate
(cached / prompt tokens, from each answer's ``meta_info.cached_tokens``), prefill tokens saved, rows/s;
and the ratio of prefill tokens saved. Target: prefix order saves >= 1.3x the tokens input order does.

Run alone: ``.venv/bin/python bench/bench_prefix_order.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tasks.inference import (  # noqa: E402
    ClientConfig,
    DatasetResult,
    DatasetSpec,
    Endpoint,
    InferenceSettings,
    ServerPool,
    run_dataset,
)
from tests.support.emulator import DEMO_MODEL, start_emulator  # noqa: E402

TARGET_RATIO = 1.3
SYSTEMS = 64  # distinct system prompts of about 300 tokens
CONCURRENCY = 32  # the default reordering window is then 1,024 rows
# Running requests hold about 32 x 330 prompt + output tokens; the pool has room for a few more prompts.
POOL_TOKENS = 12_000
EMULATOR = ["--max-running-requests", str(CONCURRENCY), "--max-total-tokens", str(POOL_TOKENS),
            "--emu-prefill-us-per-token", "20", "--emu-decode-ms-per-step", "1", "--emu-output-tokens", "24"]


def _write_input(path: Path, rows: int) -> None:
    rng = random.Random(7)
    systems = [f"You are assistant {k}. " + " ".join(f"rule{k}x{j}" for j in range(300)) for k in range(SYSTEMS)]
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i:05d}", "messages": [
                {"role": "system", "content": systems[rng.randrange(SYSTEMS)]},
                {"role": "user", "content": f"Question {i}: summarise the rules in one line."}]}) + "\n")


def _run(inp: Path, out: Path, url: str, order: str) -> tuple[DatasetResult, float]:
    settings = InferenceSettings(shard_size=256, concurrency=CONCURRENCY, sampling={"max_new_tokens": 48},
                                 model_dir=DEMO_MODEL, client=ClientConfig(max_attempts=3), order=order)
    t0 = time.perf_counter()
    result = run_dataset(DatasetSpec("mix", inp), out, ServerPool.of(Endpoint(url, "bench")), settings)
    return result, time.perf_counter() - t0


def run(quick: bool) -> list[dict[str, object]]:
    """Rows for bench/run.py: hit rate, prefill tokens saved and rows/s per order, and the ratio."""
    rows = 768 if quick else 2048
    os.environ.pop("DATAGEN_SIM_GPUS", None)
    measured: dict[str, tuple[DatasetResult, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-order-") as tmp:
        inp = Path(tmp) / "mix.jsonl"
        _write_input(inp, rows)
        em = start_emulator(EMULATOR, log_path=Path(tmp) / "emulator.log")
        try:
            for order in ("input", "prefix"):  # the same server: its cache is flushed by the other's rows
                measured[order] = _run(inp, Path(tmp) / order, em.url, order)
        finally:
            em.stop()
    out: list[dict[str, object]] = []
    for order, (res, elapsed) in measured.items():
        if res.rows_generated != rows:
            raise RuntimeError(f"{order}: {res.rows_generated} of {rows} rows generated")
        hit = res.cached_tokens / res.prompt_tokens
        out += [
            {"metric": f"{order} order: prefix-cache hit rate", "value": round(hit, 3), "unit": "cached/prompt",
             "target": "", "ok": True},
            {"metric": f"{order} order: prefill tokens saved", "value": res.cached_tokens, "unit": "tokens",
             "target": "", "ok": True},
            {"metric": f"{order} order: throughput", "value": round(rows / elapsed, 1), "unit": "rows/s",
             "target": "", "ok": True},
        ]
    ratio = measured["prefix"][0].cached_tokens / max(1, measured["input"][0].cached_tokens)
    speed = measured["input"][1] / measured["prefix"][1]
    out += [
        {"metric": "prefix vs input order: prefill tokens saved", "value": round(ratio, 2), "unit": "x",
         "target": f">= {TARGET_RATIO}", "ok": ratio >= TARGET_RATIO, "ratio": round(ratio, 2)},
        {"metric": "prefix vs input order: throughput", "value": round(speed, 2), "unit": "x", "target": "",
         "ok": True, "ratio": round(speed, 2)},
    ]
    return out


if __name__ == "__main__":
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
