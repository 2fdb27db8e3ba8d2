"""Input datasets (streamed, with stable ids and rejects) and prompt rendering with the model's chat
template (sandboxed jinja2, set up the way transformers does). The row format is in docs/output.md, "Input".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tasks.errors import DatagenError
from tasks.files import read_json_object
from tasks.reasoning import tags_for

__all__ = [
    "ChatTemplate",
    "InputRow",
    "Reject",
    "TemplateError",
    "check_input",
    "input_fingerprint",
    "iter_dataset",
    "opens_think",
    "render_row",
]

# Which assistant turns a run generates: "last", the conversation's last; "all", every one, each from
# the model's own earlier turns (declared here, beside the conversations, so that the configuration
# checks it without importing the inference client).
REGENERATE_MODES = ("last", "all")

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
RAW_LIMIT_CHARS = 10_000  # a reject keeps at most this much of the offending row
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True, slots=True)
class InputRow:
    """One usable input row: the conversation to send (final assistant turn dropped)."""

    id: str
    dataset: str
    line: int  # 1-based line (JSONL) or row number (Parquet)
    messages: list[dict[str, str]] = field(hash=False)
    prompt: str | None = None  # pre-rendered prompt text, when the input has one
    # the input record as read (at most RAW_LIMIT_CHARS): what a reject of this row keeps
    raw: str = field(default="", hash=False, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Reject:
    """An input row that cannot be used, with the reason; written to ``_rejects/<dataset>.jsonl``."""

    dataset: str
    line: int
    reason: str
    raw: str

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "line": self.line, "reason": self.reason, "raw": self.raw}


class TemplateError(DatagenError, ValueError):
    """The chat template is missing, invalid, or failed to render (names the model dir and row)."""


class _BadRow(Exception):
    pass


def input_fingerprint(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Streaming sha256 (hex) of the input file's bytes.

    Args:
        path: the input file.
        chunk_bytes: read size.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def derive_id(dataset: str, messages: Sequence[Mapping[str, str]], prompt: str | None) -> str:
    """The stable id of a row without one: ``sha256(dataset, canonical messages, prompt)[:16]``.

    Canonical JSON (sorted keys, no spaces, UTF-8) makes it the same across runs and machines; two
    identical prompts in one dataset get one id, and the second is rejected as a duplicate.
    """
    canonical = json.dumps(list(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = f"{dataset}\n{canonical}\n{prompt or ''}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def iter_dataset(path: str | Path, dataset: str) -> Iterator[InputRow | Reject]:
    """Stream the rows of a JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) dataset.

    Yields an :class:`InputRow` per usable row and a :class:`Reject` (1-based line or row number,
    reason, raw text) per bad one, in input order; a bad row never stops the iteration. Blank JSONL
    lines are skipped. A final assistant turn is dropped (it is what the run regenerates); earlier
    turns stay as context.

    Args:
        path: the dataset file; never loaded whole (JSONL by line, Parquet by record batch).
        dataset: the dataset name, part of derived ids and of every reject.

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: the file extension is not a supported format, or the Parquet file is invalid.
    """
    path = Path(path)
    seen: set[str] = set()
    for line, obj, raw in _iter_objects(path, dataset):
        if isinstance(obj, Reject):
            yield obj
            continue
        try:
            row = _parse_row(obj, dataset, line, raw[:RAW_LIMIT_CHARS])
        except _BadRow as exc:
            yield Reject(dataset, line, str(exc), raw[:RAW_LIMIT_CHARS])
            continue
        if row.id in seen:
            yield Reject(dataset, line, f"duplicate id {row.id!r}", raw[:RAW_LIMIT_CHARS])
            continue
        seen.add(row.id)
        yield row


_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def check_input(path: str | Path) -> None:
    """Check that ``path`` is a dataset ``iter_dataset`` can read, without reading its rows: a file
    (not a directory) with a supported suffix that can be opened, and for Parquet a valid footer.

    Args:
        path: the dataset file (it exists).

    Raises:
        ValueError: a directory, an unsupported suffix, or not a Parquet file; the message says
            what is wrong (not the path).
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError("is a directory; give a dataset file (.jsonl or .parquet)")
    name = path.name.lower()
    if name.endswith(".parquet"):
        try:
            pq.ParquetFile(path).close()
        except pa.ArrowInvalid as exc:
            raise ValueError(f"not a readable Parquet file: {exc}") from exc
    elif name.endswith(_JSONL_SUFFIXES):
        with open(path, "rb") as fh:
            fh.read(1)
    else:
        raise ValueError("unsupported dataset format (expected .jsonl, .json, .ndjson or .parquet)")


