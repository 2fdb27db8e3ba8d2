"""`datagen run` / `datagen status` / `datagen up|down` exit codes without a Prefect server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from datagen import cmd_run, cmd_status, cmd_up
from tests.support.paths import REPO_ROOT as ROOT


def test_run_config_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cmd_run.main(["--partition", "nosuch"]) == 2
    assert "no such partition config" in capsys.readouterr().err
    assert cmd_run.main(["--partition", "demo", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert cmd_run.main(["--partition", "demo", "--backend", "tgi"]) == 2
    assert cmd_run.main(["--shard-size", "x"]) == 2


def test_status_of_non_output_is_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_status.main([str(tmp_path)]) == 2
    assert "no _manifest.json" in capsys.readouterr().err


def test_down_without_up_stops_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_up.main(["down", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker: not running" in out and "server: not running" in out
    assert cmd_up.main(["sideways"]) == 2


DATAGEN = str(Path(sys.executable).parent / "datagen")


def _cli(cases: dict[str, list[str]], cwd: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run ``datagen ARGS`` for every case at once (each is a fresh process); name -> result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(PREFECT_HOME=str(cwd / "prefect"), DATAGEN_RUN_DIR=str(cwd / "run"),
               DATAGEN_STATE_DIR=str(cwd / "state"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    procs = {name: subprocess.Popen([DATAGEN, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in cases.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def test_configuration_errors_exit_2_with_one_line_naming_file_and_key(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    base = f'[datasets]\nx = "in.jsonl"\n[model]\npath = "{ROOT}/data/models/demo"\n[server]\nbackend = "emulator"\n'
    bodies = {
        "journal": base.replace("x = ", "_journal = "),
        "sampling": base + '[sampling]\ntemperature = "hot"\n',
        "python": base + 'python = "/no/such"\n',
        "host": base + 'host = "0.0.0.0"\n',
        # a server over two nodes whose tp does not split over them (SGLang refuses it as it starts)
        "nodes": base + 'targets = [{ nodes = ["ssh://gpu1", "ssh://gpu2"], tp_size = 3 }]\n',
    }
    for name, body in bodies.items():
        (tmp_path / f"{name}.toml").write_text(body)
    results = _cli({name: ["run", "--partition", str(tmp_path / f"{name}.toml")] for name in bodies}, tmp_path)
    # every case of tests/unit/config names its key the same way; here: the command line's exit and output
    keys = {"journal": "datasets._journal", "sampling": "sampling.temperature", "python": "server.python",
            "host": "server.host", "nodes": "server.targets[0].tp_size"}
    for name, res in results.items():
        prefix = f"datagen run: configuration error: {tmp_path / name}.toml: {keys[name]}: "
        assert res.returncode == 2, (name, res.stderr)
        assert res.stderr.startswith(prefix) and res.stderr.count("\n") == 1, (name, res.stderr)
        assert not (tmp_path / "prefect" / "prefect.db").exists(), "Prefect started before the configuration was checked"


def test_a_copy_of_demo_toml_elsewhere_is_told_where_its_relative_paths_point(tmp_path: Path) -> None:
    """Issue 25 item 12: the copy resolves data/samples/... against its own folder; the error says how."""
    copy = tmp_path / "my.toml"
    copy.write_text((ROOT / "deployments" / "demo.toml").read_text())
    res = _cli({"copy": ["run", "--partition", str(copy), "--out", str(tmp_path / "out")]}, tmp_path)["copy"]
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        f"datagen run: configuration error: {copy}: datasets.glaive_like: {tmp_path}/data/samples/glaive_like.jsonl: "
        f"no such file; a partition outside {ROOT}/deployments resolves relative paths against its own folder "
        f"({tmp_path}): write {ROOT}/data/samples/glaive_like.jsonl, or put the file in {ROOT}/deployments\n")


def test_unusable_inputs_and_outputs_exit_2_with_one_line(tmp_path: Path) -> None:
    good, bad_pq, folder = tmp_path / "in.jsonl", tmp_path / "bad.parquet", tmp_path / "prompts"
    good.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    bad_pq.write_bytes(b"PAR1 this is not parquet")
    folder.mkdir()
    out = tmp_path / "out"
    model = ["--model-path", str(ROOT / "data" / "models" / "demo"), "--backend", "emulator"]
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "_manifest.json").write_text('{"shard_size": 10, "datasets": {"x": {"shards": 4}}}')
    results = _cli({
        "dir": ["run", "--input", str(folder), *model, "--out", str(out)],
        "parquet": ["run", "--input", str(bad_pq), *model, "--out", str(out)],
        "out_file": ["run", "--input", str(good), *model, "--out", str(good / "out")],
        "out_ro": ["run", "--input", str(good), *model, "--out", "/sys/datagen-out"],
        "no_model": ["run", "--input", str(good)],
        "status_file": ["status", str(good)],
        "status_garbage": ["status", str(garbage)],
    }, tmp_path)
    want = {
        "dir": f"datagen run: configuration error: override: --input {folder}: is a directory; "
               "give a dataset file (.jsonl or .parquet)",
        "parquet": f"datagen run: configuration error: override: --input {bad_pq}: not a readable "
                   "Parquet file: ",
        "out_file": f"datagen run: configuration error: override: out: {good}/out: {good} is not a directory; "
                    "choose another output directory",
        "out_ro": "datagen run: configuration error: override: out: /sys/datagen-out: cannot write in /sys "
                  "(Operation not permitted); choose another output directory",
        "no_model": "datagen run: an --input run without --partition needs --model-path DIR (the model to launch), "
                    "--server-url URL (a running server) or --backend emulator (the bundled demo model on the emulator)",
        "status_file": f"datagen status: {good} is a file, not an output directory: give the directory that "
                       "holds _manifest.json",
        "status_garbage": f"datagen status: {garbage}/_manifest.json: datasets.x.shards: not a table of shards; "
                          "the manifest is damaged",
    }
    for name, res in results.items():
        assert res.returncode == 2, (name, res.stderr)
        assert res.stderr.startswith(want[name]) and res.stderr.count("\n") == 1, (name, res.stderr)
    assert not out.exists() and not (tmp_path / "prefect" / "prefect.db").exists()
