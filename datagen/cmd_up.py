"""`datagen up` / `datagen down`: a local Prefect control plane for datagen (`make up`, `make down`).

`up` starts, in this order, only what is not already running:
  1. a Prefect server on 127.0.0.1 (SQLite at ``$PREFECT_HOME/prefect.db``; PREFECT_HOME defaults to
     ``<project>/.prefect``; analytics off), unless ``--api-url`` names one that is already up;
  2. the process work pool ``gpu`` and one global concurrency limit ``gpu:<host>`` (limit 1) per GPU
     target of every partition, so two partitions never launch servers on one host;
  3. the automation that notifies a failed, crashed or cancelled deployment run (datagen/_notify.py;
     ``--notify`` / ``$DATAGEN_NOTIFY_BLOCK`` names the Slack, email or webhook block it sends to);
  4. every deployment of prefect.yaml (``prefect --no-prompt deploy --all``), their schedules
     (the nightly ``all``) on only with ``--schedule`` / ``$DATAGEN_SCHEDULE=1``, off with
     ``--no-schedule``, else as the server had them (off on a new server);
  5. a process worker on the pool (its environment carries DATAGEN_HOME so flow runs find the code);
and prints the UI URL and the next step (``export PREFECT_API_URL=...``, then a deployment run).
The port is ``--port``, else ``$DATAGEN_PREFECT_PORT``, else 4200; the server is told its own API
URL, so its UI works on any port. Pids go to ``<project>/.run/*.pid``
(``$DATAGEN_RUN_DIR`` or ``--run-dir`` elsewhere; with process start times, so a recycled pid is
never signalled); `down` stops exactly those processes and nothing else.

Exit codes: 0 done; 1 a step failed (the message says which, with the log's last lines);
2 usage error, or a path or setting that cannot be used.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from datagen._api_server import LEASE_STORAGE
from datagen._cli import EXIT_OK, EXIT_USAGE, exit_codes, parse_args, reports_errors
from datagen._notify import AUTOMATION_NAME, NOTIFY_ENV, ensure_failure_automation
from flows.gpulimit import ensure_limits, limit_name
from tasks.config import ConfigError, list_partitions, load_partition, project_root
from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.procs import ProcessIdentity, process_started, same_process, terminate_group

POOL = "gpu"
DEFAULT_PORT = 4200
SCHEDULE_ENV = "DATAGEN_SCHEDULE"


class UpError(DatagenError, RuntimeError):
    """A step of `datagen up` failed; the message names the step and carries the log tail."""


def _run_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("DATAGEN_RUN_DIR") or project_root() / ".run").resolve()


def _bin(name: str) -> str:
    # The venv's own console scripts, so `make up` works without an activated venv.
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------ pid files


def _write_pid(run_dir: Path, name: str, pid: int) -> None:
    atomic_write_json(run_dir / f"{name}.pid", {"pid": pid, "create_time": process_started(pid)}, indent=None)


def _read_pid(run_dir: Path, name: str) -> psutil.Process | None:
    """The process named by ``<name>.pid`` if it still is that process (pid and start time)."""
    path = run_dir / f"{name}.pid"
    try:
        info = json.loads(path.read_text())
        identity = ProcessIdentity(int(info["pid"]), float(info["create_time"]))
        return psutil.Process(identity.pid) if same_process(identity) else None
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None


def _start(argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> int:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,  # its own group: `down` stops its children too
        )
    return proc.pid


def _stop(proc: psutil.Process, first: signal.Signals, grace_s: float) -> str:
    """Signal the process group led by ``proc`` and its whole tree (``first``, then SIGKILL after
    ``grace_s``): Prefect starts some children in sessions of their own."""
    try:
        tree = [proc.pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return "already gone"
    end = terminate_group(proc.pid, grace_s, first=first, kill_wait_s=5.0, with_pids=tree)
    if end.ended_by == "gone":
        return "already gone"
    return "killed with SIGKILL" if end.ended_by == "SIGKILL" else f"stopped with {first.name}"


# ------------------------------------------------------------------------------------ up


def _wait_healthy(api_url: str, proc_pid: int | None, log: Path | None, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc_pid is not None and not psutil.pid_exists(proc_pid):
            raise UpError(f"prefect server exited during startup:\n{_tail(log) if log else ''}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise UpError(f"prefect server not healthy after {deadline_s:.0f} s:\n{_tail(log) if log else ''}")


def server_env(env: dict[str, str], api_url: str) -> dict[str, str]:
    """The environment of the server process: its UI fetches ``/ui-settings`` to learn where the API
    is, and Prefect answers with PREFECT_SERVER_UI_API_URL, else PREFECT_API_URL, else port 4200: an
    API on another port, or a PREFECT_API_URL of another server in the caller's shell, would leave
    every UI page empty or showing that other server."""
    return dict(env, PREFECT_API_URL=api_url, PREFECT_SERVER_UI_API_URL=api_url,
                PREFECT_UI_URL=api_url.removesuffix("/api"))


def gpu_limit_names() -> list[str]:
    """``gpu:<host>`` for every target of every partition config."""
    names: set[str] = set()
    for part in list_partitions():
        try:
            cfg = load_partition(part)
        except ConfigError:
            continue  # `datagen run` reports it; `up` should still come up
        names.update(limit_name(t) for t in cfg.targets)
    return sorted(names)


def _setup_api_objects(api_url: str) -> list[str]:
    # Prefect is imported here, not at the top: it reads its settings when imported, and `down`
    # (which never needs it) stays fast.
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        _ensure_pool()
        names = gpu_limit_names()
        ensure_limits(names)
    return names


def _datagen_deployments(http: httpx.Client) -> list[dict[str, Any]]:
    body = {"flows": {"name": {"any_": ["datagen"]}}}
    return list(http.post("/deployments/filter", json=body).raise_for_status().json())


def schedule_states(api_url: str) -> dict[str, bool]:
    """``{"<deployment>/<schedule slug or id>": active}`` for every schedule of a datagen deployment."""
    with httpx.Client(base_url=api_url, timeout=30) as http:
        return {f"{d['name']}/{s.get('slug') or s['id']}": bool(s["active"])
                for d in _datagen_deployments(http) for s in d.get("schedules") or []}


def apply_schedules(api_url: str, before: dict[str, bool], want: bool | None) -> list[str]:
    """Set each datagen schedule active when ``want`` is True, inactive when False, and as it was
    ``before`` the deploy when None (prefect.yaml deploys them inactive, so a fresh server runs
    nothing on its own). Returns the active ones as ``datagen/<deployment> <cron> <tz>``."""
    active_now = []
    with httpx.Client(base_url=api_url, timeout=30) as http:
        for d in _datagen_deployments(http):
            for s in d.get("schedules") or []:
                active = before.get(f"{d['name']}/{s.get('slug') or s['id']}", False) if want is None else want
                if bool(s["active"]) != active:
                    http.patch(f"/deployments/{d['id']}/schedules/{s['id']}",
                               json={"active": active}).raise_for_status()
                if active:
                    sched = s.get("schedule") or {}
                    active_now.append(f"datagen/{d['name']} {sched.get('cron', sched)} {sched.get('timezone') or ''}"
                                      .rstrip())
    return sorted(active_now)


def _ensure_pool() -> None:
    from prefect.client.orchestration import get_client  # noqa: PLC0415 (see _setup_api_objects)
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        except ObjectAlreadyExists:
            pass


@reports_errors("datagen up")
def up(args: argparse.Namespace) -> int:
    root = project_root()
    run_dir = _run_dir(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    home = Path(os.environ.get("PREFECT_HOME") or root / ".prefect").resolve()
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        DATAGEN_HOME=str(root),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    env.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASE_STORAGE)  # slot leases survive a restart
    if args.api_url:
        api_url = args.api_url.rstrip("/")
        _wait_healthy(api_url, None, None, 10.0)
        print(f"using the Prefect server at {api_url}")
    else:
        api_url = f"http://127.0.0.1:{args.port}/api"
        server = _read_pid(run_dir, "server")
        if server is None:
            log = run_dir / "server.log"
            pid = _start(
                [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(args.port)],
                log, server_env(env, api_url), root,
            )
            _write_pid(run_dir, "server", pid)
            print(f"prefect server: pid {pid}, PREFECT_HOME={home}, log {log}")
            _wait_healthy(api_url, pid, log, 90.0)
        else:
            print(f"prefect server: already running (pid {server.pid})")
    env["PREFECT_API_URL"] = api_url
    (run_dir / "api_url").write_text(api_url + "\n")

    names = _setup_api_objects(api_url)
    print(f"work pool {POOL!r} (process); global concurrency limits: {', '.join(names) or 'none'}")
    # Before the deploy, so a misnamed notification block stops `up` before anything changes.
    automation = ensure_failure_automation(api_url, args.notify)
    where = (f"notifies {args.notify}" if args.notify else
             f"actions {', '.join(automation['actions'])} (route it: --notify <block-type>/<block-name> "
             f"or ${NOTIFY_ENV})")
    print(f"failure automation {AUTOMATION_NAME!r}: {'created' if automation['created'] else 'updated'}, {where}")

    schedules_before = schedule_states(api_url)
    deploy_log = run_dir / "deploy.log"
    with open(deploy_log, "wb") as fh:
        try:
            rc = subprocess.run(
                [_bin("prefect"), "--no-prompt", "deploy", "--all"],
                cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=300,
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise UpError(str(exc)) from exc
    if rc != 0:
        raise UpError(f"`prefect --no-prompt deploy --all` exited {rc}:\n{_tail(deploy_log)}")
    print("deployed: " + ", ".join(f"datagen/{p}" for p in list_partitions()))
    active = apply_schedules(api_url, schedules_before, args.schedule)
    print("schedules active: " + ", ".join(active) if active else
          "schedules: none active (`datagen up --schedule` or DATAGEN_SCHEDULE=1 turns on the nightly `all`)")

    if not args.no_worker:
        worker = _read_pid(run_dir, "worker")
        if worker is None:
            log = run_dir / "worker.log"
            pid = _start(
                [_bin("prefect"), "worker", "start", "--pool", POOL, "--name", f"datagen-{os.uname().nodename}"],
                log, env, root,
            )
            _write_pid(run_dir, "worker", pid)
            print(f"worker: pid {pid} on pool {POOL!r}, log {log}")
        else:
            print(f"worker: already running (pid {worker.pid})")
    ui = api_url.removesuffix("/api")
    print(f"Prefect UI: {ui}")
    # The prefect CLI finds this server only through PREFECT_API_URL (without it, it would start an
    # ephemeral API that knows no deployments): the next step says so, ready to paste.
    print("next:")
    print(f"  export PREFECT_API_URL={api_url}")
    print("  .venv/bin/prefect deployment run datagen/demo --watch   (stop all: make down)")
    return EXIT_OK


@reports_errors("datagen down")
def down(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)
    stopped = 0
    # The worker first (SIGINT: it ignores SIGTERM), then the server it talks to.
    for name, sig in (("worker", signal.SIGINT), ("server", signal.SIGTERM)):
        proc = _read_pid(run_dir, name)
        if proc is None:
            print(f"{name}: not running")
        else:
            print(f"{name}: pid {proc.pid} {_stop(proc, sig, 15.0)}")
            stopped += 1
        (run_dir / f"{name}.pid").unlink(missing_ok=True)
    return EXIT_OK


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"${name}={value!r}: give 1 (on) or 0 (off), or unset it")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down"):
        print("usage: datagen up|down [options]", file=sys.stderr)
        return EXIT_USAGE
    cmd, rest = argv[0], argv[1:]
    try:
        schedule_default = _env_flag(SCHEDULE_ENV)
    except ConfigError as exc:
        print(f"datagen {cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser = argparse.ArgumentParser(prog=f"datagen {cmd}", epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="where pid files and logs go (default <project>/.run)")
    if cmd == "up":
        parser.add_argument("--port", type=int, default=int(os.environ.get("DATAGEN_PREFECT_PORT", DEFAULT_PORT)))
        parser.add_argument("--api-url", help="use this running Prefect server instead of starting one")
        parser.add_argument("--no-worker", action="store_true", help="do not start a worker")
        parser.add_argument("--schedule", action=argparse.BooleanOptionalAction, default=schedule_default,
                            help="turn the deployments' schedules (the nightly `all`) on, or off with "
                                 f"--no-schedule (default ${SCHEDULE_ENV}; unset: as they were, off on a "
                                 "new server)")
        parser.add_argument("--notify", default=os.environ.get(NOTIFY_ENV) or None, metavar="TYPE/NAME",
                            help="notification block (e.g. slack-webhook/datagen-alerts) the failure "
                                 f"automation sends to (default ${NOTIFY_ENV})")
    args = parse_args(parser, rest)
    if isinstance(args, int):
        return args
    return down(args) if cmd == "down" else up(args)
