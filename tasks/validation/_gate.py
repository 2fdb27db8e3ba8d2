"""The shard gate: validate a shard as it commits, record it in ``_validation.json``, stop on a breach."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tasks.shards import OutputDir
from tasks.validation._errors import ValidationFailed
from tasks.validation._output import judged_with_dataset, validate_shard, write_json
from tasks.validation._results import REPORT_NAME, Check, ShardValidation
from tasks.validation._stats import enough_evidence
from tasks.validation._thresholds import Thresholds


def gate_shard(out_dir: str | os.PathLike[str], dataset: str, shard_index: int,
               thresholds: Thresholds | None = None) -> ShardValidation:
    """Validate a shard that just committed, record it in ``_validation.json``, stop the run on a breach.

    Every failing check stops the run; the message is that of the most fundamental one (``CHECK_ORDER``),
    naming the others. Warnings are recorded, not raised.

    Args:
        out_dir: the output directory.
        dataset: the shard's dataset.
        shard_index: the shard's index in its dataset.
        thresholds: limits of the checks (default: ``Thresholds()``).

    Raises:
        ValidationFailed: a check failed; ``.message`` says what broke and what to do.
        BadOutput: ``out_dir`` is not an output, or the shard is not committed.
    """
    thr = thresholds or Thresholds()
    result = validate_shard(out_dir, dataset, shard_index, thr)
    _record_shard(Path(out_dir), result, thr)
    failed = result.failed()
    if failed:
        message = failed[0].message
        if len(failed) > 1:
            message += f" (also failing: {', '.join(c.name for c in failed[1:])})"
        raise ValidationFailed(message, result)
    return result


def _record_shard(out_dir: Path, result: ShardValidation, thr: Thresholds) -> None:
    # Gates of datasets running side by side read-modify-write the same report: serialise them with a
    # flock on the output directory itself (no extra file; distinct from the run's OUT/_lock).
    out = OutputDir(out_dir)
    with out.root.reopen() as mine:  # a description of its own: threads of this process serialise too
        fcntl.flock(mine.fd, fcntl.LOCK_EX)
        _record_shard_locked(out, result, thr)  # closing releases the lock


def _record_shard_locked(out: OutputDir, result: ShardValidation, thr: Thresholds) -> None:
    out_dir = out.path
    try:
        doc = json.loads(out.read_file(REPORT_NAME) or b"")
        if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), dict):
            raise ValueError("not a report")
    except (OSError, ValueError):
        doc = {"version": 1, "kind": "shards", "out_dir": str(out_dir), "datasets": {}}
    ds = doc["datasets"].setdefault(result.dataset, {"shards": {}})
    result.checks = [_with_earlier_shards(c, result, ds.get("shards") or {}, thr) for c in result.checks]
    ds.setdefault("shards", {})[str(result.shard_index)] = result.to_dict()
    verdicts = [s.get("verdict") for d in doc["datasets"].values() for s in d.get("shards", {}).values()]
    ds["verdict"] = _worst(s.get("verdict") for s in ds["shards"].values())
    doc["verdict"] = _worst(verdicts)
    doc["validated_at"] = result.validated_at
    write_json(out, REPORT_NAME, doc)


def _with_earlier_shards(check: Check, result: ShardValidation, recorded: dict[str, Any], thr: Thresholds) -> Check:
    """A small shard's failing rate check, judged with the dataset's shards recorded so far: it fails
    when their rows together are evidence of a breach (shard 0 of a small shard size still stops the
    run), else it warns and the final validation's dataset totals decide."""
    small = judged_with_dataset(check, thr)
    if small is check:
        return check
    bad, total = check.count, check.rows
    for key, shard in recorded.items():
        if key == str(result.shard_index) or not isinstance(shard, dict):
            continue
        for c in shard.get("checks") or []:
            if isinstance(c, dict) and c.get("name") == check.name and isinstance(c.get("count"), int) \
                    and isinstance(c.get("rows"), int):
                bad, total = bad + c["count"], total + c["rows"]
    limit = check.threshold if isinstance(check.threshold, float | int) else None
    if limit is not None and total and bad / total > limit and enough_evidence(bad, total, thr):
        return dataclasses.replace(check, message=f"{check.message} (with the dataset's shards so far: {bad} of "
                                                  f"{total} rows)")
    return small


def _worst(verdicts: Iterable[Any]) -> str:
    # Recorded verdicts, read back from JSON: anything but fail/warn (e.g. a hand edit) counts as pass.
    seen = set(verdicts)
    return "fail" if "fail" in seen else "warn" if "warn" in seen else "pass"
