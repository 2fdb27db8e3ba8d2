"""Journal records of tasks.inference: generated rows, turns, rejects, and the reasoning split.

``RowBuilder`` holds what every row of one run shares (dataset, parser, model, sampling, server,
provenance) and turns an input row into a prompt, a server answer into a journal row (or, for a
conversation regenerated turn by turn, a turn record), and a failure into a reject record. Journal
records carry private ``_pos``/``_attempts``/``_reject``/``_turn`` keys that the committed shard drops
(``public_reject``). A row's ``sampling_seed`` is derived from the base seed and its ``(id, sample)``
(``derive_seed``). Nothing here does I/O.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tasks.inference._client import GenerateResult
from tasks.inference._provenance import Provenance
from tasks.prompts import opens_think, render_row
from tasks.reasoning import split_reasoning

__all__ = ["RowBuilder", "TURN_KEYS", "conversation_slots", "derive_seed", "public_reject", "request_id"]

# The keys of a turn record that the row's `turns` column keeps (tasks.schema.TURN_TYPE).
TURN_KEYS = ("message_index", "raw", "reasoning", "content", "finish_reason", "prompt_tokens",
             "completion_tokens", "latency_s")


@functools.lru_cache(maxsize=8192)  # asked for a row's request and again for its record
def derive_seed(base: int, row_id: str, sample: int) -> int:
    """The ``sampling_seed`` of sample ``sample`` of row ``row_id``: 63 bits of
    ``sha256(base, id, sample)``, the same on every machine and run (within SGLang's int64 range)."""
    digest = hashlib.sha256(f"{base}\x00{row_id}\x00{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def request_id(row_id: str, sample: int, turn: int = 0, run_tag: str = "") -> str:
    """The request's ``rid``: the row id for sample 0's only turn, else tagged with the sample and
    turn, then ``@<run_tag>`` when given. SGLang refuses a rid that is already in flight ("Duplicate
    request ID"), so two runs of the same ids against one shared server need the run's tag."""
    return row_id + (f"#s{sample}" if sample else "") + (f"#t{turn}" if turn else "") + (
        f"@{run_tag}" if run_tag else "")


def conversation_slots(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Where a whole conversation is generated: the index of each assistant message that follows a
    user message, then the end.

    Turn ``t`` is generated from ``messages[:slots[t]]`` (earlier assistant turns replaced by the
    model's own) and replaces ``messages[slots[t]]``; the last turn answers the whole conversation.
    An assistant message before the first user message is context, kept as it is.
    """
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first_user] + [len(messages)]


@dataclass(frozen=True)
class RowBuilder:
    """What the rows of one run share; builds their journal records."""

    dataset: str
    parser: str | None
    model_name: str
    sampling_json: str
    server_fingerprint: str
    template: Any  # tasks.prompts.ChatTemplate | None
    template_kwargs: Mapping[str, Any]
    provenance: Provenance
    truncation_json: str | None = None  # the rows' truncation_policy column
    base_seed: int = 0

    def seed(self, row_id: str, sample: int) -> int:
        """The row's ``sampling_seed`` (``derive_seed`` of the run's base seed)."""
        return derive_seed(self.base_seed, row_id, sample)

    @staticmethod
    def sampling_text(sampling: Mapping[str, Any]) -> str:
        """The row's ``sampling`` column: the sampling params as sorted-key JSON."""
        return orjson.dumps(dict(sampling), option=orjson.OPT_SORT_KEYS).decode()

    def prompt_for(self, item: Any) -> tuple[str | None, str]:
        """``(prompt, "")`` for an input row (``tasks.prompts.InputRow``), or ``(None, reason)``
        when it has no pre-rendered prompt and the chat template is missing or fails on it."""
        try:
            prompt = render_row(item, self.template, **self.template_kwargs) if (
                item.prompt is None and self.template is not None) else item.prompt
        except ValueError as exc:  # TemplateError
            return None, f"chat template failed: {exc}"
        if prompt is None:
            return None, "no prompt and no chat template (model dir unknown)"
        return prompt, ""

    def render(self, item: Any, messages: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
        """``(prompt, "")`` for ``messages`` of input row ``item`` (a turn of its conversation), or
        ``(None, reason)`` when the chat template is missing or fails on them."""
        if self.template is None:
            return None, "no prompt and no chat template (model dir unknown)"
        try:
            return self.template.render(messages, row=f"{item.dataset}:{item.line} id={item.id}",
                                        **self.template_kwargs), ""
        except ValueError as exc:  # TemplateError
            return None, f"chat template failed: {exc}"

    def opens_think(self, prompt: str) -> bool:
        """Whether the rendered prompt already opened the parser's think block."""
        if not self.parser:
            return False
        return opens_think(prompt, self.parser)

    def split(self, text: str, think_in_prompt: bool) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a generation; ``(None, text)`` without a parser."""
        if not self.parser:
            return None, text
        # None keeps the parser's own default (deepseek-r1 is always forced); True forces it.
        return split_reasoning(text, self.parser, force_reasoning=True if think_in_prompt else None)

    def generated(self, row: Any, pos: int, prompt: str, think_in_prompt: bool,
                  res: GenerateResult, truncation_retries: int = 0, *, sample: int = 0,
                  messages: list[dict[str, str]] | None = None,
                  turns: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The journal record of a finished generation of input row ``row`` at input position ``pos``.

        Args:
            truncation_retries: the generations before it that finished by length.
            sample: the row's sample of the prompt.
            messages: the conversation ``prompt`` was rendered from (default: the input's).
            turns: the earlier turns of a conversation regenerated whole (``turn`` records); None:
                only the last turn was generated.
        """
        reasoning, content = self.split(res.text, think_in_prompt)
        return {
            "id": row.id,
            "dataset": self.dataset,
            "messages": row.messages if messages is None else messages,
            "prompt": prompt,
            "raw": res.text,
            "reasoning": reasoning,
            "content": content,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "model": self.model_name,
            "sampling": self.sampling_json,
            "server": self.server_fingerprint,
            "reasoning_parser": self.parser,
            "think_in_prompt": think_in_prompt,
            "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"),
            "latency_s": res.latency_s,
            "max_new_tokens": res.max_new_tokens,
            "budget_capped": res.capped,
            "truncation_retries": truncation_retries,
            "truncation_policy": self.truncation_json,
            # a row without a pre-rendered prompt was rendered by the chat template
            **self.provenance.columns(templated=row.prompt is None),
            "sample": sample,
            "sampling_seed": self.seed(row.id, sample),
            "turns": None if turns is None else [{k: t[k] for k in TURN_KEYS} for t in turns],
            "_pos": pos,
            "_attempts": res.attempts,
        }

    def turn(self, row: Any, pos: int, sample: int, index: int, message_index: int, think_in_prompt: bool,
             res: GenerateResult) -> dict[str, Any]:
        """The journal record of turn ``index`` (not the last) of a conversation regenerated whole,
        which replaced ``messages[message_index]``."""
        reasoning, content = self.split(res.text, think_in_prompt)
        return {"_turn": index, "_pos": pos, "id": row.id, "sample": sample, "message_index": message_index,
                "raw": res.text, "reasoning": reasoning, "content": content, "finish_reason": res.finish_reason,
                "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                "latency_s": res.latency_s, "reasoning_parser": self.parser}

    def reject(self, pos: int, line: int, reason: str, raw: str, row_id: str | None = None,
               status: int | None = None, sample: int | None = None) -> dict[str, Any]:
        """The journal record of an input record that yields no row (``_reject`` marks it); with
        ``sample``, of that sample only (e.g. its conversation outgrew the context)."""
        rec: dict[str, Any] = {"_reject": True, "_pos": pos, "dataset": self.dataset, "line": line,
                               "reason": reason, "raw": raw}
        if row_id is not None:
            rec["id"] = row_id
        if sample is not None:
            rec["sample"] = sample
        if status is not None:
            rec["status"] = status
        return rec

    @staticmethod
    def with_budget(row: dict[str, Any]) -> dict[str, Any]:
        """A journal row of an older datagen, without the budget columns, with them filled in as
        that version generated it: the sampling's ``max_new_tokens``, never capped (an overflow was
        rejected), never regenerated."""
        if "budget_capped" in row:
            return row
        sent = orjson.loads(row["sampling"]).get("max_new_tokens")
        return {**row, "max_new_tokens": sent if isinstance(sent, int) else None, "budget_capped": False,
                "truncation_retries": 0, "truncation_policy": None}

    def with_current_split(self, row: dict[str, Any]) -> dict[str, Any]:
        """A journal row split with another parser (a rerun with a fixed ``--reasoning-parser``)
        split again from its raw text, as `datagen resplit` does for committed shards: the raw text
        does not depend on the parser, so the row need not be generated again."""
        if row.get("reasoning_parser") == self.parser:
            return row
        think_in_prompt = self.opens_think(str(row["prompt"]))
        reasoning, content = self.split(str(row["raw"]), think_in_prompt)
        return {**row, "reasoning": reasoning, "content": content, "reasoning_parser": self.parser,
                "think_in_prompt": think_in_prompt}


def public_reject(rec: dict[str, Any]) -> dict[str, Any]:
    """A journaled reject as the output's reject file holds it (private ``_`` keys dropped)."""
    return {k: v for k, v in rec.items() if not k.startswith("_")}
