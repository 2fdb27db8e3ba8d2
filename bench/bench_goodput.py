"""Goodput of `datagen run`: its measured capacity against the truth, its ledger against the wall
time, and where the GPU-time of a plain run goes (issue 44).

- **Emulator** (known capacity: ``max_running_requests / decode step`` output tokens/s): one `datagen
  run` of 400 rows on one simulated GPU, 8 slots at 10 ms a step (800 tokens/s). Reported: the probe's
  capacity over the truth (target within 10%), the ledger's GPU-seconds over the server's lifecycle
  wall time from its first to its last log line (target within 1%), goodput and the buckets.
- **Real SGLang on CPU** (`make sglang-cpu`; not run without it): `datagen run`, launching the server
  itself, of 512 rows of 32 tokens at 16 in flight, then at datagen's default (twice the 1,024 slots
  CPU SGLang reports, capped at 1,024): the capacity, goodput and buckets a user sees in each.

Run alone: ``.venv/bin/python bench/bench_goodput.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from emulator.simgpu import ENV_VAR, SimGpus  # noqa: E402
from tests.support.prefect import migrated_home  # noqa: E402
from tests.support.runs import partition  # noqa: E402
from tests.support.sglang import SGLANG_PYTHON, SGLANG_VENV, make_model, run_partition  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
SLOTS, STEP_MS = 8, 10.0
LIFECYCLE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d{3}) \| \w+ +\| .*? - server .+? lifecycle(?: begins|:)", re.M)


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(PREFECT_HOME=str(migrated_home(work / "prefect")), DATAGEN_STATE_DIR=str(work / "state"),
               DATAGEN_RUN_DIR=str(work / "run"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               **{ENV_VAR: str(work / "sim-gpus.json")})
    SimGpus.init(work / "sim-gpus.json", count=1)
    return env


def _run(part: Path, out: Path, env: dict[str, str]) -> tuple[dict[str, Any], float]:
    """`datagen run`: its `_last_run.json` and its server's lifecycle wall time (from its log lines)."""
    proc = subprocess.run([DATAGEN, "run", "--partition", str(part), "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"datagen run exited {proc.returncode}: {text[-3000:]}")
    marks = [int(h) * 3600 + int(m) * 60 + float(s) for h, m, s in LIFECYCLE.findall(text)]
    return json.loads((out / "_last_run.json").read_text()), marks[-1] - marks[0]


def _buckets(ledger: dict[str, Any]) -> str:
    total = ledger["total_gpu_s"]
    return ", ".join(f"{b} {100 * s / total:.1f}%" for b, s in ledger["gpu_seconds"].items() if s >= 0.0005 * total)


def _emulator(work: Path, n: int) -> list[dict[str, Any]]:
    part, _ = partition(work, {"ds": n}, ["--emu-decode-ms-per-step", str(STEP_MS)], shard=100, conc=2 * SLOTS,
                        max_relaunches=1, server=f"max_running_requests = {SLOTS}", probe_tokens=128)
    summary, wall = _run(part, work / "out", _env(work))
    ledger = summary["ledger"]
    (server,) = ledger["servers"].values()
    truth = SLOTS * 1000.0 / STEP_MS
    cap = server["capacity"]["tokens_per_s"]
    return [
        {"metric": "emulator: probed capacity / true capacity", "value": round(cap / truth, 3), "unit": "x",
         "target": "0.90-1.10", "ok": 0.9 <= cap / truth <= 1.1, "ratio": round(cap / truth, 3),
         "note": f"{cap:.0f} of {truth:.0f} tokens/s ({SLOTS} slots, {STEP_MS:g} ms a step, probe "
                 f"{server['capacity']['seconds']:.2f} s)"},
        {"metric": "emulator: ledger GPU-seconds / lifecycle wall time", "value": round(ledger["total_gpu_s"] / wall, 4),
         "unit": "x", "target": "0.99-1.01", "ok": abs(ledger["total_gpu_s"] / wall - 1) <= 0.01,
         "note": f"{ledger['total_gpu_s']:.2f} GPU-s over {wall:.2f} s, 1 GPU"},
        {"metric": "emulator: goodput of a plain run", "value": round(ledger["goodput"], 3), "unit": "",
         "target": "", "ok": True, "note": f"{n} rows; {_buckets(ledger)}"},
    ]


def _sglang(work: Path, n: int) -> list[dict[str, Any]]:
    if not (SGLANG_VENV / ".installed").is_file():
        return [{"metric": "real SGLang: goodput of a launched run", "value": "not run", "unit": "", "target": "",
                 "ok": True, "note": "no SGLang environment: `make sglang-cpu` builds it"}]
    model = make_model(SGLANG_PYTHON, work / "model")
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} " * 8}]})
                            + "\n" for i in range(n)))
    rows = []
    # the same rows at 16 in flight, then at datagen's default (twice the slots the server reports)
    for conc in ("16", "auto"):
        case = work / f"conc-{conc}"
        case.mkdir()
        part = run_partition(case, data, model, SGLANG_PYTHON, shard=64, max_new_tokens=32,
                             run_extra="capacity_probe_tokens = 32")
        part.write_text(part.read_text().replace("concurrency = 4\n", f"concurrency = {conc}\n" if conc != "auto"
                                                 else ""))
        t0 = time.perf_counter()
        summary, wall = _run(part, case / "out", _env(case))
        ledger = summary["ledger"]
        (server,) = ledger["servers"].values()
        cap = server["capacity"]
        if conc == "16":
            rows.append({"metric": "real SGLang: probed capacity", "value": round(cap["tokens_per_s"], 1),
                         "unit": "tok/s", "target": "", "ok": True,
                         "note": f"{cap['slots']} slots x 32 tokens in {cap['seconds']:.2f} s"})
        rows.append({"metric": f"real SGLang: goodput, concurrency {conc}", "value": round(ledger["goodput"], 4),
                     "unit": "", "target": "", "ok": True,
                     "note": f"{n} rows x 32 tokens, whole command {time.perf_counter() - t0:.0f} s, lifecycle "
                             f"{wall:.1f} s; {_buckets(ledger)}"})
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        (Path(tmp) / "emu").mkdir()
        rows = _emulator(Path(tmp) / "emu", 200 if quick else 400)
        (Path(tmp) / "sglang").mkdir()
        return rows + _sglang(Path(tmp) / "sglang", 128 if quick else 512)


if __name__ == "__main__":
    result_rows = run("--quick" in sys.argv)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
