"""Validation checks on hand-built outputs, one defect at a time (real Parquet, real manifest)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from datagen import cmd_validate
from tasks.inference import DatasetSpec, Endpoint, InferenceSettings, ServerPool, run_dataset
from tasks.schema import ROW_SCHEMA
from tasks.validation import (
    BadOutput,
    Check,
    ThresholdError,
    Thresholds,
    ValidationFailed,
    gate_shard,
    publish_artifacts,
    report_markdown,
    validate_output,
    validate_shard,
    validate_table,
)
from tests.support.outputs import accept, clean_output, clean_rows, make_row, write_output
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT



def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def total(report, dataset: str = "glaive") -> dict[str, Check]:
    return by_name(next(d for d in report.datasets if d.name == dataset).checks)


def failing(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if c.status == "fail"]


# ----------------------------------------------------------------------------------------------- clean
def test_clean_output_passes_and_writes_report(tmp_path):
    out = clean_output(tmp_path / "out", shards=3, shard_size=40)
    report = validate_output(out)
    assert report.verdict == "pass"
    assert report.rows == 120
    assert [c.status for c in report.all_checks()] == ["pass"] * len(report.all_checks())
    doc = json.loads((out / "_validation.json").read_text())
    assert doc["verdict"] == "pass" and doc["rows"] == 120
    assert sorted(doc["datasets"]["glaive"]["shards"]) == ["0", "1", "2"]
    assert {c["name"] for c in doc["datasets"]["glaive"]["total"]} == {
        "schema", "complete", "unique_ids", "fingerprint", "provenance", "reasoning_present", "tag_leak", "resplit",
        "empty_content", "truncation", "finish_reason", "token_counts", "volume"}
    assert doc["samples"][0]["id"] == "glaive-000000"
    assert "PASS (120 rows" in report.summary()


def test_clean_output_without_parser_expects_no_reasoning(tmp_path):
    rows = [make_row("plain", i, parser=None, raw=f"Just an answer {i}, nothing more to say here.")
            for i in range(30)]
    out = write_output(tmp_path / "out", {"plain": [rows]}, shard_size=30)
    checks = total(validate_output(out), "plain")
    assert checks["reasoning_present"].status == "pass"
    assert checks["reasoning_present"].message == (
        "no reasoning parser and no think block in the prompt: reasoning not expected")
    assert validate_output(out).verdict == "pass"


# --------------------------------------------------------------------------------------------- defects
def test_empty_reasoning_everywhere_stops_the_gate_with_one_message(tmp_path):
    # The field-report bug: the template opens <think>, no parser, so the think text sits in content.
    rows = clean_rows("glaive", 500, parser=None, think_in_prompt=True)
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=500)
    with pytest.raises(ValidationFailed) as err:
        gate_shard(out, "glaive", 0, Thresholds())
    assert err.value.message == (
        "reasoning empty in 100% of 500 rows of shard 0 of glaive (e.g. id glaive-000000): the prompt opens "
        "the think block (chat template) and the raw output uses the <think>…</think> format but parser is none; fix the reasoning parser (one of deepseek-r1, qwen3, "
        f"qwen3-thinking; set by --reasoning-parser, the reasoning_parser flow parameter in the Prefect UI or [model] reasoning_parser in the partition), then `datagen resplit {out} --parser NAME` (re-split with deepseek-r1, 64 of the 64 of these rows checked get reasoning)" + accept("reasoning_missing_max_rate", 0.05) + " (also failing: tag_leak)"
    )
    assert failing(err.value.report.checks) == ["reasoning_present", "tag_leak"]
    # The artifact's markdown shows the tags as written (the UI would swallow a bare <think>).
    md = report_markdown(validate_output(out))
    assert "uses the &lt;think&gt;…&lt;/think&gt; format but parser is none" in md and "<think>" not in md
    doc = json.loads((out / "_validation.json").read_text())
    assert doc["verdict"] == "fail"
    shard = doc["datasets"]["glaive"]["shards"]["0"]
    assert shard["verdict"] == "fail" and shard["rows"] == 500
    assert by_name([Check(**c) for c in shard["checks"]])["reasoning_present"].value == 1.0


def test_think_in_prompt_with_parser_that_was_not_forced(tmp_path):
    # Template opened <think>, parser qwen3 set, but the split ignored think_in_prompt: no start tag in
    # raw, so everything landed in content with a bare </think>.
    rows = []
    for i in range(40):
        row = make_row("glaive", i, parser="qwen3", think_in_prompt=True)
        row["reasoning"], row["content"] = None, row["raw"]
        rows.append(row)
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=40)
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert checks["reasoning_present"].status == "fail"
    assert checks["reasoning_present"].message == (
        "reasoning empty in 100% of 40 rows of shard 0 of glaive (e.g. id glaive-000000): the raw output "
        "holds </think> but the split did not use it (parser qwen3, think_in_prompt taken into account?); "
        f"run `datagen resplit {out} --parser qwen3` (re-split with qwen3, 40 of the 40 of these rows checked get reasoning)" + accept("reasoning_missing_max_rate", 0.05))
    assert checks["resplit"].status == "fail"
    assert checks["tag_leak"].status == "fail"


def test_tags_leaking_into_content(tmp_path):
    rows = clean_rows("glaive", 50, parser=None)  # model writes <think> blocks, no parser configured
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=50)
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert failing(list(checks.values())) == ["tag_leak"]
    assert checks["reasoning_present"].status == "pass"
    assert checks["tag_leak"].value == 1.0
    assert checks["tag_leak"].message == (
        "<think> left in content of 100% of 50 rows of shard 0 of glaive (e.g. id glaive-000000): the "
        "model writes <think> but no reasoning parser is set; fix the reasoning parser (one of "
        "deepseek-r1, qwen3, qwen3-thinking, glm45, kimi_k2, minimax, step3, nemotron_3, interns1; set by --reasoning-parser, the reasoning_parser flow parameter in the Prefect UI or [model] reasoning_parser in the partition), then "
        f"`datagen resplit {out} --parser NAME`" + accept("tag_leak_max_rate", 0.01))


def test_wrong_parser_family_leaks_and_misses_reasoning(tmp_path):
    rows = clean_rows("glaive", 30, parser="mistral")  # <think> model split with [THINK] tags
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=30)
    with pytest.raises(ValidationFailed) as err:
        gate_shard(out, "glaive", 0)
    assert err.value.message.startswith(
        "reasoning empty in 100% of 30 rows of shard 0 of glaive (e.g. id glaive-000000): the raw output "
        "uses the <think>…</think> format but parser is mistral; fix the reasoning parser (one of ")


def test_duplicates_across_shards(tmp_path):
    shard0 = clean_rows("glaive", 50, 0)
    shard1 = clean_rows("glaive", 50, 50)
    shard1[7] = make_row("glaive", 3)  # id glaive-000003 again, in place of glaive-000057
    out = write_output(tmp_path / "out", {"glaive": [shard0, shard1]}, shard_size=50)
    report = validate_output(out)
    assert [s.verdict for s in report.datasets[0].shards] == ["pass", "pass"]
    checks = total(report)
    assert failing(list(checks.values())) == ["unique_ids"]
    assert checks["unique_ids"].value == 1
    assert checks["unique_ids"].message == (
        "1 duplicate rows in 100 rows of glaive (ids glaive-000003); a resume re-ran committed rows: "
        "keep one row per id and sample (rerun the affected shards)")
    assert report.verdict == "fail"


def test_duplicates_within_a_shard_fail_the_gate(tmp_path):
    rows = clean_rows("glaive", 50)
    rows[10] = make_row("glaive", 0)
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=50)
    with pytest.raises(ValidationFailed) as err:
        gate_shard(out, "glaive", 0)
    assert err.value.message.startswith("1 duplicate rows in 50 rows of shard 0 of glaive (ids glaive-000000)")


def test_missing_ids(tmp_path):
    rows = clean_rows("glaive", 47)  # slice of 50: 47 rows + 1 reject, 2 rows lost
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=50, total_rows={"glaive": 50},
                       rejects={"glaive": {0: 1}})
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert failing(list(checks.values())) == ["complete"]
    assert checks["complete"].value == 2
    assert checks["complete"].message == (
        "2 input rows missing from shard 0 of glaive: 47 rows + 1 rejects, the slice holds 50; the shard "
        "was committed incomplete or edited: rerun it (the journal resumes by id)")


def test_rejects_count_toward_the_slice_and_tail_shard(tmp_path):
    shards = [clean_rows("glaive", 48, 0), clean_rows("glaive", 7, 50)]  # slice 0: 48 + 2 rejects; tail 7
    out = write_output(tmp_path / "out", {"glaive": shards}, shard_size=50, rejects={"glaive": {0: 2}})
    report = validate_output(out)
    assert report.verdict == "pass"
    assert total(report)["complete"].message == "2 of 2 shards, 55 rows + 2 rejects"


def test_uncommitted_shards_fail_the_output(tmp_path):
    out = write_output(tmp_path / "out", {"glaive": [clean_rows("glaive", 50)]}, shard_size=50,
                       total_rows={"glaive": 200}, num_shards={"glaive": 4})
    checks = total(validate_output(out))
    assert checks["complete"].status == "fail"
    assert checks["complete"].message == (
        "3 of 4 shards of glaive not committed (shards 1-3); finish the run (`datagen run` resumes)")


def _truncate(row: dict) -> dict:
    row = dict(row)
    row["raw"] = row["raw"].split("</think>")[0]
    row["reasoning"], row["content"] = row["raw"][len("<think>"):], ""
    row["finish_reason"] = "length"
    return row


def test_truncation_above_threshold(tmp_path):
    rows = clean_rows("glaive", 50)
    rows[:10] = [_truncate(r) for r in rows[:10]]  # 20% > 10%
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=50)
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert failing(list(checks.values())) == ["truncation"]
    assert checks["truncation"].value == pytest.approx(0.2)
    assert checks["empty_content"].status == "pass"  # truncated rows have no content by design
    assert checks["truncation"].message == (
        "finish_reason length in 20% of 50 rows of shard 0 of glaive: outputs hit max_new_tokens; raise "
        "[sampling] max_new_tokens (within the context length), generate truncated rows again with a larger "
        "budget ([run.truncation] retries)" + accept("truncation_max_rate", 0.1))
    # Below the threshold it only warns; a partition may raise the threshold.
    assert by_name(validate_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA),
                                  Thresholds.from_dict({"truncation_max_rate": 0.25})))["truncation"].status == "warn"


def test_small_tail_shard_only_fails_when_every_row_breaches(tmp_path):
    rows = clean_rows("glaive", 3)
    rows[0] = _truncate(rows[0])
    table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    assert by_name(validate_table(table))["truncation"].status == "warn"
    table = pa.Table.from_pylist([_truncate(r) for r in rows], schema=ROW_SCHEMA)
    assert by_name(validate_table(table))["truncation"].status == "fail"


def test_mixed_fingerprints(tmp_path):
    shard0 = clean_rows("glaive", 50, 0)
    shard1 = clean_rows("glaive", 50, 50)
    for r in shard1:
        r["sampling"] = json.dumps({"max_new_tokens": 2048, "temperature": 0.6}, sort_keys=True)
    out = write_output(tmp_path / "out", {"glaive": [shard0, shard1]}, shard_size=50)
    report = validate_output(out)
    assert [s.verdict for s in report.datasets[0].shards] == ["pass", "pass"]
    checks = total(report)
    assert failing(list(checks.values())) == ["fingerprint"]
    assert checks["fingerprint"].message == (
        "mixed fingerprints in glaive: sampling: 2 values: "
        "'{\"max_new_tokens\": 1024, \"temperature\": 0.6}' (50 rows in shards 0), "
        "'{\"max_new_tokens\": 2048, \"temperature\": 0.6}' (50 rows in shards 1); rows were generated "
        "under different settings (a resume with changed sampling, server flags or parser): rerun the "
        "minority shards with the settings of the rest, or `datagen resplit` for a parser mismatch")


def test_mixed_server_may_be_allowed(tmp_path):
    rows = clean_rows("glaive", 40)
    for r in rows[20:]:
        r["server"] = "sglang-0.5.4:qwen3:tp1:mfs0.80:def456"
    table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    assert by_name(validate_table(table))["fingerprint"].status == "fail"
    allowed = Thresholds.from_dict({"allow_mixed_server": True})
    assert by_name(validate_table(table, allowed))["fingerprint"].status == "warn"


def test_wrong_schema(tmp_path):
    schema = pa.schema([f if f.name != "completion_tokens" else pa.field("completion_tokens", pa.int64())
                        for f in ROW_SCHEMA if f.name != "think_in_prompt"])
    rows = clean_rows("glaive", 30)
    for r in rows:
        del r["think_in_prompt"]
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=30, schema=schema)
    with pytest.raises(ValidationFailed) as err:
        gate_shard(out, "glaive", 0)
    assert err.value.message == (
        "shard 0 of glaive does not match the row schema: column 'completion_tokens' is int64, expected "
        "int32; column 'think_in_prompt' missing; the shard was written by another version of datagen or "
        "by hand: regenerate it (delete it from the manifest and rerun)")
    checks = by_name(err.value.report.checks)
    assert checks["reasoning_present"].status == "unknown"
    assert checks["reasoning_present"].message == "cannot check: column 'think_in_prompt' missing"
    assert checks["token_counts"].status == "unknown"
    assert checks["tag_leak"].status == "pass"


def test_nulls_in_required_columns_break_the_schema():
    rows = clean_rows("glaive", 5)
    loose = pa.schema([pa.field(f.name, f.type, nullable=True) for f in ROW_SCHEMA])
    rows[2]["content"] = None
    checks = by_name(validate_table(pa.Table.from_pylist(rows, schema=loose)))
    assert checks["schema"].status == "fail"
    assert "column 'content' has 1 nulls" in checks["schema"].message


def test_resplit_mismatch_when_content_belongs_to_another_row(tmp_path):
    rows = clean_rows("glaive", 50)
    rows[5]["content"], rows[6]["content"] = rows[6]["content"], rows[5]["content"]
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=50)
    checks = by_name(validate_shard(out, "glaive", 0, Thresholds.from_dict({"resplit_sample_rows": 0})).checks)
    assert failing(list(checks.values())) == ["resplit"]
    assert checks["resplit"].message == (
        "raw does not re-split to the stored reasoning/content in 2 of 50 checked rows of shard 0 of glaive "
        "(parser qwen3, e.g. id glaive-000005): the split used other settings or raw and content belong to "
        f"different rows; run `datagen resplit {out} --parser NAME`")


def test_forced_parser_on_a_model_that_did_not_think_empties_content(tmp_path):
    rows = [make_row("glaive", i, parser="deepseek-r1", raw=f"The answer to {i} is four, plainly stated.")
            for i in range(40)]
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=40)
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert failing(list(checks.values())) == ["empty_content"]
    assert checks["empty_content"].message.startswith(
        "content empty in 100% of 40 finished rows of shard 0 of glaive (e.g. id glaive-000000): the split "
        "put the whole answer into reasoning")


def test_token_counts_inconsistent_with_text():
    rows = clean_rows("glaive", 40)
    for r in rows[:4]:
        r["completion_tokens"] = 0
    for r in rows[4:8]:
        r["completion_tokens"] = 1_000  # a count from another row or field
    checks = by_name(validate_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA)))
    assert failing(list(checks.values())) == ["token_counts"]
    assert checks["token_counts"].count == 8
    assert checks["token_counts"].message.startswith(
        "token counts inconsistent with the text in table (e.g. id glaive-000000): 4 rows with text but "
        "completion_tokens 0; 4 rows outside 0.25..16.0 chars/token")


def test_aborts_and_unknown_finish_reasons():
    rows = clean_rows("glaive", 40)
    rows[0]["finish_reason"] = "abort"
    rows[1]["finish_reason"] = "eos"
    checks = by_name(validate_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA)))
    assert checks["finish_reason"].status == "fail"
    assert checks["finish_reason"].message.startswith("finish_reason outside stop/length/abort in table: 'eos' (1)")


# ------------------------------------------------------------------------------------------ thresholds
def test_thresholds_from_dict():
    t = Thresholds.from_dict({"truncation_max_rate": 0.3, "resplit_sample_rows": 10, "allow_mixed_server": True})
    assert (t.truncation_max_rate, t.resplit_sample_rows, t.allow_mixed_server) == (0.3, 10, True)
    with pytest.raises(ThresholdError, match=r"unknown validation threshold 'min_reasoning_fraction'; valid keys: "):
        Thresholds.from_dict({"min_reasoning_fraction": 0.99})
    with pytest.raises(ThresholdError, match=r"'truncation_max_rate' is a rate in \[0, 1\], not 2"):
        Thresholds.from_dict({"truncation_max_rate": 2})
    with pytest.raises(ThresholdError, match=r"'allow_mixed_server' must be true or false"):
        Thresholds.from_dict({"allow_mixed_server": "yes"})
    with pytest.raises(ThresholdError, match=r"'chars_per_token_min' \(20.0\) must be below"):
        Thresholds.from_dict({"chars_per_token_min": 20})


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input(tmp_path):
    with pytest.raises(BadOutput, match="no such directory"):
        validate_output(tmp_path / "nope")
    with pytest.raises(BadOutput, match=r"not a datagen output \(no _manifest.json\)"):
        validate_output(tmp_path)
    out = clean_output(tmp_path / "out", shards=1)
    with pytest.raises(BadOutput, match="shard 5 of 'glaive' is not committed"):
        gate_shard(out, "glaive", 5)


def test_unreadable_shard_fails_schema(tmp_path):
    out = clean_output(tmp_path / "out", shards=1)
    (out / "glaive" / "shard-00000.parquet").write_bytes(b"not parquet")
    checks = by_name(validate_shard(out, "glaive", 0).checks)
    assert checks["schema"].status == "fail"
    assert checks["schema"].message.startswith("shard 0 of glaive: cannot read ")


# ------------------------------------------------------------------------------------------------- cli
def test_cli_exit_codes_and_json(tmp_path, capsys):
    good = clean_output(tmp_path / "good", shards=2, shard_size=30)
    assert cmd_validate.main([str(good)]) == 0
    assert "validation of" in capsys.readouterr().out
    assert cmd_validate.main([str(good), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "pass" and doc["rows"] == 60
    bad = write_output(tmp_path / "bad", {"glaive": [clean_rows("glaive", 30, parser=None)]}, shard_size=30)
    assert cmd_validate.main([str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    checks = doc["datasets"]["glaive"]["total"]
    assert [c["name"] for c in checks if c["status"] == "fail"] == ["tag_leak"]
    assert cmd_validate.main([str(bad), "--threshold", "tag_leak_max_rate=1.0"]) == 0
    capsys.readouterr()
    assert cmd_validate.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"datagen validate: {tmp_path / 'missing'}: no such directory\n"
    assert cmd_validate.main([str(good), "--threshold", "bogus=1"]) == 2
    assert "unknown validation threshold 'bogus'" in capsys.readouterr().err


@pytest.mark.slow  # `datagen` subprocesses: `make test`, not `make unit`
def test_cli_real_process(tmp_path):
    bad = write_output(tmp_path / "bad", {"glaive": [clean_rows("glaive", 30, parser=None)]}, shard_size=30)
    proc = subprocess.run([sys.executable, "-m", "datagen", "validate", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "FAIL tag_leak" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "datagen", "validate", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not a datagen output" in proc.stderr


# ------------------------------------------------------------------------------------------- artifacts
def test_artifacts_outside_a_run_do_nothing(tmp_path):
    report = validate_output(clean_output(tmp_path / "out", shards=1))
    assert publish_artifacts(report, "validation") == []
    md = report_markdown(report)
    assert md.startswith("# Validation: PASS")
    assert "| reasoning_present | pass |" in md
    assert "## Sample rows" in md and "glaive-000000" in md


def test_gate_before_the_input_total_is_known(tmp_path):
    # Mid-run the manifest has total_rows/num_shards null: a full slice is complete, a short one unknown.
    out = write_output(tmp_path / "out", {"glaive": [clean_rows("glaive", 50), clean_rows("glaive", 20, 50)]},
                       shard_size=50, total_rows={"glaive": None}, num_shards={"glaive": None})
    assert gate_shard(out, "glaive", 0).verdict == "pass"
    tail = gate_shard(out, "glaive", 1)
    assert by_name(tail.checks)["complete"].status == "unknown"
    assert tail.verdict == "warn"
    doc = json.loads((out / "_validation.json").read_text())
    assert {k: v["verdict"] for k, v in doc["datasets"]["glaive"]["shards"].items()} == {"0": "pass", "1": "warn"}


def test_final_validation_fails_when_the_input_total_is_unknown(tmp_path, capsys):
    # The same mid-run output validated as final: its total is unknown, so it is not known complete.
    out = write_output(tmp_path / "out", {"glaive": [clean_rows("glaive", 50), clean_rows("glaive", 20, 50)]},
                       shard_size=50, total_rows={"glaive": None}, num_shards={"glaive": None})
    report = validate_output(out)
    assert report.verdict == "fail"
    complete = total(report)["complete"]
    assert complete.status == "fail"
    assert complete.message == (
        "glaive: the input's size is unknown (the manifest lacks num_shards: the run never read the input "
        "to the end); 2 shard(s), 70 rows + 0 rejects committed so far; finish the run (`datagen run` resumes)")
    assert cmd_validate.main([str(out)]) == 1
    assert "the input's size is unknown" in capsys.readouterr().out


def test_output_with_no_shard_and_unknown_total_fails(tmp_path):
    # The field case: 0 of 118 rows, the run stopped before its input was read to the end.
    out = write_output(tmp_path / "out", {"glaive": []}, shard_size=50,
                       total_rows={"glaive": None}, num_shards={"glaive": None})
    report = validate_output(out)
    assert report.verdict == "fail" and report.rows == 0
    assert failing(total(report).values()) == ["complete", "volume"]
    assert cmd_validate.main([str(out)]) == 1


def test_concurrent_gates_keep_every_shard_in_the_report(tmp_path):
    data = {f"ds{j}": [clean_rows(f"ds{j}", 20, k * 20) for k in range(3)] for j in range(3)}
    out = write_output(tmp_path / "out", data, shard_size=20)
    jobs = [(f"ds{j}", k) for j in range(3) for k in range(3)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda job: gate_shard(out, *job), jobs))
    doc = json.loads((out / "_validation.json").read_text())
    assert {(d, int(k)) for d, v in doc["datasets"].items() for k in v["shards"]} == set(jobs)
    assert doc["verdict"] == "pass"


def test_real_writer_output_passes_and_the_no_parser_bug_stops_at_shard_0(tmp_path, emulator_factory):
    # The writer (tasks.inference) against the emulator with the demo model (qwen3 family, <think>).
    em = emulator_factory([])
    src = tmp_path / "in.jsonl"
    src.write_text("".join((ROOT / "data/samples/glaive_like.jsonl").read_text().splitlines(True)[:24]))
    common = dict(model_dir=str(ROOT / "data/models/demo"), shard_size=12, concurrency=12,
                  sampling={"max_new_tokens": 256}, model_name="demo")
    endpoint = ServerPool.of(Endpoint(em.url, "fp"))
    good = tmp_path / "good"
    run_dataset(DatasetSpec("glaive", src), good, endpoint, InferenceSettings(reasoning_parser="auto", **common),
                on_shard_committed=lambda rec: gate_shard(good, "glaive", rec.index))
    report = validate_output(good)
    assert report.verdict == "pass", report.summary()
    assert report.rows == 24
    bad = tmp_path / "bad"
    committed: list[int] = []

    def gate(rec) -> None:
        committed.append(rec.index)
        gate_shard(bad, "glaive", rec.index)

    with pytest.raises(ValidationFailed) as err:
        run_dataset(DatasetSpec("glaive", src), bad, endpoint, InferenceSettings(reasoning_parser=None, **common),
                    on_shard_committed=gate)
    # shard 0 is judged first; the next shard's rows were already in flight (concurrency = shard size)
    # and may commit before the gate's verdict lands on a loaded machine
    assert committed[0] == 0 and len(committed) <= 2, committed
    assert err.value.message.startswith("<think> left in content of 100% of 12 rows of shard 0 of glaive")
    assert failing(err.value.report.checks) == ["tag_leak"]


@pytest.mark.parametrize("rows, rejects, status, fragment", [
    (0, 0, "fail", "glaive: 0 rows, 0 input rows rejected, below min_rows 1"),
    (0, 30, "fail", "glaive: 0 rows, 30 input rows rejected, below min_rows 1"),
    (20, 10, "fail", "(33.3%), above reject_max_rate 20.0%"),
    (27, 3, "warn", "(10.0%), above reject_warn_rate 5.0%"),
    (30, 0, "pass", "glaive: 30 rows, 0 input rows rejected (0.0%)"),
])
def test_volume_gate_empty_or_mostly_rejected_input_fails(tmp_path, rows, rejects, status, fragment):
    out = write_output(tmp_path / "out", {"glaive": [clean_rows("glaive", rows, 0)]}, shard_size=30,
                       rejects={"glaive": {0: rejects}} if rejects else None,
                       total_rows={"glaive": rows + rejects})
    report = validate_output(out)
    check = total(report)["volume"]
    assert check.status == status and fragment in check.message, check.message
    if status == "fail":
        assert report.verdict == "fail"
    assert Thresholds.from_dict({"min_rows": 0, "reject_max_rate": 1.0}).min_rows == 0


# ------------------------------------------------------------------------------------------- samples
def _sampled(n: int, samples: int, start: int = 0) -> list[dict]:
    return [make_row("glaive", i, sample=k) for i in range(start, start + n) for k in range(samples)]


def test_samples_count_toward_the_slice_and_duplicates_are_per_id_and_sample(tmp_path):
    out = write_output(tmp_path / "ok", {"glaive": [_sampled(10, 3), _sampled(4, 3, 10)]}, shard_size=10, samples=3)
    report = validate_output(out, write=False)
    assert report.verdict == "pass"
    assert total(report)["complete"].message == "2 of 2 shards, 42 rows + 0 rejects"
    # a sample missing from a shard
    short = _sampled(10, 3)
    del short[4]
    out = write_output(tmp_path / "short", {"glaive": [short]}, shard_size=10, samples=3, total_rows={"glaive": 10})
    shard = validate_output(out, write=False).datasets[0].shards[0]
    assert by_name(shard.checks)["complete"].message.startswith(
        "1 input rows missing from shard 0 of glaive: 29 rows + 0 rejects, the slice holds 30 (3 samples per record)")
    # sample 1 of a prompt twice, sample 2 missing: a duplicate of (id, sample), not of id
    dup = _sampled(10, 3)
    dup[5] = make_row("glaive", 1, sample=1)
    out = write_output(tmp_path / "dup", {"glaive": [dup]}, shard_size=10, samples=3)
    checks = total(validate_output(out, write=False))
    assert checks["unique_ids"].status == "fail" and "(ids glaive-000001#1)" in checks["unique_ids"].message


def test_a_shard_of_the_older_schema_is_read_with_defaults(tmp_path):
    older = pa.schema([f for f in ROW_SCHEMA if f.name not in ("sample", "sampling_seed", "turns")])
    rows = [{k: v for k, v in r.items() if k in older.names} for r in clean_rows("glaive", 20)]
    out = write_output(tmp_path / "out", {"glaive": [rows]}, shard_size=20, schema=older)
    report = validate_output(out, write=False)
    assert report.verdict == "pass"
    assert total(report)["schema"].status == "pass"
