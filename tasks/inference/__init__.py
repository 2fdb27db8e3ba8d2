"""Sharded inference against SGLang's native ``/generate``: client, worker pool, rows, driver."""

from __future__ import annotations

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
    Transport,
    default_concurrency,
    server_error_message,
)
from tasks.inference._driver import (
    run_dataset,
    run_dataset_async,
    run_inputs,
)
from tasks.inference._records import (
    DatasetResult,
    DatasetSpec,
    ShardProgress,
    fingerprint_server,
)

__all__ = [
    "ClientConfig",
    "ClientError",
    "ClientStats",
    "DEFAULT_CONCURRENCY",
    "DatasetResult",
    "DatasetSpec",
    "GenerateClient",
    "GenerateResult",
    "PromptTooLong",
    "RequestRejected",
    "ServerGone",
    "ShardProgress",
    "Transport",
    "default_concurrency",
    "fingerprint_server",
    "run_dataset",
    "run_dataset_async",
    "run_inputs",
    "server_error_message",
]
