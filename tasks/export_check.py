"""What a trainer sees of an export: its rows rendered with the target model's chat template.

SpecForge (and any SFT trainer that applies a chat template) trains on the text the template renders
for the assistant's turn, not on the JSON fields. A template that ignores ``reasoning_content`` (many
do: the tiny test model's, older Qwen2 and Llama templates) trains a drafter on the answers alone,
silently. ``check_template`` renders a sample of the exported records and reports the share of rows
with reasoning whose reasoning survives the rendering and the mean trained tokens per row (the text
after the prompt's rendering, counted with the model's ``tokenizer.json`` when the ``tokenizers``
package is installed, else estimated at 4 characters a token, and said so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.prompts import ChatTemplate, TemplateError

__all__ = ["SAMPLE_ROWS", "TemplateCheck", "check_template", "load_template", "token_counter"]

SAMPLE_ROWS = 200  # the first exported records rendered


@dataclass
class TemplateCheck:
    """The outcome over the rendered sample (``with_reasoning`` rows carried reasoning in their last turn)."""

    template: str
    counted: str  # "tokens" (the model's tokenizer) or "characters / 4" (an estimate)
    rows: int = 0
    with_reasoning: int = 0
    survived: int = 0
    trained: int = 0
    dropped_example: str | None = None

    @property
    def dropped(self) -> int:
        return self.with_reasoning - self.survived

    @property
    def share(self) -> float:
        return self.survived / self.with_reasoning if self.with_reasoning else 1.0

    @property
    def mean_trained(self) -> float:
        return self.trained / self.rows if self.rows else 0.0

    def line(self) -> str:
        unit = "tokens" if self.counted == "tokens" else "tokens (estimated: characters / 4; install `tokenizers` to count)"
        kept = (f"reasoning survives in {self.survived} of {self.with_reasoning} rows with reasoning ({self.share:.0%})"
                if self.with_reasoning else "no row with reasoning in the sample")
        return (f"template check ({self.template}, first {self.rows} rows): {kept}; mean trained "
                f"{self.mean_trained:,.0f} {unit} per row")

    def warning(self) -> str | None:
        """What to tell the user when the template drops reasoning, else None."""
        if not self.dropped:
            return None
        return (f"the chat template of {self.template} drops reasoning_content in {self.dropped} of "
                f"{self.with_reasoning} rows (e.g. id {self.dropped_example}): a drafter trained on this export "
                f"learns the answers only; train with a target whose template renders reasoning_content and one "
                f"of SpecForge's thinking --chat-template names (docs/output.md, 'Which SpecForge "
                f"--chat-template'), or check again with --tokenizer DIR of the target model")


def load_template(model_dir: str | Path) -> ChatTemplate:
    """The chat template of a model (or tokenizer) directory.

    Raises:
        TemplateError: there is none, or it does not compile (names the directory).
    """
    return ChatTemplate.from_model_dir(model_dir)


def token_counter(model_dir: str | Path) -> tuple[Callable[[str], int], str]:
    """A function counting the tokens of a text with the directory's ``tokenizer.json``, and what it
    counts: ``"tokens"``; without the ``tokenizers`` package or the file, characters / 4."""
    path = Path(model_dir) / "tokenizer.json"
    with contextlib.suppress(ImportError, OSError, Exception):
        import tokenizers  # noqa: PLC0415 (optional: only for exact counts)

        tok = tokenizers.Tokenizer.from_file(str(path))
        return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), "tokens"
    return (lambda text: (len(text) + 3) // 4), "characters / 4"


def _turns(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    turns = record.get("conversations") or record.get("messages") or []
    return [dict(t) for t in turns if isinstance(t, Mapping)]


def check_template(records: Iterable[Mapping[str, Any]], template: ChatTemplate, count: Callable[[str], int],
                   counted: str, *, sample: int = SAMPLE_ROWS) -> TemplateCheck:
    """Render the first ``sample`` records' conversations (``specforge`` or ``openai-messages`` export
    records) and judge what the last assistant turn trains on.

    The trained text is the full rendering less the rendering of the turns before it with the
    generation prompt (the part a trainer's loss mask covers); reasoning survives when its text (its
    first 200 characters, stripped) appears in that part.

    Raises:
        TemplateError: the template fails on a record (names it).
    """
    check = TemplateCheck(template=template.origin, counted=counted)
    for record in records:
        if check.rows >= sample:
            break
        turns = _turns(record)
        if not turns or turns[-1].get("role") != "assistant":
            continue
        row = str(record.get("id"))
        full = template.render(turns, add_generation_prompt=False, row=row)
        prompt = template.render(turns[:-1], add_generation_prompt=True, row=row)
        trained = full[len(prompt):] if full.startswith(prompt) else full
        check.rows += 1
        check.trained += count(trained)
        reasoning = (turns[-1].get("reasoning_content") or "").strip()
        if reasoning:
            check.with_reasoning += 1
            if reasoning[:200] in trained:
                check.survived += 1
            elif check.dropped_example is None:
                check.dropped_example = row
    return check


__all__ += ["TemplateError"]
