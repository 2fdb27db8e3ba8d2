"""`datagen up` / `datagen worker` / `datagen down`: a Prefect control plane for datagen (`make up`,
`make down`), on one control host or several.

`up` starts, in this order, only what is not already running:
  1. a Prefect server on 127.0.0.1 (``--host`` / ``$DATAGEN_PREFECT_HOST`` another address, for
     workers on other control hosts), unless ``--api-url`` names one that is already up. Its database
     is SQLite at ``$PREFECT_HOME/prefect.db`` (PREFECT_HOME defaults to ``<project>/.prefect``), or
     the PostgreSQL database of ``--database-url`` / ``$PREFECT_SERVER_DATABASE_CONNECTION_URL``
     (``postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DATABASE``), checked before the server starts
     and shown with its password masked; analytics off;
  2. every work pool the deployments name (process pools; prefect.yaml puts them all on ``gpu``) and
     one global concurrency limit ``gpu:<host>`` (limit 1) per GPU target of every partition, so two
     partitions never launch servers on one host, whichever control host runs them;
  3. the automation that notifies a failed, crashed or cancelled deployment run (datagen/_notify.py;
     ``--notify`` / ``$DATAGEN_NOTIFY_BLOCK`` names the Slack, email or webhook block it sends to);
  4. every deployment of prefect.yaml (``--prefect-file`` names another; ``prefect --no-prompt
     deploy --all``), their schedules (the nightly ``all``) on only with ``--schedule`` /
     ``$DATAGEN_SCHEDULE=1``, off with ``--no-schedule``, else as the server had them (off on a new
     server);
  5. a process worker on the pool ``--pool`` (default ``gpu``; its environment carries DATAGEN_HOME
     so flow runs find the code, and no database setting), once it is online;
and prints the UI URL and the next step (``export PREFECT_API_URL=...``, then a deployment run).
`worker` starts one more process worker, on this or another control host, for the pool ``--pool``
(created when missing) of the server at ``--api-url`` (else ``$PREFECT_API_URL``, else the one `up`
started here). The port is ``--port``, else ``$DATAGEN_PREFECT_PORT``, else 4200; the server is told
its own API URL, so its UI works on any port. Pids go to ``<project>/.run/*.pid``
(``$DATAGEN_RUN_DIR`` or ``--run-dir`` elsewhere; with process start times, so a recycled pid is
never signalled); `down` stops exactly those processes (every worker, then the server) and nothing
else.

Exit codes: 0 done; 1 a step failed (the message says which, with the log's last lines);
2 usage error, or a path, setting or database that cannot be used or reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from datagen._api_server import LEASE_STORAGE
from datagen._cli import EXIT_OK, EXIT_USAGE, exit_codes, parse_args, reports_errors
from datagen._database import (
    DATABASE_URL_ENV,
    check_database,
    database_url,
    mask_url,
    scrub,
    without_database_settings,
)
from datagen._heartbeats import AUTOMATION_NAME as ZOMBIE_AUTOMATION
from datagen._heartbeats import (
    CRASH_AFTER_ENV,
    HEARTBEAT_ENV,
    crash_after_s,
    ensure_zombie_automation,
    heartbeat_s,
)
from datagen._notify import AUTOMATION_NAME, NOTIFY_ENV, ensure_failure_automation
from datagen._prefect_api import PrefectApi
from flows.gpulimit import ensure_limits, limit_name
from flows.params import form_schema
from tasks.config import ConfigError, list_partitions, load_partition, project_root
from tasks.errors import DatagenError
from tasks.files import atomic_write_json
from tasks.http import client as http_client
from tasks.procs import ProcessIdentity, process_started, same_process, terminate_group

POOL = "gpu"
DEFAULT_PORT = 4200
SCHEDULE_ENV = "DATAGEN_SCHEDULE"
WORKER_QUERY_S = "2"  # the worker's poll for submitted runs, unless PREFECT_WORKER_QUERY_SECONDS is set
WORKER_ONLINE_S = 120.0  # a loaded machine needs tens of seconds to import Prefect and register
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # also names the worker's pid file


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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_healthy(api_url: str, proc_pid: int | None, log: Path | None, deadline_s: float,
                  secret_url: str | None = None) -> None:
    def tail() -> str:
        return scrub(_tail(log), secret_url) if log else ""

    deadline = time.monotonic() + deadline_s
    # one client for every probe (tasks/http.py)
    with http_client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if proc_pid is not None and not _alive(proc_pid):
                raise UpError(f"prefect server exited during startup:\n{tail()}")
            try:
                if http.get(f"{api_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    raise UpError(f"prefect server not healthy after {deadline_s:.0f} s:\n{tail()}")


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


def check_pool_name(name: str) -> str:
    """``name`` when it can name a work pool here (letters, digits, ``_.-``; it also names the worker's
    pid file).

    Raises:
        ConfigError: any other name.
    """
    if not _POOL_NAME.fullmatch(name):
        raise ConfigError(f"work pool name {name!r}: use letters, digits, '_', '.' and '-' (first a letter or digit)")
    return name


def deployments_of(prefect_file: Path) -> tuple[list[str], list[str]]:
    """``(deployment names, work pool names)`` of a prefect.yaml, in file order.

    Raises:
        ConfigError: the file cannot be read, is not YAML, or a deployment names no work pool.
    """
    try:
        data = yaml.safe_load(prefect_file.read_text())
    except OSError as exc:
        raise ConfigError(f"{prefect_file}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{prefect_file}: not YAML: {exc}") from None
    deployments = (data or {}).get("deployments") if isinstance(data, dict) else None
    if not isinstance(deployments, list) or not deployments:
        raise ConfigError(f"{prefect_file}: no `deployments:` list")
    names, pools = [], []
    for d in deployments:
        pool = (d.get("work_pool") or {}).get("name") if isinstance(d, dict) else None
        if not isinstance(pool, str) or not pool:
            raise ConfigError(f"{prefect_file}: deployment {d.get('name') if isinstance(d, dict) else d!r} "
                              "names no work_pool: give it `work_pool: {name: gpu}` (or another pool)")
        names.append(str(d.get("name")))
        if pool not in pools:
            pools.append(check_pool_name(pool))
    return names, pools


def _setup_api_objects(api_url: str, pools: list[str]) -> list[str]:
    # Prefect is imported here, not at the top: it reads its settings when imported, and `down`
    # (which never needs it) stays fast.
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        _ensure_pools(pools)
        names = gpu_limit_names()
        ensure_limits(names)
    return names


def _datagen_deployments(http: httpx.Client) -> list[dict[str, Any]]:
    body = {"flows": {"name": {"any_": ["datagen"]}}}
    return list(http.post("/deployments/filter", json=body).raise_for_status().json())


def schedule_states(api_url: str) -> dict[str, bool]:
    """``{"<deployment>/<schedule slug or id>": active}`` for every schedule of a datagen deployment."""
    with PrefectApi(api_url) as http:
        return {f"{d['name']}/{s.get('slug') or s['id']}": bool(s["active"])
                for d in _datagen_deployments(http) for s in d.get("schedules") or []}


def apply_schedules(api_url: str, before: dict[str, bool], want: bool | None) -> list[str]:
    """Set each datagen schedule active when ``want`` is True, inactive when False, and as it was
    ``before`` the deploy when None (prefect.yaml deploys them inactive, so a fresh server runs
    nothing on its own). Returns the active ones as ``datagen/<deployment> <cron> <tz>``."""
    active_now = []
    with PrefectApi(api_url) as http:
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


def apply_parameter_forms(api_url: str) -> int:
    """Rewrite each datagen deployment's parameter schema for the custom-run form
    (:func:`flows.params.form_schema`: optional parameters show their type, not "None").
    Returns how many deployments changed."""
    changed = 0
    with PrefectApi(api_url) as http:
        for d in _datagen_deployments(http):
            schema = d.get("parameter_openapi_schema") or {}
            tidy = form_schema(schema)
            if tidy != schema:
                http.patch(f"/deployments/{d['id']}", json={"parameter_openapi_schema": tidy}).raise_for_status()
                changed += 1
    return changed


def _ensure_pools(names: list[str]) -> None:
    from prefect.client.orchestration import get_client  # noqa: PLC0415 (see _setup_api_objects)
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            except ObjectAlreadyExists:
                pass


def _control_env(root: Path) -> dict[str, str]:
    """The environment of what `up` and `worker` start, less the server database's settings."""
    env = without_database_settings(os.environ)
    home = Path(env.get("PREFECT_HOME") or root / ".prefect").resolve()
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        DATAGEN_HOME=str(root),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _worker_pid_name(pool: str) -> str:
    return "worker" if pool == POOL else f"worker-{pool}"


