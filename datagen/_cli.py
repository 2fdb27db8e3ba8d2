"""Shared pieces of the ``datagen <command>`` entry points (see datagen/cli.py for the exit codes)."""

from __future__ import annotations

import argparse

__all__ = ["parse_args"]


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parse ``argv``, or return the exit code argparse asked for instead of exiting the process.

    ``--help`` gives 0 and a usage error 2 (argparse has already printed the help or the error), so a
    command's ``main`` can ``return`` it: ``if isinstance(args, int): return args``.
    """
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
