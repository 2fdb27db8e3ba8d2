"""check_canary: the first rows of a run judged before any shard commits: the field reports' bugs
stop it, a normal start with a few odd rows does not."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.reasoning import split_reasoning
from tasks.shards import rows_to_table
from tasks.validation import ThresholdError, Thresholds, ValidationFailed, check_canary, validate_table
from tests.support.outputs import accept, make_row

N = 32



def _opened_think(parser: str | None) -> list[dict[str, Any]]:
    """Rows of a chat template that opens the think block, split with ``parser`` (not one that sees it)."""
    rows = []
    for i in range(N):
        row = make_row("prompts", i, parser=None, think_in_prompt=True)
        if parser is not None:
            row["reasoning"], row["content"] = split_reasoning(row["raw"], parser)
        row["reasoning_parser"] = parser
        row["think_in_prompt"] = False  # computed with the run's parser, which does not know <think>
        rows.append(row)
    return rows


def test_wrong_parser_stops_with_the_shard_gate_message_style() -> None:
    with pytest.raises(ValidationFailed) as info:
        check_canary(_opened_think("mistral"), "prompts", out_dir="/data/out")
    assert info.value.message == (
        "reasoning empty in 100% of 32 rows of the first rows of prompts (e.g. id prompts-000000): the prompt "
        "opens the think block (chat template) and the raw output uses the <think>…</think> format but parser "
        "is mistral; fix the reasoning parser (one of deepseek-r1, qwen3, qwen3-thinking; set by --reasoning-parser, the reasoning_parser flow parameter in the Prefect UI or [model] reasoning_parser in the partition), then run again "
        "(nothing of prompts was committed, so nothing needs re-splitting)" + accept("reasoning_missing_max_rate", 0.05)
        + " (also failing: tag_leak); stopped by the canary on the first rows "
        "([validation] canary_rows)"
    )
    assert info.value.report.rows == N


def test_no_parser_stops_on_the_leaked_tag() -> None:
    with pytest.raises(ValidationFailed) as info:
        check_canary(_opened_think(None), "prompts")
    assert info.value.message.startswith(
        "</think> left in content of 100% of 32 rows of the first rows of prompts (e.g. id prompts-000000): "
        "the model writes </think> but no reasoning parser is set; fix the reasoning parser (one of ")
    assert info.value.message.endswith("; stopped by the canary on the first rows ([validation] canary_rows)")


def test_a_good_start_with_some_short_and_odd_rows_is_not_stopped() -> None:
    rows = [make_row("prompts", i) for i in range(N)]
    for i in (3, 9, 14, 20, 27):  # short answers: the model wrote an empty think block
        rows[i] = make_row("prompts", i, raw="<think></think>\n\nFour.")
    for i in (5, 17, 30):  # a second think block: the tag stays in content
        rows[i] = make_row("prompts", i, raw="<think>a</think>b<think>c</think>The answer is 4.")
    checks = {c.name: c.status for c in check_canary(rows, "prompts")}
    assert checks == {"reasoning_present": "fail", "tag_leak": "fail", "empty_content": "pass"}
    # The shard gate's rates would fail these 32 rows: the canary leaves a minority to the shard gate.
    shard = {c.name: c.status for c in validate_table(rows_to_table(rows))}
    assert shard["tag_leak"] == "fail"


def test_canary_rows_threshold() -> None:
    assert Thresholds().canary_rows == 32
    assert Thresholds.from_dict({"canary_rows": 0}).canary_rows == 0
    with pytest.raises(ThresholdError, match="'canary_rows' must be an integer >= 0"):
        Thresholds.from_dict({"canary_rows": -1})
