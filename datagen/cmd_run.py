"""`datagen run`: run the datagen flow now, in this process.

    datagen run [--partition NAME|FILE.toml] [--input PATH ...] [--SETTING VALUE ...]

The options are the run settings (tasks.config.RUN_SETTINGS; docs/configuration.md lists them).

Uses the Prefect server named by PREFECT_API_URL (or the one `datagen up` started), else starts
its own API server for the run, started while the flow is imported ($DATAGEN_API_START_TIMEOUT_S bounds
the CPU seconds it may spend starting, default 120: a busy host delays the run, it does not fail it). A
GPU host another run holds is waited for at most $DATAGEN_SLOT_WAIT_S (default 300 s). ``--input``
runs ad-hoc datasets with the partition's model and server settings:
without ``--partition``, those of ``adhoc`` (one local GPU; ``--tp-size`` for more), else ``all``;
``--server-url`` uses a running server (no launch, no hygiene on it); given several times, several.

Exit codes: 0 the run completed (validation passed); 1 the run failed (hygiene, launch, inference
or validation; the message says which), or another run held the GPU host past the slot wait; 2
usage or configuration error (a missing input names its path), a target that cannot be reached, an output written from another input or shard size, or
the output is locked by another run (refused at once, naming the lock holder), as `datagen resplit`
does, a committed shard whose file is missing or changed (`datagen repair OUT` un-commits it), or
shard files that no manifest records and that are not this input's slices.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx

from datagen._api_server import owned_api
from datagen._cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    exit_code_for,
    exit_codes,
    parse_args,
    reports_errors,
)
from flows.gpulimit import ensure_limits, limit_name
from tasks import http
from tasks.config import (
    ConfigError,
    PartitionConfig,
    RunSettings,
    add_cli_options,
    load_partition,
    project_root,
)
from tasks.inference import RunLedger, ServerReport
from tasks.shards import OutputDir, OutputLocked

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State


# Prefect reads its settings when imported: these run before any Prefect import. Without
# PREFECT_API_URL the flow uses an ephemeral API on $PREFECT_HOME/prefect.db; PREFECT_HOME defaults
# to <project>/.prefect (git-ignored) so a demo never writes to ~.
def setup_prefect_env() -> None:
    os.environ.setdefault("PREFECT_HOME", str(project_root() / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    if not os.environ.get("PREFECT_API_URL"):
        # `datagen up` left a server running: use it, so the run shows in its UI.
        api = _up_api_url()
        if api:
            os.environ["PREFECT_API_URL"] = api


def _up_api_url() -> str | None:
    run_dir = os.environ.get("DATAGEN_RUN_DIR") or str(project_root() / ".run")
    try:
        url = open(os.path.join(run_dir, "api_url")).read().strip()
    except OSError:
        return None
    return url if api_healthy(url) else None


def api_healthy(url: str | None) -> bool:
    if not url:
        return False
    try:
        with http.client(timeout=2.0) as c:
            return c.get(url.rstrip("/") + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def ui_url() -> str | None:
    """The UI address when a real Prefect server (not the ephemeral API) is in use."""
    url = os.environ.get("PREFECT_API_URL")
    return url.rstrip("/").removesuffix("/api") if url and api_healthy(url) else None



def build_parser(prog: str = "datagen run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the datagen flow now.", epilog=exit_codes(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_options(p)  # one option per run setting (tasks.config.RUN_SETTINGS)
    return p


def overrides_of(args: argparse.Namespace) -> RunSettings:
    """The overrides among the parsed options (their dests are the override names)."""
    return RunSettings.from_mapping(vars(args))


def partition_of(args: argparse.Namespace) -> str:
    """The partition to run: ``--partition``, else ``adhoc`` for an ``--input`` run, else ``all``."""
    return args.partition or ("adhoc" if args.inputs else "all")


def run_flow(partition: str, values: Mapping[str, Any]) -> tuple[int, Any]:
    """Validate the settings among ``values`` and the config, run the flow; returns (exit code, flow
    result or error)."""
    try:
        overrides = RunSettings.from_mapping(values)
        cfg = load_partition(partition).with_overrides(overrides)
    except ConfigError as exc:
        return exit_code_for(exc), exc
    locked = _locked(cfg)
    if locked is not None:
        # Refuse before starting Prefect or touching a GPU: the other run owns this output.
        return exit_code_for(locked), locked
    setup_prefect_env()
    with owned_api() as api:  # no Prefect server to use: this run's own, stopped when it ends
        # Imported after setup_prefect_env and owned_api (Prefect reads its settings when imported),
        # while the API server starts: the two take seconds each.
        from flows.cancel import sigterm_stops_the_run  # noqa: PLC0415
        from flows.datagen import datagen  # noqa: PLC0415

        sigterm_stops_the_run("terminated (SIGTERM to datagen run)")
        api.ready()

        if cfg.server_url is None:
            ensure_limits([limit_name(t) for t in cfg.hosts()])
        # cast: the flow's settings are keywords, which hides return_state's overload from mypy
        state = cast("State[Any]", datagen(partition=partition, **overrides.as_kwargs(), return_state=True))
        if state.is_completed():
            return EXIT_OK, state.result()
        err = state.result(raise_on_failure=False)
    if isinstance(err, BaseException):  # OutputLocked here: taken between the check and the flow
        return exit_code_for(err), err
    return EXIT_FAILED, state.message


def _locked(cfg: PartitionConfig) -> OutputLocked | None:
    """``OutputLocked`` when a live process holds the lock of the output this run would write."""
    if cfg.versioned:
        return None  # the flow picks (or creates) the dated directory itself
    out = OutputDir(cfg.output_root)
    holder = out.lock_holder()
    return OutputLocked(out.path / "_lock", holder) if holder is not None else None


def server_lines(servers: list[dict[str, Any]]) -> list[str]:
    """What each server of a run did (only when there were several, or one was lost)."""
    reports = [ServerReport.from_dict(s) for s in servers]
    if len(reports) < 2 and not any(r.lost for r in reports):
        return []
    lines = []
    for r in reports:
        why = r.why()
        cached = f"{r.cached_pct:.0f}% of prompt tokens cached, " if r.cached_pct is not None else ""
        lines.append(f"  server {r.server}: {r.rows} rows, {r.tokens_per_s:.0f} tokens/s, {cached}"
                     f"{r.launches} launch(es), {r.state}" + (f" ({why})" if why else ""))
    return lines


def failure_label(result: Any, failed: str) -> str:
    """How a refused or failed run's message starts: "refused" (output locked), "configuration
    error", or ``failed``."""
    if isinstance(result, OutputLocked):
        return "refused"
    return "configuration error" if isinstance(result, ConfigError) else failed