def _online(api_url: str, pool: str, name: str) -> bool:
    try:
        with http_client(timeout=5.0) as http:
            workers = http.post(f"{api_url}/work_pools/{pool}/workers/filter", json={})
        return any(w.get("name") == name and w.get("status") == "ONLINE" for w in workers.raise_for_status().json())
    except (httpx.HTTPError, ValueError):
        return False


def _start_worker(run_dir: Path, pool: str, name: str, env: dict[str, str], root: Path, beat_s: int) -> None:
    """Start ``prefect worker start --pool POOL`` unless its pid file names a live one, and wait until
    the server lists it online. Its flow runs send a heartbeat every ``beat_s`` (datagen/_heartbeats.py).

    Raises:
        UpError: the worker exited, or was not online within ``WORKER_ONLINE_S``.
    """
    pid_name = _worker_pid_name(pool)
    worker = _read_pid(run_dir, pid_name)
    if worker is not None:
        print(f"worker: already running on pool {pool!r} (pid {worker.pid})")
        return
    log = run_dir / f"{pid_name}.log"
    # Prefect's worker asks for runs every 10 s by default, so a submitted run waited up to 10 s
    # before anything started; asking every WORKER_QUERY_S is one small API call (decision 110).
    env = {"PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S, **env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(beat_s)}
    pid = _start([_bin("prefect"), "worker", "start", "--pool", pool, "--name", name], log, env, root)
    _write_pid(run_dir, pid_name, pid)
    deadline = time.monotonic() + WORKER_ONLINE_S
    while not _online(env["PREFECT_API_URL"], pool, name):
        if not _alive(pid):
            raise UpError(f"worker on pool {pool!r} exited during startup:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise UpError(f"worker on pool {pool!r} (pid {pid}) not online after {WORKER_ONLINE_S:.0f} s:\n{_tail(log)}")
        time.sleep(0.5)
    print(f"worker: pid {pid} {name!r} on pool {pool!r}, flow-run heartbeats every {beat_s} s, log {log}")


def _database_of(args: argparse.Namespace) -> str | None:
    """The database URL the server is to use (``database_url`` form), or None for SQLite under
    PREFECT_HOME.

    Raises:
        ConfigError: a bad URL, or ``--database-url`` with ``--api-url`` (that server has its own).
    """
    if args.database_url and args.api_url:
        raise ConfigError("--database-url configures the server `datagen up` starts; the server at --api-url "
                          "keeps its own database: give one or the other")
    if args.api_url:
        return None
    given = args.database_url or os.environ.get(DATABASE_URL_ENV) or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
    return database_url(given) if given else None


def _start_server(args: argparse.Namespace, run_dir: Path, env: dict[str, str], root: Path) -> str:
    # The API URL this host uses (and the UI is told); a server bound to every address is reached
    # here on loopback, so its UI works from other hosts only with --host naming this host's address.
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    api_url = f"http://{f'[{host}]' if ':' in host else host}:{args.port}/api"
    db = _database_of(args)
    shown = mask_url(db) if db else f"SQLite {env['PREFECT_HOME']}/prefect.db"
    record = run_dir / "database"
    server = _read_pid(run_dir, "server")
    if server is not None:
        running = record.read_text().strip() if record.exists() else "(not recorded)"
        if db and running != shown:
            raise ConfigError(f"the prefect server `datagen up` started (pid {server.pid}) uses {running}, not {shown}: "
                              "stop it with `datagen down` first")
        print(f"prefect server: already running (pid {server.pid}), database {running}")
        return api_url
    version = check_database(db) if db else None
    senv = server_env(env, api_url)
    if db:
        senv[DATABASE_URL_ENV] = db
    log = run_dir / "server.log"
    pid = _start([_bin("prefect"), "server", "start", "--host", args.host, "--port", str(args.port)], log, senv, root)
    _write_pid(run_dir, "server", pid)
    record.write_text(shown + "\n")
    print(f"prefect server: pid {pid}, PREFECT_HOME={env['PREFECT_HOME']}, database {shown}"
          f"{f' (PostgreSQL {version})' if version else ''}, log {log}")
    _wait_healthy(api_url, pid, log, 180.0 if db else 90.0, db)  # a new PostgreSQL database migrates first
    return api_url


def _start_of(args: argparse.Namespace) -> tuple[Path, Path, str]:
    """``(project root, run directory (created), worker pool)`` of `up` and `worker`."""
    run_dir = _run_dir(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return project_root(), run_dir, check_pool_name(args.pool)


@reports_errors("datagen up")
def up(args: argparse.Namespace) -> int:
    root, run_dir, pool = _start_of(args)
    prefect_file = Path(args.prefect_file).resolve() if args.prefect_file else root / "prefect.yaml"
    deployments, pools = deployments_of(prefect_file)
    beat = heartbeat_s(args.heartbeat_s)
    crash_after = crash_after_s(args.crash_after_s, beat)
    env = _control_env(root)
    env.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASE_STORAGE)  # slot leases survive a restart
    if args.api_url:
        api_url = args.api_url.rstrip("/")
        _database_of(args)  # --database-url with --api-url is a usage error
        _wait_healthy(api_url, None, None, 10.0)
        print(f"using the Prefect server at {api_url}")
    else:
        api_url = _start_server(args, run_dir, env, root)
    env["PREFECT_API_URL"] = api_url
    (run_dir / "api_url").write_text(api_url + "\n")

    pools = pools + [pool] * (pool not in pools)
    names = _setup_api_objects(api_url, pools)
    print(f"work pools {', '.join(map(repr, pools))} (process); global concurrency limits: {', '.join(names) or 'none'}")
    # Before the deploy, so a misnamed notification block stops `up` before anything changes.
    automation = ensure_failure_automation(api_url, args.notify)
    where = (f"notifies {args.notify}" if args.notify else
             f"actions {', '.join(automation['actions'])} (route it: --notify <block-type>/<block-name> "
             f"or ${NOTIFY_ENV})")
    print(f"failure automation {AUTOMATION_NAME!r}: {'created' if automation['created'] else 'updated'}, {where}")
    zombie = ensure_zombie_automation(api_url, crash_after)
    change = "created" if zombie["created"] else "updated" if zombie["updated"] else "unchanged"
    print(f"zombie automation {ZOMBIE_AUTOMATION!r}: {change}, "
          + (f"marks a datagen deployment run Crashed {zombie['within']} s after its last heartbeat"
             if zombie["enabled"] else "disabled (--crash-after-s 0)"))

    schedules_before = schedule_states(api_url)
    deploy_log = run_dir / "deploy.log"
    with open(deploy_log, "wb") as fh:
        try:
            rc = subprocess.run(
                [_bin("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
                cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=300,
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise UpError(str(exc)) from exc
    if rc != 0:
        raise UpError(f"`prefect --no-prompt deploy --all` exited {rc}:\n{_tail(deploy_log)}")
    print("deployed: " + ", ".join(f"datagen/{d}" for d in deployments))
    apply_parameter_forms(api_url)
    active = apply_schedules(api_url, schedules_before, args.schedule)
    print("schedules active: " + ", ".join(active) if active else
          "schedules: none active (`datagen up --schedule` or DATAGEN_SCHEDULE=1 turns on the nightly `all`)")

    if not args.no_worker:
        _start_worker(run_dir, pool, args.name or f"datagen-{os.uname().nodename}", env, root, beat)
    ui = api_url.removesuffix("/api")
    print(f"Prefect UI: {ui}")
    # The prefect CLI finds this server only through PREFECT_API_URL (without it, it would start an
    # ephemeral API that knows no deployments): the next step says so, ready to paste.
    print("next:")
    print(f"  export PREFECT_API_URL={api_url}")
    print("  .venv/bin/prefect deployment run datagen/demo --watch   (stop all: make down)")
    return EXIT_OK


def _worker_api_url(args: argparse.Namespace, run_dir: Path) -> str:
    recorded = run_dir / "api_url"
    url = args.api_url or os.environ.get("PREFECT_API_URL") or (recorded.read_text().strip() if recorded.exists() else "")
    if not url:
        raise ConfigError("no Prefect server to work for: give --api-url http://HOST:PORT/api (the server's), "
                          "set PREFECT_API_URL, or run `datagen up` on this host first")
    return url.rstrip("/")


@reports_errors("datagen worker")
def worker(args: argparse.Namespace) -> int:
    root, run_dir, pool = _start_of(args)
    beat = heartbeat_s(args.heartbeat_s)
    api_url = _worker_api_url(args, run_dir)
    try:
        _wait_healthy(api_url, None, None, 10.0)
    except UpError:
        raise UpError(f"no Prefect server answers at {api_url}: start it (`datagen up` on the server's host) "
                      "or fix --api-url / PREFECT_API_URL") from None
    env = dict(_control_env(root), PREFECT_API_URL=api_url)
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        _ensure_pools([pool])
    _start_worker(run_dir, pool, args.name or f"datagen-{os.uname().nodename}", env, root, beat)
    print(f"stop it: datagen down{f' --run-dir {args.run_dir}' if args.run_dir else ''}")
    return EXIT_OK


@reports_errors("datagen down")
def down(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)
    # Every worker first (SIGINT: it ignores SIGTERM), then the server they talk to.
    workers = sorted(p.stem for p in run_dir.glob("worker*.pid")) or ["worker"]
    for name, sig in [*((w, signal.SIGINT) for w in workers), ("server", signal.SIGTERM)]:
        proc = _read_pid(run_dir, name)
        if proc is None:
            print(f"{name}: not running")
        else:
            print(f"{name}: pid {proc.pid} {_stop(proc, sig, 15.0)}")
        (run_dir / f"{name}.pid").unlink(missing_ok=True)
    (run_dir / "database").unlink(missing_ok=True)
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


_DESCRIPTIONS = {
    "up": "Start what is not running yet: a Prefect server, the work pools and GPU limits, the deployments "
          "of prefect.yaml, the failure automation and one worker; each stopped by `datagen down`.",
    "worker": "Start one more Prefect worker for a work pool, on this or another control host.",
    "down": "Stop what `datagen up` and `datagen worker` started, by their pid files (nothing else).",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down", "worker"):
        print("usage: datagen up|worker|down [options]", file=sys.stderr)
        return EXIT_USAGE
    cmd, rest = argv[0], argv[1:]
    try:
        schedule_default = _env_flag(SCHEDULE_ENV)
    except ConfigError as exc:
        print(f"datagen {cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser = argparse.ArgumentParser(prog=f"datagen {cmd}", description=_DESCRIPTIONS[cmd], epilog=exit_codes(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="where pid files and logs go (default <project>/.run)")
    if cmd in ("up", "worker"):
        parser.add_argument("--pool", default=POOL,
                            help=f"the work pool the worker serves (default {POOL!r}; created when missing)")
        parser.add_argument("--name", help="the worker's name (default datagen-<host name>)")
        parser.add_argument("--heartbeat-s", type=int, metavar="S",
                            help=f"seconds between its flow runs' heartbeats (default ${HEARTBEAT_ENV}, else 30; "
                                 "Prefect's minimum is 30)")
    if cmd == "worker":
        parser.add_argument("--api-url", help="the Prefect API the worker serves (default $PREFECT_API_URL, else "
                                              "the server `datagen up` started with this --run-dir)")
    if cmd == "up":
        parser.add_argument("--port", type=int, default=int(os.environ.get("DATAGEN_PREFECT_PORT", DEFAULT_PORT)),
                            help=f"the started server's port (default $DATAGEN_PREFECT_PORT, else {DEFAULT_PORT})")
        parser.add_argument("--host", default=os.environ.get("DATAGEN_PREFECT_HOST") or "127.0.0.1",
                            help="the address the started server listens on (default $DATAGEN_PREFECT_HOST, else "
                                 "127.0.0.1; give the host's address for workers on other control hosts)")
        parser.add_argument("--api-url", help="use this running Prefect server instead of starting one")
        parser.add_argument("--database-url", metavar="URL",
                            help="the started server's database: postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB "
                                 f"(default ${DATABASE_URL_ENV}; unset: SQLite under PREFECT_HOME)")
        parser.add_argument("--prefect-file", metavar="PATH",
                            help="the deployments to deploy (default <project>/prefect.yaml)")
        parser.add_argument("--no-worker", action="store_true", help="do not start a worker")
        parser.add_argument("--crash-after-s", type=int, metavar="S",
                            help="mark a datagen deployment run Crashed when its heartbeats stop for this long "
                                 f"(default ${CRASH_AFTER_ENV}, else 120; at least twice --heartbeat-s; 0: off)")
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
    return {"up": up, "down": down, "worker": worker}[cmd](args)
