"""Emulator as a process: startup phases and logs, memory model, crash/orphan/SIGTERM, faults, titles."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import httpx
import psutil
import pytest

from emulator.simgpu import SimGpus
from tests.support.common import pid_alive
from tests.support.emulator import DEMO_MODEL, REPO, http_status

ZERO = ["--emu-prefill-us-per-token", "0", "--emu-decode-ms-per-step", "0"]
STARTUP_ORDER = [
    "Load weight begin. avail mem=",
    "Load weight end. ",
    "KV Cache is allocated. #tokens: ",
    "Memory pool end. avail mem=",
    "Capture cuda graph begin. This can take up to several minutes. avail mem=",
    "Capture cuda graph end. Time elapsed: ",
    "max_total_num_tokens=",
    "INFO:     Uvicorn running on http://127.0.0.1:",
    "The server is fired up and ready to roll!",
]
PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] ")


def _wait(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


def _burst(url: str, n: int = 64, words: int = 150) -> list[object]:
    async def go() -> list[object]:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> object:
                try:
                    # distinct from the first token: the prefix cache must not shrink the prefill
                    async with s.post(url + "/generate", json={"text": f"{i} " + "word " * words}) as r:
                        await r.read()
                        return r.status
                except aiohttp.ClientError as exc:
                    return type(exc).__name__
            return list(await asyncio.gather(*[one(i) for i in range(n)]))

    return asyncio.run(go())


def test_startup_phases_and_log_order(emulator_factory, sim_gpus: SimGpus) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--emu-load-time", "1.0", "--emu-warmup-time", "1.0"], wait_ready=False, fast=False)
    assert http_status(em.url + "/health") is None  # loading weights: connection refused
    _wait(lambda: http_status(em.url + "/health_generate") is not None)
    assert http_status(em.url + "/health_generate") == 503
    assert http_status(em.url + "/health") == 503
    em.wait_ready(10)
    assert http_status(em.url + "/health") == 200
    lines = em.log_text().splitlines()
    idx = [next(i for i, ln in enumerate(lines) if s in ln) for s in STARTUP_ORDER]
    assert idx == sorted(idx)
    assert PREFIX.match(lines[idx[0]])
    text = em.log_text()
    assert "avail mem=5.57 GB." in text and "available_gpu_mem=5.57 GB" in text
    assert "Memory pool end. avail mem=5.97 GB" in text
    snap = sim_gpus.snapshot()["gpus"][0]
    sched = [c for c in em.children() if c.name() == "sglang::scheduler"]
    assert [p["pid"] for p in snap["processes"]] == [sched[0].pid]
    assert 97887 - snap["used_mib"] == pytest.approx(5.57 * 1024, abs=2)


def test_093_runs_then_ooms_on_big_prefill_with_orphan(emulator_factory, sim_gpus: SimGpus) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--mem-fraction-static", "0.93", "--emu-orphan-on-crash", *ZERO])
    assert "avail mem=0.79 GB." in em.log_text()
    sched = next(c for c in em.children() if c.name() == "sglang::scheduler")
    results = _burst(em.url)
    assert "ServerDisconnectedError" in results  # requests in flight when the tree died
    assert em.wait_exit(10) == -9
    log = em.log_text()
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " in log
    assert log.index("torch.OutOfMemoryError") < log.index(
        "Received sigquit from a child process. It usually means the child failed.")
    # the orphan: alive, reparented, still holding its memory
    assert pid_alive(sched.pid) and sched.ppid() != em.pid
    assert sim_gpus.allocation_of(0, sched.pid) > 90_000


def test_088_survives_the_same_burst(emulator_factory, sim_gpus: SimGpus) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--mem-fraction-static", "0.88", *ZERO])
    assert set(_burst(em.url)) == {200}
    assert "Prefill batch. #new-seq: " in em.log_text()
    assert em.proc.poll() is None


@pytest.mark.parametrize(
    ("fraction", "message"),
    [
        ("0.5", "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."),
        ("0.95", "Capture cuda graph failed: "),
    ],
)
def test_startup_memory_failures(emulator_factory, sim_gpus, fraction: str, message: str) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--mem-fraction-static", fraction], wait_ready=False)
    assert em.wait_exit(15) == -9
    log = em.log_text()
    assert message in log and "Scheduler hit an exception" in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    if fraction == "0.95":
        assert "Possible solutions: 1. set --mem-fraction-static to a smaller value" in log
    _wait(lambda: sim_gpus.snapshot()["gpus"][0]["used_mib"] == 0)


def test_tp2_titles_gpu_mapping_and_sigterm(emulator_factory, sim_gpus: SimGpus) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--tp-size", "2", "--base-gpu-id", "1", *ZERO], env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    kids = em.children()
    assert sorted(k.name() for k in kids) == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    snap = {g["index"]: g for g in sim_gpus.snapshot()["gpus"]}
    by_title = {k.name(): k.pid for k in kids}
    assert [p["pid"] for p in snap[5]["processes"]] == [by_title["sglang::scheduler_TP0"]]
    assert [p["pid"] for p in snap[6]["processes"]] == [by_title["sglang::scheduler_TP1"]]
    assert snap[4]["used_mib"] == 0
    os.kill(em.pid, signal.SIGTERM)
    assert em.wait_exit(10) == 0  # as SGLang: drained, children ended, a clean exit
    assert "SIGTERM received." in em.log_text() and "Draining requests and shutting down..." in em.log_text()
    psutil.wait_procs(kids, timeout=5)
    assert not any(pid_alive(k.pid) for k in kids)


def test_ignore_sigterm(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--emu-ignore-sigterm"])
    os.killpg(em.pid, signal.SIGTERM)
    time.sleep(0.3)  # a negative check: nothing may change during this window
    assert em.proc.poll() is None and http_status(em.url + "/health") == 200
    os.killpg(em.pid, signal.SIGKILL)
    assert em.wait_exit(5) == -9


def test_crash_after_and_503_rate(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--emu-crash-after", "2", *ZERO])
    with httpx.Client(base_url=em.url, timeout=5) as c:
        assert [c.post("/generate", json={"text": "a"}).status_code for _ in range(2)] == [200, 200]
        with pytest.raises(httpx.TransportError):
            c.post("/generate", json={"text": "a"})
    assert em.wait_exit(10) == -9
    assert "emulated scheduler failure (--emu-crash-after 2)" in em.log_text()
    em2 = emulator_factory(["--emu-503-rate", "0.5", *ZERO])
    with httpx.Client(base_url=em2.url, timeout=5) as c:
        codes = [c.post("/generate", json={"text": "a"}) for _ in range(100)]
    busy = [r for r in codes if r.status_code == 503]
    assert 25 <= len(busy) <= 75
    assert busy[0].json() == {"object": "error", "message": "The request queue is full.", "type": "503",
                              "param": None, "code": 503}


def test_hang_after(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--emu-hang-after", "1", "--emu-health-timeout", "0.5", *ZERO])
    with httpx.Client(base_url=em.url, timeout=1.0) as c:
        assert c.post("/generate", json={"text": "a"}).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json={"text": "a"})
        assert c.get("/health_generate").status_code == 503
    assert em.proc.poll() is None


def test_api_key(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--api-key", "sekrit", *ZERO])
    with httpx.Client(base_url=em.url, timeout=5) as c:
        assert c.post("/generate", json={"text": "a"}).status_code == 401
        ok = c.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200


def test_throughput_model_slots_and_queue(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    em = emulator_factory(["--max-running-requests", "4", "--emu-decode-ms-per-step", "100",
                           "--emu-prefill-us-per-token", "0"])

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 10}}
            tasks = [asyncio.create_task(s.post(em.url + "/generate", json=body)) for _ in range(8)]
            # (running, queued) until the scheduler has filled its four slots: it admits waiting
            # requests at its next step, and a loaded host delivers the eight late
            seen: list[tuple[float, float]] = []
            deadline = time.monotonic() + 20
            while not seen or seen[-1][0] < 4.0 or sum(seen[-1]) < 8.0:
                assert time.monotonic() < deadline, seen
                async with s.get(em.url + "/metrics") as r:
                    text = await r.text()
                assert 'sglang:num_running_reqs{model_name="' in text
                running = float(re.search(r"sglang:num_running_reqs\{[^}]*\} (\S+)", text).group(1))  # type: ignore[union-attr]
                queued = float(re.search(r"sglang:num_queue_reqs\{[^}]*\} (\S+)", text).group(1))  # type: ignore[union-attr]
                seen.append((running, queued))
                await asyncio.sleep(0.02)
            assert seen[-1] == (4.0, 4.0), seen  # four slots: the other four wait
            assert all(r <= 4.0 for r, _ in seen), seen
            t0 = time.monotonic()
            for t in tasks:
                (await t).release()
            # the queued wave still needs 10 tokens: 1 from prefill + 9 decode steps of 100 ms each
            assert time.monotonic() - t0 > 0.9

    asyncio.run(go())


def test_unknown_flag_and_missing_model() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "emulator", "--model-path", str(DEMO_MODEL), "--no-such-flag"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr
    r = subprocess.run([sys.executable, "-m", "emulator", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1 and "is not a local folder" in r.stderr
