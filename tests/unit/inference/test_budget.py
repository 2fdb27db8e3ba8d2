"""The generation budget: SGLang's over-budget message, the cap, the truncation policy, and the client
capping ``max_new_tokens`` against the emulator."""

from __future__ import annotations

import asyncio
import json

import pytest

from tasks.inference import ClientConfig, ContextOverflow, GenerateClient, PromptTooLong, TruncationPolicy
from tasks.inference._budget import capped_sampling
from tests.support.inference import EMU_ARGS, FAST_CLIENT, canned_server

# What SGLang 0.5.23 answered on CPU (tests/sglang) for a 1,010-token prompt with max_new_tokens 2000.
REAL_MESSAGE = (
    "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total "
    "of 3010 tokens: 1010 tokens from the input messages and 2000 tokens for the completion. Please reduce "
    "the number of tokens in the input messages or the completion to fit within the limit."
)


def test_the_over_budget_message_gives_the_room_the_prompt_leaves() -> None:
    over = ContextOverflow.parse(REAL_MESSAGE)
    assert over == ContextOverflow(context_length=2048, total_tokens=3010, input_tokens=1010, max_new_tokens=2000)
    assert over.room == 1038
    assert over.generable == 1036  # what SGLang's scheduler generates in full (its reserve of 2)
    floats = REAL_MESSAGE.replace("2000 tokens for", "2000.0 tokens for").replace("3010", "3010.0")
    assert ContextOverflow.parse(floats) == over
    for other in ("The input (3000 tokens) is longer than the model's context length (2048 tokens).",
                  "Input length (2043 tokens) exceeds the maximum allowed length (2042 tokens). Use a shorter "
                  "input or enable --allow-auto-truncate.", "unknown field 'seed'", ""):
        assert ContextOverflow.parse(other) is None


def test_capped_sampling_lowers_min_new_tokens_with_the_budget() -> None:
    sampling = {"max_new_tokens": 4096, "min_new_tokens": 100, "temperature": 0.6}
    assert capped_sampling(sampling, 50) == {"max_new_tokens": 50, "min_new_tokens": 50, "temperature": 0.6}
    assert capped_sampling(sampling, 500) == {"max_new_tokens": 500, "min_new_tokens": 100, "temperature": 0.6}
    assert sampling["max_new_tokens"] == 4096  # not changed in place
    assert capped_sampling({}, 7) == {"max_new_tokens": 7}


def test_next_budget_grows_by_the_factor_within_the_limit_and_the_context() -> None:
    p = TruncationPolicy(retries=2, factor=2.0)
    assert p.next_budget(4096, 100, None) == 8192
    assert p.next_budget(4096, 100, 32768) == 8192
    assert p.next_budget(4096, 30000, 32768) is None  # 2,766 left: not larger than 4,096
    assert p.next_budget(1000, 30000, 32768) == 2000
    assert p.next_budget(2000, 30000, 32768) == 2766  # the rest of the context SGLang generates in
    assert p.next_budget(2766, 30000, 32768) is None
    assert TruncationPolicy(retries=1, factor=1.5).next_budget(5, 1, None) == 8  # rounded up
    limited = TruncationPolicy(retries=3, factor=4.0, max_new_tokens=10000)
    assert limited.next_budget(4096, 10, None) == 10000
    assert limited.next_budget(10000, 10, None) is None


def test_policy_values_are_checked_and_recorded_as_sorted_json() -> None:
    assert TruncationPolicy().to_json() is None and not TruncationPolicy().enabled
    assert json.loads(TruncationPolicy(retries=1, max_new_tokens=8192).to_json() or "") == {
        "factor": 2.0, "max_new_tokens": 8192, "retries": 1}
    for bad in ({"retries": -1}, {"retries": True}, {"factor": 1.0}, {"factor": float("inf")},
                {"max_new_tokens": 0}, {"max_new_tokens": 2.5}):
        with pytest.raises(ValueError):
            TruncationPolicy(**bad)  # type: ignore[arg-type]


PROMPT = "<|im_start|>user\nWhat is a shard?<|im_end|>\n<|im_start|>assistant\n"


def test_client_caps_max_new_tokens_to_the_room_the_server_names(sim_gpus, emulator_factory) -> None:
    em = emulator_factory(EMU_ARGS + ["--context-length", "300", "--emu-output-tokens", "1000"])

    async def go():
        async with GenerateClient(em.url, FAST_CLIENT) as c:
            assert await c.context_limit() == 300  # /v1/models max_model_len, before anything else
            c.context_length = None
            fits = await c.generate(PROMPT, {"max_new_tokens": 20}, rid="fits")
            # min_new_tokens above the room too: SGLang refuses a minimum above the maximum
            capped = await c.generate(PROMPT, {"max_new_tokens": 1000, "min_new_tokens": 500}, rid="capped")
            learned = c.context_length
            with pytest.raises(PromptTooLong) as alone:
                await c.generate(" w" * 300, {"max_new_tokens": 5}, rid="alone")
            with pytest.raises(PromptTooLong) as scheduler:
                await c.generate(" w" * 296, {"max_new_tokens": 1}, rid="scheduler")
            return fits, capped, learned, alone.value, scheduler.value, c.stats

    fits, capped, learned, alone, scheduler, stats = asyncio.run(go())
    assert (fits.max_new_tokens, fits.capped) == (20, False)
    # the scheduler keeps one slot short of its request limit (context - 1), SGLang's own bound: the
    # stored budget is what it generates in full, not the room the 400 names
    assert capped.capped and capped.max_new_tokens == 300 - 2 - capped.prompt_tokens
    assert capped.finish_reason == "length" and capped.completion_tokens == capped.max_new_tokens
    assert learned == 300
    assert alone.status == 400 and alone.message == (
        "The input (300 tokens) is longer than the model's context length (300 tokens).")
    assert scheduler.status == 400 and scheduler.message == (
        "Input length (296 tokens) exceeds the maximum allowed length (294 tokens). Use a shorter input or "
        "enable --allow-auto-truncate.")
    # one request each, plus the over-budget 400 of the capped one; none counted as a retry
    assert stats.requests == 5 and stats.retries == 0 and stats.errors == {}


def test_client_gives_up_when_the_capped_request_is_refused_again() -> None:
    """A server that keeps answering over-budget (it should not) makes the row a reject, not a loop."""
    body = json.dumps({"error": {"message": REAL_MESSAGE}}).encode()
    seen: list[bytes] = []

    async def go(url):
        async with GenerateClient(url, ClientConfig(max_attempts=3)) as c:
            await c.generate("x", {"max_new_tokens": 2000}, rid="r")

    with canned_server(400, body, seen) as url, pytest.raises(PromptTooLong) as info:
        asyncio.run(go(url))
    assert info.value.message == REAL_MESSAGE
    assert [json.loads(s)["sampling_params"]["max_new_tokens"] for s in seen] == [2000, 1036]
