"""What a run knows once it has started: the partition config, the output plan and the server's place.

``RunContext`` is built once in the flow, after the config is loaded and the output chosen, and
handed to every stage task and to the server session instead of long argument lists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from prefect.utilities.annotations import quote

from flows.gpulimit import host_of
from tasks.config import PartitionConfig
from tasks.inference import InferenceSettings, TruncationPolicy
from tasks.reasoning import parser_for_model

__all__ = ["RunContext", "RunPlan", "unlinked"]

T = TypeVar("T")


def unlinked(value: T) -> T:
    """``value`` as a task argument the run's graph draws no edge for (Prefect's ``quote``): the
    run's context goes to every task, and an edge from the tasks that made its parts to each of
    them would tangle the graph. The task receives ``value`` itself."""
    return cast(T, quote(value))


@dataclass(frozen=True)
class RunPlan:
    """Where a run writes: the output directory, its root, the nightly version, logs, sim GPUs."""

    out_dir: Path
    root: Path
    version: str | None
    sim_gpus: str | None
    log_dir: Path


@dataclass(frozen=True)
class RunContext:
    """One run's fixed facts.

    Args:
        cfg: the partition config with the run's overrides applied.
        plan: the output directory chosen for the run.
        run_id: the Prefect flow run id (None outside a flow run).
        target: where the server runs (the first target; ``for_server`` gives each server's).
        host: the physical GPU host of ``target``.
        gpus: the GPUs the server uses: the only ones the run's hygiene touches.
        parser: the reasoning parser (None: no split).
        fingerprint: the rows' ``server`` column of a launched server (``PartitionConfig.server_fingerprint``;
            a shared server's is asked of the server by the server session).
        explicit_fraction: ``mem_fraction_static`` given for this run (a flow parameter or
            ``--mem-fraction-static``): the first launch uses it whatever the tuner remembers.
    """

    cfg: PartitionConfig
    plan: RunPlan
    run_id: str | None
    target: str
    host: str
    gpus: tuple[int, ...]
    parser: str | None
    fingerprint: str
    explicit_fraction: float | None = None

    @classmethod
    def build(cls, cfg: PartitionConfig, plan: RunPlan, run_id: str | None,
              explicit_fraction: float | None = None) -> RunContext:
        """The context of a run of ``cfg`` into ``plan``."""
        target = cfg.targets[0]
        return cls(cfg=cfg, plan=plan, run_id=run_id, target=target, host=host_of(target),
                   gpus=tuple(cfg.server_gpus()), parser=_parser(cfg), fingerprint=cfg.server_fingerprint(),
                   explicit_fraction=explicit_fraction)

    def for_server(self, cfg: PartitionConfig) -> RunContext:
        """The context of one server of the run: ``cfg`` is ``self.cfg.for_server(slot)`` (a
        launched server) or ``self.cfg.for_url(url)`` (a running one)."""
        target = cfg.targets[0]
        return dataclasses.replace(self, cfg=cfg, target=target, host=host_of(target),
                                   gpus=tuple(cfg.server_gpus()), fingerprint=cfg.server_fingerprint())

    @property
    def launches(self) -> bool:
        """Whether the run launches its own server (else it uses ``run.server_url``)."""
        return self.cfg.server_url is None

    def inference(self) -> InferenceSettings:
        """How each dataset is generated (the same for every dataset of the run)."""
        cfg = self.cfg
        return InferenceSettings(
            shard_size=cfg.shard_size, concurrency=cfg.concurrency, sampling=dict(cfg.sampling),
            reasoning_parser=self.parser, model_dir=cfg.model_path,
            model_name=cfg.server.launch.served_model_name or Path(cfg.model_path).name,
            run_info={"flow_run": self.run_id, "host": self.host},
            truncation=TruncationPolicy(**cfg.truncation),
            order=cfg.order, order_window=cfg.order_window,
            samples=cfg.samples, regenerate=cfg.regenerate,
        )


def _parser(cfg: PartitionConfig) -> str | None:
    if cfg.reasoning_parser:
        return str(cfg.reasoning_parser)
    try:
        return parser_for_model(cfg.model_path)
    except Exception:  # a remote model dir cannot be read here: the partition must name the parser
        return None
