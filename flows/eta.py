"""How long a run has left, from what its committed shards tell: the estimators the progress
artifact can use, compared by ``bench/bench_eta.py`` on a long-tailed output-length workload.

- ``shard_rate``: elapsed time per shard committed by this run, times the shards left.
- ``row_rate``: the same per row (the last, partial shard of each dataset counts for what it holds).
- ``tail``: the rows left times the per-row time at the client's concurrency (Little's law:
  ``mean latency / concurrency``, from the latencies of the committed rows, which are a complete
  sample of their shards, long rows included), plus, per dataset still to finish, the drain at the
  end: the slowest of the last ``concurrency`` rows outlasts an average one by about the
  ``1 - 1/concurrency`` quantile minus the mean.

``Eta.remaining_s`` is the one the progress artifact shows (the bench's pick).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ESTIMATORS", "Eta", "EtaInputs"]


@dataclass(frozen=True)
class EtaInputs:
    """What the progress artifact knows when a shard commits."""

    elapsed_s: float  # since the run started
    rows_new: int  # rows generated (and committed) by this run
    shards_new: int  # shards committed by this run
    rows_left: int  # input rows not yet committed
    shards_left: int
    datasets_left: int  # datasets not yet complete, the current one included


def shard_rate(x: EtaInputs, latencies: Sequence[float], concurrency: int) -> float | None:
    if not x.shards_new:
        return None
    return x.elapsed_s / x.shards_new * x.shards_left


def row_rate(x: EtaInputs, latencies: Sequence[float], concurrency: int) -> float | None:
    if not x.rows_new:
        return None
    return x.elapsed_s / x.rows_new * x.rows_left


def tail(x: EtaInputs, latencies: Sequence[float], concurrency: int) -> float | None:
    if not latencies:
        return row_rate(x, latencies, concurrency)
    if x.rows_left <= 0:
        return 0.0
    ordered = sorted(latencies)
    mean = sum(ordered) / len(ordered)
    c = max(1, concurrency)
    q = ordered[min(len(ordered) - 1, int(len(ordered) * (1.0 - 1.0 / (c + 1))))]
    return x.rows_left * mean / c + max(0.0, q - mean) * max(1, x.datasets_left)


ESTIMATORS = {"shard_rate": shard_rate, "row_rate": row_rate, "tail": tail}


@dataclass
class Eta:
    """The run's ETA from committed shards: a bounded sample of per-row latencies (reservoir)."""

    concurrency: int
    method: str = "tail"
    sample_size: int = 4096
    latencies: list[float] = field(default_factory=list)
    _seen: int = 0
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def observe(self, latencies: Sequence[float]) -> None:
        """Add a committed shard's per-row latencies (seconds) to the sample."""
        for v in latencies:
            self._seen += 1
            if len(self.latencies) < self.sample_size:
                self.latencies.append(float(v))
            else:
                j = self._rng.randrange(self._seen)
                if j < self.sample_size:
                    self.latencies[j] = float(v)

    def remaining_s(self, x: EtaInputs) -> float | None:
        """Seconds left (None: nothing measured yet); 0 once nothing is left."""
        if x.rows_left <= 0 and x.shards_left <= 0:
            return 0.0
        return ESTIMATORS[self.method](x, self.latencies, self.concurrency)
