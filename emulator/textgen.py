"""Deterministic output text in the model family's reasoning format, and the emulator's toy tokenizer.

Outputs are built token by token in the tokenizer's own form, so ``completion_tokens ==
count_tokens(text)`` for every answer (docs/emulator.md, "Output text and tokenizer").
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

__all__ = [
    "TOKEN_RE",
    "ReasoningFormat",
    "Output",
    "count_tokens",
    "format_for_model",
    "generate",
    "skip_special_tokens",
    "FORCED_PARSERS",
    "PARSER_TAGS",
]

TOKEN_RE = re.compile(
    r"\s*(?:<\|[^|\s]{1,40}\|>|</?think>|◁/?think▷|\[/?THINK\]|\w+|[^\w\s])|\s+"
)


def count_tokens(text: str) -> int:
    """Number of tokens of ``text`` under the emulator's tokenizer."""
    return len(TOKEN_RE.findall(text))


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family writes reasoning. ``start``/``end`` empty: no reasoning."""

    start: str
    end: str
    content_prefix: str = "\n\n"
    content_suffix: str = ""


THINK = ReasoningFormat("<think>", "</think>")
KIMI = ReasoningFormat("◁think▷", "◁/think▷")
MISTRAL = ReasoningFormat("[THINK]", "[/THINK]")
GPT_OSS = ReasoningFormat(
    "<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>", "<|return|>"
)
PLAIN = ReasoningFormat("", "")

# parser name -> (start, end), as SGLang's reasoning_parser.py
PARSER_TAGS: dict[str, tuple[str, str]] = {
    **{n: ("<think>", "</think>") for n in (
        "deepseek-r1", "deepseek-v3", "qwen3", "qwen3-thinking", "glm45", "kimi_k2", "minimax",
        "step3", "nemotron_3", "interns1",
    )},
    "kimi": ("◁think▷", "◁/think▷"),
    "mistral": ("[THINK]", "[/THINK]"),
    "gpt-oss": ("<|channel|>analysis<|message|>", "<|end|>"),
}
FORCED_PARSERS = frozenset({"deepseek-r1", "qwen3-thinking", "minimax", "gpt-oss"})


def format_for_model(model_type: str, architecture: str = "") -> ReasoningFormat:
    """The reasoning format of a config's ``model_type`` (unknown families: no reasoning)."""
    mt = model_type.lower()
    if mt in ("kimi", "kimi_vl") or architecture.startswith("KimiVL"):
        return KIMI
    if mt.startswith("mistral") or mt in ("magistral", "ministral"):
        return MISTRAL
    if mt.startswith("gpt_oss") or mt == "gpt-oss":
        return GPT_OSS
    if mt.startswith(("qwen3", "deepseek", "glm", "kimi_k2", "minimax", "step3", "nemotron", "interns1")):
        return THINK
    return PLAIN


_WORDS = (
    "the model data token memory batch server prompt answer first second check value result "
    "reason step list time order case point line input output shard rank graph cache queue "
    "request number simple small large fast slow good clear right left part whole same other "
    "because so then also only still just more less each every some many few all any no"
).split()
_OPENERS = ("Okay", "First", "Let", "Hmm", "So", "Now", "Wait")
_CONTENT_OPENERS = ("The", "Here", "In", "This", "To", "Answer")


@dataclass(frozen=True)
class Output:
    """One generated answer: its token strings and the finish reason."""

    tokens: list[str]
    finish_reason: dict[str, object]
    extra: int = 0  # generated tokens trimmed from the text with a stop string

    @property
    def completion_tokens(self) -> int:
        """Tokens generated (a trimmed stop string's tokens count, as in SGLang)."""
        return len(self.tokens) + self.extra

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def _sentence_tokens(rng: random.Random, n: int, openers: tuple[str, ...], first_ws: str) -> list[str]:
    """``n`` tokens of sentences; the first token carries ``first_ws`` as its leading whitespace."""
    out: list[str] = []
    words = rng.choices(_WORDS, k=n)
    since = 0
    for i in range(n):
        if i == 0:
            out.append(first_ws + rng.choice(openers))
            since = 1
            continue
        if since >= 6 and rng.random() < 0.18 and i < n - 2:
            out.append(rng.choice((".", ",", ".")))
            since = 0
            continue
        out.append(" " + words[i])
        since += 1
    if n > 1 and out[-1] not in (".", ","):
        out[-1] = "."
    return out


