"""tasks.shards: lock, manifest, journal and atomic commits on a real directory (no server)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tasks.schema import ROW_SCHEMA
from tasks.shards import WHOLE_RECORD, InputChanged, Journal, OutputDir, OutputLocked, ShardsError


def _row(i: int, pos: int | None = None) -> dict:
    return {
        "id": f"r{i}", "dataset": "ds", "messages": [{"role": "user", "content": f"q{i}"}],
        "prompt": f"p{i}", "raw": f"<think>t{i}</think>a{i}", "reasoning": f"t{i}", "content": f"a{i}",
        "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 5, "model": "m",
        "sampling": "{}", "server": "s", "reasoning_parser": "qwen3", "think_in_prompt": False,
        "generated_at": "2026-01-01T00:00:00.000000+00:00", "latency_s": 0.1, "_pos": i if pos is None else pos,
        "max_new_tokens": 8, "budget_capped": False, "truncation_retries": 0, "truncation_policy": None,
    }


def _opened(tmp_path, shard_size: int = 4) -> OutputDir:
    out = OutputDir(tmp_path / "out")
    return out


def test_commit_writes_parquet_manifest_rejects_and_drops_journal(tmp_path):
    out = _opened(tmp_path)
    with out.lock({"flow_run": "fr-1"}):
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=4)
        j = out.journal("ds", 0)
        for i in range(3):
            j.append(_row(i))
        j.close()
        rec = out.commit_shard("ds", 0, [_row(i) for i in range(3)],
                               [{"dataset": "ds", "line": 4, "reason": "bad", "raw": "x"}])
    assert rec.rows == 3 and rec.rejects == 1 and rec.file == "ds/shard-00000.parquet"
    table = pq.read_table(out.shard_path("ds", 0))
    assert table.schema.equals(ROW_SCHEMA) and table.column("id").to_pylist() == ["r0", "r1", "r2"]
    assert pq.ParquetFile(out.shard_path("ds", 0)).metadata.row_group(0).column(0).compression == "ZSTD"
    m = out.read_manifest()
    assert m["shard_size"] == 4
    entry = m["datasets"]["ds"]
    assert entry["input_fingerprint"] == "abc" and entry["shards"]["0"]["rows"] == 3
    assert entry["shards"]["0"]["rejects"] == 1 and len(entry["shards"]["0"]["sha256"]) == 64
    assert not out.journal_path("ds", 0).exists()
    assert out.read_rejects("ds") == [{"dataset": "ds", "line": 4, "reason": "bad", "raw": "x", "shard": 0}]
    assert [s.index for s in out.committed_shards()] == [0]


def test_writes_need_the_lock(tmp_path):
    out = _opened(tmp_path)
    with pytest.raises(ShardsError, match="needs its lock"):
        out.open_dataset("ds", input_path="/x", input_fingerprint="f", shard_size=4)


def test_shard_size_or_fingerprint_change_is_refused(tmp_path):
    out = _opened(tmp_path)
    with out.lock():
        out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=4)
        with pytest.raises(InputChanged) as e:
            out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="abc", shard_size=8)
        assert "4" in str(e.value) and "8" in str(e.value) and "--shard-size 4" in str(e.value)
        with pytest.raises(InputChanged) as e2:
            out.open_dataset("ds", input_path="/in.jsonl", input_fingerprint="def", shard_size=4)
        assert "'abc'" in str(e2.value) and "'def'" in str(e2.value) and "new --out" in str(e2.value)


def test_bad_dataset_name_is_refused(tmp_path):
    out = _opened(tmp_path)
    with out.lock(), pytest.raises(ValueError, match="dataset name"):
        out.open_dataset("../etc", input_path="/x", input_fingerprint="f", shard_size=4)


def test_journal_torn_line_and_duplicates(tmp_path):
    out = OutputDir(tmp_path / "out")
    path = out.journal_path("ds", 0)
    j = out.journal("ds", 0)
    j.append(_row(0))
    j.append(_row(1))
    j.append({"_reject": True, "_pos": 2, "reason": "r", "line": 3})
    j.close()
    with open(path, "ab") as f:
        f.write(orjson.dumps(_row(1)) + b"\n")  # duplicate: ignored
        f.write(orjson.dumps(_row(3))[:40])  # torn by a kill mid-write
    c = out.read_journal("ds", 0)
    assert sorted(c.rows) == [("r0", 0), ("r1", 0)] and list(c.rejects) == [(2, WHOLE_RECORD)]
    assert c.torn_lines == 1
    assert c.units == {(0, 0), (1, 0)} and c.whole_rejects == {2}
    # appending after a torn tail starts a fresh line, so the new record is readable
    j2 = out.journal("ds", 0)
    j2.append(_row(4))
    j2.close()
    assert sorted(out.read_journal("ds", 0).rows) == [("r0", 0), ("r1", 0), ("r4", 0)]


def test_recover_cleans_temp_orphan_parquet_stale_journal_and_rejects(tmp_path):
    out = _opened(tmp_path)
    with out.lock():
        out.open_dataset("ds", input_path="/in", input_fingerprint="f", shard_size=4)
        out.commit_shard("ds", 0, [_row(i) for i in range(4)])
        # crash between rename and manifest update of shard 1: parquet present, not in manifest
        out._append_rejects("ds", 1, [{"reason": "x", "line": 5}])
        (tmp_path / "out/ds/shard-00001.parquet").write_bytes(b"half")
        (tmp_path / "out/ds/shard-00002.parquet.tmp-123").write_bytes(b"tmp")
        (tmp_path / "out/_manifest.json.tmp-9").write_bytes(b"{")
        # crash between manifest update and journal removal of shard 0
        out.journal("ds", 0).append(_row(0))
        counts = out.recover("ds")
    assert counts == {"temp_files": 2, "orphan_shards": 1, "stale_journals": 1, "stale_rejects": 1}
    assert sorted(p.name for p in (tmp_path / "out/ds").iterdir()) == ["shard-00000.parquet"]
    assert out.read_rejects("ds") == [] and not out.journal_path("ds", 0).exists()


def test_replace_shard_is_atomic_and_keeps_row_count(tmp_path):
    out = _opened(tmp_path)
    with out.lock():
        out.open_dataset("ds", input_path="/in", input_fingerprint="f", shard_size=4)
        rec = out.commit_shard("ds", 0, [_row(i) for i in range(4)])
    table = pq.read_table(rec.path)
    new = table.set_column(table.schema.get_field_index("content"), "content",
                           table.column("content").cast("string"))
    rec2 = out.replace_shard("ds", 0, new)  # takes the lock itself
    assert rec2.rows == 4 and out.read_manifest()["datasets"]["ds"]["shards"]["0"]["sha256"] == rec2.sha256
    with pytest.raises(ShardsError, match="change its rows"):
        out.replace_shard("ds", 0, table.slice(0, 2))


def test_lock_second_locker_refused_naming_holder(tmp_path):
    out = _opened(tmp_path)
    holder_code = textwrap.dedent(f"""
        import sys, time
        from tasks.shards import OutputDir
        with OutputDir({str(tmp_path / 'out')!r}).lock({{"flow_run": "fr-other"}}):
            print("locked", flush=True)
            sys.stdin.read()
    """)
    with subprocess.Popen([sys.executable, "-c", holder_code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE) as p:
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"locked"
            with pytest.raises(OutputLocked) as e:
                out.lock().acquire()
            msg = str(e.value)
            assert f"pid={p.pid}" in msg and "flow_run=fr-other" in msg and "started=" in msg
            assert out.lock_holder()["pid"] == p.pid
        finally:
            p.kill()
            p.wait()
    # the dead holder's body is still in the file, but the kernel dropped its flock
    assert (tmp_path / "out/_lock").read_bytes().strip() != b""
    assert out.lock_holder() is None
    with out.lock({"flow_run": "mine"}) as lk:
        assert lk.held and orjson.loads((tmp_path / "out/_lock").read_bytes())["pid"] == os.getpid()
        with pytest.raises(OutputLocked, match="flow_run=mine"):
            out.lock().acquire()  # a second lock object in this process is refused too
    assert out.lock_holder() is None


def test_journal_lines_that_are_json_but_no_record_are_skipped_and_named(tmp_path: Path) -> None:
    bad_type = {**_row(1), "prompt_tokens": "x"}
    no_column = {k: v for k, v in _row(2).items() if k != "prompt"}
    lines = [orjson.dumps(_row(0)), b'{"_reject": true, "_pos": "abc"}', orjson.dumps(bad_type), b'{"torn',
             orjson.dumps(no_column), b"[1]", b'{"id": 5}', orjson.dumps(_row(1)), b'{"_turn": "x", "id": "r9"}']
    path = tmp_path / "shard-00000.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    contents = Journal.parse(path.read_bytes())
    assert sorted(contents.rows) == [("r0", 0), ("r1", 0)]  # the later good copy of r1 counts
    assert contents.rows[("r1", 0)]["prompt_tokens"] == 3
    assert contents.torn_lines == 1 and contents.rejects == {} and contents.turns == {}
    assert contents.bad_lines == [
        "line 2: _pos 'abc' is not a whole number",
        "line 3: row 'r1' cannot be stored: Could not convert 'x' with type str: tried to convert to int32",
        "line 5: row 'r2' cannot be stored: column 'prompt' missing",
        "line 6: not a JSON object",
        "line 7: id 5 is not text",
        "line 9: _turn 'x' is not a whole number",
    ]
