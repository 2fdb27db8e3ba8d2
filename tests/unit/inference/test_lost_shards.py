"""A rerun on an output whose manifest or shard files were lost or changed, against the real emulator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tasks.shards import OutputDir
from tests.support.inference import EMU_ARGS, assert_exactly_once, metrics, run, write_input
from tests.support.paths import REPO_ROOT


@pytest.fixture
def emulator(sim_gpus, emulator_factory):
    return emulator_factory(EMU_ARGS)


def _files(out):
    """Bytes and inode of every shard file: a rewrite changes the inode even with equal bytes."""
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted((out / "ds").glob("shard-*.parquet"))}


def test_a_lost_manifest_is_rebuilt_from_the_shards_without_a_request(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 100, bad_at=(3, 40))  # 102 records, 7 shards of 16, 2 rejects
    run(inp, out, emulator.url)
    old = json.loads((out / "_manifest.json").read_text())["datasets"]["ds"]
    files = _files(out)
    (out / "_manifest.json").unlink()
    before = metrics(emulator.url)["num_requests_total"]

    r = run(inp, out, emulator.url)

    assert (r.shards_skipped, r.shards_committed_now, r.requests) == (7, 0, 0)
    assert r.recovered["rebuilt_shards"] == 7 and r.recovered["orphan_shards"] == 0
    assert metrics(emulator.url)["num_requests_total"] == before
    assert _files(out) == files
    new = OutputDir(out).read_manifest()["datasets"]["ds"]
    keep = ("file", "rows", "rejects", "sha256")
    assert {k: {f: s[f] for f in keep} for k, s in new["shards"].items()} == \
        {k: {f: s[f] for f in keep} for k, s in old["shards"].items()}
    assert (new["input_fingerprint"], new["total_rows"], new["complete"]) == (old["input_fingerprint"], 102, True)
    assert_exactly_once(out, ids)


def test_a_lost_manifest_with_a_shard_that_is_not_its_slice_refuses_and_keeps_every_file(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 64)
    run(inp, out, emulator.url)
    (out / "_manifest.json").unlink()
    shutil.copyfile(out / "ds" / "shard-00003.parquet", out / "ds" / "shard-00002.parquet")
    files = _files(out)
    before = metrics(emulator.url)["num_requests_total"]

    with pytest.raises(Exception, match=r"shard-00002\.parquet: 16 row id\(s\) are not records of input slice 2 "
                                        r"\(e\.g\. 'q00048'\)") as info:
        run(inp, out, emulator.url)
    assert str(info.value) == (
        f"{out / 'ds'} holds 4 shard file(s) that no manifest records ({out / '_manifest.json'} is missing or "
        f"lacks 'ds'), and 1 of them are not this input's slices of 16 records: shard-00002.parquet: 16 row "
        f"id(s) are not records of input slice 2 (e.g. 'q00048'). Nothing was changed. Restore "
        f"_manifest.json, or rerun with the input and --shard-size (and --samples, --regenerate) the output "
        f"was written with; a shard "
        f"file moved out of {out / 'ds'} is generated again")
    assert _files(out) == files and not (out / "_manifest.json").exists()
    assert metrics(emulator.url)["num_requests_total"] == before
    # with another shard size, no file is a slice: refused the same way
    with pytest.raises(Exception, match=r"4 of them are not this input's slices of 32 records"):
        run(inp, out, emulator.url, shard=32)
    assert _files(out) == files


def test_a_damaged_or_missing_shard_is_refused_at_start_and_regenerated_after_repair(tmp_path, emulator):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_input(inp, 80)
    run(inp, out, emulator.url)  # 5 shards
    (out / "ds" / "shard-00001.parquet").unlink()
    damaged = out / "ds" / "shard-00003.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-9] + b"garbage!!")
    intact = {k: v for k, v in _files(out).items() if k != damaged.name}
    manifest = (out / "_manifest.json").read_bytes()
    before = metrics(emulator.url)["num_requests_total"]

    with pytest.raises(Exception, match=r"^2 committed shard\(s\) of .* do not match the manifest: shard 1 of 'ds' "
                                        r"\(ds/shard-00001\.parquet\): the file is missing; shard 3 of 'ds'") as info:
        run(inp, out, emulator.url)
    assert str(info.value).endswith(
        f"Run `datagen repair {out}` to un-commit them, then rerun: exactly those shards are generated again "
        f"(or restore the files from a copy)")
    assert metrics(emulator.url)["num_requests_total"] == before
    assert (out / "_manifest.json").read_bytes() == manifest

    proc = subprocess.run([sys.executable, "-m", "datagen", "repair", str(out)], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO_ROOT), env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    r = run(inp, out, emulator.url)
    assert (r.shards_committed_now, r.shards_skipped, r.requests) == (2, 3, 32)
    assert {k: v for k, v in _files(out).items() if k in intact} == intact
    assert_exactly_once(out, ids)
    OutputDir(out).check_intact()