def _seed(parts: tuple[object, ...]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def generate(
    prompt_key: str,
    fmt: ReasoningFormat,
    *,
    seed: int,
    mean_tokens: int,
    max_new_tokens: int,
    stop: list[str],
    eos_token_id: int,
    opened: bool = False,
    closed: bool = False,
    length_sigma: float = 0.0,
    ignore_eos: bool = False,
) -> Output:
    """The deterministic answer to ``prompt_key``.

    Args:
        prompt_key: the prompt plus sampling seed and sample index; the same key gives the same answer.
        fmt: the model family's reasoning format.
        seed: the emulator's ``--emu-seed``.
        mean_tokens: mean output length (uniform 0.5x..1.5x).
        max_new_tokens: cut here, anywhere, with finish ``length``.
        stop: stop strings; the text ends before the first one generated.
        eos_token_id: reported as the matched stop when the answer ends on its own.
        opened: the prompt ends with the start tag, so the output starts mid-reasoning.
        closed: the prompt holds an empty think block, so the output is content only.
        length_sigma: 0: lengths uniform in 0.5x..1.5x the mean; above 0: log-normal with this
            sigma and the same mean, a long tail of outputs as reasoning models write them.
        ignore_eos: SGLang's sampling parameter: the answer does not end on its own, it runs to
            ``max_new_tokens`` (finish ``length``; stop strings still end it).
    """
    rng = random.Random(_seed((prompt_key, seed)))
    if length_sigma > 0:
        # exp(N(mu, sigma)) has mean exp(mu + sigma^2 / 2): mu keeps the configured mean
        mu = math.log(max(1, mean_tokens)) - length_sigma ** 2 / 2
        total = max(4, int(math.exp(rng.gauss(mu, length_sigma))))
    else:
        total = max(4, int(mean_tokens * (0.5 + rng.random())))
    tokens: list[str] = []
    if fmt.start and not closed:
        n_reason = max(2, int(total * 0.6))
        if not opened:
            tokens += TOKEN_RE.findall(fmt.start)
        tokens += _sentence_tokens(rng, n_reason, _OPENERS, "\n" if fmt is not GPT_OSS else "")
        tokens += TOKEN_RE.findall(("\n" if fmt is not GPT_OSS else "") + fmt.end)
        if fmt is GPT_OSS:
            tokens += TOKEN_RE.findall(fmt.content_prefix)
            tokens += _sentence_tokens(rng, max(2, total - n_reason), _CONTENT_OPENERS, "")
        else:
            tokens += _sentence_tokens(rng, max(2, total - n_reason), _CONTENT_OPENERS, "\n\n")
        if fmt.content_suffix:
            tokens += TOKEN_RE.findall(fmt.content_suffix)
    else:
        tokens += _sentence_tokens(rng, total, _CONTENT_OPENERS, "")
    if ignore_eos and len(tokens) <= max_new_tokens < 1 << 20:
        tokens += _sentence_tokens(rng, max_new_tokens + 1 - len(tokens), _CONTENT_OPENERS, " ")
    finish: dict[str, object] = {"type": "stop", "matched": eos_token_id}
    if stop:
        text = "".join(tokens)
        best = -1
        matched = ""
        for s in stop:
            if not s:
                continue
            i = text.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, matched = i, s
        if best >= 0:
            end = best + len(matched)
            pos = 0
            kept = 0
            for tok in tokens:
                pos += len(tok)
                kept += 1
                if pos >= end:
                    break
            if kept <= max_new_tokens:
                # SGLang trims the stop string from the text but counts the tokens generated
                cut = text[:best]
                out_tokens = TOKEN_RE.findall(cut)
                pad = kept - len(out_tokens)
                return Output(out_tokens, {"type": "stop", "matched": matched}, max(0, pad))
    if len(tokens) > max_new_tokens:
        return Output(tokens[:max_new_tokens], {"type": "length", "length": max_new_tokens})
    return Output(tokens, finish)


_SPECIAL = re.compile(r"<\|[^|\s]{1,40}\|>")


def skip_special_tokens(out: Output) -> Output:
    """``out`` as SGLang's detokenizer returns it by default (``skip_special_tokens``): the special
    tokens (gpt-oss's Harmony markers, ``<|...|>``) generated but absent from the text."""
    kept = [tok for tok in (_SPECIAL.sub("", t) for t in out.tokens) if tok]
    return Output(kept, out.finish_reason, out.extra + len(out.tokens) - len(kept))
