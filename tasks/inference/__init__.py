"""Sharded inference against SGLang's native ``/generate``: client, worker pool, rows, driver.

``run_dataset(spec, out_dir, endpoint, settings)`` generates one dataset into committed Parquet
shards, resuming what is on disk; ``Endpoint`` is the server (a ``ServerPool`` several, each request
going to whichever is free), ``InferenceSettings`` the how (samples per prompt, regeneration of the
last or every assistant turn). ``derive_seed`` gives a row's ``sampling_seed``,
``conversation_slots`` the turns a whole conversation is generated in.
"""

from __future__ import annotations

from tasks.inference._budget import ContextOverflow, TruncationPolicy
from tasks.inference._capacity import PROBE_RID, measure_capacity, probe_prompts
from tasks.inference._client import (
    DEFAULT_CONCURRENCY,
    ClientConfig,
    ClientError,
    ClientStats,
    GenerateClient,
    GenerateResult,
    PromptTooLong,
    RequestRejected,
    ServerGone,
    default_concurrency,
    server_error_message,
)
from tasks.inference._dispatch import Dispatcher, Lane, PrefixRoutes, ServerPool, ServerReport
from tasks.inference._driver import OpenedDataset, open_dataset, run_dataset, run_dataset_async
from tasks.inference._identity import IDENTITY_KEYS, external_fingerprint
from tasks.inference._ledger import Bucket, Capacity, Ledger, LedgerView, Mode, RunLedger, bar
from tasks.inference._order import ORDERS, prefix_order
from tasks.inference._provenance import (
    PROVENANCE_COLUMNS,
    Provenance,
    engine_of,
    hf_snapshot,
    model_revision,
    template_hash,
)
from tasks.inference._records import DatasetResult, DatasetSpec, ShardProgress
from tasks.inference._resume import check_resume
from tasks.inference._rows import conversation_slots, derive_seed
from tasks.inference._settings import AUTO, DISPATCHES, REGENERATE_MODES, Endpoint, InferenceSettings

__all__ = [
    "AUTO",
    "PROBE_RID",
    "Bucket",
    "Capacity",
    "Ledger",
    "LedgerView",
    "Mode",
    "RunLedger",
    "bar",
    "measure_capacity",
    "probe_prompts",
    "ClientConfig",
    "ClientError",
    "ClientStats",
    "ContextOverflow",
    "DEFAULT_CONCURRENCY",
    "DatasetResult",
    "DatasetSpec",
    "DISPATCHES",
    "Dispatcher",
    "Endpoint",
    "GenerateClient",
    "GenerateResult",
    "IDENTITY_KEYS",
    "InferenceSettings",
    "ORDERS",
    "PROVENANCE_COLUMNS",
    "PrefixRoutes",
    "Lane",
    "OpenedDataset",
    "PromptTooLong",
    "Provenance",
    "REGENERATE_MODES",
    "RequestRejected",
    "ServerGone",
    "ServerPool",
    "ServerReport",
    "ShardProgress",
    "TruncationPolicy",
    "check_resume",
    "conversation_slots",
    "default_concurrency",
    "engine_of",
    "derive_seed",
    "external_fingerprint",
    "hf_snapshot",
    "model_revision",
    "open_dataset",
    "prefix_order",
    "run_dataset",
    "run_dataset_async",
    "server_error_message",
    "template_hash",
]
