"""`datagen export OUT_DIR --format sharegpt|openai-messages|specforge [--out FILE]`: training JSONL.

Streams every committed shard (checked against the manifest's sha256) into JSONL on stdout or
``--out FILE`` (written to a temp name and renamed, so a failed export leaves no partial file).
Formats are described in tasks/export.py. Rows cut off by the token limit or aborted are left out
unless ``--include-truncated``. A summary goes to stderr.

With ``--tokenizer DIR`` (the target model's directory), the first 200 records of a ``specforge`` or
``openai-messages`` export are rendered with its chat template, as the trainer will render them
(tasks/export_check.py): the summary says the share of rows whose reasoning survives and the mean
trained tokens per row, and warns when the template drops reasoning; ``--strict`` refuses such an
export instead (nothing is written).

Exit codes:
  0  exported
  2  usage error, not a datagen output, unknown dataset, a shard not matching its checksum, an
     incomplete output without --allow-incomplete, --out inside OUT_DIR, the output file cannot
     be written, or (--strict) the target's chat template drops the reasoning
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from datagen._cli import EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.export import FORMATS, ExportError, check_export_target, export, iter_export
from tasks.export_check import TemplateCheck, check_template, load_template, token_counter
from tasks.files import atomic_writer


@reports_errors("datagen export")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="datagen export", description=__doc__.split("\n")[0],
                                     epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output directory (holds _manifest.json)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="sharegpt (conversations), openai-messages (messages) or specforge (an EAGLE-3 "
                             "drafter's training set)")
    parser.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)")
    parser.add_argument("--include-truncated", action="store_true",
                        help="also export rows whose finish_reason is length/abort")
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="export the committed shards of an output whose run has not finished")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="the target model's directory: render the first rows with its chat template and say "
                             "whether their reasoning survives (specforge, openai-messages)")
    parser.add_argument("--strict", action="store_true",
                        help="with --tokenizer: refuse the export (nothing written) when the template drops reasoning")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    check = _template_check(args)
    if args.out is None:
        report = export(args.out_dir, args.format, sys.stdout, datasets=args.dataset,
                        include_truncated=args.include_truncated, allow_incomplete=args.allow_incomplete)
    else:
        target = Path(args.out)
        check_export_target(args.out_dir, target)
        with atomic_writer(target) as fh:
            report = export(args.out_dir, args.format, fh, datasets=args.dataset,
                            include_truncated=args.include_truncated, allow_incomplete=args.allow_incomplete)
    where = args.out or "stdout"
    print(f"exported {report.rows} rows from {report.shards} shards as {args.format} to {where}"
          f" ({report.skipped_truncated} truncated/aborted rows left out)", file=sys.stderr)
    for problem in report.incomplete:
        print(f"datagen export: warning: incomplete output, {problem}", file=sys.stderr)
    if check is not None:
        print(check.line(), file=sys.stderr)
        if check.warning():
            print(f"datagen export: warning: {check.warning()}", file=sys.stderr)
    elif args.format != "sharegpt":
        print("template check: skipped (give --tokenizer DIR, the target model's directory, to see what the trainer "
              "will train on: the rows do not record where the model lies)", file=sys.stderr)
    return EXIT_OK


def _template_check(args: argparse.Namespace) -> TemplateCheck | None:
    """The chat-template check of the export's first rows (None without --tokenizer or for sharegpt).

    Raises:
        ExportError: --strict and the template drops reasoning, or --strict without --tokenizer.
        TemplateError: the directory has no usable chat template.
    """
    if args.tokenizer is None:
        if args.strict:
            raise ExportError("--strict needs --tokenizer DIR: the target model's chat template is what it checks")
        return None
    if args.format == "sharegpt":
        raise ExportError("--tokenizer checks reasoning_content as the trainer renders it: use --format specforge "
                          "or openai-messages (sharegpt inlines the reasoning into the text)")
    template = load_template(args.tokenizer)
    count, counted = token_counter(args.tokenizer)
    records = iter_export(args.out_dir, args.format, datasets=args.dataset, include_truncated=args.include_truncated)
    check = check_template(records, template, count, counted)
    if args.strict and check.warning():
        raise ExportError(f"{check.warning()}; nothing was written (--strict)")
    return check
