"""The decision records stay curated: each is listed in the index once, starts with a title and a
sentence (not a fragment of a cut title), and every record a document or docstring names exists or
is listed as merged into one that does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions"
CITES = re.compile(r"[Dd]ecisions? (\d{1,3})\b|decisions/(\d{1,3})(?:-[a-z0-9-]+(?:\.md)?)?\b")


def _records() -> dict[int, Path]:
    return {int(p.name.split("-")[0]): p for p in DECISIONS.glob("[0-9]*.md")}


def _merged() -> dict[int, int]:
    text = (DECISIONS / "README.md").read_text()
    return {int(a): int(b) for a, b in re.findall(r"^- (\d+): merged into \[(\d+)\]", text, re.M)}


def test_every_record_is_listed_once_and_the_index_names_no_other() -> None:
    text = (DECISIONS / "README.md").read_text()
    listed = re.findall(r"^- \[(\d+)\]\(([^)]+)\): (.+)$", text, re.M)
    records = _records()
    assert sorted(int(n) for n, _, _ in listed) == sorted(records)
    for n, file, title in listed:
        assert records[int(n)].name == file
        assert records[int(n)].read_text().splitlines()[0] == f"# {title}"
    assert not set(_merged()) & set(records)  # a merged number is not reused
    assert set(_merged().values()) <= set(records)


def test_every_record_starts_with_a_title_and_a_sentence() -> None:
    for n, path in _records().items():
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "", path.name  # a one-line title
        body = next(line for line in lines[1:] if line.strip())
        assert body[0].isupper() or body.startswith(("**", "## ", "`", "- ")), (path.name, body)
        assert re.fullmatch(rf"{n:02d}-[a-z0-9]+(-[a-z0-9]+)*\.md", path.name), path.name


def test_every_record_named_in_the_docs_and_the_code_exists() -> None:
    records, merged = _records(), _merged()
    sources = [*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("tasks/**/*.py"),
               *ROOT.glob("flows/**/*.py"), *ROOT.glob("datagen/**/*.py"), *ROOT.glob("emulator/**/*.py"),
               *ROOT.glob("bench/*.py"), ROOT / "pyproject.toml", ROOT / "Makefile"]
    missing = []
    for path in sources:
        for m in CITES.finditer(path.read_text(errors="replace")):
            n = int(m[1] or m[2])
            if n not in records and n not in merged:
                missing.append(f"{path.relative_to(ROOT)}: {m[0]}")
    assert not missing, missing
    for m in re.finditer(r"docs/decisions/([0-9][-a-z0-9]*\.md)", "".join(p.read_text(errors="replace")
                                                                          for p in sources)):
        assert (DECISIONS / m[1]).exists(), m[0]
