"""The row schema of every committed shard (columns in docs/output.md, "Output layout and schema"), shared
by the writer, the validator, resplit and export; Parquet files are written with zstd compression.

Columns added after the first release have a value that rows written before them hold implicitly
(``ADDED_DEFAULTS``); ``conform`` fills them in, so that an older output is resumed, validated and
exported as it is. A row's key is ``(id, sample)``.
"""

from __future__ import annotations

import orjson
import pyarrow as pa

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
# One assistant turn generated before the row's last one (``[run] regenerate = "all"``).
TURN_TYPE = pa.struct([
    ("message_index", pa.int32()),  # its position in the row's `messages`
    ("raw", pa.string()),
    ("reasoning", pa.string()),
    ("content", pa.string()),  # what `messages` holds at message_index
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("latency_s", pa.float64()),
])

ROW_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),  # stable prompt id (input `id` or derived)
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("messages", pa.list_(MESSAGE_TYPE), nullable=False),  # the input conversation
        pa.field("prompt", pa.string(), nullable=False),  # exact text sent to /generate
        pa.field("raw", pa.string(), nullable=False),  # exact text returned
        pa.field("reasoning", pa.string(), nullable=True),  # None when no reasoning part
        pa.field("content", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | abort
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("sampling", pa.string(), nullable=False),  # JSON of the sampling_params sent
        pa.field("server", pa.string(), nullable=False),  # fingerprint of the server launch
        pa.field("reasoning_parser", pa.string(), nullable=True),  # parser used for the split
        pa.field("think_in_prompt", pa.bool_(), nullable=False),  # the prompt opened the think block
        pa.field("generated_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("latency_s", pa.float64(), nullable=False),
        # The generation budget of the stored answer, and how the row came to it.
        pa.field("max_new_tokens", pa.int32(), nullable=True),  # budget sent (None: the server's default)
        pa.field("budget_capped", pa.bool_(), nullable=False),  # lowered to fit the model's context
        pa.field("truncation_retries", pa.int32(), nullable=False),  # regenerations after a length finish
        pa.field("truncation_policy", pa.string(), nullable=True),  # JSON of the policy (None: off)
        # provenance (tasks.inference.PROVENANCE_COLUMNS); null: unknown (a journal row written by a
        # datagen that did not record it, or a model directory not readable where datagen runs)
        pa.field("model_revision", pa.string(), nullable=True),  # sha256 of config + weights index
        pa.field("engine", pa.string(), nullable=True),  # sglang | emulator
        pa.field("engine_version", pa.string(), nullable=True),  # /server_info version
        pa.field("chat_template_hash", pa.string(), nullable=True),  # null: prompt given pre-rendered
        pa.field("run_id", pa.string(), nullable=True),  # Prefect flow run id, else local-<hex>
        pa.field("attempt", pa.int32(), nullable=True),  # 1-based call of that run on the dataset
        # -- samples and whole conversations: (id, sample) is the row's key
        pa.field("sample", pa.int32(), nullable=False),  # 0-based sample of the prompt
        pa.field("sampling_seed", pa.int64(), nullable=True),  # sent as sampling_params.sampling_seed
        pa.field("turns", pa.list_(TURN_TYPE), nullable=True),  # earlier regenerated turns; null: last only
    ]
)

# What each column holds: the dataset card lists it (tasks/card.py); docs/output.md tells more.
COLUMN_DOCS: dict[str, str] = {
    "id": "stable prompt id (the input's `id`, else derived from the row)",
    "dataset": "the dataset (config) the row belongs to",
    "messages": "the input conversation",
    "prompt": "the exact text sent to SGLang's `/generate` (chat template applied)",
    "raw": "the exact text the model returned, reasoning included",
    "reasoning": "the reasoning part of `raw` (null when there is none), newlines kept",
    "content": "the answer part of `raw`, newlines kept",
    "finish_reason": "stop, length (hit `max_new_tokens`) or abort",
    "prompt_tokens": "tokens of `prompt`, as the server counted them",
    "completion_tokens": "tokens of `raw`, as the server counted them",
    "model": "the model (its directory's name on the server)",
    "sampling": "JSON of the configured sampling parameters",
    "server": "fingerprint of the server launch (engine, flags)",
    "reasoning_parser": "the parser that split `raw` (null: none)",
    "think_in_prompt": "the chat template opened the think block in `prompt`",
    "generated_at": "when the answer arrived",
    "latency_s": "seconds from request to answer",
    "max_new_tokens": "the budget sent (null: the server's default)",
    "budget_capped": "the budget was lowered so that prompt + budget fit the model's context",
    "truncation_retries": "times the row was generated again with a larger budget after a length finish",
    "truncation_policy": "JSON of `[run.truncation]` (null: off)",
    "model_revision": "`sha256:` of the model's config and weights index (null: unknown)",
    "engine": "sglang or emulator",
    "engine_version": "the server's `/server_info` version",
    "chat_template_hash": "`sha256:` of the chat template (null: prompt given pre-rendered)",
    "run_id": "the Prefect flow run that made the row",
    "attempt": "1-based call of that run on the dataset (a retry or relaunch is the next)",
    "sample": "0-based sample of the prompt; `(id, sample)` is the row's key",
    "sampling_seed": "the seed sent (null: none)",
    "turns": "earlier assistant turns generated again (`regenerate = \"all\"`; null: last turn only)",
}

# What a row written before a column existed holds in it: the budget it was sent (read back from its
# `sampling` JSON, see ``added_value``), never capped or retried, no truncation policy; provenance
# unknown (null is "not a value" to the provenance check); one sample, no seed sent, last turn only.
# The first release wrote the 17 columns from `id` to `latency_s`; every column after them is here.
ADDED_DEFAULTS: dict[str, object] = {
    "max_new_tokens": None, "budget_capped": False, "truncation_retries": 0, "truncation_policy": None,
    "model_revision": None, "engine": None, "engine_version": None, "chat_template_hash": None,
    "run_id": None, "attempt": None,
    "sample": 0, "sampling_seed": None, "turns": None,
}

COLUMNS = tuple(ROW_SCHEMA.names)
PARQUET_COMPRESSION = "zstd"


def added_value(name: str, sampling: object) -> object:
    """What a row written before column ``name`` existed holds in it; ``sampling`` is the row's
    `sampling` JSON text (the sampling_params it was sent), which gives back its ``max_new_tokens``."""
    if name == "max_new_tokens" and isinstance(sampling, str):
        try:
            value = orjson.loads(sampling).get("max_new_tokens")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return ADDED_DEFAULTS[name]


def conform(table: pa.Table) -> pa.Table:
    """``table`` with the ``ADDED_DEFAULTS`` columns it lacks filled in (a shard of an older datagen),
    in ROW_SCHEMA order; other differences are left for the caller's schema check to report."""
    missing = [name for name in ADDED_DEFAULTS if name not in table.column_names]
    if not missing:
        return table
    sampling = (table.column("sampling").to_pylist() if "sampling" in table.column_names
                else [None] * table.num_rows)
    for name in missing:
        field = ROW_SCHEMA.field(name)
        table = table.append_column(field, pa.array([added_value(name, s) for s in sampling], type=field.type))
    order = [n for n in ROW_SCHEMA.names if n in table.column_names]
    return table.select(order + [n for n in table.column_names if n not in ROW_SCHEMA.names])

