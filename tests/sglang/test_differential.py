"""One probe suite, run against the emulator and against real SGLang 0.5.23 on CPU.

Each probe asserts what real SGLang does (endpoints, status codes, JSON key sets and types, auth with
and without the key, startup phases, finish reasons, the log lines datagen parses, process titles,
the exit on SIGTERM); the emulator must do the same. One server of each kind serves the whole module,
launched through datagen's launcher with an API key; the last probes stop it. What the emulator
does differently on purpose (GPU memory, always-on /metrics, ...) is listed in the README's known
differences, not probed here.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from emulator.simgpu import ENV_VAR, SimGpus
from tasks.inference import default_concurrency
from tasks.server import ServerConfig, ServerHandle, effective_fraction, launch, parse_progress, stop_server
from tests.support.common import free_port
from tests.support.emulator import DEMO_MODEL
from tests.support.sglang import DEADLINE_S, cpu_config, watch_health

pytestmark = [pytest.mark.timeout(600)]

SUBJECTS = ["emulator", pytest.param("sglang", marks=pytest.mark.sglang)]
EMU_ARGS = ("--emu-load-time", "0.3", "--emu-graph-time", "0.05", "--emu-warmup-time", "1.0")


@dataclass
class Subject:
    kind: str
    cfg: ServerConfig
    handle: ServerHandle
    key: str
    health: list[str]  # /health_generate while it started, repeats folded
    names: dict[int, str] = field(default_factory=dict)  # group member -> process name, at readiness

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        return httpx.get(self.handle.url + path, headers=_auth(key), timeout=60.0, trust_env=False)

    def post(self, path: str, body: Any, key: str | None = None) -> httpx.Response:
        return httpx.post(self.handle.url + path, json=body, headers=_auth(key), timeout=120.0, trust_env=False)

    def generate(self, text: Any, **sampling: Any) -> httpx.Response:
        return self.post("/generate", {"text": text, "sampling_params": sampling}, self.key)


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _config(kind: str, request: pytest.FixtureRequest, base: Path, key: str) -> ServerConfig:
    if kind == "sglang":
        return cpu_config(request.getfixturevalue("tiny_model"), api_key=key)
    sim = base / "sim-gpus.json"
    SimGpus.init(sim, count=2)
    return ServerConfig(model_path=str(DEMO_MODEL), backend="emulator", port=free_port(), api_key=key,
                        extra_args=EMU_ARGS, env={ENV_VAR: str(sim)})


@pytest.fixture(scope="module", params=SUBJECTS)
def subject(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    kind = request.param
    base = tmp_path_factory.mktemp(f"differential-{kind}")
    key = "sk-diff-" + secrets.token_hex(12)
    cfg = _config(kind, request, base, key)
    health: list[str] = []
    done = threading.Event()
    watcher = threading.Thread(target=watch_health, args=(cfg.url, health, done), daemon=True)
    watcher.start()
    try:
        handle = launch(cfg, "local", None, base / "logs", deadline_s=DEADLINE_S)
    except BaseException:
        done.set()
        raise
    finally:
        watcher.join(30)  # after a launch that succeeded it sees the 200 too
    names = {}
    for pid in handle.member_pids:
        try:
            names[pid] = psutil.Process(pid).name()
        except psutil.Error:
            continue
    yield Subject(kind, cfg, handle, key, health, names)
    stop_server(handle, grace_s=30.0, hygiene=None)


# --- startup ----------------------------------------------------------------------------------------


def test_health_goes_refused_then_503_then_200(subject: Subject) -> None:
    assert subject.health[0] == "refused"
    assert subject.health[-1] == "200"
    assert "503" in subject.health and subject.health.index("503") > 0


def test_startup_log_has_every_line_datagen_parses(subject: Subject) -> None:
    log = subject.handle.read_log()
    progress = parse_progress(log)
    assert progress.phase == "ready"
    assert progress.weights_gib is not None and progress.kv_tokens is not None
    assert progress.max_total_num_tokens == progress.kv_tokens
    assert effective_fraction(log) is not None  # server_args, whatever its form
    assert f"Uvicorn running on http://127.0.0.1:{subject.cfg.port} " in log
    assert subject.handle.progress.phase == "ready"


def test_process_titles_name_the_scheduler_and_the_detokenizer(subject: Subject) -> None:
    names = set(subject.names.values())
    assert "sglang::scheduler" in names, names
    assert any(n.startswith("sglang::detoken") for n in names), names


# --- auth -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready"])
def test_health_and_readiness_need_no_key(subject: Subject, path: str) -> None:
    r = subject.get(path)
    assert (r.status_code, r.content) == (200, b"")


@pytest.mark.parametrize("path", ["/server_info", "/model_info", "/v1/models"])
def test_info_endpoints_need_the_key(subject: Subject, path: str) -> None:
    for key in (None, "sk-wrong"):
        r = subject.get(path, key)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    assert subject.get(path, subject.key).status_code == 200


def test_generate_without_the_key_is_401(subject: Subject) -> None:
    r = subject.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})


def test_unknown_path_is_404(subject: Subject) -> None:
    assert subject.get("/no/such/endpoint", subject.key).status_code == 404


# --- JSON shapes ------------------------------------------------------------------------------------

META_KEYS = {
    "id": str, "finish_reason": dict, "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
    "weight_version": str, "num_retractions": int, "reasoning_tokens": int, "weight_versions": list,
    "cached_tokens_details": (dict, type(None)), "dp_rank": type(None), "e2e_latency": float,
    "response_sent_to_client_ts": float,
}


def _check_result(res: Any) -> None:
    assert isinstance(res, dict) and set(res) == {"text", "output_ids", "meta_info"}
    assert isinstance(res["text"], str)
    assert isinstance(res["output_ids"], list) and all(isinstance(i, int) for i in res["output_ids"])
    meta = res["meta_info"]
    assert set(meta) == set(META_KEYS), set(meta) ^ set(META_KEYS)
    for k, t in META_KEYS.items():
        assert isinstance(meta[k], t), (k, meta[k])
    assert len(res["output_ids"]) == meta["completion_tokens"]


def test_generate_answers_the_documented_shape_and_length_finish(subject: Subject) -> None:
    r = subject.post("/generate", {"text": "the weather in oslo", "rid": "probe-1",
                                   "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}, subject.key)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    res = r.json()
    _check_result(res)
    meta = res["meta_info"]
    assert meta["id"] == "probe-1"
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["completion_tokens"] == 3
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]


def test_batch_generate_answers_a_list(subject: Subject) -> None:
    r = subject.generate(["a b", "c d"], max_new_tokens=2)
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and len(body) == 2
    for res in body:
        _check_result(res)


def test_stop_string_ends_with_a_stop_finish_and_is_trimmed(subject: Subject) -> None:
    first = subject.generate("the weather in bergen", max_new_tokens=8, temperature=0.0).json()
    words = first["text"].split()
    assert words
    stop = words[min(1, len(words) - 1)]
    res = subject.generate("the weather in bergen", max_new_tokens=8, temperature=0.0, stop=[stop]).json()
    _check_result(res)
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in res["text"] and first["text"].startswith(res["text"])


def test_server_info_has_the_status_and_the_fields_datagen_reads(subject: Subject) -> None:
    info = subject.get("/server_info", subject.key).json()
    assert info["status"] == "ready"
    assert (info["port"], info["host"], info["model_path"]) == (subject.cfg.port, "127.0.0.1", subject.cfg.model_path)
    assert info["api_key"] == subject.key  # in plain text: datagen must never store this answer raw
    for k, t in {"version": str, "launch_command": str, "max_total_num_tokens": int,
                 "served_model_name": str, "context_length": (int, type(None)), "tp_size": int,
                 "mem_fraction_static": float, "startup_time": dict, "internal_states": list}.items():
        assert isinstance(info[k], t), (k, info[k])
    assert f"--port {subject.cfg.port}" in info["launch_command"]
    graphs = {"prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"}
    assert set(info["startup_time"]) == {"load_weight", "kv_cache_allocation", "scheduler_e2e", "cuda_graph",
                                         "tokenizer_e2e"}
    assert set(info["startup_time"]["cuda_graph"]) == graphs
    state = info["internal_states"][0]
    assert isinstance(state["last_gen_throughput"], float)
    memory = state["memory_usage"]
    assert set(memory) == {"weight", "kvcache", "startup_available", "token_capacity", "token_capacity_swa", "graph"}
    assert memory["token_capacity"] == info["max_total_num_tokens"] and set(memory["graph"]) == graphs
    assert isinstance(state["effective_max_running_requests_per_dp"], int)
    # Not set at launch: reported as None, the resolved slots per DP rank in internal_states.
    assert info["max_running_requests"] is None
    slots = state["effective_max_running_requests_per_dp"]
    assert default_concurrency(info) == max(16, min(1024, 2 * slots))


def test_model_info_has_the_identity_fields(subject: Subject) -> None:
    info = subject.get("/model_info", subject.key).json()
    for k, t in {"model_path": str, "tokenizer_path": str, "served_model_name": str, "is_generation": bool,
                 "weight_version": str, "model_type": str, "architectures": list, "load_format": str}.items():
        assert isinstance(info[k], t), (k, info.get(k))


def test_models_lists_the_served_model(subject: Subject) -> None:
    body = subject.get("/v1/models", subject.key).json()
    assert body["object"] == "list" and len(body["data"]) == 1
    assert set(body["data"][0]) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}


# --- errors -----------------------------------------------------------------------------------------


def test_generate_without_a_prompt_is_400_with_the_message(subject: Subject) -> None:
    r = subject.post("/generate", {"sampling_params": {"max_new_tokens": 1}}, subject.key)
    assert (r.status_code, r.json()) == (
        400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})


def test_negative_temperature_is_400_with_the_message(subject: Subject) -> None:
    r = subject.generate("x", max_new_tokens=1, temperature=-1)
    assert (r.status_code, r.json()) == (
        400, {"error": {"message": "temperature must be a non-negative finite number, got -1."}})


def test_unknown_sampling_key_is_400_naming_it(subject: Subject) -> None:
    r = subject.generate("x", max_new_tokens=1, seed=1)
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and "seed" in body["error"]


def test_invalid_json_is_400(subject: Subject) -> None:
    r = httpx.post(subject.handle.url + "/generate", content=b"not json", timeout=30.0, trust_env=False,
                   headers={**_auth(subject.key), "Content-Type": "application/json"})
    assert r.status_code == 400
    body = r.json()
    assert body["object"] == "error" and body["code"] == 400 and "JSON decode error" in body["message"]


# --- the prefix cache: shared only once a prefill has been processed ------------------------------

# ~300 tokens of a system prompt on both tokenizers (one token a word on the tiny model and the emulator)
_SYSTEM = "you are a careful assistant . " + " ".join(["kalo"] * 300) + " . "


def _cached(res: dict[str, Any]) -> int:
    return int(res["meta_info"].get("cached_tokens") or 0)


def _flush(subject: Subject) -> None:
    deadline = time.monotonic() + 60
    while subject.post("/flush_cache", {}, subject.key).status_code != 200:  # 400 while requests run
        assert time.monotonic() < deadline, "/flush_cache refused for 60 s"
        time.sleep(0.2)


def test_flushed_cache_serves_nothing_then_the_same_prompt_hits(subject: Subject) -> None:
    _flush(subject)
    first = subject.generate(_SYSTEM + "question one", max_new_tokens=2).json()
    again = subject.generate(_SYSTEM + "question one", max_new_tokens=2).json()
    assert _cached(first) == 0
    assert _cached(again) >= 300  # everything but the last prompt token, which is always computed
    _flush(subject)
    assert _cached(subject.generate(_SYSTEM + "question one", max_new_tokens=2).json()) == 0


def test_rows_prefilled_in_one_batch_share_nothing(subject: Subject) -> None:
    # What a group sent at once meets: no row of one prefill batch matches another's prompt. One
    # batched request reaches the scheduler at once, but on a loaded host real SGLang split four
    # rows into two prefill batches once (the last then hit): rows of the first batch share nothing.
    _flush(subject)
    body = subject.generate([_SYSTEM + f"question {w}" for w in ("one", "two", "three", "four")],
                            max_new_tokens=2).json()
    cached = [_cached(r) for r in body]
    assert cached[0] == 0 and cached.count(0) >= 2, cached
    if subject.kind == "emulator":
        assert cached == [0, 0, 0, 0]  # one batch, always


def test_a_sibling_sent_after_its_leader_answered_reuses_the_prefix(subject: Subject) -> None:
    _flush(subject)
    leader = subject.generate(_SYSTEM + "question one", max_new_tokens=2).json()
    body = subject.generate([_SYSTEM + f"question {w}" for w in ("two", "three")], max_new_tokens=2).json()
    assert _cached(leader) == 0
    shared = leader["meta_info"]["prompt_tokens"] - 3  # the prompts differ in their last words only
    assert all(_cached(r) >= shared for r in body), [(_cached(r), shared) for r in body]


# --- stop: last, ends the server --------------------------------------------------------------------


def test_sigterm_drains_and_exits_0_ending_every_process(subject: Subject) -> None:
    pids = sorted(set(subject.names) | {subject.handle.pid})
    t0 = time.monotonic()
    stop_server(subject.handle, grace_s=30.0, hygiene=None)
    assert subject.handle.exit_status() == 0
    assert time.monotonic() - t0 < 30.0
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []
    assert "Draining requests and shutting down" in subject.handle.read_log()
