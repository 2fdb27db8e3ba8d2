"""`datagen export OUT_DIR --format sharegpt|openai-messages|specforge [--out FILE]`: training JSONL.

Streams every committed shard (checked against the manifest's sha256) into JSONL on stdout or
``--out FILE`` (written to a temp name and renamed, so a failed export leaves no partial file).
Formats are described in tasks/export.py. Rows cut off by the token limit or aborted are left out
unless ``--include-truncated``. A summary goes to stderr.

Exit codes:
  0  exported
  2  usage error, not a datagen output, unknown dataset, a shard not matching its checksum, an
     incomplete output without --allow-incomplete, --out inside OUT_DIR, or the output file cannot
     be written
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from datagen._cli import EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.export import FORMATS, check_export_target, export
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
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
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
    return EXIT_OK
