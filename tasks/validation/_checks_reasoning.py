"""Checks of the reasoning/content split: ``reasoning_present``, ``tag_leak`` and ``resplit``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tasks.reasoning import split_reasoning
from tasks.validation._results import Check, Context
from tasks.validation._stats import (
    LEAK_MARKERS,
    LEAK_REGEX,
    TAG_FAMILIES,
    Stats,
    blank,
    count_true,
    counts,
    example_note,
    first_id,
    fix_parser,
    majority,
    no_parser,
    pct,
    rate_check,
    requires,
    resplit_command,
)
from tasks.validation._thresholds import Thresholds


# reasoning present --------------------------------------------------------------------------------
@requires("reasoning", "reasoning_parser", "think_in_prompt", "finish_reason", "raw", "id")
def measure_reasoning(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    has_parser = pc.invert(no_parser(table))
    tip = pc.fill_null(table.column("think_in_prompt"), False)
    not_abort = pc.not_equal(table.column("finish_reason"), "abort")
    expected = pc.and_(pc.or_(has_parser, tip), pc.fill_null(not_abort, True))
    reasoning = table.column("reasoning")
    missing = pc.and_(expected, blank(reasoning))
    n_missing = count_true(missing)
    stats: Stats = {
        "rows": table.num_rows,
        "expected": count_true(expected),
        "missing": n_missing,
        "missing_null": 0,
        "missing_think_in_prompt": 0,
        "parsers": counts(table.column("reasoning_parser").filter(expected)) if n_missing else {},
        "tags_in_raw": {},
        "tag_examples": {},  # end tag -> a row missing reasoning whose raw holds it
        "plain_example": None,  # a row missing reasoning whose raw holds no end tag
        "resplit_probe": 0,  # rows holding the tag re-split with the parser that fits them
        "resplit_gain": 0,  # of those, rows that get reasoning from it
        "probe_parser": None,
        "example": None,
    }
    if n_missing:
        # Diagnose only on breach: which tags the raw text carries tells which parser was needed.
        stats["missing_null"] = count_true(pc.and_(missing, pc.is_null(reasoning)))
        stats["missing_think_in_prompt"] = count_true(pc.and_(missing, tip))
        raw_missing = table.column("raw").filter(missing)
        # think_in_prompt was computed with the run's parser: a wrong parser cannot see that the
        # template opened another family's think block, so read the prompt text as well.
        prompts = (pc.utf8_rtrim_whitespace(table.column("prompt").filter(missing))
                   if "prompt" in table.column_names else None)
        ids_missing = table.column("id").filter(missing)
        tagged: pa.ChunkedArray | None = None
        for start, end in TAG_FAMILIES:
            holds = pc.fill_null(pc.match_substring(raw_missing, end), False)
            hits = count_true(holds)
            if hits:
                stats["tags_in_raw"][end] = hits
                stats["tag_examples"][end] = str(ids_missing.filter(holds)[0].as_py())
                tagged = holds if tagged is None else pc.or_(tagged, holds)
                if prompts is not None:
                    opened = count_true(pc.fill_null(pc.ends_with(prompts, start), False))
                    stats["missing_think_in_prompt"] = max(stats["missing_think_in_prompt"], opened)
        plain = ids_missing if tagged is None else ids_missing.filter(pc.invert(tagged))
        stats["plain_example"] = str(plain[0].as_py()) if len(plain) else None
        stats["example"] = first_id(table, missing)
        if stats["tags_in_raw"]:
            # the three columns the probe reads, not the whole table, are filtered
            _probe_resplit(table.select(["raw", "reasoning_parser", "think_in_prompt"]).filter(missing).filter(tagged),
                           stats)
    return stats


RESPLIT_PROBE_ROWS = 64


def _probe_resplit(rows: pa.Table, stats: Stats) -> None:
    """Re-split (a sample of) the rows that hold the dominant end tag with the parser that fits it (the
    row's own when it does), counting the rows that would get reasoning: a suggested `datagen resplit`
    says how many rows it changes, and is not suggested when it changes none."""
    end = max(stats["tags_in_raw"].items(), key=lambda kv: kv[1])[0]
    fits = next(p for (_st, en), p in TAG_FAMILIES.items() if en == end)
    sample = rows.take(_sample_indices(rows.num_rows, RESPLIT_PROBE_ROWS)).to_pylist()
    for row in sample:
        parser = row["reasoning_parser"] if row["reasoning_parser"] in fits else fits[0]
        stats["probe_parser"] = stats["probe_parser"] or parser
        try:
            reasoning, _ = split_reasoning(row["raw"], parser, force_reasoning=True if row["think_in_prompt"] else None)
        except ValueError:
            continue
        if end not in (row["raw"] or ""):
            continue
        stats["resplit_probe"] += 1
        stats["resplit_gain"] += bool(reasoning and reasoning.strip())


def judge_reasoning(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["missing"], s["expected"]
    if total == 0:
        return Check("reasoning_present", "pass", 0.0, thr.reasoning_missing_max_rate,
                     "no reasoning parser and no think block in the prompt: reasoning not expected", 0, 0)
    if bad == 0:
        return Check("reasoning_present", "pass", 0.0, thr.reasoning_missing_max_rate,
                     f"reasoning present in all {total} rows that expect it", 0, total)
    parser = majority(s["parsers"])
    head = f"reasoning empty in {pct(bad, total)} of {total} rows of {ctx.label}"
    resplit = resplit_command(ctx)
    tagged = sum(s["tags_in_raw"].values())
    end = max(s["tags_in_raw"].items(), key=lambda kv: kv[1])[0] if tagged else ""
    probe, gain = s.get("resplit_probe", 0), s.get("resplit_gain", 0)
    changes = (f" (re-split with {s.get('probe_parser')}, {gain} of the {probe} of these rows checked get reasoning)"
               if gain and ctx.committed else "")
    example = s.get("plain_example") or s.get("example")
    if tagged * 2 > bad:  # most of the rows hold an end tag: the split is what went wrong
        example = (s.get("tag_examples") or {}).get(end) or s.get("example")
        start = next(st for (st, en) in TAG_FAMILIES if en == end)
        fits = next(p for (st, en), p in TAG_FAMILIES.items() if en == end)
        opener = ("the prompt opens the think block (chat template) and "
                  if s["missing_think_in_prompt"] * 2 > bad else "")
        cause = (f"{opener}the raw output uses the {start}…{end} format but parser is {parser}; "
                 f"{fix_parser(', '.join(fits[:3]))}, then {resplit}{changes}")
        if parser != "none" and parser in fits:
            cause = (f"the raw output holds {end} but the split did not use it (parser {parser}, "
                     f"think_in_prompt taken into account?); {'run ' if ctx.committed else ''}"
                     f"{resplit_command(ctx, parser)}{changes}")
            if probe and not gain:  # the same parser on the same text: a resplit would change nothing
                cause = (f"the raw output holds {end} but splitting it with {parser} gives no reasoning either "
                         f"(re-split {probe} of these rows to check): the think blocks are empty or the text "
                         f"before {end} is not reasoning; check the model's chat template and stop strings")
    elif s["missing_think_in_prompt"] * 2 > bad:
        cause = (f"the prompt opens the think block (chat template) but parser is {parser} and the "
                 f"output was not treated as reasoning; {fix_parser()}, then {resplit}")
    elif s["missing_null"] * 2 <= bad:
        cause = ("the model wrote empty think blocks (thinking disabled in the chat template?); if that is "
                 "intended raise reasoning_missing_max_rate in the partition's [validation]")
    else:
        cause = (f"parser is {parser} but the model wrote no reasoning block; if this model does not "
                 f"reason drop the parser (then {resplit}), else check its chat template")
    if 0 < tagged * 2 <= bad:  # a few rows hold the tag: said, with what re-splitting them would change
        minority = f"{tagged} of these rows hold {end}"
        if gain and s.get("probe_parser"):
            cause += (f"; {minority}: `datagen resplit` with --parser {s['probe_parser']} gives reasoning to {gain} of "
                      f"the {probe} checked")
        elif probe:
            cause += f"; {minority}, but re-splitting them gives no reasoning either"
    note = f" (e.g. id {example})" if example else ""
    return rate_check("reasoning_present", bad, total, thr.reasoning_missing_max_rate,
                      thr.reasoning_missing_warn_rate, thr, f"{head}{note}: {cause}")


# tag leak -----------------------------------------------------------------------------------------
@requires("content", "reasoning", "reasoning_parser", "id")
def measure_tags(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    in_content = pc.fill_null(pc.match_substring_regex(table.column("content"), LEAK_REGEX), False)
    in_reasoning = pc.fill_null(pc.match_substring_regex(table.column("reasoning"), LEAK_REGEX), False)
    leaked = pc.or_(in_content, in_reasoning)
    stats: Stats = {"rows": table.num_rows, "leaked": count_true(leaked), "content": count_true(in_content),
                    "reasoning": count_true(in_reasoning), "tags": {}, "parsers": {}, "example": None}
    if stats["leaked"]:
        for column, mask in (("content", in_content), ("reasoning", in_reasoning)):
            texts = table.column(column).filter(mask)
            for tag in LEAK_MARKERS:
                hits = count_true(pc.match_substring(texts, tag)) if len(texts) else 0
                if hits:
                    stats["tags"][f"{column}:{tag}"] = hits
        stats["parsers"] = counts(table.column("reasoning_parser").filter(leaked))
        stats["example"] = first_id(table, leaked)
    return stats


def judge_tags(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["leaked"], s["rows"]
    if bad == 0:
        return Check("tag_leak", "pass", 0.0, thr.tag_leak_max_rate, "no think/channel tags left", 0, total)
    where, tag = max(s["tags"].items(), key=lambda kv: kv[1])[0].split(":", 1)
    parser = majority(s["parsers"])
    fits = LEAK_MARKERS[tag]
    if parser == "none":
        cause = (f"the model writes {tag} but no reasoning parser is set; {fix_parser(fits)}, then "
                 f"{resplit_command(ctx)}")
    elif parser not in fits.split(", "):
        cause = (f"the model writes {tag} but parser is {parser}; {fix_parser(fits)}, then "
                 f"{resplit_command(ctx)}")
    else:
        cause = (f"parser {parser} left its own tag in {where} (a second think block, or a start tag not at "
                 f"the beginning); inspect these rows; raise tag_leak_max_rate if they are legitimate")
    return rate_check("tag_leak", bad, total, thr.tag_leak_max_rate, 0.0, thr,
                      f"{tag} left in {where} of {pct(bad, total)} of {total} rows of {ctx.label}"
                      f"{example_note(s)}: {cause}")


# resplit ------------------------------------------------------------------------------------------
def _sample_indices(n: int, k: int) -> list[int]:
    if k <= 0 or k >= n:
        return list(range(n))
    return sorted({(i * n) // k for i in range(k)})


@requires("raw", "reasoning", "content", "reasoning_parser", "think_in_prompt", "id")
def measure_resplit(table: pa.Table, ctx: Context, thr: Thresholds) -> Stats:
    raw, reasoning, content = table.column("raw"), table.column("reasoning"), table.column("content")
    unparsed = no_parser(table)
    # Every row: without a parser the content is the raw text and there is no reasoning.
    np_bad = pc.and_(unparsed, pc.or_(pc.is_valid(reasoning), pc.fill_null(pc.not_equal(content, raw), True)))
    # Every row: a split never adds text.
    parts = pc.add(pc.fill_null(pc.utf8_length(reasoning), 0), pc.fill_null(pc.utf8_length(content), 0))
    overlong = pc.fill_null(pc.greater(parts, pc.utf8_length(raw)), True)
    bad_rows = pc.or_(np_bad, overlong)
    stats: Stats = {"rows": table.num_rows, "checked": table.num_rows, "mismatch": count_true(bad_rows),
                    "example": first_id(table, bad_rows), "parser": None}
    # A sample of rows with a parser: the real split must give the stored columns.
    # Indices first, then take only the sampled rows (filtering the whole table would copy it).
    where = pc.indices_nonzero(pc.invert(unparsed))
    if len(where):
        picked = where.take(_sample_indices(len(where), thr.resplit_sample_rows))
        sample = table.select(["id", "raw", "reasoning", "content", "reasoning_parser", "think_in_prompt"]
                              ).take(picked).to_pylist()
        for row in sample:
            try:
                got = split_reasoning(row["raw"], row["reasoning_parser"],
                                      force_reasoning=True if row["think_in_prompt"] else None)
            except ValueError:
                got = None  # unknown parser name: cannot be what the split came from
            if got != (row["reasoning"], row["content"]):
                stats["mismatch"] += 1
                stats["example"] = stats["example"] or row["id"]
                stats["parser"] = stats["parser"] or row["reasoning_parser"]
        stats["checked"] = table.num_rows - len(where) + len(sample)
    return stats


def judge_resplit(s: Stats, ctx: Context, thr: Thresholds) -> Check:
    bad, total = s["mismatch"], s["checked"]
    if bad == 0:
        return Check("resplit", "pass", 0, 0, f"raw re-splits to the stored reasoning/content ({total} rows checked)",
                     0, total)
    parser = s["parser"] or "none"
    return Check(
        "resplit", "fail", bad, 0,
        f"raw does not re-split to the stored reasoning/content in {bad} of {total} checked rows of "
        f"{ctx.label} (parser {parser}, e.g. id {s['example']}): the split used other settings or raw and "
        f"content belong to different rows; {'run ' if ctx.committed else ''}{resplit_command(ctx)}",
        bad, total,
    )
