"""`datagen repair OUT_DIR [--dry-run] [--json]`: un-commit damaged shards so the next run regenerates them.

Checks every committed shard against the manifest (the file exists, is a regular file, and its
bytes hash to the recorded sha256). Under the output's lock, the damaged shards leave the manifest
in one atomic replace and their files and reject lines are removed; the next `datagen run` on the
output generates exactly those shards again. Intact shards are not touched.

Exit codes:
  0  nothing was damaged, or the damaged shards were un-committed (listed on stdout); with
     --dry-run, nothing was changed and what would be un-committed was listed
  2  usage error, OUT_DIR is not a datagen output (no or unreadable manifest), the output is locked
     by a running job (names it), or a file in OUT_DIR cannot be written
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datagen._cli import EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.shards import ManifestError, OutputDir


@reports_errors("datagen repair")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="datagen repair", description=__doc__.split("\n")[0],
                                     epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output directory (holds _manifest.json)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be un-committed, change nothing")
    parser.add_argument("--json", action="store_true", help="print the damaged shards as JSON")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    out = OutputDir(Path(args.out_dir))
    if out.read_manifest() is None:
        raise ManifestError(f"{out.path}: no _manifest.json (not a datagen output, or nothing committed yet)")
    damage = out.repair(dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"out_dir": str(out.path), "dry_run": args.dry_run,
                          "damaged": [d.to_dict() for d in damage]}))
        return EXIT_OK
    verb = "would un-commit" if args.dry_run else "un-committed"
    for d in damage:
        print(f"{verb} {d.describe()}")
    if not damage:
        print(f"{out.path}: every committed shard matches the manifest; nothing to repair")
    elif not args.dry_run:
        print(f"{len(damage)} shard(s) un-committed: the next `datagen run` on {out.path} generates them again")
    return EXIT_OK
