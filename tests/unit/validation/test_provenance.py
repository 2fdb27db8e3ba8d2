"""The provenance check: one model revision and chat template per output unless allowed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.schema import ROW_SCHEMA
from tasks.validation import Check, Thresholds, ValidationFailed, gate_shard, validate_output
from tests.support.outputs import MODEL_REVISION, TEMPLATE_HASH, make_row, write_output

OTHER_TEMPLATE = "sha256:1111111111111111"
OTHER_REVISION = "sha256:2222222222222222"


def rows(dataset: str, start: int, n: int, **columns: object) -> list[dict[str, object]]:
    return [{**make_row(dataset, i), **columns} for i in range(start, start + n)]


def provenance(report, dataset: str) -> Check:  # type: ignore[no-untyped-def]
    d = next(d for d in report.datasets if d.name == dataset)
    return next(c for c in d.checks if c.name == "provenance")


def test_template_mix_across_shards_fails_naming_shards_and_values(tmp_path):
    shards = [rows("glaive", 0, 10), rows("glaive", 10, 10), rows("glaive", 20, 5, chat_template_hash=OTHER_TEMPLATE)]
    out = write_output(tmp_path / "out", {"glaive": shards}, shard_size=10)
    report = validate_output(out)
    check = provenance(report, "glaive")
    assert check.status == "fail" and report.verdict == "fail"
    assert check.message == (
        f"mixed provenance in glaive: chat_template_hash: 2 values: '{TEMPLATE_HASH}' (20 rows in shards "
        f"0-1), '{OTHER_TEMPLATE}' (5 rows in shards 2); rows were generated with different chat templates "
        "(a resume after the model directory changed): rerun the minority shards with the model and "
        "template of the rest, or accept the mix with [validation] allow_mixed_provenance = true "
        "(`datagen validate --threshold allow_mixed_provenance=true`)")
    # each shard on its own holds one template: the gate lets them through
    assert [c.status for c in gate_shard(out, "glaive", 2).checks if c.name == "provenance"] == ["pass"]

    allowed = validate_output(out, Thresholds.from_dict({"allow_mixed_provenance": True}))
    assert provenance(allowed, "glaive").status == "warn" and allowed.verdict == "warn"
    assert provenance(allowed, "glaive").message.endswith("allowed by allow_mixed_provenance")


def test_revision_mix_inside_one_shard_stops_the_gate(tmp_path):
    shard = rows("glaive", 0, 6) + rows("glaive", 6, 2, model_revision=OTHER_REVISION)
    out = write_output(tmp_path / "out", {"glaive": [shard]}, shard_size=8)
    with pytest.raises(ValidationFailed) as e:
        gate_shard(out, "glaive", 0)
    assert e.value.message.startswith(
        f"mixed provenance in shard 0 of glaive: model_revision: 2 values: '{MODEL_REVISION}' (6 rows in "
        f"shards 0), '{OTHER_REVISION}' (2 rows in shards 0); rows were generated with different model "
        "revisions")


def test_mix_across_datasets_fails_every_dataset_of_the_output(tmp_path):
    out = write_output(tmp_path / "out", {
        "a": [rows("a", 0, 4)],
        "b": [rows("b", 0, 4, chat_template_hash=OTHER_TEMPLATE)],
    }, shard_size=4)
    report = validate_output(out)
    for name in ("a", "b"):
        check = provenance(report, name)
        assert check.status == "fail", check
        assert check.message.startswith(
            f"mixed provenance in the datasets of {out}: chat_template_hash: 2 values: "
            f"'{OTHER_TEMPLATE}' (4 rows in b shards 0), '{TEMPLATE_HASH}' (4 rows in a shards 0)")


def test_null_template_of_pre_rendered_prompts_is_no_mix(tmp_path):
    shards = [rows("glaive", 0, 5), rows("glaive", 5, 5, chat_template_hash=None, model_revision=None)]
    out = write_output(tmp_path / "out", {"glaive": shards}, shard_size=5)
    report = validate_output(out)
    assert provenance(report, "glaive").status == "pass" and report.verdict == "pass"


def test_shard_of_the_older_schema_passes_schema_and_its_null_provenance_is_no_mix(tmp_path):
    # A shard written before the provenance columns existed is conformed (tasks.schema.ADDED_DEFAULTS:
    # null provenance), so it validates; beside a newer shard its nulls are "not a value", not a mix.
    older = pa.schema([f for f in ROW_SCHEMA if f.name not in ("model_revision", "chat_template_hash")])
    shards = [rows("glaive", 0, 5), rows("glaive", 5, 5)]
    first_id = shards[0][0]["id"]
    out = write_output(tmp_path / "out", {"glaive": shards}, shard_size=5,
                       table_hook=lambda t: t.select(older.names) if t["id"][0].as_py() == first_id else t)
    assert "model_revision" not in pq.read_schema(out / "glaive" / "shard-00000.parquet").names
    report = validate_output(out)
    first, second = ({c.name: c for c in shard.checks} for shard in report.datasets[0].shards)
    assert first["schema"].status == "pass", first["schema"]
    assert second["schema"].status == "pass", second["schema"]
    assert provenance(report, "glaive").status == "pass"
    assert provenance(report, "glaive").message == "one model revision and chat template"
    assert report.verdict == "pass"
