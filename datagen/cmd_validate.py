"""`datagen validate OUT_DIR [--json] [--threshold KEY=VALUE ...]`: validate a whole output directory.

Runs every check of tasks.validation over every committed shard and each dataset as a whole, writes
``OUT_DIR/_validation.json`` and the dataset card ``OUT_DIR/README.md``, and prints a summary (or,
with ``--json``, the report itself). The
report is written under the output's lock; while a live run holds it, the run owns the output:
validation is read-only then (nothing is written, stderr says so) and the exit code is the same.

Exit codes:
  0  every check passed or only warned
  1  a check failed (an output whose input total is unknown, e.g. a run stopped before reading
     its input to the end, fails ``complete``: it is not known to be complete)
  2  bad input: OUT_DIR missing or not a datagen output, or a bad threshold
"""

from __future__ import annotations

import argparse
import json
import sys

from datagen._cli import EXIT_FAILED, EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.card import write_card
from tasks.shards import OutputDir, OutputLocked
from tasks.validation import REPORT_NAME, ThresholdError, Thresholds, validate_output, write_report


def _parse_threshold(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ThresholdError(f"--threshold expects KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError as exc:
        raise ThresholdError(f"--threshold {key}: {value!r} is not a number or true/false") from exc


@reports_errors("datagen validate")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="datagen validate", description=__doc__.split("\n")[0],
                                     epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output directory (holds _manifest.json)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--threshold", action="append", default=[], metavar="KEY=VALUE",
                        help="override a threshold, e.g. truncation_max_rate=0.2 (repeatable)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    thresholds = Thresholds.from_dict(dict(_parse_threshold(t) for t in args.threshold))
    report = validate_output(args.out_dir, thresholds, write=False)
    try:
        with OutputDir(args.out_dir).lock({"command": "datagen validate"}):
            write_report(args.out_dir, report)
            write_card(args.out_dir, report.to_dict())
    except OutputLocked as exc:
        holder = ", ".join(f"{k}={v}" for k, v in exc.holder.items() if v is not None) or "holder unknown"
        print(f"datagen validate: {args.out_dir} is held by a live run ({holder}); validated read-only, "
              f"{REPORT_NAME} not written", file=sys.stderr)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(report.summary())
    return EXIT_FAILED if report.verdict == "fail" else EXIT_OK
