"""tasks.reasoning: SGLang's one-shot reasoning split, parser by parser and edge case by edge case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.reasoning import PARSERS, is_forced, parser_for_model, request_sampling, split_reasoning, tags_for
from tests.support.paths import REPO_ROOT

THINK_PARSERS = [
    "deepseek-r1",
    "qwen3",
    "qwen3-thinking",
    "glm45",
    "kimi_k2",
    "minimax",
    "step3",
    "nemotron_3",
    "interns1",
]
TAG_PARSERS = [*THINK_PARSERS, "kimi", "mistral"]
ALWAYS_FORCED = {"deepseek-r1", "qwen3-thinking", "minimax", "step3", "gpt-oss"}


def test_parser_table_names_and_tags() -> None:
    assert set(PARSERS) == {*TAG_PARSERS, "gpt-oss"}
    for name in THINK_PARSERS:
        assert tags_for(name) == ("<think>", "</think>")
    assert tags_for("kimi") == ("◁think▷", "◁/think▷")
    assert tags_for("mistral") == ("[THINK]", "[/THINK]")
    assert tags_for("gpt-oss") == ("<|channel|>analysis<|message|>", "<|end|>")
    assert tags_for("QWEN3") == ("<think>", "</think>")  # SGLang lower-cases the name


def test_unknown_parser_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'qwen4'.*deepseek-r1.*gpt-oss"):
        split_reasoning("x", "qwen4")
    with pytest.raises(ValueError, match="valid parsers"):
        tags_for("nope")


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_start_and_end_tag(parser: str) -> None:
    start, end = tags_for(parser)
    assert split_reasoning(f"{start}plan it{end}answer", parser) == ("plan it", "answer")
    # whitespace around the tags is kept exactly (SGLang strips nothing in the one-shot parse)
    assert split_reasoning(f"{start}\nplan\n{end}\n\nanswer\n", parser) == ("\nplan\n", "\n\nanswer\n")


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_forcing(parser: str) -> None:
    _, end = tags_for(parser)
    text = f"plan{end}answer"
    forced = parser in ALWAYS_FORCED
    assert is_forced(parser) is forced
    expected_default = ("plan", "answer") if forced else (None, text)
    assert split_reasoning(text, parser) == expected_default
    # force_reasoning=True: the prompt opened the think block. kimi's detector ignores the flag.
    expected_true = (None, text) if parser == "kimi" else ("plan", "answer")
    assert split_reasoning(text, parser, force_reasoning=True) == expected_true
    # force_reasoning=False does not un-force the always-forced parsers
    assert split_reasoning(text, parser, force_reasoning=False) == expected_default


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_no_start_tag_not_forced_is_all_content(parser: str) -> None:
    if is_forced(parser):
        assert split_reasoning("just an answer", parser) == ("just an answer", "")
    else:
        assert split_reasoning("just an answer", parser) == (None, "just an answer")


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_no_end_tag_is_all_reasoning(parser: str) -> None:
    start, _ = tags_for(parser)
    assert split_reasoning(f"{start}still thinking when the tokens ran out", parser) == (
        "still thinking when the tokens ran out",
        "",
    )
    assert split_reasoning("cut off", parser, force_reasoning=True) == (
        (None, "cut off") if parser == "kimi" else ("cut off", "")
    )


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_start_tag_not_at_start_is_kept(parser: str) -> None:
    start, end = tags_for(parser)
    # the start tag anywhere puts the text in reasoning, but only a leading one is stripped
    assert split_reasoning(f"pre {start}plan{end}answer", parser) == (f"pre {start}plan", "answer")
    assert split_reasoning(f" {start}plan{end}answer", parser) == (f" {start}plan", "answer")


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_repeated_leading_start_tags_and_first_end_tag(parser: str) -> None:
    start, end = tags_for(parser)
    assert split_reasoning(f"{start}{start}a{end}b{end}c", parser) == ("a", f"b{end}c")


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_empty_reasoning(parser: str) -> None:
    start, end = tags_for(parser)
    assert split_reasoning(f"{start}{end}answer", parser) == ("", "answer")
    assert split_reasoning(f"{start}{end}", parser) == ("", "")
    assert split_reasoning("", parser) == (("", "") if is_forced(parser) else (None, ""))


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_unicode(parser: str) -> None:
    start, end = tags_for(parser)
    text = f"{start}思考 🤔 ◁ñ▷{end}答案: naïve — 42"
    assert split_reasoning(text, parser) == ("思考 🤔 ◁ñ▷", "答案: naïve — 42")


TOOL_STARTS = {
    "qwen3": "<tool_call>",
    "qwen3-thinking": "<tool_call>",
    "glm45": "<tool_call>",
    "minimax": "<tool_call>",
    "nemotron_3": "<tool_call>",
    "interns1": "<tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|>",
}


@pytest.mark.parametrize("parser", TAG_PARSERS)
def test_tool_call_start_ends_reasoning(parser: str) -> None:
    tool = TOOL_STARTS.get(parser, "<tool_call>")
    start, end = tags_for(parser)
    text = f"{start}need the weather{tool}{{\"name\": \"w\"}}"
    if parser in TOOL_STARTS:
        assert split_reasoning(text, parser) == ("need the weather", f"{tool}{{\"name\": \"w\"}}")
    else:
        assert split_reasoning(text, parser) == (text[len(start) :], "")
    # with an end tag present the end tag wins, even after the tool call
    assert split_reasoning(f"{start}a{tool}b{end}c", parser) == (f"a{tool}b", "c")


def test_gpt_oss_channels() -> None:
    text = (
        "<|channel|>analysis<|message|>User asks 6*7.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>42<|return|>"
    )
    assert split_reasoning(text, "gpt-oss") == ("User asks 6*7.", "42")
    # truncated inside analysis
    assert split_reasoning("<|channel|>analysis<|message|>still going", "gpt-oss") == ("still going", "")
    # final only: no reasoning part
    assert split_reasoning("<|channel|>final<|message|>hi<|return|>", "gpt-oss") == (None, "hi")


def test_gpt_oss_tool_call_keeps_raw_markers() -> None:
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
    text = f"<|channel|>analysis<|message|>need weather<|end|><|start|>assistant{call}"
    assert split_reasoning(text, "gpt-oss") == ("need weather", call)


def test_gpt_oss_text_fallback_and_end_only() -> None:
    # special tokens stripped by skip_special_tokens: the text format
    assert split_reasoning("analysisLet me think.assistantfinalThe answer.", "gpt-oss") == (
        "Let me think.",
        "The answer.",
    )
    assert split_reasoning("assistantfinal  Only the answer ", "gpt-oss") == (None, "Only the answer")
    assert split_reasoning("reason<|end|>content", "gpt-oss") == ("reason", "content")
    # SGLang quirk: plain text with no Harmony marker yields nothing
    assert split_reasoning("plain words", "gpt-oss") == (None, "")


def test_gpt_oss_unicode() -> None:
    text = "<|channel|>analysis<|message|>ünï 思考<|end|><|start|>assistant<|channel|>final<|message|>答案<|return|>"
    assert split_reasoning(text, "gpt-oss") == ("ünï 思考", "答案")


_piece = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(TAG_PARSERS),
    force=st.sampled_from([None, True, False]),
    parts=st.lists(st.one_of(_piece, st.sampled_from(["<start>", "<end>", "<tool>"])), max_size=8),
)
def test_property_nothing_lost_but_tags(parser: str, force: bool | None, parts: list[str]) -> None:
    start, end = tags_for(parser)
    tool = TOOL_STARTS.get(parser, "<tool_call>")
    raw = "".join({"<start>": start, "<end>": end, "<tool>": tool}.get(p, p) for p in parts)
    reasoning, content = split_reasoning(raw, parser, force)
    if reasoning is None:
        assert content == raw
        assert start not in raw and not is_forced(parser, force)
        return
    body = raw
    while body.startswith(start):
        body = body[len(start) :]
    # the only things removed: the leading start tags and the first end tag
    if end in body:
        assert reasoning + end + content == body
        assert end not in reasoning
    else:
        assert reasoning + content == body
        assert content == "" or content.startswith(tool)


def _model_dir(tmp_path: Path, name: str, config: dict[str, object]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize(
    ("name", "config", "expected"),
    [
        ("Qwen3-30B-A3B", {"model_type": "qwen3_moe"}, "qwen3"),
        ("Qwen3-235B-A22B-Thinking-2507", {"model_type": "qwen3_moe"}, "qwen3-thinking"),
        ("GLM-4.5-Air", {"model_type": "glm4_moe"}, "glm45"),
        ("DeepSeek-R1-0528", {"model_type": "deepseek_v3"}, "deepseek-r1"),
        ("DeepSeek-V3", {"model_type": "deepseek_v3"}, None),
        ("Kimi-K2-Thinking", {"model_type": "kimi_k2"}, "kimi_k2"),
        ("gpt-oss-120b", {"model_type": "gpt_oss"}, "gpt-oss"),
        ("MiniMax-M2", {"architectures": ["MiniMaxM2ForCausalLM"]}, "minimax"),
        ("Magistral-Small", {"model_type": "mistral"}, "mistral"),
        ("Llama-3", {"model_type": "llama"}, None),
    ],
)
def test_parser_for_model(tmp_path: Path, name: str, config: dict[str, object], expected: str | None) -> None:
    assert parser_for_model(_model_dir(tmp_path, name, config)) == expected


def test_parser_for_model_demo_and_errors(tmp_path: Path) -> None:
    assert parser_for_model(REPO_ROOT / "data" / "models" / "demo") == "qwen3"
    assert parser_for_model(tmp_path) is None  # no config.json
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        parser_for_model(bad)


def test_gpt_oss_requests_keep_special_tokens_unless_the_sampling_says_otherwise():
    assert request_sampling({"max_new_tokens": 8}, "gpt-oss") == {"max_new_tokens": 8, "skip_special_tokens": False}
    assert request_sampling({"skip_special_tokens": True}, "gpt-oss") == {"skip_special_tokens": True}
    for parser in (None, "qwen3", "deepseek-r1", "kimi"):
        assert request_sampling({"max_new_tokens": 8}, parser) == {"max_new_tokens": 8}
    sampling = {"temperature": 0.5}
    request_sampling(sampling, "gpt-oss")
    assert sampling == {"temperature": 0.5}  # the configured table (the rows' column) is not changed
