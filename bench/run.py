"""Run every benchmark in bench/ and print one table (metric, value, target, ratio/ok).

Each ``bench/bench_<area>.py`` exposes ``run(quick: bool) -> list[dict]`` (rows ``{"metric", "value",
"unit", "target", "ok"}``, optional "ratio", "note") and runs in its own subprocess, one after the
other, so one module's state or crash cannot skew another.

Usage: python bench/run.py [--quick] [--only AREA ...] [--json PATH]
Exit codes: 0 every target met, 1 a target missed or a benchmark failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _modules(only: list[str]) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        names = {f"bench_{o.removeprefix('bench_')}.py" for o in only}
        missing = names - {p.name for p in found}
        if missing:
            raise SystemExit(f"bench/run.py: no such benchmark: {', '.join(sorted(missing))}")
        found = [p for p in found if p.name in names]
    return found


_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("bench_mod", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
rows = mod.run(quick=sys.argv[2] == "1")
sys.stdout.write("\\n@@BENCH-ROWS@@" + json.dumps(rows) + "\\n")
"""


def _run_module(path: Path, quick: bool) -> tuple[list[dict], str | None, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), "1" if quick else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    elapsed = time.monotonic() - started
    marker = "@@BENCH-ROWS@@"
    if proc.returncode != 0 or marker not in proc.stdout:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return [], f"exit {proc.returncode}: " + "\n".join(tail), elapsed
    rows = json.loads(proc.stdout.rsplit(marker, 1)[1].strip().splitlines()[0])
    return rows, None, elapsed


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for smoke checks")
    ap.add_argument("--only", nargs="*", default=[], help="areas to run (e.g. client hygiene)")
    ap.add_argument("--json", default=str(HERE / "results.json"), help="where to write the results")
    args = ap.parse_args(argv)

    results: list[dict] = []
    failures: list[str] = []
    for path in _modules(args.only):
        area = path.stem.removeprefix("bench_")
        print(f"== {area} ...", flush=True)
        rows, error, elapsed = _run_module(path, args.quick)
        if error:
            failures.append(f"{area}: {error}")
            print(f"   FAILED after {elapsed:.1f}s: {error}", flush=True)
            continue
        for row in rows:
            row.setdefault("area", area)
            results.append(row)
        print(f"   {len(rows)} metrics in {elapsed:.1f}s", flush=True)

    header = ("area", "metric", "value", "unit", "target", "ok")
    table = [header] + [
        (r["area"], r["metric"], _fmt(r["value"]), r.get("unit", ""), str(r.get("target", "")),
         "yes" if r.get("ok") else "NO")
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    print()
    for i, row in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    out = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
        "failures": failures,
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    missed = [r for r in results if not r.get("ok")]
    if failures or missed:
        print(f"{len(missed)} target(s) missed, {len(failures)} benchmark(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
