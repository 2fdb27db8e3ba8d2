"""The `datagen` command line: a thin dispatcher.

Each subcommand lives in its own module (``datagen.cmd_<name>``) exposing ``main(argv) -> int``;
it is imported only when called, so `datagen emulator` and `datagen gpu-sim` start fast.

Exit codes (shared by every subcommand; `datagen COMMAND --help` says what its 1 and 2 mean):
  0  success
  1  the operation ran and failed, or its verdict is negative (GPUs not clean, validation failed,
     run failed)
  2  usage, configuration or connection error, an unusable input or output, or a locked output
     (the caller must change something first); also an unknown command
  130 interrupted (Ctrl-C), 143 terminated (SIGTERM; not `emulator` and `gpu-sim`, which die of
     it): what the command started is stopped first
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import os
import signal
import sys
import threading

from datagen import __version__
from datagen._interrupt import interrupted, note_sigint

STAND_INS = ("emulator", "gpu-sim")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("datagen.cmd_run", "run the pipeline now (partition config or ad-hoc --input)"),
    "demo": ("datagen.cmd_demo", "run the whole pipeline on the bundled sample against the emulator"),
    "clean-gpus": ("datagen.cmd_clean_gpus", "GPU hygiene alone: find, kill and verify GPU holders"),
    "validate": ("datagen.cmd_validate", "validate an output directory"),
    "status": ("datagen.cmd_status", "shards committed/total, rows, lock holder, learned memory fraction"),
    "repair": ("datagen.cmd_repair", "un-commit missing or damaged shards so the next run regenerates them"),
    "resplit": ("datagen.cmd_resplit", "re-derive reasoning/content from stored raw text"),
    "export": ("datagen.cmd_export", "export an output as sharegpt / openai-messages / specforge JSONL"),
    "up": ("datagen.cmd_up", "start a local Prefect server, work pool, deployments and worker"),
    "worker": ("datagen.cmd_up", "start one more Prefect worker, for a work pool (this or another control host)"),
    "down": ("datagen.cmd_up", "stop what `datagen up` and `datagen worker` started (by pid file)"),
}


def _commands() -> dict[str, tuple[str, str]]:
    """datagen's commands and the stand-ins' (entry-point group ``datagen.commands``: a module with
    ``main(argv)`` whose docstring's first line is its help), when installed."""
    from importlib.metadata import entry_points

    found = dict(COMMANDS)
    for ep in sorted(entry_points(group="datagen.commands"), key=lambda e: e.name):
        found.setdefault(ep.name, (ep.value, "stand-in (not installed in production): `datagen "
                                   f"{ep.name} --help`"))
    return found


def _usage() -> str:
    lines = ["usage: datagen COMMAND [ARGS...]", "", "commands:"]
    commands = _commands()
    width = max(len(n) for n in commands)
    for name, (_, help_text) in commands.items():
        lines.append(f"  {name:<{width}}  {help_text}")
    lines.append("")
    lines.append("`datagen COMMAND --help` for a command's options and exit codes.")
    lines.append("")
    lines.append(__doc__[__doc__.index("Exit codes"):].strip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A SIGINT or SIGTERM ends it with one line and 130 or 143 (what the command
    started is stopped on the way out: it sees ``KeyboardInterrupt`` or a SIGTERM exception); a reader
    that closed the pipe (``| head``) ends it quietly with 141."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else ""
    # The stand-ins for SGLang and a GPU job die of SIGTERM as the processes they imitate do.
    previous = previous_int = None
    if name not in STAND_INS and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous_int = signal.signal(signal.SIGINT, note_sigint)
    try:
        code = _dispatch(argv)
        if code not in (0, EXIT_INTERRUPTED) and interrupted():
            # Ctrl-C turned into another error by a library on its way out: still an interrupt
            return _interrupted(name, "interrupted", EXIT_INTERRUPTED)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return _interrupted(name, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except BaseException as exc:
        if getattr(exc, "signal", None) == signal.SIGTERM or isinstance(exc, _Terminated):
            return _interrupted(name, "terminated", EXIT_TERMINATED)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM, so that ``finally`` blocks stop what the command started."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated()


def _interrupted(name: str, what: str, code: int) -> int:
    print(f"datagen{' ' + name if name in COMMANDS or name in STAND_INS else ''}: {what}", file=sys.stderr, flush=True)
    # Everything the command started was stopped on the way here; exiting now skips atexit work
    # (Prefect's queued logs for an API server that may be gone) that would otherwise retry for minutes.
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(code)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"datagen {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    commands = COMMANDS if name in COMMANDS else _commands()
    if name not in commands:
        close = difflib.get_close_matches(name, list(commands), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"datagen: unknown command {name!r}{hint}; `datagen --help` lists the commands: "
              f"{', '.join(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    if name in ("up", "down", "worker"):
        return int(module.main([name, *rest]) or 0)
    return int(module.main(rest) or 0)


# Commands that read Parquet and start no Prefect: their process ends without the interpreter's
# finalization, where pyarrow's C++ threads twice aborted a command that had already printed its
# answer ("terminate called without an active exception", SIGABRT: `datagen validate` and
# `datagen resplit` in two of the suite's last six runs), which turned its exit code into -6.
QUICK_EXIT = frozenset({"validate", "resplit", "repair", "export", "status"})


def entry() -> None:
    """The `datagen` console script: ``main``, then the exit (QUICK_EXIT's commands end at once,
    their output flushed and their log handlers closed)."""
    code = main()
    if (sys.argv[1] if len(sys.argv) > 1 else "") in QUICK_EXIT:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
