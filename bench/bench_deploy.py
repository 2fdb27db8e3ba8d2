"""A deployment run's wait between submit and Running (issue 22 item 1).

A real ``prefect server start``, then ``datagen up --api-url`` against it (work pool, limits,
``prefect deploy --all``, one process worker, with datagen's own worker settings: nothing is set
in the environment here), then ``datagen/demo`` submitted through the REST API as
``prefect deployment run`` does, one run after the other. For each run: seconds from submit to
Pending (the worker picked it up) and to Running (the flow's process started it), and to Completed.
``datagen down`` stops what ``up`` started; the server is stopped by its pid.
Target: Running within 10 s of submit (median).

Run alone: ``.venv/bin/python bench/bench_deploy.py [--quick] [--query-seconds S]`` (rows as JSON;
``--query-seconds 10`` gives the worker Prefect's default poll, the figure before decision 110).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.prefect import PrefectApi, _start_server, _stop_group, migrated_home  # noqa: E402

DATAGEN = str(Path(sys.executable).parent / "datagen")
TARGET_S = 10.0


def _timeline(api: PrefectApi, run_id: str, deadline_s: float = 600) -> dict[str, float]:
    """Seconds from now (the submit) to each state type the run reaches first, until it is final."""
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - t0 < deadline_s:
        kind = api.state(run_id).get("type")
        if kind and kind not in seen:
            seen[kind] = time.monotonic() - t0
        if kind in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return seen
        time.sleep(0.1)
    raise RuntimeError(f"run {run_id} not final in {deadline_s:.0f} s: {seen}")


def run(quick: bool, query_s: str | None = None) -> list[dict[str, Any]]:
    """``query_s``: the worker's PREFECT_WORKER_QUERY_SECONDS (None: datagen's default), for the
    figure before decision 110 (``--query-seconds 10``, Prefect's default)."""
    n = 2 if quick else 4
    times: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as name:
        tmp = Path(name)
        proc, server = _start_server(migrated_home(tmp / "server-home"), 180)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
        env.update(PREFECT_API_URL=server.api_url, PREFECT_HOME=str(migrated_home(tmp / "home")),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", DATAGEN_HOME=str(REPO),
                   DATAGEN_STATE_DIR=str(tmp / "state"), DATAGEN_RUN_DIR=str(tmp / "run"))
        if query_s is not None:
            env["PREFECT_WORKER_QUERY_SECONDS"] = query_s
        api = PrefectApi(server.api_url)
        try:
            up = subprocess.run([DATAGEN, "up", "--api-url", server.api_url], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=600)
            if up.returncode != 0:
                raise RuntimeError(f"datagen up exited {up.returncode}: {(up.stdout + up.stderr)[-3000:]}")
            for k in range(n):
                run_id = api.run("datagen/demo", out=str(tmp / f"out-{k}"))
                seen = _timeline(api, run_id)
                if "COMPLETED" not in seen:
                    raise RuntimeError(f"demo run {run_id} ended {seen}: {api.logs(run_id)[-2000:]}")
                times.append(seen)
        finally:
            api.http.close()
            subprocess.run([DATAGEN, "down"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
            _stop_group(proc.pid)
            proc.wait(timeout=10)
    running = statistics.median(t["RUNNING"] for t in times)
    return [
        {"metric": "deployment run: submit to Pending (worker picked it up)",
         "value": round(statistics.median(t.get("PENDING", t["RUNNING"]) for t in times), 2), "unit": "s",
         "target": "", "ok": True, "note": f"median of {n}: " + ", ".join(f"{t.get('PENDING', 0):.1f}" for t in times)},
        {"metric": "deployment run: submit to Running", "value": round(running, 2), "unit": "s",
         "target": f"<= {TARGET_S:.0f}", "ok": running <= TARGET_S,
         "note": f"median of {n}: " + ", ".join(f"{t['RUNNING']:.1f}" for t in times)},
        {"metric": "deployment run: submit to Completed (datagen/demo)",
         "value": round(statistics.median(t["COMPLETED"] for t in times), 2), "unit": "s", "target": "", "ok": True,
         "note": f"median of {n}"},
    ]


if __name__ == "__main__":
    query = sys.argv[sys.argv.index("--query-seconds") + 1] if "--query-seconds" in sys.argv else None
    result_rows = run("--quick" in sys.argv, query)
    print(json.dumps(result_rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in result_rows) else 1)
