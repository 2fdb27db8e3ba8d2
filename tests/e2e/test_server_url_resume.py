"""Resuming an output against a shared server (``--server-url``): the server restarted on another port
continues the output (its fingerprint is what it reports about itself, not its URL), and a resume with
changed sampling is refused before any request, naming old and new values. The real CLI, real emulators.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emulator.simgpu import SimGpus
from tasks.shards import OutputDir
from tests.e2e.test_cli_server_url import _env, _write_input
from tests.support.emulator import DEMO_MODEL
from tests.support.inference import metrics
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")
EMU_ARGS = ["--emu-decode-ms-per-step", "5", "--emu-output-tokens", "40", "--served-model-name", "demo"]


def _partition(tmp: Path, data: Path, temperature: float) -> Path:
    toml = tmp / f"shared-{temperature}.toml"
    toml.write_text(f"""
[datasets]
alpha = "{data}"

[model]
path = "{DEMO_MODEL}"

[server]
backend = "emulator"
targets = ["local"]

[run]
shard_size = 10
concurrency = 4
capacity_probe_tokens = 0

[sampling]
max_new_tokens = 128
temperature = {temperature}

[output]
root = "{tmp / 'unused-root'}"
versioned = false
""")
    return toml


def _run(tmp: Path, part: Path, url: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = _env(tmp)
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"  # a loaded test machine
    return subprocess.run([DATAGEN, "run", "--partition", str(part), "--server-url", url, "--out", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_restarted_shared_server_continues_and_changed_sampling_is_refused(
        tmp_path: Path, sim_gpus: SimGpus, emulator_factory) -> None:
    data = tmp_path / "alpha.jsonl"
    ids = _write_input(data, "a")  # 40 rows: 4 shards of 10
    out = tmp_path / "out"
    part = _partition(tmp_path, data, 0.6)

    # 1. The shared server dies after 25 answers: the run fails with shards committed.
    first = emulator_factory(EMU_ARGS + ["--emu-crash-after", "25"])
    run1 = _run(tmp_path, part, first.url, out)
    assert run1.returncode == 1, run1.stderr[-3000:]
    committed = OutputDir(out).committed_indices("alpha")
    assert committed and len(committed) < 4
    first.stop()

    # 2. Its operator restarts it on another port.
    again = emulator_factory(EMU_ARGS)
    assert again.port != first.port

    # 3. A resume with another temperature: refused at start, nothing sent to the server.
    changed = _run(tmp_path, _partition(tmp_path, data, 0.9), again.url, out)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert (f"datagen run: run failed: sampling of dataset 'alpha' in {out}: the output has {{'temperature': 0.6}}, "
            f"this run has {{'temperature': 0.9}}; its rows were generated with {{'max_new_tokens': 128, "
            f"'temperature': 0.6}}: rerun with that [sampling] to resume, or write to a new --out\n") in changed.stderr
    assert metrics(again.url)["num_requests_total"] == 0

    # 4. The same settings resume against the restarted server and pass the final validation.
    run2 = _run(tmp_path, part, again.url, out)
    assert run2.returncode == 0, run2.stderr[-3000:]
    assert f"completed: 40 rows in {out}\n" in run2.stdout
    rows = [r for f in sorted((out / "alpha").glob("shard-*.parquet"))
            for r in pq.read_table(f, columns=["id", "server"]).to_pylist()]
    assert sorted(r["id"] for r in rows) == ids
    servers = {r["server"] for r in rows}
    assert len(servers) == 1 and re.fullmatch(r"external:[0-9a-f]{12}", servers.pop())
