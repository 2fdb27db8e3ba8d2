"""The run summary's markdown: the reason shows as written in the Prefect UI."""

from __future__ import annotations

from flows.summary import RunSummary


def test_the_why_line_keeps_think_tags_visible() -> None:
    s = RunSummary(partition="demo", verdict="FAIL", out_dir="/o", latest=None, rows={"ds": 0}, rows_new=0,
                   prompt_tokens=0, completion_tokens=0, wall_s=1.0, gpus=1, gpu_hours=None, relaunches=0,
                   max_relaunches=3, reason="ValidationFailed: the raw output uses the <think>…</think> format")
    md = s.markdown()
    assert "Why: ValidationFailed: the raw output uses the &lt;think&gt;…&lt;/think&gt; format\n" in md
    assert "<think>" not in md
