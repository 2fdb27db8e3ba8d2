"""Emulator endpoints: shapes, status codes, determinism, streaming, batch order (one shared server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from emulator.textgen import count_tokens
from tasks.reasoning import split_reasoning
from tests.support.emulator import EmulatorProc, start_emulator

ZERO = ["--emu-prefill-us-per-token", "0", "--emu-decode-ms-per-step", "0"]
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
             "e2e_latency"}


@pytest.fixture(scope="module")
def em() -> Iterator[EmulatorProc]:
    proc = start_emulator([*ZERO, "--context-length", "300", "--served-model-name", "demo-model",
                           "--emu-output-tokens", "40"])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(em: EmulatorProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=em.url, timeout=10) as c:
        yield c


def test_generate_single_shape_and_token_counts(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": "Hello there, model.", "sampling_params": {"max_new_tokens": 256}})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert META_KEYS <= set(meta)
    assert meta["prompt_tokens"] == count_tokens("Hello there, model.") == 5
    assert meta["completion_tokens"] == count_tokens(body["text"]) == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "stop", "matched": 151645}
    assert body["text"].startswith("<think>\n") and "\n</think>\n\n" in body["text"]
    assert len(meta["id"]) == 32


def test_generate_is_deterministic_and_seeded(client: httpx.Client) -> None:
    def text(sp: dict[str, object]) -> str:
        return str(client.post("/generate", json={"text": "same prompt", "sampling_params": sp}).json()["text"])

    assert text({}) == text({})
    assert text({"sampling_seed": 1}) == text({"sampling_seed": 1})
    assert text({"sampling_seed": 1}) != text({"sampling_seed": 2})


def test_length_finish_can_cut_before_end_tag(client: httpx.Client) -> None:
    body = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert body["meta_info"]["completion_tokens"] == 5
    assert "</think>" not in body["text"]


def test_stop_string_is_matched_and_trimmed(client: httpx.Client) -> None:
    body = client.post("/generate", json={"text": "x", "sampling_params": {"stop": ["</think>"]}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</think>"}
    assert "</think>" not in body["text"] and body["text"].startswith("<think>")


def test_batch_keeps_order_and_rids(client: httpx.Client) -> None:
    prompts = ["first", "second prompt", "third one here"]
    r = client.post("/generate", json={"text": prompts, "rid": ["a", "b", "c"],
                                       "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4},
                                                           {"max_new_tokens": 5}]})
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [1, 2, 3]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 4, 5]
    single = client.post("/generate", json={"text": "second prompt", "sampling_params": {"max_new_tokens": 4}})
    assert single.json()["text"] == out[1]["text"]


def test_n_samples_and_input_ids(client: httpx.Client) -> None:
    out = client.post("/generate", json={"text": "q", "sampling_params": {"n": 3, "temperature": 0.8}}).json()
    assert isinstance(out, list) and len(out) == 3
    assert len({o["text"] for o in out}) == 3
    ids = client.post("/generate", json={"input_ids": [1, 2, 3, 4]}).json()
    assert ids["meta_info"]["prompt_tokens"] == 4


def test_streaming_is_cumulative_and_ends_with_done(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": "s", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 6}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_errors_400(client: httpx.Client) -> None:
    r = client.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    long = " w" * 300
    r = client.post("/generate", json={"text": long})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "The input (300 tokens) is longer than the model's context length "
                                             "(300 tokens)."}}
    # prompt + max_new_tokens over the context: SGLang's tokenizer manager refuses, naming the numbers
    r = client.post("/generate", json={"text": " w" * 100, "sampling_params": {"max_new_tokens": 250}})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": (
        "Requested token count exceeds the model's maximum context length of 300 tokens. You requested a total "
        "of 350 tokens: 100 tokens from the input messages and 250 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit.")}}
    r = client.post("/generate", json={"text": " w" * 100, "sampling_params": {"max_new_tokens": 200}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 200 - 2
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "max_new_tokens must be at least 0, got -1."}})


def test_info_endpoints(client: httpx.Client, em: EmulatorProc) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"].endswith("data/models/demo") and info["is_generation"] is True
        assert "tokenizer_path" in info
    for path in ("/server_info", "/get_server_info"):
        si = client.get(path).json()
        assert si["port"] == em.port and si["tp_size"] == 1 and si["mem_fraction_static"] == 0.88
        assert si["max_total_num_tokens"] == 298425
        state = si["internal_states"][0]
        assert set(state["memory_usage"]) == {"weight", "kvcache", "startup_available", "token_capacity",
                                              "token_capacity_swa", "graph"}
        assert state["memory_usage"]["token_capacity"] == 298425
        assert "last_gen_throughput" in state
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "demo-model" and models["data"][0]["owned_by"] == "sglang"
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")


def test_metrics_counters(client: httpx.Client) -> None:
    before = _metrics(client)
    client.post("/generate", json={"text": "one two three", "sampling_params": {"max_new_tokens": 7}})
    after = _metrics(client)
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == 3
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 7
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert "sglang:emu_busy_slot_seconds_total" in after


def _metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_reasoning_formats_by_family(tmp_path: Path, emulator_factory) -> None:  # type: ignore[no-untyped-def]
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"model_type": "kimi_vl", "architectures": ["KimiVLForConditionalGeneration"],
                                                  "hidden_size": 1024, "num_hidden_layers": 4,
                                                  "num_attention_heads": 8, "vocab_size": 1000}))
    e = emulator_factory(["--model-path", str(kimi), *ZERO, "--reasoning-parser", "kimi"])
    with httpx.Client(base_url=e.url) as c:
        text = c.post("/generate", json={"text": "hi"}).json()["text"]
        assert text.startswith("◁think▷") and "◁/think▷" in text
        opened = c.post("/generate", json={"text": "user: hi\nassistant: ◁think▷\n"}).json()["text"]
        assert not opened.startswith("◁think▷") and opened.count("◁/think▷") == 1
        reasoning, content = split_reasoning(text, "kimi")  # datagen's own kimi parser splits it
        assert reasoning and "◁" not in content


def test_generate_reports_cached_tokens_of_a_shared_prefix(client: httpx.Client) -> None:
    system = "You are a careful assistant who answers in one sentence. " * 3
    metas = [client.post("/generate", json={"text": system + q, "sampling_params": {"max_new_tokens": 4}}
                         ).json()["meta_info"] for q in ("Why is the sky blue?", "Why is grass green?")]
    shared = count_tokens(system + "Why is")
    assert metas[1]["cached_tokens"] == shared and metas[1]["prompt_tokens"] == count_tokens(system + "Why is grass green?")
    again = client.post("/generate", json={"text": system + "Why is grass green?",
                                           "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"]
    assert again["cached_tokens"] == again["prompt_tokens"] - 1  # SGLang computes the last token itself
