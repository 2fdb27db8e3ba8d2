"""`datagen export OUT_DIR --format sharegpt|openai-messages|specforge [--out FILE]`: training JSONL.

Streams every committed shard (checked against the manifest's sha256) into JSONL on stdout or
``--out FILE`` (written to a temp name and renamed, so a failed export leaves no partial file).
Formats are described in tasks/export.py. Rows cut off by the token limit or aborted are left out
unless ``--include-truncated``. A summary goes to stderr.

Exit codes:
  0  exported
  2  usage error, not a datagen output, unknown dataset, a shard not matching its checksum, or the
     output file cannot be written
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from datagen._cli import parse_args
from tasks.export import FORMATS, ExportError, export
from tasks.files import atomic_writer

# FORMATS, ExportError, export
from tasks.shards import ShardsError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="datagen export", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output directory (holds _manifest.json)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)")
    parser.add_argument("--include-truncated", action="store_true",
                        help="also export rows whose finish_reason is length/abort")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    try:
        if args.out is None:
            report = export(args.out_dir, args.format, sys.stdout, datasets=args.dataset,
                            include_truncated=args.include_truncated)
        else:
            target = Path(args.out)
            with atomic_writer(target) as fh:
                report = export(args.out_dir, args.format, fh, datasets=args.dataset,
                                include_truncated=args.include_truncated)
    except (ValueError, ExportError, ShardsError, OSError) as exc:
        print(f"datagen export: {exc}", file=sys.stderr)
        return 2
    where = args.out or "stdout"
    print(f"exported {report.rows} rows from {report.shards} shards as {args.format} to {where}"
          f" ({report.skipped_truncated} truncated/aborted rows left out)", file=sys.stderr)
    return 0
