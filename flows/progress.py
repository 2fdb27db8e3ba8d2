"""Per-run progress: one Prefect progress artifact updated per committed shard, plus a log line.

The artifact says shards and rows done (per dataset), rows/s, prompt and completion tokens and
tokens/s of this run, and an ETA (flows.eta); ``close`` gives it its end state, done or failed.
Shard commits are reported from inside the inference task (possibly from its event-loop thread),
so API calls go through a one-thread executor with the caller's context copied: the artifact is
updated in order, and a slow API never stalls generation.
"""

from __future__ import annotations

import contextvars
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, TaskRunContext

from flows.eta import Eta, EtaInputs
from tasks.artifacts import artifact_key
from tasks.inference import DEFAULT_CONCURRENCY, RunLedger, ShardProgress

__all__ = ["LABEL_EVERY_S", "DatasetCounts", "Progress", "artifact_key", "fmt_duration"]

ProgressState = Literal["running", "done", "failed", "cancelled"]

# The flow run's progress label is set at the first committed shard, then at most this often: each
# set is an API write (about 60 ms of client CPU and a database write), and a run of small shards
# queued them faster than the API took them (4.7 s at the end of a 40-shard run, measured).
LABEL_EVERY_S = 10.0


def fmt_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _k(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


@dataclass
class DatasetCounts:
    """One dataset's counts: committed in the output (``rows``, ``shards``) and made by this run."""

    rows_total: int  # rows to generate: input records (rejects included) x samples per record
    shards_total: int
    rows: int = 0
    rejects: int = 0
    shards: int = 0
    rows_new: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Progress:
    """Counts shards, rows and tokens across the partition's datasets.

    Args:
        partition: the run's partition (the artifact key's end).
        datasets: each dataset's input records (rejects included: shard k is a fixed slice).
        shard_size: input records per shard.
        samples: rows generated per input record (``--samples``): what the rows and the ETA count.
        concurrency: requests in flight (the ETA's model); None until the first shard says how many
            the run keeps (``ShardProgress.in_flight``: twice the servers' slots by default).
        logger: where the progress lines go.
    """

    partition: str
    datasets: Mapping[str, int]
    shard_size: int
    concurrency: int | None
    logger: logging.Logger | logging.LoggerAdapter[Any]
    flow_run_id: str | None = None
    counts: dict[str, DatasetCounts] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    state: ProgressState = "running"
    why: str = ""
    shards_new: int = 0  # committed by this run (the others were resumed)
    eta: Eta | None = None
    _artifact: UUID | None = None
    _pool: ThreadPoolExecutor | None = None
    _labelled: float = 0.0  # when the run's progress label was last set (monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    samples: int = 1
    # the run's GPU-time ledger now (flows.fleet.Fleet.ledger): its goodput joins the running line
    ledger: Callable[[], RunLedger] | None = None

    def __post_init__(self) -> None:
        self.counts = {name: DatasetCounts(n * self.samples, max(1, math.ceil(n / self.shard_size)))
                       for name, n in self.datasets.items()}
        self.eta = Eta(self.concurrency or DEFAULT_CONCURRENCY)

    # totals over the datasets ------------------------------------------------------------------
    def total(self, counter: str) -> int:
        """The sum of one ``DatasetCounts`` field over the datasets."""
        return sum(int(getattr(c, counter)) for c in self.counts.values())

    total_shards = property(lambda self: self.total("shards_total"))
    done_shards = property(lambda self: self.total("shards"))
    rows = property(lambda self: self.total("rows"))
    rows_new = property(lambda self: self.total("rows_new"))
    prompt_tokens = property(lambda self: self.total("prompt_tokens"))
    completion_tokens = property(lambda self: self.total("completion_tokens"))

    @property
    def elapsed_s(self) -> float:
        return max((self.ended or time.monotonic()) - self.started, 1e-6)

    def start(self, committed: Mapping[str, tuple[int, int, int]]) -> None:
        """Count what the output already holds (``dataset -> (shards, rows, rejects)``) and create
        the artifact."""
        for name, (shards, rows, rejects) in committed.items():
            if name in self.counts:
                c = self.counts[name]
                c.shards, c.rows, c.rejects = shards, rows, rejects
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datagen-progress")
        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            return  # not in a run (a test, a script): the log lines only
        try:
            self._artifact = create_progress_artifact(  # type: ignore[assignment]
                self._percent(), key=artifact_key("datagen-progress", self.partition),
                description=self.describe(),
            )
        except Exception as exc:  # observability must never fail the run
            self.logger.warning("progress artifact not created: %s", exc)
        self._label({"datagen.host": socket.gethostname(), "datagen.progress": self.resume_point()})

    def reconcile(self, committed: Mapping[str, tuple[int, int, int]]) -> None:
        """Take the output's counts where they are ahead: a shard whose commit finished while the
        run was being stopped (another shard's gate, a crash) was never reported."""
        with self._lock:
            for name, (shards, rows, rejects) in committed.items():
                c = self.counts.get(name)
                if c is not None and shards > c.shards:
                    c.shards, c.rows, c.rejects = shards, rows, rejects

    def _percent(self) -> float:
        return 100.0 * self.done_shards / self.total_shards if self.total_shards else 100.0

    def _eta_inputs(self) -> EtaInputs:
        left = [c for c in self.counts.values() if c.shards < c.shards_total]
        return EtaInputs(elapsed_s=self.elapsed_s, rows_new=self.rows_new, shards_new=self.shards_new,
                         shards_left=sum(c.shards_total - c.shards for c in left),
                         rows_left=sum(max(0, c.rows_total - c.rows - c.rejects) for c in left),
                         datasets_left=len(left))

    def remaining_s(self) -> float | None:
        """The ETA (flows.eta), 0 when everything is committed."""
        assert self.eta is not None
        return self.eta.remaining_s(self._eta_inputs())

    def running_rate(self) -> float:
        """Rows per second while running: the rate the ETA divides the rows left by, so that the
        progress line's rate and its ETA agree (flows.eta)."""
        assert self.eta is not None
        rate = self.eta.rate(self._eta_inputs())
        return self.rows_new / self.elapsed_s if rate is None else rate

    def describe(self, dataset: str = "", shard: int | None = None) -> str:
        """The artifact's text: state, shards, rows (per dataset), rates, tokens and the ETA."""
        rows_total = sum(c.rows_total for c in self.counts.values())
        per = ", ".join(f"{n} {c.rows + c.rejects}/{c.rows_total}" for n, c in self.counts.items())
        rate = self.rows_new / self.elapsed_s
        tok_rate = self.completion_tokens / self.elapsed_s
        tokens = (f"tokens {_k(self.prompt_tokens)} in / {_k(self.completion_tokens)} out "
                  f"({tok_rate:,.0f} out/s)")
        rejects = self.total("rejects")
        counts = (f"{self.done_shards}/{self.total_shards} shards, {self.rows + rejects}/{rows_total} rows ({per})"
                  + (f", {rejects} rejected" if rejects else ""))
        if self.state == "done":
            return (f"{self.partition}: DONE in {fmt_duration(self.elapsed_s)}: {counts}, {rate:,.1f} rows/s, "
                    f"{tokens}")
        if self.state == "cancelled":
            return (f"{self.partition}: CANCELLED ({self.why}) after {fmt_duration(self.elapsed_s)}: {counts} kept, "
                    f"{tokens}; a rerun resumes after the committed shards")
        if self.state == "failed":
            why = f" ({self.why})" if self.why else ""
            return f"{self.partition}: FAILED{why} after {fmt_duration(self.elapsed_s)}: {counts}, {tokens}"
        where = f", last {dataset} shard {shard}" if dataset and shard is not None else ""
        rate = self.running_rate()
        eta = ("all shards committed" if self.done_shards >= self.total_shards
               else f"ETA {fmt_duration(self.remaining_s())}")
        good = f", {self.ledger().headline()}" if self.ledger is not None else ""
        return f"{self.partition}: {counts}, {rate:,.1f} rows/s, {tokens}, {eta}{where}{good}"

    def shard_committed(self, p: ShardProgress) -> None:
        """Count one committed shard, log the progress line and update the artifact."""
        with self._lock:
            c = self.counts.get(p.dataset)
            if c is None:
                c = self.counts[p.dataset] = DatasetCounts(p.dataset_rows_total or p.rows, 1)
            c.shards += 1
            c.rows += p.rows
            c.rejects += p.rejects
            c.rows_new += p.rows_generated
            c.prompt_tokens += p.prompt_tokens
            c.completion_tokens += p.completion_tokens
            self.shards_new += 1
            assert self.eta is not None
            if p.in_flight:
                self.eta.concurrency = p.in_flight
            self.eta.observe(self.elapsed_s, p.rows_generated, p.latencies_s)
            text = self.describe(p.dataset, p.shard)
            pct = self._percent()
        self.logger.info("progress %s", text)
        self._update(pct, text)
        now = time.monotonic()
        if self.shards_new == 1 or now - self._labelled >= LABEL_EVERY_S:
            self._labelled = now
            self._label({"datagen.progress": self.resume_point()})

    def resume_point(self) -> str:
        """Where a run started now would resume, for the flow run's ``datagen.progress`` label (the
        failure notification of a run crashed for silence quotes it: datagen/_notify.py)."""
        per = ", ".join(f"{n} {c.shards}/{c.shards_total}" for n, c in self.counts.items())
        return f"{self.done_shards}/{self.total_shards} shards committed ({per}); a rerun resumes after them"

    def _update(self, pct: float, text: str) -> None:
        if self._artifact is None or self._pool is None:
            return
        ctx = contextvars.copy_context()
        self._pool.submit(ctx.run, _safe_update, update_progress_artifact, self._artifact, pct, text)

    def _label(self, labels: dict[str, bool | int | float | str]) -> None:
        """Set the flow run's labels (in order, off the caller's thread, never failing the run): a run
        whose process dies keeps what they said last."""
        if self._pool is None or not self.flow_run_id:
            return
        ctx = contextvars.copy_context()
        self._pool.submit(ctx.run, _safe_label, self.flow_run_id, labels)

    def close(self, state: ProgressState = "done", why: str = "") -> None:
        """End the progress: ``done`` (100%), ``failed`` (``why``: e.g. the error's name) or
        ``cancelled`` (``why``: by whom), said in the artifact and the log; then wait for the
        artifact's updates."""
        with self._lock:
            if self.state == "running":
                self.state, self.why, self.ended = state, why, time.monotonic()
                text = self.describe()
                pct = 100.0 if state == "done" else self._percent()
                self.logger.info("progress %s", text)
                self._update(pct, text)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _safe_label(flow_run_id: str, labels: dict[str, bool | int | float | str]) -> None:
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(UUID(flow_run_id), dict(labels))
    except Exception:
        logging.getLogger("datagen.progress").warning("flow run labels not updated", exc_info=True)


def _safe_update(fn: Any, artifact: UUID, pct: float, text: str) -> None:
    try:
        fn(artifact, min(pct, 100.0), description=text)
    except Exception:
        logging.getLogger("datagen.progress").warning("progress artifact update failed", exc_info=True)
