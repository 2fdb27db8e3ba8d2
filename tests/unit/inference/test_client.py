"""tasks.inference._client against the real emulator: transports, retries, rejects, server gone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tasks.inference import (
    ClientConfig,
    GenerateClient,
    PromptTooLong,
    RequestRejected,
    ServerGone,
    default_concurrency,
    server_error_message,
)
from tests.support.common import free_port
from tests.support.inference import canned_server

PROMPT = "<|im_start|>user\nWhat is a shard?<|im_end|>\n<|im_start|>assistant\n"
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "connect_timeout_s": 2.0, "request_timeout_s": 20.0}
EMU = ["--mem-fraction-static", "0.88", "--emu-prefill-us-per-token", "0", "--emu-decode-ms-per-step", "0",
       "--max-running-requests", "32"]


def _run(coro):
    return asyncio.run(coro)


def test_generate_answers_and_4xx_is_not_retried(sim_gpus, emulator_factory):
    em = emulator_factory(EMU + ["--context-length", "300"])

    async def go(t):
        async with GenerateClient(em.url, ClientConfig(**FAST)) as c:
            info = await c.server_info()
            res = await c.generate(PROMPT, {"max_new_tokens": 30, "sampling_seed": 7}, rid=f"row-{t}")
            with pytest.raises(RequestRejected) as bad:
                await c.generate(PROMPT, {"temperature": -1}, rid="bad")
            with pytest.raises(PromptTooLong) as long:
                await c.generate("word " * 400, {"max_new_tokens": 5}, rid="long")
            return info, res, bad.value, long.value, c.stats

    results = {t: _run(go(t)) for t in ("a", "b")}
    texts = {t: r[1].text for t, r in results.items()}
    assert len(set(texts.values())) == 1, texts  # one seed, one text
    for t, (info, res, bad, long, stats) in results.items():
        assert default_concurrency(info) == 64
        assert res.rid == f"row-{t}" and res.meta_info["id"] == f"row-{t}"
        assert res.finish_reason in ("stop", "length") and res.completion_tokens > 0 and res.prompt_tokens > 0
        assert bad.status == 400 and "temperature must be a non-negative finite number" in bad.message
        assert long.status == 400 and "longer than the model's context length" in long.message
        assert stats.requests == 3 and stats.retries == 0  # neither 400 was retried


def test_503_queue_full_is_retried_with_backoff(sim_gpus, emulator_factory):
    em = emulator_factory(EMU + ["--emu-503-rate", "0.4"])

    async def go():
        # a busy server is not a gone one: "queue is full" does not use up max_attempts
        async with GenerateClient(em.url, ClientConfig(max_attempts=1, **FAST)) as c:
            out = await asyncio.gather(*(c.generate(PROMPT + str(i), {"max_new_tokens": 8}, rid=f"r{i}")
                                         for i in range(30)))
            return out, c.stats

    results, stats = _run(go())
    assert [r.rid for r in results] == [f"r{i}" for i in range(30)]
    assert stats.retries > 0 and stats.errors.get("http_503", 0) == stats.retries
    assert stats.requests == 30 + stats.retries


def test_connection_refused_gives_server_gone_after_attempts():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with GenerateClient(url, ClientConfig(max_attempts=4, **FAST)) as c:
            t0 = time.monotonic()
            with pytest.raises(ServerGone) as e:
                await c.generate(PROMPT, {}, rid="x")
            return e.value, c.stats, time.monotonic() - t0

    err, stats, took = _run(go())
    assert stats.requests == 4 and stats.errors == {"refused": 4} and took < 5
    assert "stopped answering" in str(err) and "failed 4 times" in str(err) and err.last_error


def test_error_messages_and_default_concurrency():
    assert server_error_message(b'{"error": {"message": "too long"}}') == "too long"
    assert server_error_message(b'{"object":"error","message":"The request queue is full.","code":503}') == \
        "The request queue is full."
    assert server_error_message(b"plain text") == "plain text"
    assert default_concurrency(None) == 128 and default_concurrency({"max_running_requests": 4}) == 16
    assert default_concurrency({"max_running_requests": 2048}) == 1024
    # SGLang reports max_running_requests as given (None by default); its schedulers' resolved slots
    # are in internal_states, one entry per DP rank.
    states = [{"effective_max_running_requests_per_dp": 24}, {"effective_max_running_requests_per_dp": 24}]
    assert default_concurrency({"max_running_requests": None, "internal_states": states}) == 96
    assert default_concurrency({"max_running_requests": None, "internal_states": []}) == 128
    with pytest.raises(TypeError, match="transport"):
        ClientConfig(transport="httpx")  # type: ignore[call-arg]  # one transport: the choice is gone


def test_server_alive_check_short_cuts_retries_only_for_a_dead_process():
    url = f"http://127.0.0.1:{free_port()}"
    calls: list[str] = []

    def dead() -> bool:
        calls.append("dead")
        return False

    def alive() -> bool:
        calls.append("alive")
        return True

    def broken() -> bool:
        calls.append("broken")
        raise OSError("ssh: connection timed out")

    async def go(check):
        async with GenerateClient(url, ClientConfig(max_attempts=4, **FAST), server_alive=check) as c:
            t0 = time.monotonic()
            errs = await asyncio.gather(*(c.generate(PROMPT, {}, rid=f"x{i}") for i in range(8)),
                                        return_exceptions=True)
            return errs, c.stats, time.monotonic() - t0

    errs, stats, took = _run(go(dead))
    assert all(isinstance(e, ServerGone) for e in errs) and took < 1.0
    assert stats.requests == 8 and stats.retries == 0  # no request was retried
    assert 1 <= calls.count("dead") <= 2  # requests failing together share one check
    assert str(errs[0]).startswith(f"{url} stopped answering: its server process is dead (request 'x")
    assert errs[0].last_error and "times" not in str(errs[0])
    for check, name in ((alive, "alive"), (broken, "broken")):  # live or unknown: the retry path as before
        errs, stats, _ = _run(go(check))
        assert all(isinstance(e, ServerGone) and "failed 4 times" in str(e) for e in errs)
        assert stats.requests == 32 and calls.count(name) >= 1


@pytest.mark.parametrize("body, fragment", [
    (b'{"text": null, "meta_info": {"finish_reason": {"type": "stop"}}}', "without a `text` string"),
    (b'{"text": 42, "meta_info": {}}', "without a `text` string"),
    (b'{"text": "ok", "meta_info": ["not", "an", "object"]}', "`meta_info` that is not an object"),
    (b'{"text": "ok", "meta_info": {"finish_reason": "stop", "completion_tokens": "many"}}',
     "meta_info.completion_tokens = 'many', not a token count"),
    (b'{"text": "ok", "meta_info": {"finish_reason": "stop", "prompt_tokens": -3}}',
     "meta_info.prompt_tokens = -3, not a token count"),
])
def test_malformed_answers_are_named_never_stored(body, fragment):
    """A 200 whose JSON is not what SGLang sends is a clear ServerGone, never a row holding "None"."""
    async def go(url):
        async with GenerateClient(url, ClientConfig(max_attempts=2, **FAST)) as c:
            with pytest.raises(ServerGone) as e:
                await c.generate(PROMPT, {}, rid="x")
            return e.value

    with canned_server(200, body) as url:
        err = _run(go(url))
    assert fragment in str(err)


def test_a_bad_body_is_retried_and_the_next_good_answer_kept():
    """One truncated or non-JSON 200 (a proxy, a cut connection) costs a retry, not the server."""
    good = b'{"text": "fine", "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": 3, "completion_tokens": 1}}'

    async def go(url):
        async with GenerateClient(url, ClientConfig(max_attempts=3, **FAST)) as c:
            return await c.generate(PROMPT, {}, rid="x"), c.stats

    seen: list[bytes] = []
    with canned_server(200, [b'{"text": "fi', b"<html>bad gateway</html>", good], seen) as url:
        res, stats = _run(go(url))
    assert res.text == "fine" and res.attempts == 3 and len(seen) == 3
    assert stats.retries == 2 and stats.errors == {"bad_body": 2}


def test_server_info_never_carries_the_api_key(sim_gpus, emulator_factory):
    secret = "sk-info-" + "7" * 16
    em = emulator_factory(EMU + ["--api-key", secret])
    raw = httpx.get(em.url + "/server_info", headers={"Authorization": f"Bearer {secret}"}, timeout=10).json()
    assert raw["api_key"] == secret  # as SGLang reports it

    async def go():
        async with GenerateClient(em.url, ClientConfig(api_key=secret, **FAST)) as c:
            return await c.server_info()

    info = _run(go())
    assert info is not None and info["max_running_requests"] == 32 and "max_total_num_tokens" in info
    assert "api_key" not in info and secret not in json.dumps(info)
    # launch_command repeats the flag (SGLang reports its sys.argv, where the bootstrap put the key)
    assert f"--api-key {secret}" in raw["launch_command"] and "--api-key ***" in info["launch_command"]
