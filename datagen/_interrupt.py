"""Whether a SIGINT reached this command: a flag that survives a library wrapping ``KeyboardInterrupt``.

Kept free of heavy imports: ``datagen.cli`` installs the handler before any command module loads.
"""

from __future__ import annotations

import threading

__all__ = ["interrupted", "note_sigint"]

_SIGINT_SEEN = threading.Event()


def note_sigint(signum: int, frame: object) -> None:
    """SIGINT handler of the command line: remember it, then raise ``KeyboardInterrupt`` as Python's does.

    A library may wrap that ``KeyboardInterrupt`` in an error of its own (pydantic's serializer, during
    Prefect's start-up, makes it a ``ValueError``); ``datagen._cli.reports_errors`` and ``datagen.cli``
    read the flag so the command still ends as interrupted (130), never as a configuration error (2).
    """
    _SIGINT_SEEN.set()
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a SIGINT reached this process (through ``note_sigint``)."""
    return _SIGINT_SEEN.is_set()
