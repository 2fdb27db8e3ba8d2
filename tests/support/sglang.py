"""Real SGLang on CPU for the `sglang` tier: its interpreter, the tiny model, configs and log capture.

The interpreter is the environment `make sglang-cpu` builds (.venv-sglang); without it the tier is
skipped with a message naming that target, except under CI (CI=true), where it fails. The model is a
tiny random Qwen3 written by data/models/make_tiny_model.py (weights filled by `--load-format dummy`).
Servers start through datagen's own launcher with a ServerConfig whose ``python`` is that interpreter;
the KV pool, host memory on CPU, is bounded by ``--max-total-tokens``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from emulator.simgpu import ENV_VAR
from tasks.server import ServerConfig
from tests.support.common import free_port
from tests.support.paths import REPO_ROOT
from tests.support.runs import cli_env, records

SGLANG_VENV = REPO_ROOT / ".venv-sglang"
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
MODEL_SCRIPT = REPO_ROOT / "data" / "models" / "make_tiny_model.py"
# One directory per xdist worker: two workers must not write the same files at once.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
MODEL_DIR = REPO_ROOT / ".run" / (f"sglang-tiny-model-{_WORKER}" if _WORKER else "sglang-tiny-model")
CONTEXT = 2048  # the tiny model's max_position_embeddings
KV_TOKENS = 4096
# CPU device, random weights, a bounded KV pool, and a scheduler that sleeps while it has nothing to
# do: without --sleep-on-idle SGLang's scheduler polls its sockets in a loop and holds one core at
# 100% for as long as the server is up (20 CPU-s in 20 idle s here; 0 with the flag), which the
# tests sharing these two cores paid for (docs/testing.md).
CPU_ARGS = ("--device", "cpu", "--load-format", "dummy", "--max-total-tokens", str(KV_TOKENS), "--sleep-on-idle")
DEADLINE_S = 400.0  # warm-up alone takes about 70 s on a busy 2-core machine
DATAGEN = str(Path(sys.executable).parent / "datagen")
TOKENS = 6  # generated per request of a `datagen run` (ignore_eos): short, so the tier passes under load


def sglang_python() -> Path:
    """The interpreter with SGLang; skips the test (fails it under CI) when it was not built."""
    if (SGLANG_VENV / ".installed").is_file() and SGLANG_PYTHON.is_file():
        return SGLANG_PYTHON
    why = f"real SGLang environment {SGLANG_VENV} is missing: run `make sglang-cpu`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI runs the sglang tier; .ci/run builds it before the tests)")
    pytest.skip(why)


def make_model(python: Path, out: Path = MODEL_DIR) -> Path:
    """Write the tiny model directory ``out`` with the SGLang interpreter (it has `tokenizers`)."""
    subprocess.run([str(python), str(MODEL_SCRIPT), str(out)], check=True, capture_output=True, timeout=120)
    return out


def cpu_config(model_path: str | Path, **kw: Any) -> ServerConfig:
    """A ServerConfig for real SGLang on CPU on a free loopback port; ``kw`` overrides fields."""
    extra = tuple(kw.pop("extra_args", ()))
    python = kw.pop("python", None) or sglang_python()
    return ServerConfig(
        model_path=str(model_path), host="127.0.0.1", port=kw.pop("port", None) or free_port(),
        python=str(python), extra_args=CPU_ARGS + extra, **kw,
    )


def watch_health(url: str, seen: list[str], done: threading.Event) -> None:
    """Poll ``url``/health_generate until it answers 200 or ``done`` is set, appending each new
    outcome ("refused", "timeout" or the status code) to ``seen`` (repeats folded)."""
    with httpx.Client(trust_env=False) as client:
        while not done.is_set():
            try:
                outcome = str(client.get(url + "/health_generate", timeout=5.0).status_code)
            except httpx.ConnectError:
                outcome = "refused"
            except httpx.TransportError:
                outcome = "timeout"
            if not seen or seen[-1] != outcome:
                seen.append(outcome)
            if outcome == "200":
                return
            done.wait(0.05)


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    """The SGLang interpreter (skip, or fail under CI, when missing)."""
    return sglang_python()


@pytest.fixture(scope="session")
def tiny_model(sglang_env: Path) -> Path:
    """The tiny Qwen3-shaped model directory, written once per session."""
    return make_model(sglang_env)


@pytest.fixture
def sglang_logs(tmp_path: Path) -> Iterator[Path]:
    """A directory for server logs of one test."""
    d = tmp_path / "logs"
    d.mkdir()
    yield d


# --- `datagen run` against real SGLang (tests/sglang/test_user_path.py, test_differential.py) ----------

def run_env(tmp: Path, **extra: str) -> dict[str, str]:
    """``cli_env`` (tests/support/runs.py) on this worker's simulated GPUs and the session's Prefect
    server, as under `datagen up`; ``extra`` added (DATAGEN_API_KEY, ...)."""
    return cli_env(tmp, Path(os.environ[ENV_VAR]), extra={"DO_NOT_TRACK": "1", **extra})


def run_partition(tmp: Path, data: Path, model: Path, python: Path, *, shard: int, max_new_tokens: int = TOKENS,
                  run_extra: str = "") -> Path:
    """``tmp``/real.toml: dataset ``ds`` = ``data`` on the tiny ``model``, served by real SGLang on CPU
    from ``python``; ``max_new_tokens`` per request with ignore_eos, so tokens count requests."""
    part = tmp / "real.toml"
    part.write_text(f"""
[datasets]
ds = "{data}"

[model]
path = "{model}"
reasoning_parser = "qwen3"

[server]
backend = "sglang"
targets = ["local"]
python = "{python}"
extra_args = {json.dumps(list(CPU_ARGS))}

[run]
shard_size = {shard}
concurrency = 4
hygiene_grace_s = 1
{run_extra}
{"" if "capacity_probe_tokens" in run_extra else "capacity_probe_tokens = 0  # the probe: test_user_path.py"}

[sampling]
max_new_tokens = {max_new_tokens}
ignore_eos = true
temperature = 0.7

# random weights: no reasoning block and every row ends by length, by construction; a sampled row may
# hold a stray <think> token (about 1 in 3,900 tokens), which is noise here, not a parser leak
[validation]
reasoning_missing_max_rate = 1.0
truncation_max_rate = 1.0
tag_leak_max_rate = 1.0

[output]
root = "{tmp / 'unused-root'}"
versioned = false
""")
    return part


def run_datagen(tmp: Path, argv: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    """``argv`` (a `datagen` command) run to its end in ``run_env(tmp, **extra)``."""
    return subprocess.run(argv, cwd=REPO_ROOT, env=run_env(tmp, **extra), capture_output=True, text=True,
                          timeout=800, stdin=subprocess.DEVNULL)


def run_summaries(tmp: Path) -> list[dict]:
    """The run summaries of the state directory's records, oldest first."""
    recs = sorted(records(tmp).values(), key=lambda r: r.get("owner", {}).get("started", 0))
    return [r["summary"] for r in recs if "summary" in r]


def write_prompts(path: Path, n: int) -> list[str]:
    """``n`` one-turn prompts p000, p001, ... as JSONL at ``path``; returns their ids."""
    ids = [f"p{i:03d}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                            for i in ids))
    return ids
