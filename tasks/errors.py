"""The root of every datagen error, and what an error says about retrying the step that raised it.

Each family lives with the code that raises it and keeps the built-in base its callers catch::

    DatagenError                              retryable?
    ├── ConfigError (ValueError)              no      tasks.config
    ├── TemplateError (ValueError)            no      tasks.prompts
    ├── TargetError (ValueError)              no      tasks.targets
    ├── TargetUnreachable (ConnectionError)   yes     tasks.targets
    ├── ProbeFailed (RuntimeError)            yes     tasks.hygiene
    ├── GpusNotClean (RuntimeError)           yes     tasks.hygiene (the driver releases memory late)
    │   └── NoGpus                            no      (no driver and no simulated GPUs on the target)
    ├── ServerError (RuntimeError)            no      tasks.server
    │   ├── ServerConfigError (ValueError)    no
    │   ├── LaunchFailed                      unless failure.kind is bad_flag, model_not_found, host_memory,
    │   │                                     or too_high / too_low (the fraction search gave up on those)
    │   └── StopFailed                        yes
    ├── MemoryStoreError (RuntimeError)       no      tasks.server
    ├── ClientError                           no      tasks.inference
    │   ├── ServerGone                        no      (the server's lifecycle relaunches it: flows.fleet)
    │   └── RequestRejected                   no
    │       └── PromptTooLong                 no
    ├── ShardsError                           no      tasks.shards
    │   ├── OutputLocked                      no
    │   ├── InputChanged                      no
    │   └── ManifestError                     no
    ├── ExportError                           no      tasks.export
    ├── UnsafeFile (OSError)                  no      tasks.files (a symlink or foreign file to write)
    ├── WriteFailed (OSError)                 no      tasks.files (the disk or quota is full: exit 1)
    ├── ThresholdError (ValueError)           no      tasks.validation
    ├── BadOutput                             no      tasks.validation
    ├── ValidationFailed                      no      tasks.validation
    ├── SlotTimeout (RuntimeError)            no      flows.gpulimit (another run held the GPU host too long)
    ├── IllegalMove (RuntimeError)            no      flows.lifecycle (a bug: a move a server's phase does not allow)
    ├── ApiServerError (RuntimeError)         no      datagen._api_server
    ├── UpError (RuntimeError)                no      datagen.cmd_up
    └── DatabaseUnreachable (ConnectionError) no      datagen._database (the caller fixes the URL or starts it)

``retryable`` answers one question: can running the same step again, unchanged, succeed? The flow's
retry conditions (flows.retry) and nothing else read it; the command line maps families to exit
codes (datagen._cli).
"""

from __future__ import annotations

__all__ = ["DatagenError"]


class DatagenError(Exception):
    """Base of every error datagen raises. ``retryable``: whether retrying the same step can help."""

    retryable: bool = False
