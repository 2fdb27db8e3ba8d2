"""tasks.prompts: dataset streaming, rejects with line numbers, chat template rendering."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.prompts import (
    ChatTemplate,
    InputRow,
    Reject,
    TemplateError,
    derive_id,
    input_fingerprint,
    iter_dataset,
    opens_think,
    render_row,
)
from tasks.reasoning import split_reasoning
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
DEMO = REPO / "data" / "models" / "demo"


def _jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_messages_and_conversations_shapes(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]},
            {"id": 7, "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q2"},
                                        {"from": "gpt", "value": "old answer"}]},
            {"id": "c", "messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "A"},
                                     {"role": "user", "content": "two"}]},
            {"id": "d", "prompt": "<|im_start|>user\nraw<|im_end|>\n<|im_start|>assistant\n"},
            {"id": "e", "messages": [{"role": "user", "content": [{"type": "text", "text": "pa"},
                                                                  {"type": "text", "text": "rts"}]}]},
        ],
    )
    rows = list(iter_dataset(path, "d"))
    assert all(isinstance(r, InputRow) for r in rows)
    assert [(r.id, r.line) for r in rows] == [("a", 1), ("7", 2), ("c", 3), ("d", 4), ("e", 5)]
    assert rows[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    # ShareGPT roles mapped, final assistant turn dropped (it is regenerated)
    assert rows[1].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q2"}]
    # earlier assistant turns stay as context
    assert [m["role"] for m in rows[2].messages] == ["user", "assistant", "user"]
    assert rows[3].prompt is not None and rows[3].messages == []
    assert rows[4].messages == [{"role": "user", "content": "parts"}]


def test_derived_id_is_stable_and_documented(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "héllo"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": msgs}, {"messages": msgs + [{"role": "assistant", "content": "x"}]}])
    canonical = json.dumps(msgs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hashlib.sha256(f"ds\n{canonical}\n".encode()).hexdigest()[:16]
    assert derive_id("ds", msgs, None) == expected
    first, second = list(iter_dataset(path, "ds"))
    assert isinstance(first, InputRow) and first.id == expected
    # same conversation once the answer is dropped: same id, so a duplicate
    assert isinstance(second, Reject) and second.reason == f"duplicate id {expected!r}" and second.line == 2
    # the dataset name is part of the id
    other = next(iter_dataset(path, "other"))
    assert isinstance(other, InputRow) and other.id != expected


def test_every_reject_reason_with_line_numbers(tmp_path: Path) -> None:
    good = {"role": "user", "content": "fine"}
    lines: list[object] = [
        {"id": "ok", "messages": [good]},  # 1
        '{"id": "broken", "messages": [',  # 2
        {"id": "sys", "messages": [{"role": "system", "content": "only a system turn"}]},  # 3
        {"id": "role", "messages": [{"role": "wizard", "content": "hi"}]},  # 4
        {"id": "empty", "messages": [{"role": "user", "content": "   "}]},  # 5
        {"id": "ok", "messages": [good]},  # 6
        "",  # 7: blank lines are skipped
        [1, 2],  # 8
        {"id": "none"},  # 9
        {"id": "role2", "conversations": [{"from": "narrator", "value": "x"}]},  # 10
        {"id": "nonstr", "messages": [{"role": "user", "content": 5}]},  # 11
        {"id": 1.5, "messages": [good]},  # 12
        {"id": "nolist", "messages": "hello"},  # 13
        {"id": "emptylist", "messages": []},  # 14
        {"id": "onlyassistant", "messages": [{"role": "assistant", "content": "a"}]},  # 15
    ]
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    with open(path, "ab") as fh:
        fh.write(b'{"id": "latin", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')  # 16
    out = list(iter_dataset(path, "bad"))
    assert [type(r).__name__ for r in out].count("InputRow") == 1
    rejects = {r.line: r.reason for r in out if isinstance(r, Reject)}
    assert rejects[2].startswith("unparseable JSON: ")
    assert rejects[3] == "no user turn"
    assert rejects[4] == "unknown role 'wizard' in messages[0]"
    assert rejects[5] == "empty content in messages[0]"
    assert rejects[6] == "duplicate id 'ok'"
    assert rejects[8] == "row is not an object (got list)"
    assert rejects[9] == "no messages, conversations or prompt"
    assert rejects[10] == "unknown role 'narrator' in conversations[0]"
    assert rejects[11] == "messages[0].content is not a string"
    assert rejects[12] == "id must be a string or integer (got float)"
    assert rejects[13] == "messages is not a list"
    assert rejects[14] == "messages is empty"
    assert rejects[15] == "no user turn"
    assert rejects[16].startswith("invalid UTF-8")
    assert sorted(rejects) == [2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    assert all(r.dataset == "bad" for r in out)
    broken = next(r for r in out if isinstance(r, Reject) and r.line == 2)
    assert broken.raw == '{"id": "broken", "messages": ['
    assert broken.to_dict() == {"dataset": "bad", "line": 2, "reason": broken.reason, "raw": broken.raw}


def test_parquet_streamed_by_batches(tmp_path: Path) -> None:
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    n = 2500  # more than one record batch
    table = pa.table(
        {
            "id": [f"r{i}" if i != 1234 else "r0" for i in range(n)],
            "messages": pa.array([[{"role": "user", "content": f"question {i}"}] for i in range(n)], msg_type),
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=700)
    out = list(iter_dataset(path, "pq"))
    assert len(out) == n
    rej = [r for r in out if isinstance(r, Reject)]
    assert [(r.line, r.reason) for r in rej] == [(1235, "duplicate id 'r0'")]
    assert json.loads(rej[0].raw)["messages"] == [{"role": "user", "content": "question 1234"}]
    assert out[-1].line == n and isinstance(out[-1], InputRow) and out[-1].id == f"r{n - 1}"


def test_unsupported_format_and_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported dataset format"):
        list(iter_dataset(tmp_path / "x.csv", "x"))
    path = tmp_path / "f.jsonl"
    data = b"x" * (3 << 20)
    path.write_bytes(data)
    assert input_fingerprint(path) == hashlib.sha256(data).hexdigest()


def test_demo_template_renders_like_transformers() -> None:
    tpl = ChatTemplate.from_model_dir(DEMO)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tpl.render(msgs)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not opens_think(prompt, "qwen3")
    off = tpl.render(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_think(off, "qwen3")
    assert tpl.special_tokens == {"bos_token": None, "eos_token": "<|im_end|>"}
    row = InputRow("x1", "ds", 4, [{"role": "tool", "content": "t"}, {"role": "user", "content": "u"}])
    with pytest.raises(TemplateError, match=r"demo: chat template failed \(row ds:4 id=x1\): Conversation roles"):
        render_row(row, tpl)
    pre = InputRow("p", "ds", 1, [], prompt="PRE")
    assert render_row(pre, tpl) == "PRE"


def _model(tmp_path: Path, template: object, **extra: object) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **extra}))
    return d


def test_template_that_opens_the_think_block(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"
    )
    tpl = ChatTemplate.from_model_dir(_model(tmp_path, template, bos_token={"content": "<s>"}))
    prompt = tpl.render([{"role": "user", "content": " hi "}])
    assert prompt == "<s><|user|>hi\n<|assistant|>\n<think>\n"
    assert opens_think(prompt, "qwen3")
    # the prompt opened the block, so the output has no start tag: split with force_reasoning
    assert split_reasoning("plan</think>\n\nanswer", "qwen3", opens_think(prompt, "qwen3")) == ("plan", "\n\nanswer")
    assert opens_think("x[THINK]  \n", "mistral") and not opens_think("x[THINK]y", "mistral")


def test_template_sandbox_helpers(tmp_path: Path) -> None:
    template = (
        "{%- for m in messages -%}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}|{{ strftime_now('%Y') | length }}|{% generation %}{{ m.content }}{% endgeneration %}"
        "{%- endfor -%}"
        "{%- if tools is none and documents is none %}|nt{% endif %}"
        "{%- if enable_thinking is defined %}|think={{ enable_thinking }}{% endif %}"
    )
    tpl = ChatTemplate(template, origin="inline")
    out = tpl.render([{"role": "user", "content": "<ü>"}, {"role": "user", "content": "skipped"}], enable_thinking=True)
    assert out == '{"role": "user", "content": "<ü>"}|4|<ü>|nt|think=True'
    # the sandbox refuses attribute tricks
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", origin="evil")
    with pytest.raises(TemplateError, match="evil: chat template failed"):
        evil.render([{"role": "user", "content": "x"}])
    raising = ChatTemplate("{{ raise_exception('no system role') }}", origin="r")
    with pytest.raises(TemplateError, match="r: chat template failed: no system role"):
        raising.render([])


def test_named_templates_and_missing(tmp_path: Path) -> None:
    d = _model(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}])
    assert ChatTemplate.from_model_dir(d).render([]) == "D1"
    assert ChatTemplate.from_model_dir(d, name="tool_use").render([]) == "T"
    with pytest.raises(TemplateError, match="no chat template named 'rag'"):
        ChatTemplate.from_model_dir(d, name="rag")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TemplateError, match="empty: no chat template"):
        ChatTemplate.from_model_dir(empty)
    (empty / "chat_template.jinja").write_text("J{{ add_generation_prompt }}")
    assert ChatTemplate.from_model_dir(empty).render([]) == "JTrue"
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}", origin="bad")


def test_byte_order_mark_on_line_one_is_not_a_reject(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    body = '{"id": "a", "messages": [{"role": "user", "content": "Q"}]}\n{"id": "b", "prompt": "P"}\n'
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    rows = list(iter_dataset(path, "bom"))
    assert [(type(r).__name__, r.id, r.line) for r in rows] == [("InputRow", "a", 1), ("InputRow", "b", 2)]


def test_a_lone_surrogate_is_a_reject_when_read_and_a_valid_pair_is_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "ok", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}\n'
                    '{"id": "bad\\ud800", "messages": [{"role": "user", "content": "x"}]}\n'
                    '{"id": "bad2", "messages": [{"role": "user", "content": "half \\udc00 a pair"}]}\n')
    got = list(iter_dataset(path, "ds"))
    assert [type(g).__name__ for g in got] == ["InputRow", "Reject", "Reject"]
    assert got[0].messages[0]["content"] == "smile \U0001f600"
    assert [(g.line, g.reason) for g in got[1:]] == [
        (2, "a string holds the lone surrogate \\ud800 (an escape of half a UTF-16 pair, not a character): fix the line"),
        (3, "a string holds the lone surrogate \\udc00 (an escape of half a UTF-16 pair, not a character): fix the line")]
