"""Per-run progress: one Prefect progress artifact updated per committed shard, plus a log line.

Shard commits are reported from inside the inference task (possibly from its event-loop thread),
so API calls go through a one-thread executor with the caller's context copied: the artifact is
updated in order, and a slow API never stalls generation.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

__all__ = ["Progress", "artifact_key"]


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclass
class Progress:
    """Counts shards and rows across the partition's datasets."""

    partition: str
    total_shards: int
    logger: logging.Logger | logging.LoggerAdapter[Any]
    done_shards: int = 0
    rows: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    flow_run_id: str | None = None
    skipped_shards: int = 0  # committed by an earlier run (resume): not counted in the rate
    _artifact: UUID | None = None
    _pool: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, already_committed: int, already_rows: int) -> None:
        self.done_shards = self.skipped_shards = already_committed
        self.rows = already_rows
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datagen-progress")
        try:
            self._artifact = create_progress_artifact(  # type: ignore[assignment]
                self._percent(), key=artifact_key("datagen-progress", self.partition),
                description=self.describe(),
            )
        except Exception as exc:  # observability must never fail the run
            self.logger.warning("progress artifact not created: %s", exc)

    def _percent(self) -> float:
        return 100.0 * self.done_shards / self.total_shards if self.total_shards else 100.0

    def describe(self, dataset: str = "", shard: int | None = None) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        new_shards = self.done_shards - self.skipped_shards
        rate = self.tokens / elapsed
        eta = (elapsed / new_shards) * (self.total_shards - self.done_shards) if new_shards else None
        where = f" last {dataset} shard {shard}" if dataset and shard is not None else ""
        return (
            f"{self.partition}: {self.done_shards}/{self.total_shards} shards, {self.rows} rows, "
            f"{rate:.0f} tokens/s, ETA {_fmt_eta(eta)}{where}"
        )

    def shard_committed(self, dataset: str, shard: int, rows: int, completion_tokens: int) -> None:
        """Count one committed shard, log the progress line and update the artifact."""
        with self._lock:
            self.done_shards += 1
            self.rows += rows
            self.tokens += completion_tokens
            text = self.describe(dataset, shard)
            pct = self._percent()
        self.logger.info("progress %s", text)
        if self._artifact is None or self._pool is None:
            return

        ctx = contextvars.copy_context()
        self._pool.submit(ctx.run, _safe_update, update_progress_artifact, self._artifact, pct, text)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _safe_update(fn: Any, artifact: UUID, pct: float, text: str) -> None:
    try:
        fn(artifact, min(pct, 100.0), description=text)
    except Exception:
        logging.getLogger("datagen.progress").warning("progress artifact update failed", exc_info=True)
