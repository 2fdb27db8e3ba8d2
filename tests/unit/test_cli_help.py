"""Every command's --help says what it does and what each option means (issue 25 item 12), and the
top-level help names every export format."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from datagen.cli import COMMANDS, STAND_INS

pytestmark = pytest.mark.slow  # subprocesses: the CLI tier


def _help(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "datagen", *argv, "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _undocumented(text: str) -> list[str]:
    """Options of the help's options section with no help text (argparse prints the signature alone
    on its line, and nothing indented under it)."""
    lines = text[text.index("options:"):].split("\n\n")[0].splitlines()[1:]
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-\S+(?:[ ,][^ ].*?)?)(\s{2,}\S.*)?$", line)
        if not m or m.group(2):
            continue
        follows = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^ {20,}\S", follows):
            bare.append(m.group(1).split(",")[0].split()[0])
    return [b for b in bare if b not in ("-h",)]


@pytest.mark.parametrize("command", sorted([*COMMANDS, *STAND_INS]))
def test_every_command_has_a_description_and_help_for_each_option(command: str) -> None:
    text = _help(command)
    usage_end = text.index("\n\n")
    description = text[usage_end:text.index("options:")].strip() if "options:" in text else ""
    assert description, f"datagen {command} --help has no description:\n{text[:600]}"
    assert _undocumented(text) == [], text


def test_top_level_help_names_every_export_format() -> None:
    from tasks.export import FORMATS

    text = subprocess.run([sys.executable, "-m", "datagen", "--help"], capture_output=True, text=True,
                          timeout=60).stdout
    line = next(x for x in text.splitlines() if x.strip().startswith("export "))
    assert all(f in line for f in FORMATS), line
