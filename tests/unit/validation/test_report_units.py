"""What the validation table says of a check's value: one unit for the value and its limit, and what
is counted (issue 25 item 9); the demo partition's limits fail an output where half the rows have no
reasoning."""

from __future__ import annotations

from tasks.config import load_partition
from tasks.shards import rows_to_table
from tasks.validation import Thresholds, validate_table
from tasks.validation._artifacts import report_markdown, report_table
from tasks.validation._results import Check, DatasetValidation, ValidationReport, measured
from tests.support.outputs import make_row
from tests.support.paths import REPO_ROOT


def test_a_rate_and_its_limit_share_one_unit_and_say_what_they_count() -> None:
    assert measured(Check("reasoning_present", "pass", 0.0, 0.05, "m")) == ("0% without reasoning", "at most 5%")
    assert measured(Check("volume", "pass", 0.0, 0.2, "m")) == ("0% rejected", "at most 20%")
    assert measured(Check("volume", "fail", 0, 1, "m")) == ("0 rows", "at least 1 rows")
    assert measured(Check("tag_leak", "fail", 0.0125, 0.01, "m")) == ("1.25% with tags left", "at most 1%")
    assert measured(Check("complete", "pass", 3, 3, "m")) == ("3 of 3 shards", "")
    assert measured(Check("unique_ids", "fail", 4, 0, "m")) == ("4 duplicate rows", "")
    assert measured(Check("fingerprint", "pass", 1, 1, "m")) == ("", "")  # yes/no: the message says
    assert measured(Check("token_counts", "pass", 5.237, "0.25..16.0", "m")) == ("5.24 chars/token",
                                                                               "0.25..16.0 chars/token")


def test_the_artifacts_show_the_measured_value_and_its_limit_never_a_bare_fraction() -> None:
    c = Check("reasoning_present", "pass", 0.0, 0.5, "reasoning present in all 10 rows that expect it", 0, 10)
    report = ValidationReport("/o", [DatasetValidation("a", 10, [], [c])], Thresholds())
    assert report_table(report)[0] == {"dataset": "a", "check": "reasoning_present", "status": "pass",
                                            "measured": "0% without reasoning", "limit": "at most 50%", "rows": 10,
                                            "message": c.message}
    md = report_markdown(report)
    assert "| check | status | measured | limit | message |" in md
    assert "| reasoning_present | pass | 0% without reasoning | at most 50% |" in md and "| 0.5 |" not in md
    assert "without reasoning" in report.summary() and "(at most 50%)" in report.summary()


def test_the_demo_partition_fails_an_output_where_half_the_rows_have_no_reasoning() -> None:
    cfg = load_partition(str(REPO_ROOT / "deployments" / "demo.toml"))
    thr = cfg.validation  # typed at load
    rows = [make_row("d", i) for i in range(40)]
    for i in range(0, 40, 2):
        rows[i] = make_row("d", i, raw="<think></think>\n\nFour.")
    checks = {c.name: c for c in validate_table(rows_to_table(rows), thr)}
    assert checks["reasoning_present"].status == "fail", checks["reasoning_present"]
