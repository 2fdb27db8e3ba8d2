"""datagen against SGLang's own benchmark client on one real SGLang server (CPU), side by side.

One real SGLang server of the tier's tiny model on CPU (`make sglang-cpu`; dummy weights). Driven, in
alternating order, by

- SGLang's own client, ``python -m sglang.benchmark.serving --backend sglang --dataset-name
  random-ids`` (fixed input and output lengths, ``ignore_eos``, ``--max-concurrency``); it imports
  ``datasets`` at import time, which the CPU environment lacks, so a stub of that package is put on
  its path (the random-ids dataset does not use it);
- ``datagen run --partition P --server-url URL``, the user's command against a running server, with
  the same number of requests, output length (``max_new_tokens`` with ``ignore_eos``) and requests in
  flight, and prompts of about the same length (checked from ``prompt_tokens``).

Reported: output tokens/s while serving for each (SGLang's ``output_throughput``, first request to
last answer; datagen's from its rows, the earliest ``generated_at - latency_s`` to the latest
``generated_at``), their ratio (target >= 1.0), and the whole ``datagen run``'s time beside its
serving span.

Without the SGLang environment the benchmark reports itself as not run.
Run alone: ``.venv/bin/python bench/bench_sglang_serving.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tasks.server import launch_tuned, stop_server  # noqa: E402
from tests.support.prefect import migrated_home  # noqa: E402
from tests.support.sglang import CPU_ARGS, SGLANG_PYTHON, SGLANG_VENV, cpu_config, make_model  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
CONCURRENCY = 16
INPUT_TOKENS = 32
OUTPUT_TOKENS = 32
WORDS = ("kalo", "vomi", "zubri", "quel", "tas", "ren", "ing", "ed", "lo", "mi", "on", "ka")


def _sglang_client(url: str, model: Path, n: int, work: Path, k: int) -> tuple[float, float]:
    """SGLang's own client: (output tokens/s, mean input tokens)."""
    stub = work / "stub"
    (stub / "datasets").mkdir(parents=True, exist_ok=True)
    (stub / "datasets" / "__init__.py").write_text(
        "def load_dataset(*args, **kwargs):\n    raise RuntimeError('datasets is stubbed for the benchmark')\n")
    out = work / f"sglang-bench-{k}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(stub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [str(SGLANG_PYTHON), "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
         "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random-ids",
         "--num-prompts", str(n), "--random-input-len", str(INPUT_TOKENS), "--random-output-len",
         str(OUTPUT_TOKENS), "--random-range-ratio", "1.0", "--max-concurrency", str(CONCURRENCY),
         "--output-file", str(out), "--seed", str(k)],
        env=env, cwd=work, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"sglang.benchmark.serving exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    result = json.loads(out.read_text().strip().splitlines()[-1])
    return float(result["output_throughput"]), float(result["total_input_tokens"]) / n


def _partition(work: Path, model: Path, url: str, n: int, k: int) -> Path:
    rng = random.Random(k)
    data = work / f"prompts-{k}.jsonl"
    with open(data, "w") as f:
        for i in range(n):  # about INPUT_TOKENS tokens once rendered
            text = " ".join(rng.choice(WORDS) for _ in range(INPUT_TOKENS - 12))
            f.write(json.dumps({"id": f"r{i:05d}", "messages": [{"role": "user", "content": text}]}) + "\n")
    part = work / f"serving-{k}.toml"
    part.write_text(f"""name = "serving"
[datasets]
ds = "{data}"
[model]
path = "{model}"
reasoning_parser = "qwen3"
[server]
backend = "sglang"
python = "{SGLANG_PYTHON}"
extra_args = {json.dumps(list(CPU_ARGS))}
[run]
server_url = "{url}"
shard_size = {n}
concurrency = {CONCURRENCY}
[sampling]
max_new_tokens = {OUTPUT_TOKENS}
ignore_eos = true
[validation]
reasoning_missing_max_rate = 1.0
truncation_max_rate = 1.0
tag_leak_max_rate = 1.0
[output]
root = "{work / f'root-{k}'}"
""")
    return part


