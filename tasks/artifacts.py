"""What every stage task writes into the Prefect UI the same way: task run names, artifact keys,
GPU labels and the markdown artifact that never fails the run."""

from __future__ import annotations

import re
from collections.abc import Callable
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import task_run
from prefect.utilities.annotations import quote

__all__ = ["artifact_key", "gpu_label", "markdown", "run_name"]


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower())).strip("-")


def gpu_label(gpus: tuple[int, ...] | list[int]) -> str:
    """``gpu0``, ``gpu0,1``, ``gpu0..7`` (a contiguous range of more than two): the GPUs in run
    names and artifact descriptions."""
    g = sorted(gpus)
    if len(g) > 2 and g == list(range(g[0], g[-1] + 1)):
        return f"gpu{g[0]}..{g[-1]}"
    return "gpu" + ",".join(map(str, g))


def markdown(text: str, key: str, description: str) -> UUID | None:
    """A markdown artifact of the current run; its id, or None when it could not be created (the
    run's logger says why: observability must never fail the run)."""
    try:
        return create_markdown_artifact(text, key=key, description=description)  # type: ignore[return-value]
    except Exception as exc:
        get_run_logger().warning("artifact %s not created: %s", key, exc)
        return None


def run_name(fmt: str) -> Callable[[], str]:
    """A task run name from ``fmt`` filled with the task's parameters, the context's host and
    GPUs (``gpus``), the dataset's name and, for a relaunch, `` (relaunch k/N)`` (``again``)."""
    def name() -> str:
        params = {k: v.unquote() if isinstance(v, quote) else v for k, v in task_run.parameters.items()}
        ctx = params.pop("ctx")
        dataset = params.pop("dataset", None)
        attempt = int(params.get("attempt", 1))
        again = f" (relaunch {attempt - 1}/{ctx.cfg.max_relaunches})" if attempt > 1 else ""
        return fmt.format(host=ctx.host, gpus=gpu_label(ctx.gpus), dataset=getattr(getattr(dataset, "spec", None), "name", ""),
                          again=again, **params)

    return name
