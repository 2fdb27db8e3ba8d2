"""Launching SGLang (or the emulator): command line, readiness, failure classifier, tuner, stop.

``launch_tuned(cfg, target, log_dir)`` starts a server with a tuned ``--mem-fraction-static`` and
returns its ``ServerHandle``; ``stop_server`` ends its process group and cleans its GPUs;
``HangWatchdog`` kills a server that lives but answers nothing.
"""

from __future__ import annotations

from tasks.server._config import (
    API_KEY_ENV,
    BACKENDS,
    BOOTSTRAP_ENV,
    DEFAULT_PORT,
    SPECULATIVE_ALGORITHMS,
    Backend,
    ServerConfig,
    ServerConfigError,
    ServerError,
    build_command,
    format_fraction,
    launch_argv,
    launch_env,
    redact,
    server_flags,
)
from tasks.server._launch import (
    HygieneFn,
    ServerHandle,
    StopFailed,
    adopt_running,
    launch,
    stop_server,
)
from tasks.server._leash import guardian_state
from tasks.server._log import (
    Failure,
    FailureKind,
    LaunchFailed,
    StartupProgress,
    classify_failure,
    effective_fraction,
    parse_progress,
)
from tasks.server._memory import (
    FileStore,
    FractionMemory,
    MemoryEntry,
    MemoryKey,
    MemoryStoreError,
    PrefectStore,
    default_file,
    describe_key,
    gpu_model_name,
    list_remembered,
    memory_key,
    prefect_api_reachable,
    state_dir,
    variable_name,
)
from tasks.server._tuner import (
    Attempt,
    LaunchReport,
    TuningPolicy,
    launch_tuned,
    next_fraction,
    record_runtime_oom,
    runtime_failure,
)
from tasks.server._watchdog import HangWatchdog

__all__ = [
    "adopt_running",
    "guardian_state",
    "API_KEY_ENV",
    "BACKENDS",
    "Backend",
    "Attempt",
    "BOOTSTRAP_ENV",
    "DEFAULT_PORT",
    "Failure",
    "FailureKind",
    "FileStore",
    "FractionMemory",
    "HangWatchdog",
    "HygieneFn",
    "LaunchFailed",
    "LaunchReport",
    "MemoryEntry",
    "MemoryKey",
    "MemoryStoreError",
    "PrefectStore",
    "SPECULATIVE_ALGORITHMS",
    "ServerConfig",
    "ServerConfigError",
    "ServerError",
    "ServerHandle",
    "StartupProgress",
    "StopFailed",
    "TuningPolicy",
    "build_command",
    "classify_failure",
    "effective_fraction",
    "format_fraction",
    "describe_key",
    "gpu_model_name",
    "launch",
    "launch_argv",
    "launch_env",
    "launch_tuned",
    "default_file",
    "list_remembered",
    "memory_key",
    "next_fraction",
    "parse_progress",
    "prefect_api_reachable",
    "record_runtime_oom",
    "redact",
    "runtime_failure",
    "server_flags",
    "state_dir",
    "variable_name",
    "stop_server",
]
