"""`datagen status`, `datagen repair` and `datagen validate` on hand-built outputs, as subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.shards import OutputDir
from tasks.validation import validate_output
from tests.support.outputs import clean_output, clean_rows, write_output
from tests.support.paths import REPO_ROOT

# Each test runs `datagen` commands as subprocesses (the user's path): the CLI tier of `make test`, not `make unit`.
pytestmark = pytest.mark.slow


def _datagen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datagen", *args], capture_output=True, text=True, timeout=60,
                          cwd=str(REPO_ROOT))


@pytest.fixture
def output(tmp_path: Path) -> Path:
    """Four committed shards of 10 rows; shard 1 and 3 have 2 reject lines each."""
    data = [clean_rows("ds", 10, k * 12) for k in range(4)]
    out = write_output(tmp_path / "out", {"ds": data}, shard_size=12, rejects={"ds": {0: 2, 1: 2, 2: 2, 3: 2}})
    rejects = out / "_rejects" / "ds.jsonl"  # tagged with their shard, as a run writes them
    lines = [json.loads(x) for x in rejects.read_text().splitlines()]
    rejects.write_text("".join(json.dumps({**r, "shard": r["line"] // 12}) + "\n" for r in lines))
    return out


def _damage(out: Path) -> None:
    (out / "ds" / "shard-00001.parquet").unlink()
    shard = out / "ds" / "shard-00003.parquet"
    shard.write_bytes(shard.read_bytes()[:-9] + b"garbage!!")


def test_status_lists_missing_and_changed_shards_and_exits_1(output: Path) -> None:
    proc = _datagen("status", str(output))
    assert proc.returncode == 0, proc.stderr
    assert "  ds: 4/4 shards, 48 of 48 rows and rejects (40 rows, 8 rejects)" in proc.stdout
    _damage(output)
    proc = _datagen("status", str(output))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "  ds: 4/4 shards, 2 damaged, 48 of 48 rows and rejects (40 rows, 8 rejects)" in lines
    assert "    damaged shard 1 (ds/shard-00001.parquet): the file is missing" in lines
    changed = [x for x in lines if x.startswith("    damaged shard 3 (ds/shard-00003.parquet): sha256 ")]
    assert len(changed) == 1 and changed[0].endswith("(changed after commit)")
    assert f"damaged shards: run `datagen repair {output}` to un-commit them; the next run generates them again" \
        in lines
    doc = json.loads(_datagen("status", str(output), "--json").stdout)
    assert [(d["shard"], d["problem"]) for d in doc["datasets"]["ds"]["damaged"]][0] == (1, "the file is missing")
    assert "Exit codes:" in _datagen("status", "--help").stdout


def test_repair_uncommits_exactly_the_damaged_shards(output: Path) -> None:
    _damage(output)
    manifest_before = (output / "_manifest.json").read_bytes()
    intact = {k: (output / "ds" / f"shard-0000{k}.parquet").read_bytes() for k in (0, 2)}

    proc = _datagen("repair", str(output), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "would un-commit shard 1 of 'ds' (ds/shard-00001.parquet): the file is missing"
    assert proc.stdout.splitlines()[1].startswith("would un-commit shard 3 of 'ds' (ds/shard-00003.parquet): sha256")
    assert (output / "_manifest.json").read_bytes() == manifest_before

    proc = _datagen("repair", str(output))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"2 shard(s) un-committed: the next `datagen run` on {output} generates them again")
    manifest = json.loads((output / "_manifest.json").read_text())
    entry = manifest["datasets"]["ds"]
    assert sorted(entry["shards"]) == ["0", "2"] and entry["complete"] is False
    assert not (output / "ds" / "shard-00003.parquet").exists()
    assert {k: (output / "ds" / f"shard-0000{k}.parquet").read_bytes() for k in (0, 2)} == intact
    assert sorted({r["shard"] for r in OutputDir(output).read_rejects("ds")}) == [0, 2]
    proc = _datagen("status", str(output))
    assert proc.returncode == 0 and "  ds: 2/4 shards, 24 of 48 rows and rejects (20 rows, 4 rejects)" in proc.stdout
    proc = _datagen("repair", str(output))
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"{output}: every committed shard matches the manifest; nothing to repair"


def test_repair_refuses_a_locked_output_and_a_non_output(output: Path, tmp_path: Path) -> None:
    _damage(output)
    before = (output / "_manifest.json").read_bytes()
    with OutputDir(output).lock({"flow_run": "run-42"}):
        proc = _datagen("repair", str(output))
    assert proc.returncode == 2 and "run-42" in proc.stderr and "datagen repair: output" in proc.stderr
    assert (output / "_manifest.json").read_bytes() == before
    proc = _datagen("repair", str(tmp_path / "nothing"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"datagen repair: {tmp_path / 'nothing'}: no _manifest.json (not a datagen " \
                                  f"output, or nothing committed yet)"
    assert not (tmp_path / "nothing").exists()


def test_validate_is_read_only_while_a_run_holds_the_output(tmp_path: Path) -> None:
    out = clean_output(tmp_path / "out")
    report = out / "_validation.json"
    with OutputDir(out).lock({"flow_run": "run-7"}) as lk:
        proc = _datagen("validate", str(out))
    assert proc.returncode == 0, proc.stderr
    assert not report.exists()
    assert proc.stderr.strip() == (
        f"datagen validate: {out} is held by a live run (host={lk.info['host']}, pid={lk.info['pid']}, "
        f"flow_run=run-7, started={lk.info['started']}); validated read-only, _validation.json not written")
    proc = _datagen("validate", str(out))
    assert proc.returncode == 0 and proc.stderr == ""
    assert json.loads(report.read_text())["verdict"] == "pass"


def test_validate_refuses_a_planted_report_symlink(tmp_path: Path) -> None:
    out = clean_output(tmp_path / "out")
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (out / "_validation.json").symlink_to(victim)
    proc = _datagen("validate", str(out))
    assert proc.returncode == 2
    assert f"datagen validate: refusing to write {out / '_validation.json'}: it is a symbolic link to {victim}" \
        in proc.stderr
    assert victim.read_text() == "keep me\n"


def test_validation_of_a_changed_or_missing_shard_names_datagen_repair(output: Path) -> None:
    _damage(output)
    # shard 3: readable, but not the bytes committed
    (output / "ds" / "shard-00003.parquet").write_bytes((output / "ds" / "shard-00002.parquet").read_bytes())
    report = validate_output(output, write=False)
    messages = [c.message for s in report.datasets[0].shards for c in s.checks if c.status == "fail"]
    fix = f"run `datagen repair {output}` to un-commit it: the next run generates it again"
    assert any(m.startswith("shard 1 of ds: cannot read ") and m.endswith(fix) for m in messages), messages
    assert any(m.startswith("the file's sha256 differs from the manifest (changed after commit)") and
               m.endswith(fix) for m in messages), messages


def test_status_says_whether_the_last_validation_still_describes_the_output(output: Path, tmp_path: Path) -> None:
    """Issue 25 item 10: a report of an earlier state is not the output's verdict."""
    env = {**__import__("os").environ, "DATAGEN_STATE_DIR": str(tmp_path / "state")}
    env.pop("PREFECT_API_URL", None)

    def status() -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "datagen", "status", str(output)], capture_output=True,
                              text=True, timeout=60, cwd=str(REPO_ROOT), env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    assert "validation: not run" in status()
    report = validate_output(output)
    line = next(x for x in status() if x.startswith("validation: "))
    assert line == f"validation: {report.verdict} (40 rows, validated {report.validated_at})", line
    manifest = json.loads((output / "_manifest.json").read_text())
    del manifest["datasets"]["ds"]["shards"]["3"]  # as a run that was stopped before its last shard
    manifest["datasets"]["ds"]["complete"] = False
    (output / "_manifest.json").write_text(json.dumps(manifest))
    (output / "ds" / "shard-00003.parquet").unlink()
    line = next(x for x in status() if x.startswith("validation: "))
    assert line.startswith(f"validation: not final: ds unfinished (last report: {report.verdict} (40 rows, "), line
    # the fractions: where they were read, and that a copy of the Variables is kept there
    assert f"  (read from {tmp_path / 'state' / 'fractions.json'}, where each run on this host keeps a copy" \
        in "\n".join(status())