def _iter_objects(path: Path, dataset: str) -> Iterator[tuple[int, Any, str]]:
    suffix = path.name.lower()
    if suffix.endswith(".parquet"):
        yield from _iter_parquet(path)
    elif suffix.endswith(_JSONL_SUFFIXES):
        yield from _iter_jsonl(path, dataset)
    else:
        raise ValueError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")


def _iter_jsonl(path: Path, dataset: str) -> Iterator[tuple[int, Any, str]]:
    with open(path, "rb") as fh:
        for line, data in enumerate(fh, start=1):
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raw = data.decode("utf-8", "replace")[:RAW_LIMIT_CHARS]
                yield line, Reject(dataset, line, f"invalid UTF-8: {exc}", raw), raw
                continue
            if line == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark that editors on Windows write
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raw = text.rstrip("\r\n")[:RAW_LIMIT_CHARS]
                yield line, Reject(dataset, line, f"unparseable JSON: {exc}", raw), raw
                continue
            lone = _lone_surrogate(obj) if "\\u" in text else None
            if lone is not None:  # valid JSON, but no UTF-8 text: it could never be sent or stored
                raw = text.rstrip("\r\n")[:RAW_LIMIT_CHARS]
                yield line, Reject(dataset, line, f"a string holds the lone surrogate \\u{ord(lone):04x} (an escape "
                                   "of half a UTF-16 pair, not a character): fix the line", raw), raw
                continue
            yield line, obj, text.rstrip("\r\n")


def _lone_surrogate(obj: Any) -> str | None:
    """The first lone surrogate in any string (key or value) of ``obj``, None when there is none:
    ``json.loads`` accepts ``"\\ud800"``, but no UTF-8 encoder (the request's, Parquet's) does."""
    try:
        orjson.dumps(obj)
        return None
    except (orjson.JSONEncodeError, TypeError):
        pass
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            for ch in item:
                if "\ud800" <= ch <= "\udfff":
                    return ch
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any, str]]:
    try:
        pf = pq.ParquetFile(path)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{path}: not a readable Parquet file: {exc}") from exc
    line = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for obj in batch.to_pylist():
            line += 1
            yield line, obj, json.dumps(obj, ensure_ascii=False, default=str)


def _parse_row(obj: Any, dataset: str, line: int, raw: str) -> InputRow:
    if not isinstance(obj, dict):
        raise _BadRow(f"row is not an object (got {type(obj).__name__})")
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise _BadRow("prompt is not a non-empty string")
    if obj.get("messages") is not None:
        messages = _parse_turns(obj["messages"], "messages", "role", "content", None)
    elif obj.get("conversations") is not None:
        messages = _parse_turns(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    elif prompt is not None:
        messages = []
    else:
        raise _BadRow("no messages, conversations or prompt")
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]  # the response is what we regenerate
    if prompt is None and not any(m["role"] == "user" for m in messages):
        raise _BadRow("no user turn")
    row_id = obj.get("id")
    if row_id is None or row_id == "":
        row_id = derive_id(dataset, messages, prompt)
    elif isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise _BadRow(f"id must be a string or integer (got {type(row_id).__name__})")
    return InputRow(str(row_id), dataset, line, messages, prompt, raw)


def _parse_turns(
    turns: Any, key: str, role_key: str, content_key: str, role_map: Mapping[str, str] | None
) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise _BadRow(f"{key} is not a list")
    out: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRow(f"{key}[{i}] is not an object")
        role = turn.get(role_key)
        mapped = (role_map.get(role) if isinstance(role, str) else None) if role_map else role
        if not isinstance(mapped, str) or mapped not in ROLES:
            raise _BadRow(f"unknown role {role!r} in {key}[{i}]")
        content = _text_of(turn.get(content_key))
        if content is None:
            raise _BadRow(f"{key}[{i}].{content_key} is not a string")
        if not content.strip():
            raise _BadRow(f"empty content in {key}[{i}]")
        out.append({"role": mapped, "content": content})
    if not out:
        raise _BadRow(f"{key} is empty")
    return out


