"""Unit tests of tasks.server._tuner: the state machine, memory stores, the tuned launch over a scripted launcher."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tasks.files import TMP_MARK
from tasks.server import (
    Attempt,
    Failure,
    FileStore,
    FractionMemory,
    LaunchFailed,
    MemoryStoreError,
    PrefectStore,
    ServerConfig,
    ServerHandle,
    StartupProgress,
    TuningPolicy,
    gpu_model_name,
    launch_tuned,
    list_remembered,
    memory_key,
    next_fraction,
    record_runtime_oom,
)


def att(fraction, kind=None):
    return Attempt(fraction, fraction, Failure(kind, "x") if kind else None, None, 0.0)


POLICY = TuningPolicy()


def test_steps_down_then_smaller():
    a = [att(0.93, "too_high")]
    assert next_fraction(a, POLICY) == 0.88
    a.append(att(0.88, "too_high"))
    assert next_fraction(a, POLICY) == 0.845  # second step down is smaller (0.035)


def test_steps_up_and_bisects_once_bracketed():
    a = [att(0.6, "too_low")]
    assert next_fraction(a, POLICY) == 0.65
    a.append(att(0.65, "too_high"))
    assert next_fraction(a, POLICY) == 0.625


def test_step_up_never_reaches_known_too_high():
    a = [att(0.9, "too_high"), att(0.85, "too_low")]
    assert next_fraction(a, POLICY) == 0.875
    assert next_fraction([att(0.85, "too_low")], POLICY, ceiling=0.87) == 0.86


def test_gives_up_on_empty_bracket_bounds_and_other_kinds():
    assert next_fraction([att(0.88, "too_high"), att(0.875, "too_low")], POLICY) is None
    assert next_fraction([att(0.5, "too_high")], POLICY) is None  # at the lower bound already
    assert next_fraction([att(0.95, "too_low")], POLICY) is None
    for kind in ("port_in_use", "bad_flag", "model_not_found", "host_memory", "unknown", "timeout"):
        assert next_fraction([att(0.8, kind)], POLICY) is None


def test_default_start_steps_from_effective_value():
    a = [Attempt(None, 0.88, Failure("too_high", "x"), None, 0.0)]
    assert next_fraction(a, POLICY) == 0.83


# --- memory -----------------------------------------------------------------------------------------


def test_file_store_roundtrip_atomic_and_locked(tmp_path):
    path = tmp_path / "state" / "fractions.json"
    mem = FractionMemory(FileStore(path))
    assert mem.get("k") is None and mem.entries() == []
    mem.remember_success("k", 0.88, 5.47)
    e = mem.get("k")
    assert (e.fraction, e.headroom_gib, e.runtime_oom_at) == (0.88, 5.47, None)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["entries"]["k"]["fraction"] == 0.88
    assert [p.name for p in path.parent.iterdir() if TMP_MARK in p.name] == []

    # concurrent writers under the flock never lose an update
    def write(i):
        mem.remember_success(f"key{i}", 0.8, float(i))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e.key for e in mem.entries()) == sorted(["k", *(f"key{i}" for i in range(8))])


def test_file_store_garbage_is_an_error(tmp_path):
    path = tmp_path / "fractions.json"
    path.write_text("{not json")
    with pytest.raises(MemoryStoreError, match="fractions.json"):
        FractionMemory(FileStore(path)).get("k")


def test_default_store_is_file_without_prefect_api(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAGEN_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens on port 9
    mem = FractionMemory.default()
    assert mem.kind == "file"
    assert isinstance(mem.store, FileStore) and mem.store.path == tmp_path / "st" / "fractions.json"


def test_default_store_is_prefect_when_api_answers(monkeypatch):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{srv.server_address[1]}/api")
        assert isinstance(FractionMemory.default().store, PrefectStore)
    finally:
        srv.shutdown()
        srv.server_close()


def test_memory_key_parts():
    cfg = ServerConfig(model_path="/models/m/", tp_size=8, port=1234)
    k = memory_key(cfg, "ssh://u@gpu1", "NVIDIA H100")
    host, model, tp, gpu, digest = k.split("|")
    assert (host, model, tp, gpu) == ("ssh://u@gpu1", "/models/m", "tp8", "NVIDIA H100")
    # port, fraction, name and key do not matter; memory-relevant flags do
    assert memory_key(ServerConfig(model_path="/models/m", tp_size=8, port=999, mem_fraction_static=0.7,
                                   api_key="s", served_model_name="x"), "ssh://u@gpu1", "NVIDIA H100") == k
    assert memory_key(ServerConfig(model_path="/models/m", tp_size=8, context_length=4096),
                      "ssh://u@gpu1", "NVIDIA H100") != k
    assert memory_key(cfg, "local", "g").startswith(os.uname().nodename + "|")


# --- tuned launch over a scripted launcher ---------------------------------------------------------


class Scripted:
    """A launcher whose outcome depends on the fraction: below ``low`` too_low, above ``high`` too_high."""

    def __init__(self, low: float, high: float, default: float = 0.88) -> None:
        self.low, self.high, self.default = low, high, default
        self.calls: list[float | None] = []

    def __call__(self, cfg, target, fraction, log_dir, deadline_s):
        self.calls.append(fraction)
        f = self.default if fraction is None else fraction
        tail = f"server_args=ServerArgs(mem_fraction_static={f})"
        if f < self.low:
            raise LaunchFailed(Failure("too_low", "raise"), tail, exit_status=-9)
        if f > self.high:
            raise LaunchFailed(Failure("too_high", "lower"), tail, exit_status=-9)
        return ServerHandle(pid=1, pgid=1, url="http://x", log_path="/dev/null", fraction=fraction,
                            target="local", command=[], gpus=[0],
                            progress=StartupProgress(headroom_gib=round((0.95 - f) * 95, 2)), ready_s=0.1)


@pytest.fixture
def memory(tmp_path):
    return FractionMemory(FileStore(tmp_path / "fractions.json"))


def test_tuned_launch_remembers_and_second_run_launches_once(memory):
    cfg = ServerConfig(model_path="m", mem_fraction_static=0.93)
    hyg: list[tuple] = []
    launcher = Scripted(low=0.6, high=0.9)
    handle, report = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher,
                                  hygiene=lambda t, g: hyg.append((t, g)))
    assert launcher.calls == [0.93, 0.88]
    assert report.start_source == "configured" and report.fraction == 0.88
    assert report.summary() == "0.93 -> too_high; 0.88 -> ok"
    assert hyg == [("local", [0])]
    assert memory.get(report.key).fraction == 0.88 and memory.get(report.key).headroom_gib == 6.65

    launcher2 = Scripted(low=0.6, high=0.9)
    _, report2 = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher2, hygiene=None)
    assert launcher2.calls == [0.88] and report2.start_source == "remembered"


def test_runtime_oom_makes_next_launch_start_lower(memory):
    cfg = ServerConfig(model_path="m", mem_fraction_static=0.93)
    _, r = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=Scripted(0.5, 0.95), hygiene=None)
    assert r.fraction == 0.93
    e = record_runtime_oom(cfg, "local", 0.93, memory=memory, gpu_name="G")
    assert (e.fraction, e.runtime_oom_at) == (0.88, 0.93)
    launcher = Scripted(0.5, 0.95)
    _, r2 = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher, hygiene=None)
    assert launcher.calls == [0.88] and r2.fraction == 0.88
    assert [x["fraction"] for x in list_remembered(memory)] == [0.88]
    assert list_remembered(memory)[0]["store"] == "file"


def test_default_start_and_never_fits_message(memory):
    cfg = ServerConfig(model_path="m")
    launcher = Scripted(low=0.9, high=0.85)  # nothing fits
    with pytest.raises(LaunchFailed) as ei:
        launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher, hygiene=None)
    assert launcher.calls[0] is None
    msg = str(ei.value)
    assert msg.startswith("gave up launching the server after")
    assert "[default (0.88) -> too_low, 0.93 -> too_high, 0.905 -> too_high, 0.893 -> too_low]" in msg
    assert "no fraction in [0.5, 0.95] fits" in msg
    assert launcher.calls == [None, 0.93, 0.905, 0.893]
    assert [a.failure.kind for a in ei.value.attempts] == ["too_low", "too_high", "too_high", "too_low"]
    assert memory.entries() == []


def test_max_attempts_bound(memory):
    launcher = Scripted(low=0.5, high=0.52)
    with pytest.raises(LaunchFailed) as ei:
        launch_tuned(ServerConfig(model_path="m", mem_fraction_static=0.95), memory=memory, gpu_name="G",
                     launcher=launcher, hygiene=None, policy=TuningPolicy(max_attempts=3))
    assert launcher.calls == [0.95, 0.9, 0.865]
    assert "no fraction worked within 3 attempts" in str(ei.value)


def test_non_fraction_failure_stops_at_once(memory):
    calls = []

    def launcher(cfg, target, fraction, log_dir, deadline_s):
        calls.append(fraction)
        raise LaunchFailed(Failure("bad_flag", "fix the flag", "error: unrecognized arguments: --x"), "",
                           exit_status=2)

    with pytest.raises(LaunchFailed) as ei:
        launch_tuned(ServerConfig(model_path="m"), memory=memory, gpu_name="G", launcher=launcher, hygiene=None)
    assert calls == [None]
    assert ei.value.failure.kind == "bad_flag"
    assert "bad_flag is not fixed by changing --mem-fraction-static" in str(ei.value)


def test_gpu_model_in_the_memory_key_comes_from_discovery(sim_gpus) -> None:
    assert gpu_model_name("local", [3]) == "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def test_gpu_model_unreadable_is_unknown(monkeypatch) -> None:
    monkeypatch.delenv("DATAGEN_SIM_GPUS", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML, even on a GPU host
    assert gpu_model_name("local", [0]) == "unknown-gpu"


def test_on_started_reaches_the_launcher_on_every_attempt(memory):
    cfg = ServerConfig(model_path="m", mem_fraction_static=0.93)
    seen: list[tuple[float | None, object]] = []

    class Recording(Scripted):
        def __call__(self, cfg, target, fraction, log_dir, deadline_s, on_started=None):
            seen.append((fraction, on_started))
            return super().__call__(cfg, target, fraction, log_dir, deadline_s)

    def cb(pid: int, pgid: int) -> None:
        pass

    launch_tuned(cfg, memory=memory, gpu_name="G", launcher=Recording(0.6, 0.9), hygiene=None, on_started=cb)
    assert seen == [(0.93, cb), (0.88, cb)]
    # Without a callback a launcher that does not know the keyword still works.
    _, r = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=Scripted(0.6, 0.9), hygiene=None)
    assert r.fraction == 0.88


def test_an_explicit_fraction_wins_over_the_remembered_one_which_stays_visible(memory):
    cfg = ServerConfig(model_path="m", mem_fraction_static=0.8)
    _, r = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=Scripted(0.5, 0.95), hygiene=None)
    record_runtime_oom(cfg, "local", 0.8, memory=memory, gpu_name="G")  # remembered: 0.75, OOM at 0.8
    launcher = Scripted(0.5, 0.95)
    _, r2 = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher, hygiene=None, pinned=0.9)
    assert launcher.calls == [0.9] and r2.fraction == 0.9  # neither the memory nor its OOM ceiling
    assert (r2.start_source, r2.remembered) == ("explicit", 0.75)
    launcher = Scripted(0.5, 0.95)
    _, r3 = launch_tuned(cfg, memory=memory, gpu_name="G", launcher=launcher, hygiene=None)
    # without it, memory again: still below the runtime OOM it recorded
    assert launcher.calls == [0.75] and r3.start_source == "remembered"
