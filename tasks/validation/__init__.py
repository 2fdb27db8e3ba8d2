"""Validation of committed shards and whole outputs: catch bad data in the first shard, not hours later.

Checks, in report order (vectorised over Arrow; only ``resplit`` parses rows one by one, on a sample):

    schema             columns, types and nullability against tasks.schema.ROW_SCHEMA
    complete           rows + rejects of a shard equal its input slice; every shard committed
    unique_ids         one row per input id, within a shard and across a dataset
    fingerprint        one sampling, server, model and reasoning_parser value across the output
    provenance         one model_revision and chat_template_hash across the output (nulls aside),
                       unless ``allow_mixed_provenance``
    reasoning_present  reasoning where a parser is set or the prompt opened the think block
    tag_leak           no think/channel tag of any parser family in content or reasoning
    resplit            re-splitting raw gives the stored reasoning and content (a sample); without a
                       parser content == raw
    empty_content      no blank content among rows that finished with ``stop``
    truncation         rate of finish_reason "length"
    finish_reason      only stop/length/abort, and the rate of abort
    token_counts       token counts consistent with the text (characters per token within a band)

``gate_shard`` judges each shard as it commits; ``check_canary`` judges the first rows a run
generates, before any shard commits.

A check is ``pass``, ``warn``, ``fail`` or ``unknown`` (it could not run); a report fails when any check
failed, else warns when any warned or was unknown.
"""

from __future__ import annotations

from tasks.validation._artifacts import md_text, publish_artifacts, report_markdown, report_table
from tasks.validation._canary import CANARY_CHECKS, check_canary
from tasks.validation._checks import validate_table
from tasks.validation._checks_rows import FINISH_REASONS
from tasks.validation._errors import BadOutput, ThresholdError, ValidationFailed
from tasks.validation._gate import gate_shard
from tasks.validation._output import MANIFEST_NAME, validate_output, validate_shard, write_report
from tasks.validation._results import (
    CHECK_ORDER,
    REPORT_NAME,
    Check,
    Context,
    DatasetValidation,
    ShardValidation,
    ValidationReport,
    measured,
)
from tasks.validation._thresholds import Thresholds

__all__ = [
    "CANARY_CHECKS",
    "CHECK_ORDER",
    "FINISH_REASONS",
    "MANIFEST_NAME",
    "REPORT_NAME",
    "BadOutput",
    "Check",
    "Context",
    "DatasetValidation",
    "ShardValidation",
    "ThresholdError",
    "Thresholds",
    "ValidationFailed",
    "ValidationReport",
    "check_canary",
    "gate_shard",
    "md_text",
    "measured",
    "publish_artifacts",
    "report_markdown",
    "report_table",
    "validate_output",
    "validate_shard",
    "write_report",
    "validate_table",
]
