"""Inference test helpers: input writer, output readers, /metrics reader, subprocess driver."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.inference import (
    ClientConfig,
    DatasetSpec,
    Endpoint,
    InferenceSettings,
    ServerPool,
    ShardProgress,
    run_dataset,
)
from tasks.schema import conform
from tasks.shards import OutputDir, ShardRecord
from tests.support.emulator import DEMO_MODEL
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
FAST_CLIENT = ClientConfig(max_attempts=3, backoff_base_s=0.02, backoff_max_s=0.1, connect_timeout_s=2,
                           request_timeout_s=30)
# Zero prefill time and a small decode step: a few hundred rows take about a second.
EMU_ARGS = ["--mem-fraction-static", "0.88", "--emu-prefill-us-per-token", "0",
            "--emu-decode-ms-per-step", "1", "--emu-output-tokens", "40", "--max-running-requests", "32"]


def write_input(path: Path, n: int, *, bad_at: tuple[int, ...] = (), long_at: tuple[int, ...] = ()) -> list[str]:
    """JSONL with ``n`` usable rows ``q00000``...; bad lines before records in ``bad_at``; long prompts."""
    ids = []
    with open(path, "w") as f:
        for i in range(n):
            if i in bad_at:
                f.write("{not json\n")
            words = " ".join(f"w{j}" for j in range(600)) if i in long_at else f"question number {i}"
            f.write(json.dumps({"id": f"q{i:05d}", "messages": [{"role": "user", "content": words}]}) + "\n")
            ids.append(f"q{i:05d}")
    return ids


def write_conversations(path: Path, n: int, *, turns: int = 3) -> list[str]:
    """JSONL with ``n`` conversations ``c00000``... of ``turns`` user/assistant exchanges (a system
    turn first); the model regenerates ``turns`` assistant turns of each."""
    ids = []
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You answer briefly."}]
            for t in range(turns):
                messages += [{"role": "user", "content": f"conversation {i} question {t}"},
                             {"role": "assistant", "content": f"original answer {t}"}]
            f.write(json.dumps({"id": f"c{i:05d}", "messages": messages}) + "\n")
            ids.append(f"c{i:05d}")
    return ids


def committed_rows(out: Path, dataset: str = "ds", columns: list[str] | None = None) -> list[dict[str, Any]]:
    """The committed rows of ``dataset`` in shard order (``columns`` only, when given); shards of an
    older datagen read with the defaults of the columns added since."""
    rows: list[dict[str, Any]] = []
    for rec in OutputDir(out).committed_shards(dataset):
        table = conform(pq.read_table(rec.path))
        rows.extend((table.select(columns) if columns else table).to_pylist())
    return rows


def committed_keys(out: Path, dataset: str = "ds") -> list[tuple[str, int]]:
    """The sorted ``(id, sample)`` keys of the committed rows, duplicates kept."""
    return sorted((r["id"], r["sample"]) for r in committed_rows(out, dataset, ["id", "sample"]))


def turns_on_disk(out: Path, dataset: str = "ds") -> int:
    """Turns of whole conversations done: in committed rows and journaled rows (each ``turns`` plus
    its last turn) and journaled turns of unfinished conversations."""
    o = OutputDir(out)
    committed = o.committed_indices(dataset)
    n = sum(len(r["turns"]) + 1 for r in committed_rows(out, dataset, ["turns"]))
    for k in o.open_journals(dataset):
        if k not in committed:
            contents = o.read_journal(dataset, k)
            n += sum(len(r["turns"]) + 1 for r in contents.rows.values())
            n += sum(len(t) for key, t in contents.turns.items() if key not in contents.rows)
    return n


def committed_ids(out: Path, dataset: str = "ds") -> list[str]:
    ids: list[str] = []
    for rec in OutputDir(out).committed_shards(dataset):
        ids.extend(pq.read_table(rec.path, columns=["id"]).column("id").to_pylist())
    return ids


def rows_on_disk(out: Path, dataset: str = "ds") -> int:
    """Rows committed plus rows in the journals of uncommitted shards (what a rerun must not redo)."""
    o = OutputDir(out)
    committed = o.committed_indices(dataset)
    n = sum(r.rows for r in o.committed_shards(dataset))
    for k in o.open_journals(dataset):
        if k not in committed:
            n += len(o.read_journal(dataset, k).rows)
    return n


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^sglang:(\w+)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits (requests of a killed client drained)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["num_running_reqs"] == 0 and m["num_queue_reqs"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"emulator still busy: {m}")
        time.sleep(0.02)


def assert_exactly_once(out: Path, ids: list[str], dataset: str = "ds") -> None:
    got = committed_ids(out, dataset)
    rejected = {r.get("id") for r in OutputDir(out).read_rejects(dataset)}
    expected = [i for i in ids if i not in rejected]
    assert sorted(got) == sorted(expected), (len(got), len(set(got)), len(expected))
    manifest = OutputDir(out).read_manifest()
    assert manifest is not None and manifest["datasets"][dataset]["complete"] is True


DRIVER = """
import json, sys
from tasks.inference import ClientConfig, DatasetSpec, Endpoint, InferenceSettings, ServerPool, TruncationPolicy, run_dataset
a = json.loads(sys.argv[1])
settings = InferenceSettings(model_dir=a["model"], shard_size=a["shard"], concurrency=a["conc"],
                             sampling=a["sampling"], run_info={"flow_run": a.get("flow_run")},
                             client=ClientConfig(max_attempts=3, backoff_base_s=0.02),
                             truncation=TruncationPolicy(**a["truncation"]),
                             samples=a.get("samples", 1), regenerate=a.get("regenerate", "last"))
