"""Shared pieces of the ``datagen <command>`` entry points: argument parsing, and the one table that
turns an error into an exit code (the codes datagen.cli documents).

2 (``EXIT_USAGE``) when the caller must change something first: usage, configuration, a value or
path that cannot be used, an output that is not a datagen output (or fails its checksum, or is
locked by another run, or was written from another input), a target that cannot be reached. 1
(``EXIT_FAILED``) for every other error: the operation ran and failed (GPUs not clean, a launch
that failed, a server that stopped answering, validation failed).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import ParamSpec

from datagen._interrupt import interrupted
from tasks.config import ConfigError
from tasks.errors import DatagenError
from tasks.export import ExportError
from tasks.files import WriteFailed
from tasks.hygiene import ProbeFailed
from tasks.prompts import TemplateError
from tasks.shards import ShardsError
from tasks.targets import TargetError, TargetUnreachable
from tasks.validation import BadOutput, ThresholdError

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "exit_code_for", "exit_codes", "parse_args", "reports_errors",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# What the caller must fix before trying again; every other error means the operation failed (1).
# ValueError and OSError stand for a bad value or a path that cannot be read or written.
_USAGE_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, TemplateError, ThresholdError, TargetError,  # configuration
    ShardsError, BadOutput, ExportError,  # an output that cannot be used (locked, changed input, bad data)
    TargetUnreachable, ProbeFailed,  # the target cannot be reached or cannot run the probe
    ValueError, OSError,
)
# What `reports_errors` turns into a message and an exit code; anything else is a bug and keeps its
# traceback.
_REPORTED: tuple[type[BaseException], ...] = (DatagenError, ValueError, OSError)
# The operation ran and failed although it is an OSError: the disk filled up while it wrote.
_FAILED_ERRORS: tuple[type[BaseException], ...] = (WriteFailed,)

def _chained(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen

P = ParamSpec("P")


def exit_code_for(exc: BaseException) -> int:
    """The exit code for a command that stopped on ``exc`` (``EXIT_USAGE`` or ``EXIT_FAILED``)."""
    if isinstance(exc, _FAILED_ERRORS):
        return EXIT_FAILED
    return EXIT_USAGE if isinstance(exc, _USAGE_ERRORS) else EXIT_FAILED


def reports_errors(prog: str) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Decorate a command function: a datagen error, ``ValueError`` or ``OSError`` escaping it is
    printed as ``<prog>: <message>`` on stderr and becomes ``exit_code_for(exc)``.

    Args:
        prog: the prefix of the message, e.g. ``"datagen export"``.
    """

    def decorate(fn: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return fn(*args, **kwargs)
            except _REPORTED as exc:
                if isinstance(exc, BrokenPipeError):
                    raise  # the reader left (`| head`): datagen.cli ends the command quietly
                if interrupted() or any(isinstance(e, KeyboardInterrupt) for e in _chained(exc)):
                    raise KeyboardInterrupt from exc  # Ctrl-C, wrapped by a library: 130, not 2
                print(f"{prog}: {exc}", file=sys.stderr)
                return exit_code_for(exc)

        return run

    return decorate


def exit_codes(doc: str | None) -> str:
    """The "Exit codes" paragraph of a command module's docstring: its ``--help`` epilog (use it with
    ``argparse.RawDescriptionHelpFormatter``).

    Raises:
        ValueError: the docstring has no such paragraph.
    """
    for paragraph in (doc or "").split("\n\n"):
        if paragraph.startswith("Exit codes"):
            return paragraph.strip()
    raise ValueError("the docstring has no 'Exit codes' paragraph")


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parse ``argv``, or return the exit code argparse asked for instead of exiting the process.

    ``--help`` gives 0 and a usage error 2 (argparse has already printed the help or the error), so a
    command's ``main`` can ``return`` it: ``if isinstance(args, int): return args``.
    """
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
