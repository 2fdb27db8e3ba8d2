"""Checks of how rows ended and were counted: ``empty_content``, ``truncation``, ``finish_reason``,
``token_counts``."""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.compute as pc

from tasks.validation._results import Check, Context
from tasks.validation._stats import (
    TAG_FAMILIES,
    Stats,
    blank,
    count_true,
    counts,
    example_note,
    first_id,
    fix_parser,
    pct,
    rate_check,
    rate_status,
    requires,
    resplit_command,
    setting_note,
)
from tasks.validation._thresholds import Thresholds

FINISH_REASONS = ("stop", "length", "abort")


# empty content ------------------------------------------------------------------------------------
@requires("content", "reasoning", "finish_reason", "id")
def measure_content(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    finished = pc.fill_null(pc.equal(table.column("finish_reason"), "stop"), False)
    empty = pc.and_(finished, blank(table.column("content")))
    n = count_true(empty)
    into, after = 0, 0
    if n:
        # the answer went into reasoning only when the raw text holds no end tag to split at; a raw
        # text that holds one (looked for in these rows only) is a model that stopped after its reasoning
        into_reasoning = pc.and_(empty, pc.invert(blank(table.column("reasoning"))))
        into = count_true(into_reasoning)
        if into and "raw" in table.column_names:
            raw = table.column("raw").filter(into_reasoning)
            ended = functools.reduce(pc.or_, (pc.fill_null(pc.match_substring(raw, end), False)
                                              for _start, end in TAG_FAMILIES))
            after = count_true(ended)
    return {
        "finished": count_true(finished),
        "empty": n,
        "all_reasoning": into - after,
        "after_reasoning": after,
        "example": first_id(table, empty) if n else None,
    }


def judge_content(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["empty"], s["finished"]
    if bad == 0:
        return Check("empty_content", "pass", 0.0, thr.empty_content_max_rate,
                     f"content present in all {total} finished rows", 0, total)
    if s["all_reasoning"] * 2 > bad:
        cause = ("the split put the whole answer into reasoning (no end tag found: the parser is forced or "
                 "think_in_prompt is set while the model did not think); " + fix_parser() + ", then "
                 f"{resplit_command(ctx)}")
    elif s.get("after_reasoning", 0) * 2 > bad:
        cause = ("the model stopped right after its reasoning (the raw text ends at the end tag: nothing to "
                 "re-split); check the stop strings and the prompts (it ended its turn after thinking)")
    else:
        cause = "the model stopped without an answer; check the prompts and stop strings"
    return rate_check("empty_content", bad, total, thr.empty_content_max_rate, thr.empty_content_warn_rate, thr,
                      f"content empty in {pct(bad, total)} of {total} finished rows of {ctx.label} "
                      f"(e.g. id {s['example']}): {cause}")


# finish reasons -----------------------------------------------------------------------------------
@requires("finish_reason")
def measure_finish(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    by_reason = counts(table.column("finish_reason"))
    return {"rows": table.num_rows, "length": by_reason.get("length", 0), "abort": by_reason.get("abort", 0),
            "invalid": {k: v for k, v in by_reason.items() if k not in FINISH_REASONS}}


def judge_truncation(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["length"], s["rows"]
    if bad == 0:
        return Check("truncation", "pass", 0.0, thr.truncation_max_rate, "no row hit max_new_tokens", 0, total)
    return rate_check("truncation", bad, total, thr.truncation_max_rate, thr.truncation_warn_rate, thr,
                      f"finish_reason length in {pct(bad, total)} of {total} rows of {ctx.label}: outputs hit "
                      f"max_new_tokens; raise [sampling] max_new_tokens (within the context length), generate "
                      f"truncated rows again with a larger budget ([run.truncation] retries)")


def judge_finish(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    total = s["rows"]
    if s["invalid"]:
        shown = ", ".join(f"{k!r} ({v})" for k, v in s["invalid"].items())
        n = sum(s["invalid"].values())
        return Check("finish_reason", "fail", n, 0,
                     f"finish_reason outside stop/length/abort in {ctx.label}: {shown}; the writer "
                     f"stored something else than meta_info.finish_reason.type", n, total)
    bad = s["abort"]
    if bad == 0:
        return Check("finish_reason", "pass", 0.0, thr.abort_max_rate, "no aborted rows", 0, total)
    return rate_check("finish_reason", bad, total, thr.abort_max_rate, 0.0, thr,
                      f"finish_reason abort in {pct(bad, total)} of {total} rows of {ctx.label}: the server "
                      f"aborted requests (overload, OOM or shutdown); see the server log")


# token counts -------------------------------------------------------------------------------------
@requires("raw", "prompt", "prompt_tokens", "completion_tokens", "id")
def measure_tokens(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    ct = pc.fill_null(table.column("completion_tokens"), 0).cast(pa.int64())
    pt = pc.fill_null(table.column("prompt_tokens"), 0).cast(pa.int64())
    raw_len = pc.fill_null(pc.utf8_length(table.column("raw")), 0).cast(pa.int64())
    prompt_len = pc.fill_null(pc.utf8_length(table.column("prompt")), 0)
    negative = pc.or_(pc.less(ct, 0), pc.less(pt, 0))
    zero_ct = pc.and_(pc.greater(raw_len, 0), pc.equal(ct, 0))
    zero_pt = pc.and_(pc.greater(prompt_len, 0), pc.equal(pt, 0))
    # Per-row band, only on rows long enough for the ratio to mean something.
    long_rows = pc.greater_equal(ct, thr.token_ratio_min_tokens)
    low = pc.less(raw_len, pc.multiply(ct, thr.chars_per_token_min))
    high = pc.greater(raw_len, pc.multiply(ct, thr.chars_per_token_max))
    out_band = pc.and_(long_rows, pc.or_(low, high))
    bad = pc.or_(pc.or_(negative, zero_ct), pc.or_(zero_pt, out_band))
    n_bad = count_true(bad)
    return {
        "rows": table.num_rows,
        "bad": n_bad,
        "negative": count_true(negative) if n_bad else 0,
        "zero_completion": count_true(zero_ct) if n_bad else 0,
        "zero_prompt": count_true(zero_pt) if n_bad else 0,
        "out_of_band": count_true(out_band) if n_bad else 0,
        "chars": int(pc.sum(raw_len).as_py() or 0),
        "tokens": int(pc.sum(pc.max_element_wise(ct, 0)).as_py() or 0),
        "example": first_id(table, bad) if n_bad else None,
    }


def judge_tokens(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["bad"], s["rows"]
    ratio = s["chars"] / s["tokens"] if s["tokens"] else 0.0
    band = f"{thr.chars_per_token_min}..{thr.chars_per_token_max}"
    problems = []
    if s["negative"]:
        problems.append(f"{s['negative']} negative counts")
    if s["zero_completion"]:
        problems.append(f"{s['zero_completion']} rows with text but completion_tokens 0")
    if s["zero_prompt"]:
        problems.append(f"{s['zero_prompt']} rows with a prompt but prompt_tokens 0")
    if s["out_of_band"]:
        problems.append(f"{s['out_of_band']} rows outside {band} chars/token")
    agg_bad = s["tokens"] >= thr.token_ratio_min_tokens and not (
        thr.chars_per_token_min <= ratio <= thr.chars_per_token_max)
    if agg_bad:
        problems.insert(0, f"{ratio:.2f} chars per completion token overall (band {band})")
    status = "fail" if agg_bad else rate_status(bad, total, thr.token_mismatch_max_rate, 0.0, thr)
    note = "" if agg_bad else setting_note("token_counts", status, bad, total, thr)
    if not problems:
        return Check("token_counts", "pass", round(ratio, 3), band,
                     f"token counts consistent with the text ({ratio:.2f} chars/token)", 0, total)
    return Check("token_counts", status, round(ratio, 3), band,
                 f"token counts inconsistent with the text in {ctx.label}{example_note(s)}: " + "; ".join(problems)
                 + "; the writer took counts from another field or row (meta_info.prompt_tokens/"
                 "completion_tokens of the same response)" + note, bad, total)
