"""``Thresholds``: the limits of the checks, from a partition's ``[validation]`` table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.validation._errors import ThresholdError


@dataclass(frozen=True)
class Thresholds:
    """Limits of the checks; the partition config's ``[validation]`` table overrides the defaults.

    ``*_max_rate`` fails a check above it, ``*_warn_rate`` warns above it (rates of rows in [0, 1]):
    reasoning missing among rows that expect it, tags left over, blank content among ``stop`` rows,
    ``length`` finishes, ``abort`` finishes, rows with token counts inconsistent with their text.
    ``chars_per_token_min/max``: the band of characters per completion token, for the shard as a whole
    and for rows with at least ``token_ratio_min_tokens`` tokens. ``resplit_sample_rows``: rows per
    shard re-split in Python (0 = all). The evidence bar of every rate check (the canary's, the shard
    gate's, the final validation's): a rate fails only on at least ``min_breaches`` breaching rows,
    and on fewer than ``min_rows_for_rate`` rows only when every row breaches; below the bar it
    warns. A shard of fewer than ``min_rows_for_rate`` rows is judged with its dataset (its own rate
    checks warn at most). ``allow_mixed_server``: mixed server fingerprints only warn;
    ``allow_mixed_provenance``: mixed model revisions or chat templates only warn. ``min_rows``: a
    dataset with fewer rows fails (an empty or all-rejected input must not pass, nor move ``latest``);
    ``reject_max_rate``/``reject_warn_rate``: input rows sent to ``_rejects/`` among all input rows.
    ``canary_rows``: the first rows a run generates for a dataset (``canary_rows``, at most half the
    concurrency) are checked as they arrive, before any shard commits (0: no canary; ``check_canary``).
    """

    reasoning_missing_max_rate: float = 0.05
    reasoning_missing_warn_rate: float = 0.02
    tag_leak_max_rate: float = 0.01
    empty_content_max_rate: float = 0.2
    empty_content_warn_rate: float = 0.02
    truncation_max_rate: float = 0.1
    truncation_warn_rate: float = 0.02
    abort_max_rate: float = 0.01
    token_mismatch_max_rate: float = 0.01
    chars_per_token_min: float = 0.25
    chars_per_token_max: float = 16.0
    token_ratio_min_tokens: int = 16
    resplit_sample_rows: int = 64  # per shard; 0 = every row
    min_rows_for_rate: int = 20
    min_breaches: int = 3
    allow_mixed_server: bool = False
    allow_mixed_provenance: bool = False
    min_rows: int = 1
    reject_max_rate: float = 0.2
    reject_warn_rate: float = 0.05
    canary_rows: int = 32

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> Thresholds:
        """Defaults overridden by ``values`` (e.g. a partition's ``[validation]`` table).

        Args:
            values: threshold name -> value; None or empty keeps every default.

        Raises:
            ThresholdError: an unknown key (named, with the valid ones) or a value of the wrong type
                or out of range.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in (values or {}).items():
            if key not in fields:
                raise ThresholdError(
                    f"unknown validation threshold {key!r}; valid keys: {', '.join(sorted(fields))}"
                )
            kwargs[key] = _checked(key, value, fields[key].default)
        made = cls(**kwargs)
        if made.chars_per_token_min >= made.chars_per_token_max:
            raise ThresholdError(
                f"validation threshold 'chars_per_token_min' ({made.chars_per_token_min}) must be below "
                f"'chars_per_token_max' ({made.chars_per_token_max})"
            )
        return made

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _checked(key: str, value: Any, default: Any) -> Any:
    """``value`` for the threshold ``key`` (whose default gives its type), or ThresholdError."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ThresholdError(f"validation threshold {key!r} must be true or false, not {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ThresholdError(f"validation threshold {key!r} must be an integer >= 0, not {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ThresholdError(f"validation threshold {key!r} must be a number, not {value!r}")
    elif key.endswith("_rate") and not 0.0 <= float(value) <= 1.0:
        raise ThresholdError(f"validation threshold {key!r} is a rate in [0, 1], not {value!r}")
    elif float(value) < 0:
        raise ThresholdError(f"validation threshold {key!r} must be >= 0, not {value!r}")
    return float(value) if isinstance(default, float) else value
