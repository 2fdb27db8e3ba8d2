"""`datagen clean-gpus`: GPU hygiene alone: find, end and verify every holder of the selected GPUs.

    datagen clean-gpus [--host TARGET] [--gpus 0,1] [--grace S] [--threshold-mib M] [--deadline S]
                       [--dry-run] [--json] [--all-users]

TARGET is ``local`` (default), ``ssh://[user@]host[:port]`` or ``pct://[user@]host[:port]/CTID``;
SSH settings come from the environment (see `tasks.targets`). Prints a readable report, or the
report as JSON with ``--json``.

Exit codes:
  0  the selected GPUs were verified clean (every one under the threshold, no survivor)
  1  not clean, or unknown (no driver and no simulated GPUs: unknown is not clean); with --dry-run,
     1 means something would be killed or memory is in use now
  2  usage error, bad target or GPU list, target unreachable, or the probe could not run there
"""

from __future__ import annotations

import argparse
import sys

from datagen._cli import EXIT_FAILED, EXIT_OK, exit_codes, parse_args, reports_errors
from tasks.hygiene import (
    DEFAULT_DEADLINE_S,
    DEFAULT_GRACE_S,
    DEFAULT_THRESHOLD_MIB,
    clean_gpus,
    parse_gpu_list,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datagen clean-gpus", description=__doc__.split("\n\n")[0],
                                epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="local", help="target: local, ssh://user@host[:port], pct://user@host/CTID")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices, or 'all' (default: all); an empty value is an error")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--threshold-mib", type=int, default=DEFAULT_THRESHOLD_MIB,
                   help="a GPU is clean at or under this many MiB used")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                   help="seconds to wait for memory to drop under the threshold after the kills")
    p.add_argument("--dry-run", action="store_true", help="print the plan, kill nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--all-users", action="store_true", help="also end other users' processes")
    return p


@reports_errors("datagen clean-gpus")
def main(argv: list[str]) -> int:
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    report = clean_gpus(
        args.host, parse_gpu_list(args.gpus), grace_s=args.grace, threshold_mib=args.threshold_mib,
        deadline_s=args.deadline, dry_run=args.dry_run, include_other_users=args.all_users,
    )
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK if report.clean else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
