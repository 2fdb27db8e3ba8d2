"""`datagen resplit OUT_DIR --parser NAME [--dry-run] [--json]`: re-derive reasoning/content from raw.

Recomputes the ``reasoning`` and ``content`` columns of every committed shard from the stored ``raw``
text with SGLang's one-shot split for ``--parser`` (tasks.reasoning), without a server, and rewrites
the shards that change atomically (temp + fsync + rename, manifest sha256 updated). This recovers a
run whose split was wrong (no parser, the wrong parser, a template that opened the think block).

Exit codes:
  0  done (or, with --dry-run, what would change was printed)
  2  usage error, unknown parser, not a datagen output, a shard not matching its checksum, or the
     output is locked by a running job
"""

from __future__ import annotations

import argparse
import json

from datagen._cli import EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.export import resplit
from tasks.reasoning import PARSERS


@reports_errors("datagen resplit")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="datagen resplit", description=__doc__.split("\n")[0],
                                     epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output directory (holds _manifest.json)")
    parser.add_argument("--parser", required=True, metavar="NAME",
                        help=f"SGLang reasoning parser: {', '.join(PARSERS)}")
    parser.add_argument("--dry-run", action="store_true", help="count what would change, write nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    report = resplit(args.out_dir, args.parser, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        verb = "would rewrite" if args.dry_run else "rewrote"
        print(f"resplit with {report.parser}: {report.rows_changed} of {report.rows} rows changed; "
              f"{verb} {report.shards_rewritten} of {report.shards} shards")
    return EXIT_OK
