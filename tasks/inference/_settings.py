"""What ``run_dataset`` generates against (``Endpoint``) and how (``InferenceSettings``).

Both are frozen values: the flow builds them once per server and per run, tests build them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.inference._budget import TruncationPolicy
from tasks.inference._client import ClientConfig
from tasks.inference._order import ORDERS
from tasks.inference._records import DEFAULT_SAMPLING
from tasks.prompts import REGENERATE_MODES

__all__ = ["AUTO", "DISPATCHES", "REGENERATE_MODES", "Endpoint", "InferenceSettings"]

DISPATCHES = ("prefix", "free")  # across several servers: prefix-aware, or any free slot
AUTO = "auto"  # reasoning_parser: inferred from the model directory's config


@dataclass(frozen=True)
class Endpoint:
    """A server to generate against.

    Args:
        url: its base URL (``http://host:port``).
        fingerprint: what its answers depend on; written to every row's ``server`` column, so it
            must not change when the same server is relaunched at another port or fraction.
        api_key: its ``--api-key`` (None: none).
        alive: liveness of the server process, consulted on connection errors so that a dead
            server raises ``ServerGone`` at once instead of after every retry (None: unknown).
    """

    url: str
    fingerprint: str
    api_key: str | None = field(default=None, repr=False)
    alive: Callable[[], bool] | None = None


@dataclass(frozen=True)
class InferenceSettings:
    """How one dataset is generated.

    Args:
        shard_size: records per shard (bound to the dataset in the manifest).
        concurrency: requests in flight (None: twice the server's max_running_requests, else 128).
        sampling: SGLang ``sampling_params``.
        reasoning_parser: parser for the reasoning split; ``AUTO``: inferred from ``model_dir``;
            None: no split.
        model_dir: the model directory, for the chat template (None: pre-rendered prompts only).
        model_name: the rows' ``model`` column (None: from the server's /server_info).
        client: timeouts, retries and transport of the HTTP client.
        run_info: extra fields of the output lock's body (flow_run, host).
        canary_rows: the first rows generated (``canary_rows``, at most half the concurrency) are
            handed to ``run_dataset``'s ``on_canary`` as soon as they are journaled (0: never).
        truncation: how rows that finish by length are generated again with a larger budget.
        order: ``prefix``: rows of a window that share a long prompt prefix are sent together, so
            the server's prefix cache serves them (``tasks.inference._order``); ``input``: input order.
            The rows are stored in input order either way.
        order_window: rows per reordering window (None: ``window_for(concurrency)``).
        dispatch: with several servers, ``prefix``: a row goes to the server that last served its
            prompt's prefix when it can take it soon, else to any free slot
            (``tasks.inference._dispatch.Dispatcher``); ``free``: to any free slot.

        samples: rows per prompt, each with its own ``sampling_seed`` derived from the base seed
            (``sampling["sampling_seed"]``, 0 when unset) and the row's ``(id, sample)``.
        regenerate: one of ``REGENERATE_MODES``.

    Raises:
        ValueError: an unknown ``order`` or ``dispatch`` or an ``order_window`` below 1, ``samples`` below 1, an unknown ``regenerate``.
    """

    shard_size: int
    concurrency: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    reasoning_parser: str | None = AUTO
    model_dir: str | Path | None = None
    model_name: str | None = None
    client: ClientConfig = field(default_factory=ClientConfig)
    run_info: Mapping[str, Any] = field(default_factory=dict)
    canary_rows: int = 0
    truncation: TruncationPolicy = field(default_factory=TruncationPolicy)
    order: str = "prefix"
    order_window: int | None = None
    dispatch: str = "prefix"
    samples: int = 1
    regenerate: str = "last"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}, got {self.dispatch!r}")
        if self.order_window is not None and self.order_window < 1:
            raise ValueError(f"order_window must be >= 1, got {self.order_window}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.regenerate not in REGENERATE_MODES:
            raise ValueError(f"regenerate must be one of {', '.join(REGENERATE_MODES)}, got {self.regenerate!r}")

    def window_for(self, concurrency: int) -> int:
        """Rows per reordering window: ``order_window``, else 32x the requests in flight, within
        [256, 4096]; 1 for ``input`` order. A larger window makes larger groups (only a group's
        first row misses the cache), but it is read ahead of the sends: it bounds the memory held
        and how long a shard's commit may wait."""
        if self.order == "input":
            return 1
        if self.order_window is not None:
            return self.order_window
        return max(256, min(4096, 32 * concurrency))