r = run_dataset(DatasetSpec("ds", a["input"]), a["out"], ServerPool.of(Endpoint(a["url"], "test-server")), settings)
print(json.dumps(r.to_dict()), flush=True)
"""


def start_driver(inp: Path, out: Path, url: str, *, shard: int, conc: int = 32, flow_run: str | None = None,
                 sampling: dict[str, Any] | None = None, truncation: dict[str, Any] | None = None,
                 samples: int = 1, regenerate: str = "last") -> subprocess.Popen[bytes]:
    """``run_dataset`` in a child process (``truncation``: TruncationPolicy's fields)."""
    args = json.dumps({"input": str(inp), "out": str(out), "url": url, "model": str(DEMO_MODEL),
                       "shard": shard, "conc": conc, "flow_run": flow_run,
                       "sampling": sampling or {"max_new_tokens": 64}, "truncation": truncation or {},
                       "samples": samples, "regenerate": regenerate})
    return subprocess.Popen([sys.executable, "-c", DRIVER, args], cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def run(inp: Path, out: Path, url: str, shard: int = 16, *, server_alive: Callable[[], bool] | None = None,
        on_shard_committed: Callable[[ShardRecord], Any] | None = None,
        progress: Callable[[ShardProgress], Any] | None = None,
        on_canary: Callable[[list[dict[str, Any]]], Any] | None = None, **settings: Any):
    """``run_dataset`` of dataset "ds" with the demo model; ``settings`` are InferenceSettings fields."""
    settings.setdefault("client", FAST_CLIENT)
    settings.setdefault("sampling", {"max_new_tokens": 64})
    settings.setdefault("concurrency", 32)
    return run_dataset(DatasetSpec("ds", inp), out, ServerPool.of(Endpoint(url, "test-server", alive=server_alive)),
                       InferenceSettings(shard_size=shard, model_dir=DEMO_MODEL, **settings),
                       on_shard_committed=on_shard_committed, progress=progress, on_canary=on_canary)


@contextlib.contextmanager
def canned_server(status: int | list[int], body: bytes | list[bytes], seen: list[bytes] | None = None) -> Iterator[str]:
    """A loopback HTTP server answering every POST with ``status`` (a list: one status per request in
    order, the last repeated) and the JSON ``body`` (a list: likewise), request bodies appended to
    ``seen``; yields its base URL and stops it on exit."""
    statuses = list(status) if isinstance(status, list) else [status]
    bodies = list(body) if isinstance(body, list) else [body]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            request = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if seen is not None:
                seen.append(request)
            self.send_response(statuses.pop(0) if len(statuses) > 1 else statuses[0])
            answer = bodies.pop(0) if len(bodies) > 1 else bodies[0]
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
