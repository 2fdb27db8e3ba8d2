"""Every `datagen` command that reads an output, on a manifest that is damaged or hostile: one line
naming the manifest and the key (exit 2), never a traceback, never a PASS, and nothing outside the
output read, counted or deleted (issue 23 items 2 and 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.outputs import clean_output
from tests.support.paths import REPO_ROOT

DATAGEN = str(Path(sys.executable).parent / "datagen")
SECRET = b"a file outside the output\n"

Edit = Callable[[dict[str, Any]], None]


def _shard(m: dict[str, Any], k: str = "0") -> dict[str, Any]:
    return m["datasets"]["glaive"]["shards"][k]


def _traversal(m: dict[str, Any]) -> None:
    m["datasets"]["../../evil"] = json.loads(json.dumps(m["datasets"]["glaive"]))


CASES: dict[str, tuple[Edit, str, str]] = {
    # name: (edit, key the message names, problem)
    "traversal name": (_traversal, "datasets.'../../evil'", "dataset name '../../evil' must be 1-128 of"),
    "file outside": (lambda m: _shard(m).update(file="../../../../etc/hostname"), "datasets.glaive.shards.0.file",
                     "'../../../../etc/hostname' is not this shard's file 'glaive/shard-00000.parquet'"),
    "no sha256": (lambda m: _shard(m).pop("sha256"), "datasets.glaive.shards.0.sha256", "missing"),
    "no committed_at": (lambda m: _shard(m).pop("committed_at"), "datasets.glaive.shards.0.committed_at",
                        "missing"),
    "rows text": (lambda m: _shard(m).update(rows="abc"), "datasets.glaive.shards.0.rows",
                  "'abc' is not a whole number >= 0"),
    "shard key": (lambda m: m["datasets"]["glaive"]["shards"].update({"x1": _shard(m)}),
                  "datasets.glaive.shards.x1", "'x1' is not a shard index"),
    "shard size": (lambda m: m.update(shard_size="50"), "shard_size", "'50' is not a whole number >= 1"),
}
COMMANDS = {
    "status": ["status"], "validate": ["validate"], "repair": ["repair"],
    "export": ["export", "--format", "sharegpt", "--out", "{tmp}/export.jsonl"],
    "resplit": ["resplit", "--parser", "qwen3"],
}
# Every command meets the two manifests that point outside the output (what could read, count or
# delete a stranger's file); each other damage is read by the same loader whatever the command, so
# it meets one command, the commands taken in turn: 15 processes where all pairs were 35.
HOSTILE = ("traversal name", "file outside")
PAIRS = [(case, command) for case in HOSTILE for command in COMMANDS] + [
    (case, list(COMMANDS)[i % len(COMMANDS)]) for i, case in enumerate(c for c in CASES if c not in HOSTILE)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Each pair of PAIRS, all at once (each a fresh output and a fresh `datagen` process)."""
    base = tmp_path_factory.mktemp("corrupt")
    procs = {}
    for i, (case, command) in enumerate(PAIRS):
        edit, argv = CASES[case][0], COMMANDS[command]
        tmp = base / f"{i}-{command}"
        out = clean_output(tmp / "a" / "b" / "out", shards=2, shard_size=5)
        evil = tmp / "a" / "evil"  # where '../../evil' points from out
        evil.mkdir()
        (evil / "shard-00000.parquet").write_bytes((out / "glaive" / "shard-00000.parquet").read_bytes())
        (evil / "shard-00099.parquet").write_bytes(SECRET)
        manifest = json.loads((out / "_manifest.json").read_text())
        edit(manifest)
        (out / "_manifest.json").write_text(json.dumps(manifest))
        before = (out / "_manifest.json").read_bytes()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
        env.update(DATAGEN_STATE_DIR=str(tmp / "state"), PREFECT_HOME=str(tmp))
        args = [a.replace("{tmp}", str(tmp)) for a in argv]
        procs[(case, command)] = (subprocess.Popen(
            [DATAGEN, *args, str(out)], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out, evil, before)
    done = {}
    for key, (proc, out, evil, before) in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        done[key] = (proc.returncode, stdout, stderr, out, evil, before)
    return done


def test_every_command_and_every_damage_is_covered() -> None:
    assert {c for c, _ in PAIRS} == set(CASES) and {m for _, m in PAIRS} == set(COMMANDS)


@pytest.mark.parametrize(("case", "command"), PAIRS)
def test_a_damaged_manifest_is_named_with_its_key_and_nothing_outside_is_touched(
        results: dict[tuple[str, str], Any], case: str, command: str) -> None:
    code, stdout, stderr, out, evil, before = results[(case, command)]
    _, key, problem = CASES[case]
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr and "PASS" not in stdout
    assert stderr.startswith(f"datagen {command}: ") and stderr.count("\n") == 1, stderr
    assert f"{out / '_manifest.json'}: {key}: {problem}" in stderr, stderr
    assert stderr.rstrip().endswith("move it aside and rerun with the same input and --shard-size (each shard file "
                                    "that proves to be its input slice is recorded again)"), stderr
    assert sorted(p.name for p in evil.iterdir()) == ["shard-00000.parquet", "shard-00099.parquet"]
    assert (evil / "shard-00099.parquet").read_bytes() == SECRET
    assert (out / "_manifest.json").read_bytes() == before  # nothing rewritten
    assert sorted(p.name for p in (out / "glaive").iterdir()) == ["shard-00000.parquet", "shard-00001.parquet"]
