"""Remembered fractions a person can read: keys without output parsers, readable Prefect Variable names,
entries learned under the older keys still found (and moved), a hand-broken entry ignored with a
warning, GiB throughout, and the `datagen status` lines."""

from __future__ import annotations

import json
import logging
import re

from datagen.cmd_status import render_fractions
from tasks.server import (
    FileStore,
    FractionMemory,
    ServerConfig,
    list_remembered,
    memory_key,
    variable_name,
)

GPU = "NVIDIA H200"


def _cfg(parser: str | None = "qwen3", **kw: object) -> ServerConfig:
    return ServerConfig(model_path="/models/Qwen3-8B", tp_size=8, reasoning_parser=parser, **kw)  # type: ignore[arg-type]


def test_the_reasoning_parser_does_not_split_the_memory() -> None:
    qwen, r1, none = (memory_key(_cfg(p), "gpu1", GPU) for p in ("qwen3", "deepseek-r1", None))
    assert qwen == r1 == none
    assert qwen.legacy != r1.legacy  # the keys entries were learned under before
    assert none.legacy is None  # without a parser the old key is the new one
    assert memory_key(_cfg(context_length=4096), "gpu1", GPU) != qwen  # memory-relevant flags still count


def test_variable_names_are_readable_distinct_and_valid_for_prefect() -> None:
    key = memory_key(_cfg(), "gpu1", GPU)
    name = variable_name(key)
    assert re.fullmatch(r"datagen_fraction_gpu1_qwen3-8b_tp8_nvidia-h200_[0-9a-f]{8}", name), name
    other = memory_key(ServerConfig(model_path="/other/Qwen3-8B", tp_size=8), "gpu1", GPU)
    assert variable_name(other) != name  # two models of one name on one host
    long = variable_name(memory_key(ServerConfig(model_path="/m/" + "x" * 400, tp_size=8), "ssh://u@h", "G" * 300))
    assert len(long) <= 255 and re.fullmatch(r"[a-z0-9_-]+", long)


def test_an_entry_learned_under_the_legacy_key_is_used_then_moved(tmp_path) -> None:
    key = memory_key(_cfg(), "gpu1", GPU)
    path = tmp_path / "fractions.json"
    old = {"key": key.legacy, "fraction": 0.83, "headroom_gib": 5.47, "runtime_oom_at": 0.88, "updated_at": "t",
           "history": ["2026-01-01T00:00:00Z launched at 0.88, headroom 5.47 GB"]}
    path.write_text(json.dumps({"version": 1, "entries": {key.legacy: old}}))
    mem = FractionMemory(FileStore(path))
    got = mem.get(key)
    assert got is not None and (got.fraction, got.runtime_oom_at) == (0.83, 0.88)
    assert got.history == ["2026-01-01T00:00:00Z launched at 0.88, headroom 5.47 GiB"]
    mem.remember_success(key, 0.83, 5.5)
    entries = json.loads(path.read_text())["entries"]
    assert list(entries) == [str(key)]  # one entry, under the new key; nothing learned was lost
    assert entries[str(key)]["runtime_oom_at"] == 0.88 and entries[str(key)]["history"][-1].endswith("5.5 GiB")


def test_a_hand_broken_entry_is_ignored_with_a_warning_then_rewritten(tmp_path, caplog) -> None:
    key = memory_key(_cfg(), "gpu1", GPU)
    path = tmp_path / "fractions.json"
    path.write_text(json.dumps({"version": 1, "entries": {str(key): {"key": str(key), "fraction": "0.8x"}}}))
    mem = FractionMemory(FileStore(path))
    with caplog.at_level(logging.WARNING, logger="tasks.server._tuner"):
        assert mem.get(key) is None
    assert "fraction is '0.8x', not a number" in caplog.text and "fix or delete it" in caplog.text
    mem.remember_success(key, 0.85, 4.0)
    assert mem.get(key).fraction == 0.85  # type: ignore[union-attr]


def test_status_lines_name_the_model_and_where_it_is_kept(tmp_path) -> None:
    key = memory_key(_cfg(), "gpu1", GPU)
    mem = FractionMemory(FileStore(tmp_path / "fractions.json"))
    mem.remember_success(key, 0.88, 5.47)
    mem.remember_runtime_oom(key, 0.88, 0.05)
    (line,) = render_fractions(list_remembered(mem))
    assert line.startswith("learned memory fraction: 0.83 for gpu1, /models/Qwen3-8B, tp 8, NVIDIA H200 "
                           "(headroom 5.47 GiB; runtime OOM at 0.88; updated ")
    assert line.endswith(f"[file: {tmp_path / 'fractions.json'}]")
    assert render_fractions([]) == ["learned memory fraction: none yet"]
