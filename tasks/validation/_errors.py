"""The errors of tasks.validation (one hierarchy, all raised to the caller, none swallowed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.errors import DatagenError

if TYPE_CHECKING:
    from tasks.validation._results import ShardValidation, ValidationReport


class ThresholdError(DatagenError, ValueError):
    """A threshold key is unknown or its value is out of range; the message names the key."""


class BadOutput(DatagenError):
    """The path is not a datagen output directory (missing, no manifest, unreadable manifest)."""


class ValidationFailed(DatagenError):
    """A shard breached a threshold: the run must stop. ``message`` is the one actionable line."""

    def __init__(self, message: str, report: ShardValidation | ValidationReport) -> None:
        super().__init__(message)
        self.message = message
        self.report = report
