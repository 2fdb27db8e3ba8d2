"""Sharded inference against SGLang's native ``/generate``: client, worker pool, rows, driver.

``run_dataset(spec, out_dir, endpoint, settings)`` generates one dataset into committed Parquet
shards, resuming what is on disk; ``Endpoint`` is the server, ``InferenceSettings`` the how.
"""

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
from tasks.inference._driver import run_dataset, run_dataset_async
from tasks.inference._identity import IDENTITY_KEYS, external_fingerprint
from tasks.inference._records import DatasetResult, DatasetSpec, ShardProgress
from tasks.inference._resume import check_resume
from tasks.inference._settings import AUTO, REGENERATE_MODES, Endpoint, InferenceSettings

__all__ = [
    "AUTO",
    "ClientConfig",
    "ClientError",
    "ClientStats",
    "DEFAULT_CONCURRENCY",
    "DatasetResult",
    "DatasetSpec",
    "Endpoint",
    "GenerateClient",
    "GenerateResult",
    "IDENTITY_KEYS",
    "InferenceSettings",
    "PromptTooLong",
    "REGENERATE_MODES",
    "RequestRejected",
    "ServerGone",
    "ShardProgress",
    "Transport",
    "check_resume",
    "default_concurrency",
    "external_fingerprint",
    "run_dataset",
    "run_dataset_async",
    "server_error_message",
]