def _datagen(url: str, model: Path, n: int, work: Path, k: int) -> tuple[float, float, float, float]:
    """``datagen run``: (output tokens/s while serving, mean input tokens, serving span s, whole run s)."""
    part = _partition(work, model, url, n, k)
    out = work / f"datagen-out-{k}"
    env = {key: v for key, v in os.environ.items() if not key.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(PREFECT_HOME=str(migrated_home(work / f"prefect-{k}")), DATAGEN_STATE_DIR=str(work / "state"),
               DATAGEN_RUN_DIR=str(work / "run"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    t0 = time.perf_counter()
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    whole = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"datagen run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    table = pq.read_table(sorted(out.glob("ds/shard-*.parquet")),
                          columns=["generated_at", "latency_s", "completion_tokens", "prompt_tokens"]).to_pydict()
    if len(table["generated_at"]) != n:
        raise RuntimeError(f"datagen run wrote {len(table['generated_at'])} of {n} rows")
    ends = [t.timestamp() if hasattr(t, "timestamp") else float(t) for t in table["generated_at"]]
    starts = [e - lat for e, lat in zip(ends, table["latency_s"], strict=True)]
    span = max(ends) - min(starts)
    return sum(table["completion_tokens"]) / span, sum(table["prompt_tokens"]) / n, span, whole


def run(quick: bool) -> list[dict[str, object]]:
    if not (SGLANG_VENV / ".installed").is_file():
        return [{"metric": "datagen vs sglang.benchmark.serving on real SGLang", "value": "not run", "unit": "",
                 "target": ">= 1.0x", "ok": True, "note": "no SGLang environment: `make sglang-cpu` builds it"}]
    n = 128 if quick else 256
    rounds = 1 if quick else 2
    os.environ.pop("DATAGEN_SIM_GPUS", None)
    sg: list[float] = []
    dg: list[tuple[float, float, float, float]] = []
    sg_input: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-sglang-serving-") as tmp:
        work = Path(tmp)
        model = make_model(SGLANG_PYTHON, work / "model")
        handle, _ = launch_tuned(cpu_config(model), "local", work / "logs", deadline_s=400, memory=None,
                                 gpu_name="cpu", hygiene=None)
        try:
            for k in range(rounds):
                for who in (("sglang", "datagen") if k % 2 == 0 else ("datagen", "sglang")):
                    if who == "sglang":
                        tps, mean_in = _sglang_client(handle.url, model, n, work, k)
                        sg.append(tps)
                        sg_input.append(mean_in)
                    else:
                        dg.append(_datagen(handle.url, model, n, work, k))
        finally:
            stop_server(handle, grace_s=30.0, hygiene=None)
    sg_tps = sum(sg) / len(sg)
    dg_tps = sum(d[0] for d in dg) / len(dg)
    ratio = dg_tps / sg_tps
    span = sum(d[2] for d in dg) / len(dg)
    whole = sum(d[3] for d in dg) / len(dg)
    return [
        {"metric": "sglang.benchmark.serving: output tokens/s", "value": round(sg_tps, 1), "unit": "tok/s",
         "target": "", "ok": True, "note": f"each round: {[round(x, 1) for x in sg]}; input tokens/request "
                                           f"{round(sum(sg_input) / len(sg_input), 1)}"},
        {"metric": "datagen run: output tokens/s while serving", "value": round(dg_tps, 1), "unit": "tok/s",
         "target": "", "ok": True, "note": f"each round: {[round(d[0], 1) for d in dg]}; input tokens/request "
                                           f"{round(sum(d[1] for d in dg) / len(dg), 1)}"},
        {"metric": "datagen / sglang.benchmark.serving, output tokens/s", "value": round(ratio, 2), "unit": "x",
         "target": ">= 1.0", "ok": ratio >= 1.0, "ratio": round(ratio, 2)},
        {"metric": "datagen run: whole command vs serving span", "value": round(whole, 1), "unit": "s",
         "target": "", "ok": True, "note": f"serving span {round(span, 1)} s; {n} requests x {OUTPUT_TOKENS} tokens"},
    ]


if __name__ == "__main__":
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
