"""Split a model's raw output into reasoning and content, exactly as SGLang's one-shot parse does.

A re-implementation of SGLang's ``--reasoning-parser`` (``reasoning_parser.py``, ``detect_and_parse``):
datagen keeps the raw text from ``/generate`` and splits it here, and ``datagen resplit`` can redo the
split later without a server. gpt-oss's Harmony channels are parsed in ``_harmony``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.files import read_json_object
from tasks.reasoning._harmony import parse_harmony

__all__ = ["PARSERS", "ParserSpec", "parser_for_model", "request_sampling", "split_reasoning", "tags_for"]

_THINK = ("<think>", "</think>")
_QWEN_TOOL = "<tool_call>"


@dataclass(frozen=True)
class ParserSpec:
    """One SGLang reasoning parser: its tags and how forcing applies."""

    name: str
    start: str
    end: str
    tool_start: str | None = None
    always_forced: bool = False
    never_forced: bool = False
    # The markers are special tokens, which SGLang drops from the text unless told to keep them.
    keeps_special_tokens: bool = False


PARSERS: dict[str, ParserSpec] = {
    spec.name: spec
    for spec in (
        ParserSpec("deepseek-r1", *_THINK, always_forced=True),
        ParserSpec("qwen3", *_THINK, tool_start=_QWEN_TOOL),
        ParserSpec("qwen3-thinking", *_THINK, tool_start=_QWEN_TOOL, always_forced=True),
        ParserSpec("glm45", *_THINK, tool_start=_QWEN_TOOL),
        ParserSpec("kimi_k2", *_THINK, tool_start="<|tool_calls_section_begin|>"),
        ParserSpec("minimax", *_THINK, tool_start=_QWEN_TOOL, always_forced=True),
        ParserSpec("step3", *_THINK, always_forced=True),
        ParserSpec("nemotron_3", *_THINK, tool_start=_QWEN_TOOL),
        ParserSpec("interns1", *_THINK, tool_start=_QWEN_TOOL),
        ParserSpec("kimi", "\u25c1think\u25b7", "\u25c1/think\u25b7", never_forced=True),
        ParserSpec("mistral", "[THINK]", "[/THINK]"),
        ParserSpec("gpt-oss", "<|channel|>analysis<|message|>", "<|end|>", always_forced=True,
                   keeps_special_tokens=True),
    )
}


def _spec(parser: str) -> ParserSpec:
    # SGLang looks parser names up lower-cased.
    spec = PARSERS.get(parser.lower()) if isinstance(parser, str) else None
    if spec is None:
        raise ValueError(f"unknown reasoning parser {parser!r}; valid parsers: {', '.join(PARSERS)}")
    return spec


def tags_for(parser: str) -> tuple[str, str]:
    """Return the (start, end) reasoning tags of ``parser``.

    Args:
        parser: an SGLang reasoning parser name.

    Raises:
        ValueError: the parser name is unknown (the message lists the valid ones).
    """
    spec = _spec(parser)
    return spec.start, spec.end


def request_sampling(sampling: Mapping[str, Any], parser: str | None) -> dict[str, Any]:
    """The ``sampling_params`` to send for ``parser``: ``sampling`` plus, for a parser whose markers
    are special tokens (gpt-oss's Harmony), ``skip_special_tokens=False`` unless ``sampling`` sets it,
    as SGLang's own chat endpoint does. Without it ``/generate`` returns the text with the markers
    dropped, which the split can only read by its text fallback.

    Raises:
        ValueError: the parser name is unknown.
    """
    out = dict(sampling)
    if parser is not None and _spec(parser).keeps_special_tokens:
        out.setdefault("skip_special_tokens", False)
    return out


def is_forced(parser: str, force_reasoning: bool | None = None) -> bool:
    """Whether ``parser`` treats the output as reasoning from its first character.

    Args:
        parser: an SGLang reasoning parser name.
        force_reasoning: the prompt opened the think block; ignored by always/never-forced parsers.

    Raises:
        ValueError: the parser name is unknown.
    """
    spec = _spec(parser)
    if spec.always_forced:
        return True
    if spec.never_forced:
        return False
    return bool(force_reasoning)


def split_reasoning(
    text: str, parser: str, force_reasoning: bool | None = None
) -> tuple[str | None, str]:
    """Split raw model output into ``(reasoning, content)`` with SGLang's one-shot semantics.

    The text is in reasoning when the parser is forced or its start tag occurs anywhere; otherwise
    all of it is content and ``reasoning`` is None. Start tags at the very beginning are stripped
    (repeatedly), elsewhere they stay. Text before the first end tag is reasoning, the rest content;
    nothing is whitespace-stripped. With no end tag everything is reasoning and content is ""
    (truncated output), unless the parser's tool-call start occurs: reasoning ends there and the
    tool call begins the content. ``reasoning`` is "" (not None) for an empty block
    (``<think></think>x``).

    Forced, as in SGLang's source: ``deepseek-r1``, ``step3``, ``qwen3-thinking``, ``minimax`` and
    ``gpt-oss`` always; ``kimi`` never; the others only with ``force_reasoning``.

    Args:
        text: the raw output, exactly as the server returned it.
        parser: an SGLang reasoning parser name (one of ``PARSERS``).
        force_reasoning: the prompt already opened the think block (``tasks.prompts.opens_think``).

    Raises:
        ValueError: the parser name is unknown (the message lists the valid ones).
    """
    spec = _spec(parser)
    if spec.name == "gpt-oss":
        return parse_harmony(text)
    forced = is_forced(spec.name, force_reasoning)
    if not forced and spec.start not in text:
        return None, text
    body = text
    while body.startswith(spec.start):
        body = body[len(spec.start) :]
    end_at = body.find(spec.end)
    if end_at < 0:
        if spec.tool_start is not None:
            tool_at = body.find(spec.tool_start)
            if tool_at >= 0:
                # The tool call stays in content, where a tool-call parser looks for it.
                return body[:tool_at], body[tool_at:]
        return body, ""
    return body[:end_at], body[end_at + len(spec.end) :]


# config.json model_type -> parser. Families whose reasoning variant shares a model_type with a
# non-reasoning one (DeepSeek V3 vs R1) are told apart by the directory name below.
_BY_MODEL_TYPE: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "qwen3_next": "qwen3",
    "glm4_moe": "glm45",
    "kimi_k2": "kimi_k2",
    "kimi_vl": "kimi",
    "minimax": "minimax",
    "minimax_m1": "minimax",
    "minimax_m2": "minimax",
    "step3": "step3",
    "step3_vl": "step3",
    "nemotron_h": "nemotron_3",
    "interns1": "interns1",
    "gpt_oss": "gpt-oss",
}
_BY_ARCHITECTURE_PREFIX: dict[str, str] = {
    "Qwen3": "qwen3",
    "Glm4Moe": "glm45",
    "KimiK2": "kimi_k2",
    "MiniMax": "minimax",
    "Step3": "step3",
    "NemotronH": "nemotron_3",
    "InternS1": "interns1",
    "GptOss": "gpt-oss",
}


def parser_for_model(model_dir: str | Path) -> str | None:
    """Infer the SGLang reasoning parser for a model directory from its config.json.

    Uses ``model_type`` first, then ``architectures``; the directory name disambiguates DeepSeek
    R1 vs V3, Kimi K2 (DeepSeek V3 architecture), Qwen3 "Thinking" checkpoints and Magistral.
    Returns None when the family is unknown or has no reasoning format, or config.json is absent.

    Args:
        model_dir: the model directory (its config.json and its name are read).

    Raises:
        ValueError: config.json exists but is not a JSON object.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = read_json_object(path, "model config")
    name = Path(model_dir).resolve().name.lower()
    model_type = str(config.get("model_type") or "").lower()
    architectures = [str(a) for a in config.get("architectures") or []]

    parser = _BY_MODEL_TYPE.get(model_type)
    if parser is None:
        for arch in architectures:
            parser = next((p for pre, p in _BY_ARCHITECTURE_PREFIX.items() if arch.startswith(pre)), None)
            if parser is not None:
                break
    if parser is None and model_type in ("deepseek_v3", "deepseek_v2"):
        if "kimi" in name:
            parser = "kimi_k2"
        elif "r1" in name.replace("-", "_").split("_"):
            parser = "deepseek-r1"
    if parser is None and model_type in ("mistral", "mistral3") and "magistral" in name:
        parser = "mistral"
    if parser == "qwen3" and "thinking" in name:
        parser = "qwen3-thinking"
    return parser
