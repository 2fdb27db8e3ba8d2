"""Journal records of tasks.inference: generated rows, rejects, and the reasoning split.

``RowBuilder`` holds what every row of one run shares (dataset, parser, model, sampling, server) and
turns an input row into a prompt, a server answer into a journal row, and a failure into a reject
record. Journal records carry private ``_pos``/``_attempts``/``_reject`` keys that the committed
shard drops (``public_reject``). Nothing here does I/O.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from tasks.inference._client import GenerateResult
from tasks.prompts import opens_think, render_row
from tasks.reasoning import split_reasoning

__all__ = ["RowBuilder", "public_reject"]


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
                  res: GenerateResult) -> dict[str, Any]:
        """The journal record of a finished generation of input row ``row`` at input position ``pos``."""
        reasoning, content = self.split(res.text, think_in_prompt)
        return {
            "id": row.id,
            "dataset": self.dataset,
            "messages": row.messages,
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
            "_pos": pos,
            "_attempts": res.attempts,
        }

    def reject(self, pos: int, line: int, reason: str, raw: str, row_id: str | None = None,
               status: int | None = None) -> dict[str, Any]:
        """The journal record of an input record that yields no row (``_reject`` marks it)."""
        rec: dict[str, Any] = {"_reject": True, "_pos": pos, "dataset": self.dataset, "line": line,
                               "reason": reason, "raw": raw}
        if row_id is not None:
            rec["id"] = row_id
        if status is not None:
            rec["status"] = status
        return rec

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