def verdict_line(summary: str, out: Path) -> str:
    """The validation's first line: the checks were logged above, and are kept in the output."""
    head = summary.splitlines()[0] if summary else "validation: not run"
    return f"{head}; the checks are in the log above and {out / '_validation.json'}"


@reports_errors("datagen run")
def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):
        return args
    if args.partition is None and args.inputs and not (args.model_path or args.server_url):
        if args.backend != "emulator":
            print("datagen run: an --input run without --partition needs --model-path DIR (the model to "
                  "launch), --server-url URL (a running server) or --backend emulator (the bundled demo "
                  "model on the emulator)", file=sys.stderr)
            return EXIT_USAGE
        # on the emulator the ad-hoc partition's own [model] path, the bundled demo model, is served
    code, result = run_flow(partition_of(args), vars(args))
    if code == EXIT_OK:
        print(f"completed: {result['rows']} rows in {result['out_dir']}")
        for line in server_lines(result.get("servers") or []):
            print(line)
        ledger = RunLedger.from_dict(result.get("ledger"))
        if ledger is not None:
            print("GPU-time ledger:")
            print("\n".join(ledger.text_lines()))
        print(verdict_line(result["validation"], Path(result["out_dir"])))
        if result.get("latest"):
            print(f"latest -> {result['out_dir']}")
    else:
        print(f"datagen run: {failure_label(result, 'run failed')}: {result}", file=sys.stderr)
    return code
