"""The hygiene stage's Prefect task: clean the server's GPUs on its target and prove them clean, with
its verdict as an artifact. Retried by the flow's policy (flows/retry.py) while GPUs are not yet
clean."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tasks.artifacts import artifact_key, gpu_label, markdown, run_name
from tasks.gpus import SIM_GPUS_NOTE
from tasks.hygiene import GpusNotClean, NoGpus, clean_gpus
from tasks.run import RunContext
from tasks.server import DEFAULT_PORT
from tasks.targets import host_of, on_each

__all__ = ["hygiene", "no_gpu_ways"]


def no_gpu_ways(model_path: str | None) -> str:
    """Every way on from a host without a GPU, each one that works as written."""
    model = model_path or "MODEL_DIR"
    return ("the ways on: run where the GPUs are ([server] targets = [\"ssh://user@gpu-host\"] in a partition, "
            "`datagen run --partition FILE.toml`); use a server already running elsewhere (--server-url "
            "http://host:port); SGLang on this CPU, slow but real (start `python -m sglang.launch_server "
            f"--model-path {model} --device cpu --port {DEFAULT_PORT}` and pass --server-url "
            f"http://127.0.0.1:{DEFAULT_PORT}: "
            "datagen launches servers on GPUs only); or try the pipeline on the emulator (--backend emulator: "
            "simulated GPUs are created under the output)")


@task(task_run_name=run_name("hygiene-{phase}-{host}-{gpus}"), cache_policy=NONE)
def hygiene(ctx: RunContext, phase: str) -> dict[str, Any]:
    """Clean the server's GPUs on the run's target and verify; processes holding only other GPUs
    are spared and listed so.

    Raises:
        NoGpus: no GPU can be read on the target (not retried: the message says what to run instead).
        GpusNotClean: not verified clean (retried).
    """
    # a server over several nodes: every node's GPUs, cleaned at once, each reported on its own
    cleaned = on_each(lambda node: clean_gpus(target=node, gpus=list(ctx.gpus), grace_s=ctx.cfg.hygiene_grace_s),
                        ctx.nodes)
    reports = [_report_node(ctx, phase, node, report) for node, report in zip(ctx.nodes, cleaned, strict=True)]
    for node, report in zip(ctx.nodes, reports, strict=True):
        host = host_of(node)
        if report.backend == "none":
            emulator = ctx.cfg.server.launch.backend == "emulator"
            raise NoGpus(f"no GPU can be read on {host} ({report.error}); "
                         + ("set [sim_gpus] in the partition or DATAGEN_SIM_GPUS to simulated GPUs for the emulator"
                            if emulator else no_gpu_ways(ctx.cfg.model_path)), report)
        if not report.clean:
            raise GpusNotClean(f"GPUs on {host} not verified clean ({report.verdict}):\n{report.summary()}")
    if len(reports) == 1:
        return reports[0].to_dict()
    return {"nodes": {node: report.to_dict() for node, report in zip(ctx.nodes, reports, strict=True)}}


def _report_node(ctx: RunContext, phase: str, node: str, report: Any) -> Any:
    """One host's hygiene report, logged and published."""
    host = host_of(node)
    report.notes = [n for n in report.notes if n != SIM_GPUS_NOTE]  # said once per run (prepare-output)
    summary = report.summary()
    verdict = report.verdict.upper().replace("_", " ")
    get_run_logger().info("hygiene %s on %s: %s", phase, host, summary)
    markdown(f"# GPU hygiene ({phase}) on `{host}`\n\nverdict: **{verdict}**\n\n```\n{summary}\n```\n",
             key=artifact_key("hygiene", phase, ctx.cfg.name, host),
             description=f"{verdict}: hygiene {phase} on {host} {gpu_label(ctx.gpus)}")
    return report
