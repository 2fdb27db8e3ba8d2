"""The dataset card, and the output as the Hugging Face `datasets` library and DuckDB read it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.card import CARD_NAME, hf_features, write_card
from tasks.schema import ROW_SCHEMA
from tasks.validation import validate_output
from tests.support.inference import EMU_ARGS, run


@pytest.fixture
def output(tmp_path, sim_gpus, emulator_factory) -> Path:  # type: ignore[no-untyped-def]
    em = emulator_factory(EMU_ARGS)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    with open(inp, "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"q{i:02d}", "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}"}]}) + "\n")
        f.write("{not json\n")
    run(inp, out, em.url, shard=5, run_info={"flow_run": "fr-card"})
    write_card(out, validate_output(out).to_dict(), title="demo output")
    return out


@pytest.fixture
def hf_home(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    # Offline, with caches under tmp_path: the libraries must read the local files and nothing else.
    for key, value in {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
        monkeypatch.setenv(key, value)
    return tmp_path / "hf"


def test_card_header_is_a_hub_dataset_card(output, hf_home):
    from huggingface_hub import DatasetCard

    card = DatasetCard.load(output / CARD_NAME)
    data = card.data.to_dict()
    assert data["configs"] == [{"config_name": "ds", "data_files": [{"split": "train", "path": "ds/shard-*.parquet"}],
                                "default": True}]
    (info,) = data["dataset_info"]
    assert info["features"] == hf_features()
    # name, bytes and examples: the split form `datasets` reads (without num_bytes it warns and drops it)
    (split,) = info["splits"]
    files = sorted((output / "ds").glob("shard-*.parquet"))
    assert split == {"name": "train", "num_examples": 12, "num_bytes": info["dataset_size"]}
    assert split["num_bytes"] == sum(pq.ParquetFile(f).metadata.row_group(i).total_byte_size
                                     for f in files for i in range(pq.ParquetFile(f).metadata.num_row_groups))
    assert info["download_size"] == sum(f.stat().st_size for f in files)
    assert card.text.startswith("\n# demo output\n")
    # the one rejected input line of 13 warns (reject_warn_rate 5%): the card carries the verdict
    assert "| `ds` | 12 | 1 | 3 of 3 | 12 / 0 / 0 | warn |" in card.text and "Verdict **warn**" in card.text
    assert "| volume | warn | " in card.text
    assert "- run_id: `fr-card` (12 rows)" in card.text and "- engine: `emulator` (12 rows)" in card.text
    assert "- runs (calls per run): `fr-card` (1)" in card.text


def test_datasets_library_loads_the_output_with_the_row_schema(output, hf_home):
    import datasets

    expected = datasets.Features.from_arrow_schema(ROW_SCHEMA)
    ds = datasets.load_dataset("parquet", data_files=str(output / "ds" / "shard-*.parquet"), split="train",
                               cache_dir=str(hf_home / "cache"))
    assert ds.features == expected and ds.num_rows == 12
    assert ds["id"] == [f"q{i:02d}" for i in range(12)]
    assert ds.features["generated_at"] == datasets.Value("timestamp[us, tz=UTC]")
    assert ds.features["attempt"] == datasets.Value("int32") and ds[0]["attempt"] == 1
    assert ds[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "question 0"}]
    # by the card alone: its configs and features are what load_dataset(OUT, name) goes by
    warned: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    handler = Collect()
    logging.getLogger("datasets").addHandler(handler)
    try:
        by_card = datasets.load_dataset(str(output), "ds", split="train", cache_dir=str(hf_home / "cache"))
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert by_card.features == expected and by_card["id"] == ds["id"]
    assert warned == []  # the card's dataset_info is read whole ("splits ... malformed" before)


def test_duckdb_reads_the_output_with_column_types_intact(output):
    import duckdb

    con = duckdb.connect()
    try:
        rel = con.sql(f"SELECT * FROM read_parquet('{output}/ds/shard-*.parquet') ORDER BY id")
        types = dict(zip(rel.columns, (str(t) for t in rel.types), strict=True))
        table = rel.arrow()
        if isinstance(table, pa.RecordBatchReader):  # duckdb >= 1.4 returns a reader
            table = table.read_all()
    finally:
        con.close()
    assert types["messages"] == "STRUCT(\"role\" VARCHAR, \"content\" VARCHAR)[]"
    assert (types["generated_at"], types["attempt"], types["latency_s"], types["think_in_prompt"]) == (
        "TIMESTAMP WITH TIME ZONE", "INTEGER", "DOUBLE", "BOOLEAN")
    assert table.num_rows == 12
    for f in ROW_SCHEMA:  # same Arrow types back (strings may come back as large or view strings)
        got = table.schema.field(f.name).type
        if pa.types.is_string(f.type):
            assert pa.types.is_string(got) or pa.types.is_large_string(got) or pa.types.is_string_view(got), f.name
        elif pa.types.is_timestamp(f.type):  # the same instant type; DuckDB names UTC Etc/UTC
            assert (got.unit, got.tz in ("UTC", "Etc/UTC")) == ("us", True), got
        elif f.name != "messages":
            assert got == f.type, (f.name, got)


def test_datagen_validate_writes_the_card(output):
    from datagen import cmd_validate

    (output / CARD_NAME).unlink()
    assert cmd_validate.main([str(output), "--json"]) == 0
    text = (output / CARD_NAME).read_text()
    assert text.startswith("---\nconfigs:\n") and "\n# out\n" in text and "Verdict **warn**" in text
