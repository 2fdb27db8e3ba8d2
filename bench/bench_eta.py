"""The progress artifact's ETA on a long-tailed output-length workload: each estimator of flows.eta
fed the shard commits of one real inference run against the emulator (log-normal output lengths),
its error against the true time left at 25/50/75% of the run, side by side in the same run.

Run alone: ``.venv/bin/python bench/bench_eta.py [--quick]`` (rows as JSON lines).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_client import DEMO, _start_emulator, _stop, _write_input  # noqa: E402 - the repo goes on sys.path first
from flows.eta import ESTIMATORS, Eta, EtaInputs  # noqa: E402
from tasks.inference import (  # noqa: E402
    DatasetSpec,
    Endpoint,
    InferenceSettings,
    ServerPool,
    ShardProgress,
    run_dataset,
)

SIGMA = 1.0  # log-normal sigma of output lengths: the longest of 1,000 rows is ~20x the median
MEAN_TOKENS = 160
CONCURRENCY = 32
SHARD = 50
POINTS = (0.25, 0.5, 0.75)
TARGET = 0.25  # the chosen estimator's mean absolute error over the three points


def _run(n: int, sigma: float) -> tuple[list[tuple[float, dict[str, float | None]]], float]:
    """One run: at each shard commit, (seconds since start, each estimator's ETA); and the run's length."""
    with tempfile.TemporaryDirectory(prefix="bench-eta-") as tmp:
        d = Path(tmp)
        proc, url = _start_emulator(["--emu-output-tokens", str(MEAN_TOKENS), "--emu-output-sigma", str(sigma),
                                     "--emu-decode-ms-per-step", "4", "--emu-prefill-us-per-token", "1",
                                     "--max-running-requests", str(CONCURRENCY)], d / "emu.log")
        try:
            inp = d / "in.jsonl"
            _write_input(inp, n)
            eta = Eta(CONCURRENCY)
            events: list[tuple[float, dict[str, float | None]]] = []
            done = {"rows": 0, "shards": 0}
            total_shards = -(-n // SHARD)
            started = time.monotonic()

            def on_progress(p: ShardProgress) -> None:
                done["rows"] += p.rows_generated
                done["shards"] += 1
                elapsed = time.monotonic() - started
                eta.observe(elapsed, p.rows_generated, p.latencies_s)
                x = EtaInputs(elapsed_s=elapsed, rows_new=done["rows"], shards_new=done["shards"],
                              rows_left=n - p.dataset_rows_done, shards_left=total_shards - done["shards"],
                              datasets_left=1, first_s=eta.first_s, first_rows=eta.first_rows)
                events.append((x.elapsed_s, {k: f(x, eta.latencies, CONCURRENCY) for k, f in ESTIMATORS.items()}))

            settings = InferenceSettings(model_dir=DEMO, shard_size=SHARD, concurrency=CONCURRENCY,
                                         sampling={"max_new_tokens": 4096, "temperature": 0.7})
            run_dataset(DatasetSpec("eta", inp), d / "out", ServerPool.of(Endpoint(url, "bench")), settings, progress=on_progress)
            return events, time.monotonic() - started
        finally:
            _stop(proc)


def errors(events: list[tuple[float, dict[str, float | None]]], total: float) -> dict[str, dict[float, float]]:
    """Relative error of each estimator at each point: the last commit at or before ``point * total``."""
    out: dict[str, dict[float, float]] = {k: {} for k in ESTIMATORS}
    for point in POINTS:
        before = [e for e in events if e[0] <= point * total]
        if not before:
            continue
        t, estimates = before[-1]
        truth = total - t
        for name, value in estimates.items():
            if value is not None and truth > 0:
                out[name][point] = (value - truth) / truth
    return out


def run(quick: bool) -> list[dict[str, Any]]:
    n = 800 if quick else 2000
    events, total = _run(n, SIGMA)
    errs = errors(events, total)
    rows: list[dict[str, Any]] = []
    for name, by_point in errs.items():
        mean_abs = sum(abs(v) for v in by_point.values()) / max(1, len(by_point))
        chosen = name == Eta(CONCURRENCY).method
        for point, err in sorted(by_point.items()):
            rows.append({"metric": f"eta_error_{name}_at_{int(point * 100)}pct", "value": round(err * 100, 1),
                         "unit": "%", "target": "", "ok": True,
                         "note": f"{n} rows, log-normal sigma {SIGMA}, concurrency {CONCURRENCY}, run {total:.1f} s"})
        rows.append({"metric": f"eta_mean_abs_error_{name}", "value": round(mean_abs * 100, 1), "unit": "%",
                     "target": f"<= {TARGET * 100:.0f}%" if chosen else "", "ok": (mean_abs <= TARGET) if chosen else True,
                     "note": "the progress artifact's ETA" if chosen else "compared"})
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(json.dumps(row))
