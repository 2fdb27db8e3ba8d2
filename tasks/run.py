"""What a run knows once it has started: the partition config, the output plan and the server's place.

``RunContext`` is built once in the flow, after the config is loaded and the output chosen, and
handed to every stage task (tasks/<stage>/task.py) and server lifecycle instead of long argument
lists. It is plain data with no Prefect in it, below the stage tasks that take it, so that
``tasks/`` never imports ``flows/`` (docs/decisions/111-stage-tasks-beside-their-cores.md). It is a plain
object, not a dataclass, on purpose: Prefect walks a task's dataclass arguments to draw the run's
graph and would draw an edge from every task whose result the context holds (the config, the plan)
to every task given the context; an opaque object is passed as is, so the graph shows only the data
each task takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config import PartitionConfig
from tasks.inference import InferenceSettings
from tasks.reasoning import parser_for_model
from tasks.targets import host_of

__all__ = ["RunContext", "RunPlan"]

@dataclass(frozen=True)
class RunPlan:
    """Where a run writes: the output directory, its root, the nightly version, logs, sim GPUs."""

    out_dir: Path
    root: Path
    version: str | None
    sim_gpus: str | None
    log_dir: Path


class RunContext:
    """One run's fixed facts: the config (with the run's overrides), the output plan, the Prefect run
    id and the reasoning parser, read once (it may read the model directory). The server's place
    (``target``, ``host``, ``gpus``) and the rows' ``fingerprint`` are read off the config, so the
    context of one server of the run is the same context with that server's config (``for_server``).

    Args:
        cfg: the partition config with the run's overrides applied.
        plan: the output directory chosen for the run.
        run_id: the Prefect flow run id (None outside a flow run).
        parser: the reasoning parser (None: no split).
    """

    __slots__ = ("cfg", "parser", "plan", "run_id")

    def __init__(self, *, cfg: PartitionConfig, plan: RunPlan, run_id: str | None, parser: str | None) -> None:
        self.cfg = cfg
        self.plan = plan
        self.run_id = run_id
        self.parser = parser

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def replace(self, **changes: Any) -> RunContext:
        """A copy with ``changes`` applied."""
        return RunContext(**(self._fields() | changes))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunContext) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunContext(partition={self.cfg.name!r}, run_id={self.run_id!r}, target={self.target!r}, gpus={self.gpus})"

    @classmethod
    def build(cls, cfg: PartitionConfig, plan: RunPlan, run_id: str | None) -> RunContext:
        """The context of a run of ``cfg`` into ``plan``."""
        return cls(cfg=cfg, plan=plan, run_id=run_id, parser=_parser(cfg))

    def for_server(self, cfg: PartitionConfig) -> RunContext:
        """The context of one server of the run: ``cfg`` is ``self.cfg.for_server(slot)`` (a
        launched server) or ``self.cfg.for_url(url)`` (a running one)."""
        return self.replace(cfg=cfg)

    @property
    def target(self) -> str:
        """Where the server runs (the config's first target; ``for_server`` gives each server's)."""
        return self.cfg.targets[0]

    @property
    def host(self) -> str:
        """The physical GPU host of ``target``."""
        return host_of(self.target)

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs the server uses (on each of its nodes): the only ones the run's hygiene touches."""
        return tuple(self.cfg.server_gpus())

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every host of the server, node 0 (``target``) first: one for a server on one host."""
        return self.cfg.server.nodes or (self.target,)

    @property
    def gpu_count(self) -> int:
        """GPUs the server holds on all its nodes together (the ledger's GPU-seconds count these)."""
        return len(self.gpus) * len(self.nodes)

    @property
    def fingerprint(self) -> str:
        """The rows' ``server`` column of a launched server (``PartitionConfig.server_fingerprint``; a
        shared server's is asked of the server by its lifecycle)."""
        return self.cfg.server_fingerprint()

    @property
    def explicit_fraction(self) -> float | None:
        """``mem_fraction_static`` given for this run (a flow parameter or ``--mem-fraction-static``):
        the first launch uses it whatever the tuner remembers."""
        return self.cfg.explicit_fraction

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
            truncation=cfg.truncation,
            order=cfg.order, order_window=cfg.order_window, dispatch=cfg.dispatch,
            samples=cfg.samples, regenerate=cfg.regenerate,
        )


def _parser(cfg: PartitionConfig) -> str | None:
    if cfg.reasoning_parser:
        return str(cfg.reasoning_parser)
    try:
        return parser_for_model(cfg.model_path)
    except Exception:  # a remote model dir cannot be read here: the partition must name the parser
        return None
