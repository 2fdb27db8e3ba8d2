"""tasks.export_check: an export's rows rendered with the target's chat template, as the trainer sees them."""

from __future__ import annotations

import pytest

from tasks.export_check import check_template, token_counter
from tasks.prompts import ChatTemplate
from tests.support.outputs import REASONING_TEMPLATE
from tests.support.paths import REPO_ROOT

# the common older way: content only
DROPS = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def _records(n: int, with_reasoning: int) -> list[dict]:
    out = []
    for i in range(n):
        answer = {"role": "assistant", "content": f"The answer is {i}."}
        if i < with_reasoning:
            answer["reasoning_content"] = f"Let me add {i} and nothing: it stays {i}."
        out.append({"id": f"r{i}", "conversations": [{"role": "user", "content": f"What is {i}?"}, answer]})
    return out


def _count(text: str) -> int:
    return len(text.split())


def test_a_template_that_renders_reasoning_keeps_it_and_one_that_ignores_it_is_reported() -> None:
    kept = check_template(_records(10, 8), ChatTemplate(REASONING_TEMPLATE, origin="keeps"), _count, "tokens")
    assert (kept.rows, kept.with_reasoning, kept.survived, kept.warning()) == (10, 8, 8, None)
    assert kept.line().startswith("template check (keeps, first 10 rows): reasoning survives in 8 of 8 rows with "
                                  "reasoning (100%); mean trained ")
    dropped = check_template(_records(10, 8), ChatTemplate(DROPS, origin="drops"), _count, "tokens")
    assert (dropped.with_reasoning, dropped.survived, dropped.dropped_example) == (8, 0, "r0")
    assert dropped.warning().startswith("the chat template of drops drops reasoning_content in 8 of 8 rows (e.g. id r0)")
    # what is trained on: the answer's turn only ("The answer is N.<|im_end|>"), never the prompt
    assert dropped.mean_trained == pytest.approx(4.0)
    assert kept.mean_trained > dropped.mean_trained


def test_the_sample_is_bounded_and_the_unit_is_said() -> None:
    check = check_template(_records(500, 500), ChatTemplate(REASONING_TEMPLATE, origin="keeps"), lambda t: (len(t) + 3) // 4,
                           "characters / 4", sample=200)
    assert check.rows == 200
    assert "tokens (estimated: characters / 4; install `tokenizers` to count) per row" in check.line()


def test_the_demo_model_template_drops_reasoning() -> None:
    demo = REPO_ROOT / "data/models/demo"
    count, counted = token_counter(demo)
    check = check_template(_records(4, 4), ChatTemplate.from_model_dir(demo), count, counted)
    assert check.survived == 0 and check.with_reasoning == 4
