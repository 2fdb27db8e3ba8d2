"""`datagen demo` (what `make demo` runs) as a new user meets it: one validation table, a `View at`
link that says it lives only while the command runs, and a "next:" block whose commands work
(issue 25 item 11)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.runs import cli_env

pytestmark = pytest.mark.slow
DATAGEN = str(Path(sys.executable).parent / "datagen")


def test_demo_prints_one_table_an_honest_link_and_next_steps_that_work(tmp_path: Path) -> None:
    env = cli_env(tmp_path, tmp_path / "unused", own_api=True)  # make demo: no server anywhere
    env.pop("DATAGEN_SIM_GPUS")
    out = tmp_path / "demo"
    res = subprocess.run([DATAGEN, "demo", "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=400, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    both = res.stdout + res.stderr
    assert both.count("ok   schema ") == 2, both[-4000:]  # one table (of two datasets), not two
    assert f"validation of {out}: PASS (600 rows, " in res.stdout
    view = [x for x in res.stderr.splitlines() if " - View at http://127.0.0.1:" in x]
    assert len(view) == 1 and view[0].endswith("(while this command runs: its own Prefect API stops when it ends; "
                                               "`make up` keeps a server and its UI)"), view
    lines = res.stdout.splitlines()
    steps = lines[lines.index("next:") + 1:]
    assert len(steps) == 5 and all(x.startswith("  ") for x in steps), steps
    by_what = {x[:26].strip(): x[26:] for x in steps}
    assert by_what["the dataset card"] == f"{out}/README.md" and (out / "README.md").is_file()
    rows = subprocess.run(shlex.split(by_what["a few rows"]), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert rows.returncode == 0 and "'id': 'glaive-" in rows.stdout, rows.stdout + rows.stderr
    export = shlex.split(by_what["training JSONL"].replace("/tmp/glaive_like.jsonl", str(tmp_path / "x.jsonl")))
    exp = subprocess.run(export, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert exp.returncode == 0, exp.stderr
    first = json.loads((tmp_path / "x.jsonl").read_text().splitlines()[0])
    assert first["conversations"][-1]["from"] == "gpt"
    assert by_what["your own prompts"].startswith(".venv/bin/datagen run --input my.jsonl --backend emulator")
    assert "make up" in by_what["through Prefect"]
