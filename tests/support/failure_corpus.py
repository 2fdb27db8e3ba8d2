"""The SGLang failure corpora (tests/data/sglang_failures): reading a log and classifying it.

Each file starts with ``# key: value`` lines: ``source`` (a real run here, or the GitHub issue the
log lines are quoted from), ``expect`` (the kind a careful engineer gives it), optionally ``exit``
(the exit status), ``suggested`` (the fraction SGLang names) and ``note``. The tuned corpus is the
directory's own ``*.log``; ``heldout/`` holds logs the classifier was not tuned on.
"""

from __future__ import annotations

from pathlib import Path

from tasks.server import Attempt, Failure, TuningPolicy, classify_failure, next_fraction, runtime_failure
from tests.support.paths import REPO_ROOT

CORPUS = REPO_ROOT / "tests" / "data" / "sglang_failures"
HELDOUT = CORPUS / "heldout"
# Failures that are not about memory must never move --mem-fraction-static.
MOVES_FRACTION = frozenset({"too_high", "too_low"})


def read_log(path: Path) -> tuple[dict[str, str], str]:
    """A corpus file's header (``# key: value`` lines) and the log text after it."""
    header: dict[str, str] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and lines[0].startswith("# ") and ":" in lines[0]:
        key, _, value = lines.pop(0)[2:].partition(":")
        header[key.strip()] = value.strip()
    return header, "\n".join(lines)


def classify_log(path: Path) -> tuple[dict[str, str], str, Failure]:
    """The header, the log text and classify_failure's verdict (with the header's exit status)."""
    header, text = read_log(path)
    return header, text, classify_failure(text, int(header["exit"]) if "exit" in header else None)


def fraction_moves(text: str, failure: Failure) -> list[str]:
    """How a failure moves the fraction: [] when neither the tuner nor the runtime-OOM path does."""
    moves = []
    if next_fraction([Attempt(0.8, 0.8, failure, None, 1.0)], TuningPolicy()) is not None:
        moves.append(f"tuner steps to another fraction ({failure.kind})")
    if runtime_failure(text) is not None:
        moves.append("recorded as a runtime OOM")
    return moves
