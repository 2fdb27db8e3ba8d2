"""Held-out SGLang failure logs (tests/data/sglang_failures/heldout): the classifier was not tuned on them.

Each was labelled (``expect``) before the classifier first read it (see the history of heldout/). The
classifier must agree with those labels on at least 95% of the set, and a failure whose label is not
a memory kind must never move --mem-fraction-static, whatever the classifier calls it. A log that
drives a classifier fix moves to the tuned corpus; the set is topped up with fresh logs, labelled first.
"""

from __future__ import annotations

from tests.support.failure_corpus import HELDOUT, MOVES_FRACTION, classify_log, fraction_moves

FILES = sorted(HELDOUT.glob("*.log"))
AGREEMENT = 0.95


def test_heldout_set_is_large_and_real() -> None:
    assert len(FILES) >= 25
    headers = [classify_log(f)[0] for f in FILES]
    assert all(h.get("source", "").startswith("https://github.com/") and h.get("expect") for h in headers)


def test_classifier_agrees_with_the_labels() -> None:
    disagree = []
    for path in FILES:
        header, _, failure = classify_log(path)
        if failure.kind != header["expect"]:
            disagree.append(f"{path.name}: expected {header['expect']}, got {failure.kind} ({failure.evidence!r})")
    agree = len(FILES) - len(disagree)
    assert agree >= AGREEMENT * len(FILES), (
        f"held-out agreement {agree}/{len(FILES)} = {agree / len(FILES):.1%} < {AGREEMENT:.0%}; disagreeing:\n  "
        + "\n  ".join(disagree))


def test_failures_not_about_memory_never_move_the_fraction() -> None:
    moved = []
    for path in FILES:
        header, text, failure = classify_log(path)
        if header["expect"] not in MOVES_FRACTION and (how := fraction_moves(text, failure)):
            moved.append(f"{path.name} (expected {header['expect']}): {'; '.join(how)}")
    assert not moved, "failures not about memory that move the fraction:\n  " + "\n  ".join(moved)
