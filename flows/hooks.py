"""State hooks of the datagen flow: GPU hygiene on the partition's targets after failure, crash
or cancellation, limited to the GPUs of the partition's server (``gpus`` in the run record, else
``server.gpus`` / 0..tp_size-1 from the partition config): another job on another GPU is spared.

Hooks run outside the run context, and after a SIGKILL of the flow process they run in the
process worker (or ``serve``), not in the dead process. So they take everything from the flow
run's parameters and the run record on disk (``flows.runrecord``), log through
``flow_run_logger`` and never raise (Prefect only logs a hook's exception). A plain script run
that is SIGKILLed gets no hook at all: the next run's first task is hygiene anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.logging.loggers import flow_run_logger

from flows import runrecord
from flows.gpulimit import host_of, release_lease
from tasks import standins
from tasks.artifacts import artifact_key
from tasks.config import load_partition
from tasks.gpus import SIM_GPUS_NOTE
from tasks.hygiene import clean_gpus

__all__ = ["cleanup_hook"]


def cleanup_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """Kill the servers this run started and verify the GPUs clean on every target."""
    logger = flow_run_logger(flow_run, flow)
    run_id = str(flow_run.id)
    record = runrecord.read(run_id)
    params = dict(getattr(flow_run, "parameters", None) or {})
    targets = record.targets
    gpus = record.gpus
    grace = 5.0
    if targets is None or gpus is None:
        try:
            cfg = load_partition(params.get("partition", "all"))
            targets = cfg.hosts() if targets is None else targets
            gpus = cfg.server_gpus() if gpus is None else gpus
            grace = cfg.hygiene_grace_s
        except Exception as exc:
            logger.error("cleanup hook: cannot load the partition config (%s); nothing cleaned", exc)
            return
    if record.shared_server or params.get("server_url"):
        logger.info("cleanup hook (%s): shared server, GPUs are not ours to clean", state.name)
        return
    if record.targets is not None and not record.lease and not record.servers:
        # The run stopped before it held `gpu:<host>` (e.g. another run holds the output's lock):
        # whatever is on those GPUs belongs to another run, which cleaning would kill.
        logger.info("cleanup hook (%s): the run never held a GPU slot; nothing of ours to clean", state.name)
        return
    standins.look_at(record.sim_gpus)  # a worker may not have inherited them: hygiene must look there
    lines = [f"# Cleanup after {state.name}", ""]
    verdicts: list[str] = []  # hygiene's verdict per target
    # This run's local servers, recorded as soon as each process existed (a server still loading
    # included): ended by process group once their pid and start time are checked, never by a
    # bare pgid that may name another session by now. Remote ones go to hygiene as extra_pids.
    for entry in record.servers:
        if entry.local and not entry.done:
            ended = runrecord.end_server(entry, grace)
            if ended:
                logger.info("cleanup hook: ended server pid %s (process group %s)", entry.pid, entry.pgid)
                lines += [f"server pid {entry.pid} (process group {entry.pgid}): ended", ""]
            runrecord.server_state(run_id, entry.pid, runrecord.ServerState.ENDED if ended else runrecord.ServerState.GONE,
                                  entry.target)
    for target in targets:
        pids = tuple(
            s.pgid or s.pid for s in record.servers
            if s.target == target and target != "local" and not s.done
        )
        try:
            # Each target's own servers' GPUs when recorded (several servers per run), else the run's.
            mine = record.target_gpus.get(target, gpus)
            report = clean_gpus(target=target, gpus=list(mine), grace_s=grace, extra_pids=pids)
            report.notes = [n for n in report.notes if n != SIM_GPUS_NOTE]  # the run said it once
            summary = report.summary()
            verdict = report.verdict
        except Exception as exc:
            summary, verdict = f"hygiene raised {type(exc).__name__}: {exc}", "unknown"
        level = logger.info if verdict == "clean" else logger.error
        level("cleanup hook (%s) on %s: %s\n%s", state.name, host_of(target), verdict, summary)
        lines += [f"## `{host_of(target)}`: {verdict}", "", "```", summary, "```", ""]
        verdicts.append(verdict)
    lease = None if record.lease_released else record.lease  # gpu_slots let it go on the way out
    released = False
    if lease:
        released = release_lease(lease)
        logger.info("cleanup hook: gpu slot lease %s %s", lease, "released" if released else "already gone")
        lines.append(f"gpu slot lease {lease}: {'released' if released else 'already gone'}")
    partition = str(record.partition or Path(str(params.get("partition", "all"))).stem)
    verdict = "CLEAN" if verdicts and all(v == "clean" for v in verdicts) else "NOT CLEAN" if verdicts else "NOTHING"
    _artifact(flow_run.id, "\n".join(lines), logger, key=artifact_key("hygiene-cleanup", partition),
              description=f"{verdict}: GPU hygiene after {state.name} ({partition})")
    # A released lease: the next run on this host need not try it again (runrecord.release_dead_leases).
    runrecord.cleaned(run_id, state.name, released=bool(lease and released))


def _artifact(flow_run_id: Any, markdown: str, logger: Any, key: str, description: str) -> None:
    try:
        with get_client(sync_client=True) as client:
            client.create_artifact(
                ArtifactCreate(key=key, type="markdown", data=markdown, description=description,
                               flow_run_id=flow_run_id)
            )
    except Exception as exc:
        logger.warning("cleanup artifact not created: %s", exc)
