"""gpt-oss (Harmony format) reasoning split, matching SGLang's one-shot ``GptOssDetector`` parse.

The ``analysis`` channel is reasoning; ``final`` and tool calls (``commentary ... to=``, raw markers
kept) are content. Text without ``<|channel|>``/``<|start|>`` falls back to SGLang's text rules
(special tokens stripped), then to ``<|end|>`` alone. SGLang's quirks are kept on purpose, because
``/separate_reasoning`` has them: plain text with no marker yields empty reasoning and content, and a
trailing fragment that could begin a marker (``<|en``) is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["parse_harmony"]

_LITERALS: dict[str, str] = {
    "<|start|>": "START",
    "<|channel|>": "CHANNEL",
    "<|message|>": "MESSAGE",
    "<|constrain|>": "CONSTRAIN",
    "<|end|>": "END",
    "<|call|>": "CALL",
    "<|return|>": "RETURN",
}
_GUARDS = list(_LITERALS)
_SYSTEM_KEYWORDS = ("assistant", "user", "system")


@dataclass
class _Event:
    kind: str  # reasoning | normal | tool_call
    content: str
    raw: str | None = None


@dataclass
class _Tok:
    kind: str
    start: int
    end: int


class _State(Enum):
    IDLE = 0
    ANALYSIS = 1
    COMMENTARY = 2
    JSON = 3
    FINAL = 4


def _prefix_hold(text: str, tokens: list[str]) -> tuple[str, str]:
    """Split off the longest suffix of ``text`` that could be the beginning of one of ``tokens``."""
    hold = 0
    for tok in tokens:
        for k in range(min(len(tok) - 1, len(text)), 0, -1):
            if tok.startswith(text[-k:]):
                hold = max(hold, k)
                break
    return (text, "") if hold == 0 else (text[:-hold], text[-hold:])


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos, unknown = 0, False
    while pos < len(text):
        at = text.find("<|", pos)
        if at < 0:
            break
        if at > pos:
            out.append(_Tok("TEXT", pos, at))
        literal = next((lit for lit in _LITERALS if text.startswith(lit, at)), None)
        if literal is not None:
            out.append(_Tok(_LITERALS[literal], at, at + len(literal)))
            pos = at + len(literal)
            continue
        if any(lit.startswith(text[at:]) for lit in _LITERALS):
            out.append(_Tok("TEXT", at, len(text)))  # a partial marker at the very end
            pos = len(text)
            break
        unknown = True
        out.append(_Tok("TEXT", at, at + 2))
        close = text.find("|>", at + 2)
        if close < 0:
            pos = at + 2
            continue
        nxt = text.find("<|", close + 2)
        stop = nxt if nxt >= 0 else len(text)
        out.append(_Tok("TEXT", at + 2, stop))
        pos = stop
        if nxt < 0:
            break
    if pos < len(text):
        out.append(_Tok("TEXT", pos, len(text)))
    elif unknown and any(text.endswith(lit) for lit in _LITERALS):
        out.append(_Tok("TEXT", pos, pos))
    return out


class _Machine:
    """The canonical-format state machine; state persists across the two one-shot calls."""

    def __init__(self) -> None:
        self.state = _State.IDLE
        self.buffer = ""
        self.tool_start = -1

    def parse(self, text: str) -> tuple[list[_Event], str]:
        toks = _tokens(text)
        if not toks:
            return [], ""
        events: list[_Event] = []
        pos, steps = 0, 0
        # A held token is revisited until this bound, as in SGLang; it yields nothing more.
        while pos < len(toks) and steps < 2 * len(toks):
            new, pos = self._step(toks, pos, text)
            events.extend(new)
            steps += 1
        return events, ("" if pos >= len(toks) else text[toks[pos].start :])

    def _tool_call(self, tok: _Tok, text: str) -> tuple[list[_Event], int]:
        raw = text[self.tool_start : tok.end] if self.tool_start >= 0 else text[: tok.end]
        event = _Event("tool_call", self.buffer.strip(), raw)
        self.buffer, self.tool_start, self.state = "", -1, _State.IDLE
        return [event], -1

    def _step(self, toks: list[_Tok], pos: int, text: str) -> tuple[list[_Event], int]:
        tok = toks[pos]
        if tok.kind == "TEXT":
            return self._text(toks, pos, text)
        kind, state = tok.kind, self.state
        if kind in ("START", "CHANNEL") and state is not _State.IDLE:
            # Implicit close: a new header ends the open block; buffered tool text is dropped.
            if state in (_State.COMMENTARY, _State.JSON):
                self.buffer = ""
            self.state = _State.IDLE
            return [], pos
        if state is _State.IDLE:
            return self._idle_marker(toks, pos, text)
        if state is _State.ANALYSIS:
            if kind == "END":
                self.state = _State.IDLE
            elif kind == "CONSTRAIN":
                self.state = _State.IDLE
                return [], pos
            elif kind == "CALL":
                return self._tool_call(tok, text)[0], pos + 1
            return [], pos + 1
        if state is _State.COMMENTARY:
            if kind == "CONSTRAIN":
                self.state = _State.JSON
                return [], pos + (2 if pos + 1 < len(toks) and toks[pos + 1].kind == "TEXT" else 1)
            if kind == "END":
                content = self.buffer.strip()
                self.buffer, self.state = "", _State.IDLE
                return ([_Event("normal", content)] if content else []), pos + 1
            if kind == "CALL":
                return self._tool_call(tok, text)[0], pos + 1
            return [], pos + 1
        if state is _State.JSON:
            if kind == "CALL":
                return self._tool_call(tok, text)[0], pos + 1
            return [], pos + 1
        # FINAL
        if kind in ("RETURN", "END"):
            self.state = _State.IDLE
            if kind == "RETURN" and pos + 1 < len(toks) and toks[pos + 1].kind == "TEXT":
                nxt = toks[pos + 1]
                return [_Event("normal", text[nxt.start : nxt.end])], pos + 2
        return [], pos + 1

    def _idle_marker(self, toks: list[_Tok], pos: int, text: str) -> tuple[list[_Event], int]:
        tok = toks[pos]
        if tok.kind in ("CHANNEL", "START") and pos + 1 >= len(toks):
            return [], pos  # header cut off at the end: held
        nxt = toks[pos + 1] if pos + 1 < len(toks) else None
        if tok.kind == "CHANNEL" and nxt is not None and nxt.kind == "TEXT":
            channel = text[nxt.start : nxt.end].strip()
            parts = channel.split()
            base = parts[0].lower() if parts else ""
            if base not in ("analysis", "commentary", "final"):
                return [], self._skip_past(toks, pos, "END")
            if " to=" in channel:
                self.state, self.tool_start = _State.COMMENTARY, tok.start
                return [], pos + 2
            self.state = {"analysis": _State.ANALYSIS, "commentary": _State.COMMENTARY}.get(
                base, _State.FINAL
            )
            return [], self._skip_past(toks, pos, "MESSAGE")
        if tok.kind == "START" and nxt is not None and nxt.kind == "TEXT":
            header = text[nxt.start : nxt.end].strip()
            if " to=" in header and "(" not in header and not header.lower().startswith(_SYSTEM_KEYWORDS):
                return [], pos + 2  # a tool response header
        return [], pos + 1

    @staticmethod
    def _skip_past(toks: list[_Tok], pos: int, kind: str) -> int:
        for i in range(pos + 1, len(toks)):
            if toks[i].kind == kind:
                return i + 1
        return len(toks)

    def _text(self, toks: list[_Tok], pos: int, text: str) -> tuple[list[_Event], int]:
        tok = toks[pos]
        chunk = text[tok.start : tok.end]
        state = self.state
        if state is _State.ANALYSIS:
            return [_Event("reasoning", chunk)], pos + 1
        if state is _State.FINAL:
            return [_Event("normal", chunk)], pos + 1
        if state in (_State.COMMENTARY, _State.JSON):
            self.buffer += chunk
            return [], pos + 1
        stripped = chunk.strip()
        if pos > 0 and toks[pos - 1].kind == "START" and stripped.lower() in _SYSTEM_KEYWORDS:
            return [], pos + 1
        if pos == len(toks) - 1:
            emit, _ = _prefix_hold(chunk, _GUARDS)
            return ([_Event("normal", emit)], pos + 1) if emit else ([], pos)
        if (
            pos > 0
            and toks[pos - 1].kind == "CALL"
            and toks[pos + 1].kind == "CHANNEL"
            and stripped.lower() == "commentary"
        ):
            return [], pos + 1  # filler between a tool call and the next block
        if stripped in _GUARDS:
            return [], pos + 1
        return [_Event("normal", chunk)], pos + 1


_ANALYSIS_THEN_FINAL = re.compile(
    r"^\s*(?:assistant)?\s*(analysis|commentary)(.*?)\s*assistantfinal\s*(.*)\s*$", re.I | re.S
)
_FINAL_ONLY = re.compile(r"^\s*assistantfinal\s*(.*)\s*$", re.I | re.S)
_ANALYSIS_ONLY = re.compile(r"^\s*(?:assistant)?\s*(analysis|commentary)(.*)\s*$", re.I | re.S)
_TEXT_FORMAT = re.compile(r"(?:^|\s)(?:assistant)?\s*(analysis|commentary|assistantfinal)", re.I)


def _text_format(text: str) -> tuple[list[_Event], str]:
    """The fallback for output whose special tokens were stripped (``skip_special_tokens``)."""
    m = _ANALYSIS_THEN_FINAL.match(text)
    if m:
        channel, middle, final = m.groups()
        events: list[_Event] = []
        if middle.strip():
            kind = "reasoning" if channel.lower() == "analysis" else "normal"
            events.append(_Event(kind, middle.strip()))
        if final.strip():
            events.append(_Event("normal", final.strip()))
        return events, ""
    low = text.lower()
    if re.search(r"(?:^|\s)(?:assistant)?\s*(analysis|commentary)", text, re.I):
        if "assistantfin" in low and "assistantfinal" not in low:
            return [], text
    m = _FINAL_ONLY.match(text)
    if m:
        return ([_Event("normal", m.group(1).strip())] if m.group(1).strip() else []), ""
    m = _ANALYSIS_ONLY.match(text)
    if m:
        channel, body = m.groups()
        emit, hold = _prefix_hold(body, ["assistantfinal"])
        if emit and channel.lower() == "analysis":
            return [_Event("reasoning", emit)], (text[: m.start(2)] + hold if hold else channel)
        if emit:
            return [_Event("normal", emit if hold else emit.strip())], (text[: m.start(2)] + hold if hold else "")
        return [], text[: m.start(2)] + hold
    emit, hold = _prefix_hold(text, ["analysis", "commentary", "assistantfinal"])
    return ([_Event("normal", emit)] if emit else []), hold


class _HarmonyParser:
    def __init__(self) -> None:
        self.strategy: str | None = None
        self.machine = _Machine()
        self.buffer = ""
        self.end_seen = False
        self.emitted: list[_Event] = []
        self.partial_commentary = ""

    def parse(self, chunk: str) -> list[_Event]:
        self.buffer += chunk
        buf = self.buffer
        if self.strategy is None:
            if "<|channel|>" in buf or "<|start|>" in buf:
                self.strategy = "canonical"
            elif _TEXT_FORMAT.search(buf):
                self.strategy = "text"
            elif "<|end|>" in buf:
                self.strategy = "end_only"
            else:
                return []
        if self.strategy == "canonical":
            events, remaining = self.machine.parse(buf)
        elif self.strategy == "text":
            events, remaining = _text_format(buf)
        else:
            events, remaining = self._end_only(buf)
        self.buffer = remaining
        history = list(self.emitted)
        kept = [e for e in events if not self._filtered(e, history)]
        self.emitted.extend(kept)
        return kept

    def _end_only(self, buf: str) -> tuple[list[_Event], str]:
        if self.end_seen:
            return ([_Event("normal", buf)] if buf else []), ""
        if "<|end|>" not in buf:
            return [], buf
        self.end_seen = True
        reasoning, normal = buf.split("<|end|>", 1)
        events = [_Event("reasoning", reasoning)] if reasoning else []
        return events + ([_Event("normal", normal)] if normal else []), ""

    def _filtered(self, event: _Event, history: list[_Event]) -> bool:
        # After a tool call, a stray "commentary" channel name may leak as text; SGLang drops it.
        if event.kind == "tool_call":
            self.partial_commentary = ""
        if event.kind != "normal":
            return False
        filtering = False
        for past in reversed(history[-5:]):
            if past.kind == "tool_call" or (past.kind == "normal" and "<|call|>" in past.content):
                filtering = True
                break
            if past.content.strip():
                break
        if not filtering and not self.partial_commentary:
            return False
        candidate = self.partial_commentary + event.content.strip().lower()
        if candidate == "commentary":
            self.partial_commentary = ""
            return True
        if "commentary".startswith(candidate):
            self.partial_commentary = candidate
            return True
        self.partial_commentary = ""
        return False


def parse_harmony(text: str) -> tuple[str | None, str]:
    """One-shot split of gpt-oss output: ``(reasoning or None, content)``.

    ``reasoning`` is None when no analysis (reasoning) part was found.
    """
    parser = _HarmonyParser()
    events = parser.parse(text) + parser.parse("")
    reasoning = [e.content for e in events if e.kind == "reasoning"]
    content = "".join(
        (e.raw or e.content) if e.kind == "tool_call" else e.content for e in events if e.kind != "reasoning"
    )
    return ("".join(reasoning) if reasoning else None), content