def _text_of(content: Any) -> str | None:
    # OpenAI-style content parts: keep the text parts, in order.
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = [p.get("text") for p in content if p.get("type") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    return None


# --- chat template -------------------------------------------------------------------------------


class _GenerationTag(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` marks assistant text; it renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)  # type: ignore[no-any-return]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Like transformers: no HTML escaping (Jinja's own tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A model's chat template, compiled once; ``render`` is the ``apply_chat_template`` text."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        origin: str = "<chat template>",
    ) -> None:
        """Compile ``source``.

        Raises:
            TemplateError: the template does not compile (names ``origin``).
        """
        self.source = source
        self.origin = origin
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{origin}: chat template does not compile: {exc} (line {exc.lineno})") from exc
        # The template's globals are a ChainMap over the environment's, which jinja2 iterates twice per
        # render (a quarter of a short row's render time); nothing adds globals after this point.
        self._template.globals = dict(self._template.globals)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, name: str = "default") -> ChatTemplate:
        """Load the chat template of a model directory.

        Looks at tokenizer_config.json ``chat_template`` (a string, or a list of named templates of
        which ``name`` is used), then chat_template.jinja, then chat_template.json.

        Args:
            model_dir: the model directory.
            name: which template to use when tokenizer_config.json holds several.

        Raises:
            TemplateError: no template, unreadable files, no template called ``name``, or it does not compile.
        """
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        tok_path = model_dir / "tokenizer_config.json"
        if tok_path.is_file():
            config = _read_json(tok_path)
        source: Any = config.get("chat_template")
        if source is None and (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        if source is None and (model_dir / "chat_template.json").is_file():
            source = _read_json(model_dir / "chat_template.json").get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if name not in named:
                raise TemplateError(
                    f"{model_dir}: no chat template named {name!r} (has: {', '.join(map(str, named))})"
                )
            source = named[name]
        if not isinstance(source, str) or not source:
            raise TemplateError(f"{model_dir}: no chat template (tokenizer_config.json chat_template)")
        return cls(
            source,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            origin=str(model_dir),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        row: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` into the prompt text.

        Args:
            messages: the conversation, ``{"role", "content"}`` dicts.
            add_generation_prompt: end with the assistant header, as for generation.
            row: names the input row in an error message.
            kwargs: template variables (``enable_thinking``, ...).

        Raises:
            TemplateError: the template raised or failed (names the model dir and ``row``).
        """
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
            )
        except Exception as exc:  # a template can fail in any way (TypeError, UndefinedError...)
            where = f" (row {row})" if row is not None else ""
            raise TemplateError(f"{self.origin}: chat template failed{where}: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except ValueError as exc:
        raise TemplateError(str(exc)) from exc


def render_row(row: InputRow, template: ChatTemplate, **template_kwargs: Any) -> str:
    """The exact prompt text for ``row``: its pre-rendered ``prompt``, else the rendered messages.

    Args:
        row: a parsed input row.
        template: the model's chat template.
        template_kwargs: template variables (``enable_thinking``, ...).

    Raises:
        TemplateError: rendering failed (names the model dir and the row's dataset, line and id).
    """
    if row.prompt is not None:
        return row.prompt
    return template.render(row.messages, row=f"{row.dataset}:{row.line} id={row.id}", **template_kwargs)


def opens_think(prompt: str, parser: str) -> bool:
    """Whether the rendered prompt already opened the think block (ends with the start tag).

    Use the result as ``force_reasoning`` for :func:`tasks.reasoning.split_reasoning`.

    Args:
        prompt: the exact prompt text sent.
        parser: the reasoning parser whose start tag counts.

    Raises:
        ValueError: unknown parser.
    """
    start, _ = tags_for(parser)
    return prompt.rstrip().endswith(start)
