"""Prefix-aware dispatch against free-slot dispatch across three servers, side by side in one run.

Three emulators with radix caches (each KV pool holds its running requests and a few spare prompts)
serve one ``run_dataset`` through a ``ServerPool``, the way a partition with three targets or three
``--server-url`` does. Three inputs, each generated with ``dispatch = "free"`` and ``"prefix"`` in
alternating order, every server's cache flushed before each run:

- ``samples``: distinct prompts of about 400 tokens, four samples each (``samples = 4``);
- ``system``: rows drawing one of 64 system prompts of about 300 tokens at random;
- ``mixed``: both at once, issue 22's shared-prefix mix: rows drawing one of 64 system prompts,
  each with its own question, four samples each;
- ``unique``: distinct prompts of about 400 tokens, one sample each (nothing to share).

Reported per input and mode: the share of prompt tokens the servers' prefix caches served (from each
answer's ``meta_info.cached_tokens``) and rows/s; then prefix against free for both, and the prompt
tokens each prefilled (not cached), free over prefix. Targets (issue 22): on ``mixed``, at least
1.5x less prefill than free dispatch and rows/s not lower; on ``unique``, rows/s within 5%; more
cached tokens on every shared mix. The emulator's prefill costs 20 us per uncached token, so the rows/s
gain is the emulator's model of prefill, not a GPU's: the cached share is what carries over to real
SGLang (docs/benchmarks.md).

Run alone: ``.venv/bin/python bench/bench_dispatch.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
import urllib.request
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

SERVERS = 3
CONCURRENCY = 16  # per server
# Running requests hold about 16 x (400 prompt + 24 output) tokens; the pool has room for about 20 more prompts.
POOL_TOKENS = 16_000
EMULATOR = ["--max-running-requests", str(CONCURRENCY), "--max-total-tokens", str(POOL_TOKENS),
            "--emu-prefill-us-per-token", "20", "--emu-decode-ms-per-step", "1", "--emu-output-tokens", "24"]
MIXES = ("samples", "system", "mixed", "unique")
SYSTEM_PROMPTS = 64


# mix -> (cached-token gain, prefilled-token cut, rows/s ratio) prefix against free must reach; 0: reported only.
# The cut is free's uncached share over prefix's: the prefill work saved. On ``mixed`` free dispatch
# already has about 2/3 of the prompt tokens cached, so the cached-token gain cannot pass 1.5x there.
TARGETS = {"samples": (1.01, 0.0, 0.0), "system": (1.01, 0.0, 0.0), "mixed": (1.01, 1.5, 1.0),
           "unique": (0.0, 0.0, 0.95)}


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}w{j}" for j in range(n))


def _write(path: Path, mix: str, rows: int) -> int:
    """The input of ``mix``; returns the samples per prompt."""
    rng = random.Random(11)
    systems = [f"You are assistant {k}. " + _words(f"s{k}", 300) for k in range(SYSTEM_PROMPTS)]
    samples = 4 if mix in ("samples", "mixed") else 1
    with open(path, "w") as f:
        for i in range(rows // samples):
            if mix in ("system", "mixed"):
                messages = [{"role": "system", "content": systems[rng.randrange(len(systems))]},
                            {"role": "user", "content": f"Question {i}: summarise the rules in one line."}]
            else:
                messages = [{"role": "user", "content": f"Prompt {i}. " + _words(f"p{i}", 400)}]
            f.write(json.dumps({"id": f"r{i:05d}", "messages": messages}) + "\n")
    return samples


def _flush(urls: list[str]) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=30).read()


def _run(inp: Path, out: Path, urls: list[str], dispatch: str, samples: int) -> tuple[DatasetResult, float]:
    pool = ServerPool()
    for i, url in enumerate(urls):
        pool.add(f"s{i}", Endpoint(url, "bench"))
    settings = InferenceSettings(shard_size=256, concurrency=CONCURRENCY, sampling={"max_new_tokens": 48},
                                 model_dir=DEMO_MODEL, client=ClientConfig(max_attempts=3),
                                 dispatch=dispatch, samples=samples)
    t0 = time.perf_counter()
    result = run_dataset(DatasetSpec("mix", inp), out, pool, settings)
    return result, time.perf_counter() - t0


def run(quick: bool) -> list[dict[str, object]]:
    """Rows for bench/run.py: cached share and rows/s per input and dispatch, and the ratios."""
    rows = 768 if quick else 1536
    rounds = 1 if quick else 2
    os.environ.pop("DATAGEN_SIM_GPUS", None)
    cached: dict[tuple[str, str], list[float]] = {}
    speed: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-") as tmp:
        ems = [start_emulator(EMULATOR, log_path=Path(tmp) / f"emulator-{i}.log") for i in range(SERVERS)]
        try:
            urls = [em.url for em in ems]
            for mix in MIXES:
                inp = Path(tmp) / f"{mix}.jsonl"
                samples = _write(inp, mix, rows)
                for r in range(rounds):
                    order = ("free", "prefix") if r % 2 == 0 else ("prefix", "free")
                    for dispatch in order:
                        _flush(urls)
                        res, elapsed = _run(inp, Path(tmp) / f"{mix}-{dispatch}-{r}", urls, dispatch, samples)
                        if res.rows_generated != rows:
                            raise RuntimeError(f"{mix}/{dispatch}: {res.rows_generated} of {rows} rows generated")
                        cached.setdefault((mix, dispatch), []).append(res.cached_tokens / res.prompt_tokens)
                        speed.setdefault((mix, dispatch), []).append(rows / elapsed)
        finally:
            for em in ems:
                em.stop()
    out: list[dict[str, object]] = []
    for mix in MIXES:
        for dispatch in ("free", "prefix"):
            c, s = cached[(mix, dispatch)], speed[(mix, dispatch)]
            out += [
                {"metric": f"{mix}: {dispatch} dispatch, prompt tokens cached", "value": round(sum(c) / len(c), 3),
                 "unit": "cached/prompt", "target": "", "ok": True},
                {"metric": f"{mix}: {dispatch} dispatch, throughput", "value": round(sum(s) / len(s), 1),
                 "unit": "rows/s", "target": "", "ok": True},
            ]
        gain = sum(cached[(mix, "prefix")]) / max(1e-9, sum(cached[(mix, "free")]))
        ratio = sum(speed[(mix, "prefix")]) / sum(speed[(mix, "free")])
        cut = (len(cached[(mix, "free")]) - sum(cached[(mix, "free")])) / max(
            1e-9, len(cached[(mix, "prefix")]) - sum(cached[(mix, "prefix")]))
        cache_target, cut_target, speed_target = TARGETS[mix]
        out += [
            {"metric": f"{mix}: prefix vs free dispatch, prompt tokens cached", "value": round(gain, 2), "unit": "x",
             "target": f">= {cache_target}" if cache_target else "", "ok": gain >= cache_target,
             "ratio": round(gain, 2)},
            {"metric": f"{mix}: free / prefix dispatch, prompt tokens prefilled", "value": round(cut, 2), "unit": "x",
             "target": f">= {cut_target}" if cut_target else "", "ok": cut >= cut_target, "ratio": round(cut, 2)},
            {"metric": f"{mix}: prefix vs free dispatch, throughput", "value": round(ratio, 2), "unit": "x",
             "target": f">= {speed_target}" if speed_target else "", "ok": ratio >= speed_target,
             "ratio": round(ratio, 2)},
        ]
    return out


if __name__ == "__main__":
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
