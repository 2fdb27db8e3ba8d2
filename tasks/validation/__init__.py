"""Validation of committed shards and whole outputs: catch bad data in the first shard, not hours later.

Every check is vectorised over Arrow (``pyarrow.compute``); only the ``resplit`` check calls Python per
row, on a bounded, evenly spaced sample (``Thresholds.resplit_sample_rows`` per shard).

Checks (names are stable; tests and the flow rely on them), in the order the gate reports them:

- ``schema``: columns, types and nullability against ``tasks.schema.ROW_SCHEMA`` (extra columns warn).
- ``complete``: rows + rejects of a shard equal its slice of the input (``shard_size``, ``total_rows``
  from the manifest), the manifest's row count matches the file; for a whole output every shard is
  committed.
- ``unique_ids``: one row per input id (per shard, then across all shards of a dataset).
- ``fingerprint``: one ``sampling``, ``server``, ``model`` and ``reasoning_parser`` value across the
  output (a mixed server fingerprint only warns with ``allow_mixed_server``).
- ``reasoning_present``: rows that should carry reasoning (a parser is set, or the prompt opened the
  think block) whose ``reasoning`` is null or blank. With no parser and no think block in the prompt,
  reasoning is not expected.
- ``tag_leak``: a think/channel tag of any parser family left in ``content`` or ``reasoning``.
- ``resplit``: ``raw`` re-split with ``tasks.reasoning.split_reasoning`` gives the stored
  reasoning/content (a sample); rows without a parser must have ``content == raw`` (every row), and
  reasoning + content can never be longer than raw (every row).
- ``empty_content``: blank ``content`` among rows that finished with ``stop`` (a truncated row has no
  content by design).
- ``truncation``: rate of ``finish_reason == "length"``.
- ``finish_reason``: values outside stop/length/abort, and the rate of ``abort``.
- ``token_counts``: counts are non-negative; ``completion_tokens > 0`` when ``raw`` is non-empty and
  ``prompt_tokens > 0`` when ``prompt`` is; characters per completion token within
  [``chars_per_token_min``, ``chars_per_token_max``] for the shard as a whole and for each row with at
  least ``token_ratio_min_tokens`` tokens. The default band 0.25..16 holds for real tokenizers (about 4
  for English, 1-1.5 for CJK, below 1 only for emoji/rare characters split into bytes, above 8 only
  for long whitespace or punctuation runs); a row outside it means counts from another row or field.

Rate checks fail above their ``*_max_rate`` and warn above their ``*_warn_rate`` (or above zero where no
warn rate exists). On fewer than ``min_rows_for_rate`` rows a rate check only fails when every row
breaches (a 3-row tail shard with one truncated row is noise, three of three is not).

Statuses: ``pass``, ``warn``, ``fail``, and ``unknown`` when a check could not run (e.g. a column it
needs is missing; ``schema`` then fails). A report's verdict is ``fail`` if any check failed, else
``warn`` if any warned or was unknown, else ``pass``.

Errors: ``ThresholdError`` (bad threshold key or value), ``BadOutput`` (not an output directory),
``ValidationFailed`` (raised by :func:`gate_shard`; carries one actionable message and the result).

Modules (private; import from ``tasks.validation``): ``_thresholds`` (``Thresholds``), ``_results``
(``Check``, ``Context``, shard/dataset/output results, verdicts, summary), ``_stats`` (helpers shared by
the checks), ``_checks_structure`` / ``_checks_reasoning`` / ``_checks_rows`` (the vectorised checks),
``_checks`` (their order, ``validate_table``), ``_output`` (manifest, output walk, ``_validation.json``),
``_gate`` (``gate_shard``), ``_artifacts`` (Prefect artifacts), ``_errors``.
"""

from __future__ import annotations

from tasks.validation._artifacts import publish_artifacts
from tasks.validation._artifacts import report_markdown as report_markdown
from tasks.validation._artifacts import report_table as report_table
from tasks.validation._checks import validate_table
from tasks.validation._checks_rows import FINISH_REASONS as FINISH_REASONS
from tasks.validation._errors import BadOutput, ThresholdError, ValidationFailed
from tasks.validation._gate import gate_shard
from tasks.validation._output import MANIFEST_NAME as MANIFEST_NAME
from tasks.validation._output import validate_output, validate_shard
from tasks.validation._results import CHECK_ORDER as CHECK_ORDER
from tasks.validation._results import REPORT_NAME as REPORT_NAME
from tasks.validation._results import (
    Check,
    Context,
    ShardValidation,
    ValidationReport,
)
from tasks.validation._results import DatasetValidation as DatasetValidation
from tasks.validation._thresholds import Thresholds

# Unchanged from the single-module version; the other public names above (report_markdown,
# report_table, DatasetValidation, the constants) are importable too, as before.
__all__ = [
    "BadOutput",
    "Check",
    "Context",
    "ShardValidation",
    "ThresholdError",
    "Thresholds",
    "ValidationFailed",
    "ValidationReport",
    "gate_shard",
    "publish_artifacts",
    "validate_output",
    "validate_shard",
    "validate_table",
]
