"""tasks.schema: what a row or shard of an older datagen holds in the columns added since."""
from __future__ import annotations

import datetime as dt

import orjson
import pyarrow as pa
import pytest

from tasks.schema import ADDED_DEFAULTS, ROW_SCHEMA, added_value, conform
from tasks.shards import rows_to_table

FIRST_RELEASE = ["id", "dataset", "messages", "prompt", "raw", "reasoning", "content", "finish_reason",
                 "prompt_tokens", "completion_tokens", "model", "sampling", "server", "reasoning_parser",
                 "think_in_prompt", "generated_at", "latency_s"]


def _old_row(i: int, sampling: dict[str, object]) -> dict[str, object]:
    return {"id": f"r{i}", "dataset": "ds", "messages": [{"role": "user", "content": "q"}], "prompt": "p",
            "raw": "a", "reasoning": None, "content": "a", "finish_reason": "stop", "prompt_tokens": 3,
            "completion_tokens": 1, "model": "m", "sampling": orjson.dumps(sampling).decode(), "server": "s",
            "reasoning_parser": None, "think_in_prompt": False,
            "generated_at": dt.datetime(2026, 11, 30, tzinfo=dt.UTC).isoformat(), "latency_s": 0.1}


def test_every_column_after_the_first_release_has_a_default() -> None:
    assert [n for n in ROW_SCHEMA.names if n not in FIRST_RELEASE] == list(ADDED_DEFAULTS)
    for name, value in ADDED_DEFAULTS.items():
        assert value is not None or ROW_SCHEMA.field(name).nullable, name


def test_a_journal_row_of_an_older_datagen_commits_with_its_budget_read_back_from_its_sampling() -> None:
    table = rows_to_table([_old_row(0, {"max_new_tokens": 4096, "temperature": 0.6}), _old_row(1, {"top_p": 1})])
    assert table.schema.equals(ROW_SCHEMA, check_metadata=False)
    rows = table.to_pylist()
    assert [r["max_new_tokens"] for r in rows] == [4096, None]  # none sent: the server's default
    assert {(r["budget_capped"], r["truncation_retries"], r["sample"]) for r in rows} == {(False, 0, 0)}
    assert {r["model_revision"] for r in rows} == {None} and {r["turns"] for r in rows} == {None}


def test_conform_fills_an_older_shard_and_leaves_a_current_one_as_it_is() -> None:
    current = rows_to_table([_old_row(0, {"max_new_tokens": 64})])
    old = current.select(FIRST_RELEASE)
    filled = conform(old)
    assert filled.schema.equals(ROW_SCHEMA, check_metadata=False) and filled.to_pylist() == current.to_pylist()
    assert conform(current) is current


@pytest.mark.parametrize("sampling", ['{"max_new_tokens": true}', "[1]", "not json", None])
def test_an_unreadable_sampling_gives_an_unknown_budget(sampling: object) -> None:
    assert added_value("max_new_tokens", sampling) is None
    assert added_value("truncation_retries", sampling) == 0
    assert pa.array([added_value("max_new_tokens", sampling)], type=pa.int32()).null_count == 1
