"""Per-shard commit cost through directory handles (issue 47) against the by-name code it replaced.

Each side commits the same shards, in its own process, into its own output on the same disk:
``OutputDir.commit_shard`` of a 100-row shard (one reject line), after its journal was written
(rejects appended, Parquet temp file, fsync, rename, directory fsync, manifest replaced, journal
removed). The old side is the tree at ``BASE`` (``git archive``), the last commit before the handles;
the rounds alternate old and new so that the shared, noisy machine weighs on both alike. The figure
is new / old of the median commit time; the target is at most 1.10 (no dearer than before, within
noise). Also reported: the journal's append cost per row, new / old.

Run alone: ``.venv/bin/python bench/bench_commit.py [--quick]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE = "2a5beff"  # main before tasks.files.Dir (issue 47)
TARGET = 1.10

_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from tasks.shards import OutputDir
out_dir, shards, rows = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def row(i):
    return {"id": f"r{i}", "dataset": "ds", "messages": [{"role": "user", "content": f"question {i} " * 20}],
            "prompt": f"prompt {i} " * 30, "raw": f"<think>{'t' * 400}</think>{'a' * 300}", "reasoning": "t" * 400,
            "content": "a" * 300, "finish_reason": "stop", "prompt_tokens": 60, "completion_tokens": 180,
            "model": "m", "sampling": "{}", "server": "s", "reasoning_parser": "qwen3", "think_in_prompt": False,
            "generated_at": "2026-01-01T00:00:00.000000+00:00", "latency_s": 0.1, "_pos": i,
            "max_new_tokens": 512, "budget_capped": False, "truncation_retries": 0, "truncation_policy": None}

out = OutputDir(out_dir)
commits, appends = [], []
with out.lock({"flow_run": "bench"}):
    out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="f", shard_size=rows)
    for k in range(shards):
        batch = [row(k * rows + i) for i in range(rows)]
        j = out.journal("ds", k)
        t0 = time.perf_counter()
        for r in batch:
            j.append(r)
        j.close()
        t1 = time.perf_counter()
        out.commit_shard("ds", k, batch, [{"dataset": "ds", "line": 1, "reason": "bad", "raw": "x"}])
        commits.append(time.perf_counter() - t1)
        appends.append((t1 - t0) / rows)
print(json.dumps({"commit": commits, "append": appends}))
"""


def _old_tree(dest: Path) -> Path | None:
    """The ``tasks`` package at BASE, extracted under ``dest``; None without git history."""
    archive = subprocess.run(["git", "archive", "--format=tar", BASE, "tasks"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        return None
    tar_path = dest / "old.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest / "old", filter="data")
    return dest / "old"


def _side(tree: Path, out: Path, shards: int, rows: int) -> dict[str, list[float]]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(out), str(shards), str(rows)],
                          capture_output=True, text=True, timeout=600, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    rounds, shards, rows = (2, 10, 100) if quick else (5, 30, 100)
    with tempfile.TemporaryDirectory(prefix="bench-commit-") as tmp:
        old_tree = _old_tree(Path(tmp))
        if old_tree is None:
            return [{"area": "commit", "metric": "commit new/old", "value": "skipped", "unit": "",
                     "target": f"<= {TARGET}", "ok": True, "note": f"no git history for {BASE}"}]
        got: dict[str, dict[str, list[float]]] = {"old": {"commit": [], "append": []}, "new": {"commit": [], "append": []}}
        for r in range(rounds):
            for side, tree in (("old", old_tree), ("new", ROOT)) if r % 2 == 0 else (("new", ROOT), ("old", old_tree)):
                res = _side(tree, Path(tmp) / f"{side}-{r}", shards, rows)
                for key in got[side]:
                    got[side][key] += res[key]
    med = {side: {k: statistics.median(v) for k, v in d.items()} for side, d in got.items()}
    ratio = med["new"]["commit"] / med["old"]["commit"]
    append_ratio = med["new"]["append"] / med["old"]["append"]
    n = rounds * shards
    return [
        {"area": "commit", "metric": "shard commit (100 rows), by name (before)", "value": med["old"]["commit"] * 1e3,
         "unit": "ms", "target": "", "ok": True, "note": f"median of {n}"},
        {"area": "commit", "metric": "shard commit (100 rows), through handles", "value": med["new"]["commit"] * 1e3,
         "unit": "ms", "target": "", "ok": True, "note": f"median of {n}"},
        {"area": "commit", "metric": "shard commit new/old", "value": ratio, "unit": "x", "target": f"<= {TARGET}",
         "ok": ratio <= TARGET, "ratio": ratio},
        {"area": "commit", "metric": "journal append per row new/old", "value": append_ratio, "unit": "x",
         "target": f"<= {TARGET}", "ok": append_ratio <= TARGET, "ratio": append_ratio},
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
