"""Prefix-aware dispatch against free-slot dispatch on two real SGLang servers (CPU), side by side.

``bench_dispatch`` measures the dispatch on three emulators, whose prefill time is a model; what
carries over to a GPU is how many prompt tokens the servers' radix caches serve. This benchmark
checks that on real SGLang: two servers of the tier's tiny model on CPU (`make sglang-cpu`), one
``run_dataset`` through a ``ServerPool`` of both, each input generated with ``dispatch = "free"``
and ``"prefix"`` in alternating order, both caches flushed before each run:

- ``samples``: 16 prompts of about 340 tokens, four samples each;
- ``system``: 64 rows drawing one of 16 system prompts of about 340 tokens at random.

Reported per input and mode: cached / prompt tokens (``meta_info.cached_tokens`` of each answer)
and rows/s; then prefix / free. Targets: prefix dispatch caches more on both inputs, and the same
inputs on two emulators sized like the real servers do not make it look better (emulator gain at most
1.25x the real gain).

Without the SGLang environment the benchmark reports itself as not run.
Run alone: ``.venv/bin/python bench/bench_dispatch_sglang.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

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
from tasks.server import launch_tuned, stop_server  # noqa: E402
from tests.support.emulator import DEMO_MODEL, start_emulator  # noqa: E402
from tests.support.sglang import SGLANG_PYTHON, SGLANG_VENV, cpu_config, make_model  # noqa: E402

CONCURRENCY = 8
ROWS = 64
WORDS = ("kalo", "vomi", "zubri", "quel", "tas", "ren", "ing", "ed", "lo", "mi", "on", "ka")
MIXES = ("samples", "system")


def _text(rng: random.Random, k: int) -> str:
    return f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(320))


def _write(path: Path, mix: str) -> int:
    """The input of ``mix`` (``ROWS`` rows in all); returns the samples per prompt."""
    rng = random.Random(7)
    with open(path, "w") as f:
        if mix == "samples":
            for i in range(ROWS // 4):
                f.write(json.dumps({"id": f"r{i:05d}", "messages": [{"role": "user", "content": _text(rng, i)}]}) + "\n")
            return 4
        systems = [_text(rng, k) for k in range(16)]
        for i in range(ROWS):
            f.write(json.dumps({"id": f"r{i:05d}", "messages": [
                {"role": "system", "content": systems[rng.randrange(len(systems))]},
                {"role": "user", "content": f"Question {i}: summarise the rules in one line."}]}) + "\n")
    return 1


def _run(inp: Path, out: Path, urls: list[str], model: Path, dispatch: str, samples: int) -> tuple[DatasetResult, float]:
    for url in urls:  # each run starts cold
        httpx.post(url + "/flush_cache", timeout=60, trust_env=False)
    pool = ServerPool()
    for i, url in enumerate(urls):
        pool.add(f"s{i}", Endpoint(url, "bench"))
    settings = InferenceSettings(shard_size=ROWS, concurrency=CONCURRENCY,
                                 sampling={"max_new_tokens": 8, "ignore_eos": True}, model_dir=model,
                                 client=ClientConfig(max_attempts=3), dispatch=dispatch, samples=samples)
    t0 = time.perf_counter()
    result = run_dataset(DatasetSpec("mix", inp), out, pool, settings)
    return result, time.perf_counter() - t0


def _measure(base: Path, tag: str, urls: list[str], model: Path, rounds: int) -> dict[tuple[str, str], list[float]]:
    """mix, dispatch -> [cached, prompt tokens, rows, seconds]."""
    totals: dict[tuple[str, str], list[float]] = {}
    for mix in MIXES:
        inp = base / f"{tag}-{mix}.jsonl"
        samples = _write(inp, mix)
        for k in range(rounds):
            for dispatch in (("free", "prefix") if k % 2 == 0 else ("prefix", "free")):
                res, elapsed = _run(inp, base / f"{tag}-{mix}-{dispatch}-{k}", urls, model, dispatch, samples)
                if res.rows_generated != ROWS:
                    raise RuntimeError(f"{tag} {mix}/{dispatch}: {res.rows_generated} of {ROWS} rows generated")
                t = totals.setdefault((mix, dispatch), [0, 0, 0, 0.0])
                t[0] += res.cached_tokens
                t[1] += res.prompt_tokens
                t[2] += ROWS
                t[3] += elapsed
    return totals


def run(quick: bool) -> list[dict[str, object]]:
    if not (SGLANG_VENV / ".installed").is_file():
        return [{"metric": "prefix-aware dispatch on real SGLang", "value": "not run", "unit": "",
                 "target": "more cached tokens", "ok": True,
                 "note": "no SGLang environment: `make sglang-cpu` builds it"}]
    rounds = 1 if quick else 2
    os.environ.pop("DATAGEN_SIM_GPUS", None)
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-sglang-") as tmp:
        base = Path(tmp)
        model = make_model(SGLANG_PYTHON, base / "model")
        handles = []
        try:
            for i in range(2):  # the tier's KV pool (4,096 tokens) each: running requests and a few prompts
                handle, _ = launch_tuned(cpu_config(model), "local", base / f"logs-{i}", deadline_s=400,
                                         memory=None, gpu_name="cpu", hygiene=None)
                handles.append(handle)
            real = _measure(base, "real", [h.url for h in handles], model, rounds)
        finally:
            for handle in handles:
                stop_server(handle, grace_s=30.0, hygiene=None)
        ems = []
        try:
            for i in range(2):
                ems.append(start_emulator(["--max-running-requests", str(CONCURRENCY), "--max-total-tokens", "4096",
                                           "--emu-prefill-us-per-token", "100", "--emu-decode-ms-per-step", "20"],
                                          log_path=base / f"emulator-{i}.log"))
            emu = _measure(base, "emu", [em.url for em in ems], DEMO_MODEL, rounds)
        finally:
            for em in ems:
                em.stop()
    out: list[dict[str, object]] = []
    for mix in MIXES:
        for dispatch in ("free", "prefix"):
            cached, prompt, rows, elapsed = real[(mix, dispatch)]
            out += [
                {"metric": f"real SGLang x2, {mix}, {dispatch} dispatch: cached / prompt tokens",
                 "value": round(cached / prompt, 3), "unit": "ratio", "target": "", "ok": True},
                {"metric": f"real SGLang x2, {mix}, {dispatch} dispatch: throughput",
                 "value": round(rows / elapsed, 2), "unit": "rows/s", "target": "", "ok": True},
            ]
        gain = real[(mix, "prefix")][0] / max(1, real[(mix, "free")][0])
        speed = real[(mix, "free")][3] / max(1e-9, real[(mix, "prefix")][3])
        emu_gain = emu[(mix, "prefix")][0] / max(1, emu[(mix, "free")][0])
        out += [
            {"metric": f"real SGLang x2, {mix}: prefix vs free dispatch, cached tokens", "value": round(gain, 2),
             "unit": "x", "target": "> 1", "ok": gain > 1, "ratio": round(gain, 2)},
            {"metric": f"real SGLang x2, {mix}: prefix vs free dispatch, rows/s", "value": round(speed, 2),
             "unit": "x", "target": "", "ok": True, "ratio": round(speed, 2)},
            {"metric": f"emulator x2 (same inputs), {mix}: prefix vs free dispatch, cached tokens",
             "value": round(emu_gain, 2), "unit": "x", "target": f"<= 1.25 x real ({round(1.25 * gain, 2)})",
             "ok": emu_gain <= 1.25 * gain},
        ]
    return out


if __name__ == "__main__":
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
