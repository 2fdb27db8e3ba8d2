"""Exit codes that tell a wrapper the truth (issue 23 item 6): a Ctrl-C wrapped by a library is still
130, never 2; a reader that closed the pipe (`datagen export ... | head -1`) ends the command quietly
with 141."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.outputs import clean_output
from tests.support.paths import REPO_ROOT

DATAGEN = str(Path(sys.executable).parent / "datagen")


def test_a_ctrl_c_that_a_library_wraps_in_its_own_error_exits_130_not_2() -> None:
    probe = ("import sys; from datagen import cli; "
             "cli.COMMANDS['probe'] = ('tests.support.sigint_probe', 'test probe'); sys.exit(cli.main(['probe']))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "datagen probe: interrupted\n")


def test_export_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    out = clean_output(tmp_path / "out", shards=2, shard_size=50)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -1` that has already exited: every write fails with EPIPE
    try:
        proc = subprocess.run([DATAGEN, "export", "--format", "sharegpt", str(out)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO_ROOT)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_export_piped_to_head_gives_the_first_line_and_a_quiet_exit(tmp_path: Path) -> None:
    # About 240 KB of output, well past a pipe's 64 KiB: the export must still be writing when head
    # exits, so it meets the closed pipe every time. (With 24 KB it could write everything before
    # head had read a line, finish with 0 and its summary on stderr: a loaded machine did so.)
    out = clean_output(tmp_path / "out", shards=4, shard_size=250)
    proc = subprocess.run(f"'{DATAGEN}' export --format sharegpt '{out}' | head -1; echo \"${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    first, status = proc.stdout.splitlines()
    assert first.startswith('{"id": "glaive-000000", "conversations": '), first
    assert (status, proc.stderr) == ("141", ""), (status, proc.stderr)


def test_export_to_an_unwritable_out_names_the_path_given(tmp_path: Path) -> None:
    out = clean_output(tmp_path / "out", shards=1, shard_size=5)
    for target in ("/proc/self/x", str(tmp_path / "no" / "such" / "x.jsonl")):
        proc = subprocess.run([DATAGEN, "export", "--format", "sharegpt", "--out", target, str(out)],
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert proc.returncode == 2
        assert proc.stderr == (f"datagen export: [Errno 2] No such file or directory (writing it through a temp "
                               f"file beside it): '{target}'\n")
