"""Chaos run: N rounds of `datagen run` on the emulator, each with one fault from the matrix (README,
"Reliability"), rerun until complete; then nothing may be lost, duplicated or left behind.

    python bench/chaos.py --rounds N [--seed S] [--round K] [--faults a,b,...] [--quick] [--keep]
                          [--work-dir DIR] [--json PATH]

A round's parameters depend only on (seed, K), so ``--seed S --round K`` replays it. Every process a
round starts carries ``DATAGEN_CHAOS_TAG=<token>`` in its environment; leftovers are found by that
token and killed by pid. All rounds share one Prefect server, stopped by pid at the end.

Exit codes: 0 every round passed; 1 a round lost or duplicated a row, failed validation, did not
complete, or left a process or GPU memory behind; 2 usage error or the harness could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from emulator.simgpu import ENV_VAR, SimGpus  # noqa: E402
from tasks.http import client as http_client  # noqa: E402
from tests.support.common import tree_digest  # noqa: E402
from tests.support.sshd import (  # noqa: E402
    SSHD,
    SshHost,
    cut_off,
    hosts_env,
    restart_sshd,
    start_hosts,
    stop_hosts,
)

FAULTS = ("kill9", "server_crash", "runtime_oom", "hang", "http_503", "orphan", "stale_holder",
          "disk_full", "malformed", "multi_server_dies", "multi_host_unreachable", "multi_server_hangs",
          "dir_symlink", "manifest_traversal", "bad_body", "kill9_no_rerun", "worker_kill")
# Faults of one server among three, each on its own host (a real sshd on 127.0.0.2, .3, .4).
MULTI = ("multi_server_dies", "multi_host_unreachable", "multi_server_hangs")
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
TAG_ENV = "DATAGEN_CHAOS_TAG"
MAX_PROGRESS_RERUNS = 12  # reruns beyond --max-reruns only while each adds rows
# worker_kill: the round's deployment run is SIGKILLed with its worker's whole process tree; the zombie
# automation of `datagen up` must mark it Crashed (heartbeats every 30 s, this bound), the next run completes
WORKER_CRASH_AFTER_S = 60
OUTLIVE_BOUND_S = 30.0  # kill9_no_rerun: no process of the killed run (its server) may live longer
# Files outside OUT that a run following a planted link or a hostile manifest would write, delete or
# rewrite; every round checksums this tree before and after.
SENTINEL_FILES = ("ds0.jsonl", "notes.tmp-77-abcd", "shard-00000.parquet", "shard-00000.jsonl",
                  "ds0/shard-00001.jsonl", "ds0/shard-00000.parquet", "server.log")
VENV_BIN = Path(sys.executable).parent
DATAGEN = str(VENV_BIN / "datagen") if (VENV_BIN / "datagen").exists() else "datagen"
MODEL_DIR = ROOT / "data" / "models" / "demo"
# Fast emulator timings: the point is the fault handling, not the model's speed.
FAST_EMU = ["--emu-load-time", "0.2", "--emu-graph-time", "0.05", "--emu-warmup-time", "0.1",
            "--emu-output-tokens", "24", "--emu-decode-ms-per-step", "1", "--emu-health-timeout", "1"]
WORDS = ("alpha beta gamma delta graph cache shard token prefill decode parquet schema journal "
         "tensor kernel queue batch model server commit flush rename lock socket thread").split()


# --- round plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything random about a round, drawn from (seed, round) only."""

    round: int
    fault: str
    datasets: dict[str, int]  # name -> valid rows
    malformed: int  # malformed rows per dataset
    shard_size: int
    concurrency: int
    prompt_words: tuple[int, int]
    extra_args: list[str] = field(default_factory=list)
    mem_fraction: float | None = None
    kill_at_rows: int | None = None  # kill9: after this many rows are done, else at kill_at_s
    kill_at_s: float | None = None
    holder: dict[str, int] | None = None
    tmpfs_kib: int | None = None
    data_seed: int = 0
    victim_args: str = ""  # multi: emulator fault flags of the victim host's server (DATAGEN_EMU_ARGS)
    act_at_rows: int | None = None  # multi: kill the victim's server / cut its host off at this many rows
    restore_after_s: float = 0.0  # multi_host_unreachable: its sshd comes back after this long
    plant: str | None = None  # dir_symlink: the directory under OUT planted as a link to the sentinel
    server_grace_s: float | None = None  # run.server_grace_s (None: the default; a kill9 rerun adopts)

    def describe(self) -> str:
        bits: list[str] = []
        emu = [a for a in self.extra_args if a.startswith("--emu-") and a not in FAST_EMU]
        for i, a in enumerate(self.extra_args):
            if a in emu and a not in ("--emu-orphan-on-crash",):
                bits.append(f"{a.removeprefix('--emu-')}={self.extra_args[i + 1]}")
            elif a == "--emu-orphan-on-crash":
                bits.append("orphan-on-crash")
        if self.mem_fraction is not None:
            bits.append(f"fraction={self.mem_fraction}")
        if self.kill_at_rows is not None:
            bits.append(f"kill@{self.kill_at_rows}rows")
        if self.kill_at_s is not None:
            bits.append(f"kill@{self.kill_at_s:.1f}s")
        if self.holder:
            bits.append(f"hold gpu{self.holder['gpu']} {self.holder['mib']}MiB +{self.holder['children']}ch")
        if self.tmpfs_kib:
            bits.append(f"tmpfs={self.tmpfs_kib}KiB")
        if self.fault == "malformed":
            bits.append(f"malformed={self.malformed}/ds")
        if self.victim_args:
            bits.append(f"victim {self.victim_args.removeprefix('--emu-')}")
        if self.act_at_rows is not None:
            bits.append(f"act@{self.act_at_rows}rows")
        if self.restore_after_s:
            bits.append(f"back after {self.restore_after_s:.1f}s")
        if self.plant:
            bits.append(f"link {self.plant}")
        return " ".join(bits)


def fault_order(seed: int) -> list[str]:
    order = list(FAULTS)
    random.Random(f"chaos-order:{seed}").shuffle(order)
    return order


def plan_round(seed: int, k: int, faults: list[str] | None, quick: bool) -> Plan:
    rng = random.Random(f"chaos:{seed}:{k}")
    order = [f for f in fault_order(seed) if not faults or f in faults]
    if faults:  # keep the caller's order so a short run covers what it asked for
        order = [f for f in faults if f in FAULTS]
    fault = order[k % len(order)]
    n_ds = 1 if quick else rng.choice((1, 2))
    lo, hi = (60, 120) if quick else (120, 260)
    datasets = {f"ds{i}": rng.randint(lo, hi) for i in range(n_ds)}
    total = sum(datasets.values())
    p = Plan(round=k, fault=fault, datasets=datasets, malformed=rng.randint(1, 3),
             shard_size=rng.choice((20, 25, 40, 50)), concurrency=rng.choice((8, 16, 32)),
             prompt_words=(4, 30), extra_args=list(FAST_EMU), data_seed=rng.randrange(1 << 30))
    # Fault after N requests: N above the concurrency (a crash with every request still in flight
    # makes no progress) and below the total (else the fault never fires).
    n_lo = min(p.concurrency + 5, total // 2)
    n_at = rng.randint(n_lo, max(n_lo, total - p.concurrency - 5))
    if fault == "kill9":
        if rng.random() < 0.25:
            p.kill_at_s = rng.uniform(0.5, 8.0)  # anywhere from Python start-up to mid-run
        else:
            p.kill_at_rows = rng.randint(1, max(1, total - 1))
    elif fault == "server_crash":
        p.extra_args += ["--emu-crash-after", str(n_at)]
    elif fault == "runtime_oom":
        p.mem_fraction = 0.93
        p.concurrency = 64
        p.prompt_words = (60, 120)  # 64 prompts of 100+ tokens: a 2,048+ token prefill batch
    elif fault == "hang":
        p.extra_args += ["--emu-hang-after", str(n_at)]
    elif fault == "http_503":
        p.extra_args += ["--emu-503-rate", f"{rng.uniform(0.05, 0.3):.2f}", "--emu-seed", str(rng.randrange(1000))]
    elif fault == "orphan":
        p.extra_args += ["--emu-orphan-on-crash", "--emu-crash-after", str(n_at)]
    elif fault == "stale_holder":
        p.holder = {"gpu": rng.choice((0, 1)), "mib": rng.choice((20000, 50000, 90000)),
                    "children": rng.randint(0, 2)}
    elif fault == "disk_full":
        p.tmpfs_kib = rng.choice((48, 64, 96, 128))
    elif fault == "malformed":
        p.malformed = max(3, total // 10 // n_ds)
    elif fault == "multi_server_dies":
        p.act_at_rows = rng.randint(p.concurrency, max(p.concurrency, total // 2))
    elif fault == "multi_host_unreachable":
        p.act_at_rows = rng.randint(p.concurrency, max(p.concurrency, total // 2))
        p.restore_after_s = rng.uniform(0.5, 4.0)
    elif fault == "multi_server_hangs":
        p.victim_args = f"--emu-hang-after {rng.randint(5, max(5, total // 6))}"
    elif fault == "dir_symlink":
        p.plant = rng.choice(("ds0", "_journal", "_journal/ds0", "_rejects", "_logs"))
    elif fault in ("manifest_traversal", "kill9_no_rerun", "worker_kill"):
        p.kill_at_rows = rng.randint(1, max(1, total - 1))
        if fault == "kill9_no_rerun":  # nobody adopts its server: its guardian ends it after the grace
            p.server_grace_s = round(rng.uniform(1.0, 5.0), 1)
    elif fault == "bad_body":
        p.extra_args += ["--emu-bad-body-rate", f"{rng.uniform(0.03, 0.15):.2f}", "--emu-seed", str(rng.randrange(1000))]
    return p


# --- data ----------------------------------------------------------------------------------------


def _malformed_line(i: int, rng: random.Random, valid_id: str) -> str:
    kinds = [
        lambda: '{"id": "bad-json-' + str(i) + '", "messages": [',
        lambda: json.dumps({"id": f"no-user-{i}", "messages": [{"role": "system", "content": "x"}]}),
        lambda: json.dumps({"id": f"bad-role-{i}", "messages": [{"role": "wizard", "content": "hi"}]}),
        lambda: json.dumps({"id": f"empty-{i}", "messages": [{"role": "user", "content": "   "}]}),
        lambda: json.dumps({"id": f"not-list-{i}", "messages": "hello"}),
        lambda: json.dumps({"id": True, "messages": [{"role": "user", "content": "bool id"}]}),
        lambda: json.dumps({"id": f"nothing-{i}"}),
        lambda: json.dumps({"id": valid_id, "messages": [{"role": "user", "content": "duplicate id"}]}),
        lambda: "[1, 2, 3]",
    ]
    return rng.choice(kinds)()


def write_dataset(path: Path, name: str, plan: Plan, rows: int) -> tuple[set[str], set[int]]:
    """Write ``rows`` valid rows plus ``plan.malformed`` malformed ones at random lines.
    Returns (valid ids, 1-based line numbers of the malformed rows)."""
    rng = random.Random(f"{plan.data_seed}:{name}")
    total = rows + plan.malformed
    bad_lines = set(rng.sample(range(2, total + 1), plan.malformed))  # line 1 is always valid
    ids: list[str] = []
    lines: list[str] = []
    for line in range(1, total + 1):
        if line in bad_lines:
            lines.append(_malformed_line(line, rng, rng.choice(ids)))
            continue
        rid = f"r{plan.round}-{name}-{len(ids):05d}"
        ids.append(rid)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*plan.prompt_words)))
        lines.append(json.dumps({"id": rid, "messages": [{"role": "user", "content": f"{text} #{rid}"}]}))
    path.write_text("\n".join(lines) + "\n")
    return set(ids), bad_lines


def _targets(plan: Plan, hosts: list[SshHost]) -> str:
    """``[server] targets``: local, or one entry per host, each server bound to its host's own
    loopback address; the first host's server is the victim."""
    if not hosts:
        return '["local"]'
    entries = []
    for i, h in enumerate(hosts):
        env = f', env = {{ DATAGEN_EMU_ARGS = "{plan.victim_args}" }}' if i == 0 and plan.victim_args else ""
        entries.append(f'{{ target = "{h.url()}", port = {_free_port(h.address)}, '
                       f'flags = {{ host = "{h.address}"{env} }} }}')
    return "[" + ", ".join(entries) + "]"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_partition(path: Path, plan: Plan, datasets: dict[str, Path], out: Path,
                    hosts: list[SshHost] | None = None) -> None:
    ds = "\n".join(f'{name} = "{p}"' for name, p in datasets.items())
    extra = ", ".join(json.dumps(a) for a in plan.extra_args)
    frac = f"mem_fraction_static = {plan.mem_fraction}\n" if plan.mem_fraction is not None else ""
    grace = f"server_grace_s = {plan.server_grace_s}\n" if plan.server_grace_s is not None else ""
    path.write_text(f"""name = "chaos{plan.round}"
[datasets]
{ds}
[model]
path = "{MODEL_DIR}"
reasoning_parser = "qwen3"
[server]
backend = "emulator"
targets = {_targets(plan, hosts or [])}
tp_size = 2
port = 0
launch_deadline_s = 60
{frac}extra_args = [{extra}]
[run]
shard_size = {plan.shard_size}
concurrency = {plan.concurrency}
max_relaunches = 3
hygiene_grace_s = 1
hang_timeout_s = 3
capacity_probe_tokens = 0
host_wait_s = 30
{grace}[sampling]
max_new_tokens = 256
[output]
root = "{out}"
""")


# --- processes -----------------------------------------------------------------------------------


def tagged_pids(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``DATAGEN_CHAOS_TAG=tag``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(TAG_ENV) == tag:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def describe_pid(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} {' '.join(p.cmdline())[:80] or p.name()}"
    except psutil.NoSuchProcess:
        return f"{pid} (gone)"


def kill_pids(pids: list[int]) -> None:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            p.send_signal(signal.SIGKILL)
            procs.append(p)
    psutil.wait_procs(procs, timeout=5)


class PrefectApi:
    """One `prefect server start` for all rounds (own session; stopped by pid)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.deployed = False  # `datagen up --no-worker` ran against it (worker_kill rounds)

    def start(self, deadline_s: float = 90.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/api"
        # The repossessor frees an expired GPU-slot lease; checking every 2 s instead of 15 s bounds
        # the wait if a SIGKILLed run's lease was not recorded (killed between acquiring and recording).
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   DO_NOT_TRACK="1", PREFECT_API_URL=self.url,
                   PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="2")
        prefect = str(VENV_BIN / "prefect") if (VENV_BIN / "prefect").exists() else "prefect"
        log = open(self.home / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + deadline_s
        with http_client(timeout=2) as probe:  # one client for every probe (tasks/http.py)
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"prefect server exited {self.proc.returncode}; see {self.home}/server.log")
                with contextlib.suppress(httpx.HTTPError):
                    if probe.get(self.url + "/health").status_code == 200:
                        return
                time.sleep(0.25)
        raise RuntimeError(f"prefect server not healthy within {deadline_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)


# --- a round -------------------------------------------------------------------------------------


@dataclass
class RoundResult:
    round: int
    fault: str
    params: str
    runs: list[str] = field(default_factory=list)  # exit status of each `datagen run`
    rows: int = 0
    expected: int = 0
    lost: int = 0
    duplicated: int = 0
    unexpected: int = 0
    rejects: int = 0
    rejects_expected: int = 0
    validate_rc: int | None = None
    leftovers: list[str] = field(default_factory=list)
    gpu_mib_left: int = 0
    outside_changed: bool = False  # the sentinel tree outside OUT differs after the round
    outlived_s: float | None = None  # kill9_no_rerun: how long the killed run's processes lived on
    outlive_bound_s: float = OUTLIVE_BOUND_S  # its bound: OUTLIVE_BOUND_S past the server's grace
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.errors and self.lost == 0 and self.duplicated == 0 and self.unexpected == 0
                and self.rejects == self.rejects_expected and self.validate_rc == 0 and not self.leftovers
                and self.gpu_mib_left == 0 and not self.outside_changed
                and (self.outlived_s is None or self.outlived_s <= self.outlive_bound_s))


def _done_rows(out: Path) -> int:
    """Rows finished so far: committed shard rows (manifest) + journaled records."""
    n = 0
    with contextlib.suppress(OSError, ValueError):
        man = json.loads((out / "_manifest.json").read_text())
        for d in man.get("datasets", {}).values():
            n += sum(int(s.get("rows", 0)) for s in d.get("shards", {}).values())
    for j in (out / "_journal").glob("*/*.jsonl") if (out / "_journal").is_dir() else []:
        with contextlib.suppress(OSError):
            n += j.read_bytes().count(b"\n")
    return n


def _run_datagen(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float, plan: Plan | None,
                 out: Path, act: tuple[int, Callable[[], bool]] | None = None) -> str:
    """One `datagen run`; with a kill plan, SIGKILL it at the planned moment; with ``act``
    (rows, action), call the action once that many rows are done (again until it returns True).
    Returns the status."""
    with open(log, "ab") as fh:
        fh.write(f"\n=== {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        start = time.monotonic()
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                if act is not None and _done_rows(out) >= act[0] and act[1]():
                    act = None
                if plan is not None and (
                        (plan.kill_at_s is not None and elapsed >= plan.kill_at_s)
                        or (plan.kill_at_rows is not None and _done_rows(out) >= plan.kill_at_rows)):
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return f"killed@{elapsed:.1f}s"
                if elapsed > timeout_s:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return "timeout"
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return str(proc.returncode)


def _start_holder(spec: dict[str, int], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [DATAGEN, "gpu-sim", "hold", "--gpu", str(spec["gpu"]), "--mib", str(spec["mib"]),
           "--ignore-sigterm", "--children", str(spec["children"]), "--child-mib", "1024"]
    fh = open(log, "wb")  # noqa: SIM115 - closed by the caller via proc.wait
    proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    end = time.monotonic() + 20
    while time.monotonic() < end:  # wait until it holds (it prints a line then)
        if log.read_text().startswith("holding"):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"gpu-sim hold exited {proc.returncode}: {log.read_text()[-300:]}")
        time.sleep(0.05)
    raise RuntimeError("gpu-sim hold did not start holding within 20 s")


def _check_output(res: RoundResult, out: Path, ids: dict[str, set[str]], bad: dict[str, set[int]]) -> None:
    for name, valid in ids.items():
        seen: Counter[str] = Counter()
        for f in sorted((out / name).glob("shard-*.parquet")):
            seen.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
        res.rows += sum(seen.values())
        res.expected += len(valid)
        res.lost += len(valid - seen.keys())
        res.duplicated += sum(c - 1 for c in seen.values() if c > 1)
        res.unexpected += len(seen.keys() - valid)
        rej_path = out / "_rejects" / f"{name}.jsonl"
        lines: list[int] = []
        if rej_path.exists():
            for raw in rej_path.read_text().splitlines():
                if raw.strip():
                    lines.append(int(json.loads(raw).get("line", -1)))
        res.rejects += len(lines)
        res.rejects_expected += len(bad[name])
        if sorted(lines) != sorted(bad[name]):
            res.errors.append(f"{name}: reject lines {sorted(lines)} != malformed lines {sorted(bad[name])}")


def make_sentinel(root: Path) -> None:
    for name in SENTINEL_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(f"not datagen's: {name}\n".encode())


def _expect(res: RoundResult, what: str, proc: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    """A refusal the round expects: exit ``code`` and ``text`` in the output, else a round error."""
    said = proc.stdout + proc.stderr
    if proc.returncode != code or text not in said:
        res.errors.append(f"{what}: exit {proc.returncode} (expected {code} with {text!r}): {said.strip()[-300:]}")


def _wait_gone(tag: str, sims: list[Path], bound_s: float) -> float:
    """Seconds until no process carries ``tag`` and no simulated GPU holds memory (``bound_s`` + 1
    when that never happened within the bound)."""
    start = time.monotonic()
    while tagged_pids(tag) or sum(_sim_used_mib(p) for p in sims):
        if time.monotonic() - start > bound_s:
            return bound_s + 1
        time.sleep(0.2)
    return time.monotonic() - start


def _sim_used_mib(sim_path: Path) -> int:
    snap = SimGpus(sim_path).snapshot()
    return sum(int(g.get("used_mib", 0)) for g in snap["gpus"])


def _victim_action(plan: Plan, rdir: Path, victim: SshHost, timers: list[threading.Timer]) -> Callable[[], bool]:
    """What a multi round does to its victim host once ``plan.act_at_rows`` rows are done."""
    def kill_server() -> bool:
        # The victim's newest server, from the run record (written the moment it started).
        for rec in (rdir / "state" / "runs").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                mine = [x for x in json.loads(rec.read_text()).get("servers", []) if x.get("target") == victim.url()]
                if mine and mine[-1].get("state") == "ready":
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(int(mine[-1]["pgid"]), signal.SIGKILL)
                    return True
        return False  # not up yet: try again at the next poll

    def cut() -> bool:
        cut_off(victim)

        def restore() -> None:
            victim.proc = restart_sshd(victim.server)

        timer = threading.Timer(plan.restore_after_s, restore)
        timers.append(timer)
        timer.start()
        return True

    return kill_server if plan.fault == "multi_server_dies" else cut


def _hostile_manifest(res: RoundResult, out: Path, cmd: list[str], env: dict[str, str], log: Path) -> str:
    """Add a dataset named ``../sentinel`` (a copy of a real entry) to the killed run's manifest: every
    command refuses it naming the manifest and key; the operator then restores the manifest. Returns
    the refused run's status."""
    path = out / "_manifest.json"
    original = path.read_bytes()
    manifest = json.loads(original)
    if not manifest.get("datasets"):
        return "2"
    manifest["datasets"]["../sentinel"] = json.loads(json.dumps(next(iter(manifest["datasets"].values()))))
    path.write_text(json.dumps(manifest))
    key = f"{path}: datasets.'../sentinel': dataset name '../sentinel' must be"
    for argv in (["status"], ["repair"], ["validate"]):
        proc = subprocess.run([DATAGEN, *argv, str(out)], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
        _expect(res, f"datagen {argv[0]} on a manifest with '../sentinel'", proc, 2, key)
    with open(log, "ab") as fh:
        fh.write(b"\n=== run on a manifest with a traversal name\n")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    _expect(res, "datagen run on a manifest with '../sentinel'", proc, 2, key)
    path.write_bytes(original)
    return str(proc.returncode)


def _worker_kill(res: RoundResult, plan: Plan, api: PrefectApi, part: Path, out: Path, env: dict[str, str],
                 rdir: Path, timeout_s: float) -> str:
    """The worker_kill round through Prefect as a user runs it: `datagen up --no-worker` (once per chaos
    run: deployments, the zombie automation), `datagen worker`, a run of datagen/demo on the round's
    partition; at the planned rows, SIGKILL of the worker and every process under it; `datagen worker`
    again; the run must be Crashed by its stopped heartbeats, and a new run of the deployment (its
    slot free) complete. Returns the last run's status ("0" when it completed)."""
    wenv = dict(env, DATAGEN_HOME=str(ROOT), DATAGEN_CRASH_AFTER_S=str(WORKER_CRASH_AFTER_S))
    if not api.deployed:
        up = subprocess.run([DATAGEN, "up", "--api-url", api.url, "--no-worker", "--run-dir", str(api.home / "run")],
                            env=wenv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            raise RuntimeError(f"datagen up exited {up.returncode}: {(up.stdout + up.stderr)[-2000:]}")
        api.deployed = True
    run_dir = rdir / "run"

    def worker() -> int:
        w = subprocess.run([DATAGEN, "worker", "--api-url", api.url], env=wenv, cwd=ROOT, capture_output=True,
                           text=True, timeout=240)
        if w.returncode != 0:
            raise RuntimeError(f"datagen worker exited {w.returncode}: {(w.stdout + w.stderr)[-2000:]}")
        return int(json.loads((run_dir / "worker.pid").read_text())["pid"])

    final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
    try:
        pid = worker()
        with http_client(timeout=30) as http:
            dep = http.get(f"{api.url}/deployments/name/datagen/demo").raise_for_status().json()

            def submit() -> str:
                body = {"parameters": {"partition": str(part), "out": str(out)}}
                return str(http.post(f"{api.url}/deployments/{dep['id']}/create_flow_run", json=body)
                           .raise_for_status().json()["id"])

            def state(run: str) -> dict[str, str]:
                return http.get(f"{api.url}/flow_runs/{run}").raise_for_status().json()["state"] or {}

            def wait(run: str, types: set[str], bound_s: float) -> dict[str, str]:
                end = time.monotonic() + bound_s
                while (st := state(run)).get("type") not in types and time.monotonic() < end:
                    time.sleep(0.5)
                return st

            run = submit()
            start = time.monotonic()
            assert plan.kill_at_rows is not None
            while _done_rows(out) < plan.kill_at_rows and state(run).get("type") not in final:
                if time.monotonic() - start > timeout_s:
                    res.errors.append(f"worker_kill: the run reached {_done_rows(out)} rows in {timeout_s:.0f} s")
                    return "timeout"
                time.sleep(0.05)
            if state(run).get("type") in final:
                res.runs.append(f"ended-before-kill:{state(run).get('type')}")
            else:
                procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                for p in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.send_signal(signal.SIGKILL)
                psutil.wait_procs(procs, timeout=10)
                res.runs.append(f"worker-killed@{time.monotonic() - start:.1f}s")
                worker()  # `datagen worker` (or `up`) brings it back, as after a reboot
                st = wait(run, final, 3 * WORKER_CRASH_AFTER_S + 30)
                res.runs.append(st.get("type", "?").lower())
                if st.get("type") != "CRASHED" or not str(st.get("message", "")).startswith("datagen: no heartbeat"):
                    res.errors.append(f"worker_kill: the killed run ended {st.get('type')}: {st.get('message')}")
            rerun = submit()
            st = wait(rerun, final, timeout_s)
            if st.get("type") != "COMPLETED":
                res.errors.append(f"worker_kill: the next run ended {st.get('type')}: {st.get('message')}")
            return "0" if st.get("type") == "COMPLETED" else str(st.get("type", "?")).lower()
    finally:
        subprocess.run([DATAGEN, "down", "--run-dir", str(run_dir)], env=wenv, cwd=ROOT, capture_output=True,
                       timeout=120)


def run_round(plan: Plan, work: Path, api: PrefectApi, max_reruns: int, run_timeout_s: float) -> RoundResult:
    t0 = time.monotonic()
    res = RoundResult(plan.round, plan.fault, plan.describe())
    rdir = work / f"round-{plan.round:03d}"
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    out = rdir / "out"
    out.mkdir()
    mounted = False
    holder: subprocess.Popen[bytes] | None = None
    tag = f"chaos-{plan.round}-{uuid.uuid4().hex[:12]}"
    sim_path = rdir / "sim-gpus.json"
    SimGpus.init(sim_path, count=8)
    env = dict(os.environ, **{ENV_VAR: str(sim_path), TAG_ENV: tag, "DATAGEN_STATE_DIR": str(rdir / "state"),
                              "PREFECT_API_URL": api.url, "PREFECT_HOME": str(api.home),
                              "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                              "DATAGEN_RUN_DIR": str(rdir / "run"),
                              "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    hosts: list[SshHost] = []
    timers: list[threading.Timer] = []
    act: tuple[int, Callable[[], bool]] | None = None
    try:
        if plan.fault in MULTI:
            if not os.path.exists(SSHD):
                res.errors.append("multi-server faults need openssh-server (/usr/sbin/sshd)")
                return res
            # The tag in every session's environment marks what the hosts run (servers included).
            hosts = start_hosts(rdir / "hosts", HOSTS, gpus=2, session_env={TAG_ENV: tag})
            env.update(hosts_env(hosts))
            env.pop(ENV_VAR)  # each host's simulated GPUs come from its sshd
            if plan.act_at_rows is not None:
                act = (plan.act_at_rows, _victim_action(plan, rdir, hosts[0], timers))
        ids: dict[str, set[str]] = {}
        bad: dict[str, set[int]] = {}
        paths: dict[str, Path] = {}
        for name, n in plan.datasets.items():
            paths[name] = rdir / f"{name}.jsonl"
            ids[name], bad[name] = write_dataset(paths[name], name, plan, n)
        part = rdir / "partition.toml"
        write_partition(part, plan, paths, out, hosts)
        sentinel = rdir / "sentinel"
        make_sentinel(sentinel)
        before = tree_digest(sentinel)
        if plan.tmpfs_kib:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={plan.tmpfs_kib}k", "chaos-tmpfs", str(out)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                res.errors.append(f"mount tmpfs failed ({r.stderr.strip()}): disk_full needs root")
                return res
            mounted = True
        if plan.holder:
            holder = _start_holder(plan.holder, env, rdir / "holder.log")
        link = out / plan.plant if plan.plant else None
        if link is not None:  # someone planted a directory link in the output
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(sentinel, target_is_directory=True)
        cmd = [DATAGEN, "run", "--partition", str(part), "--out", str(out)]
        log = rdir / "run.log"
        killing = plan if plan.fault in ("kill9", "manifest_traversal", "kill9_no_rerun") else None
        if plan.fault == "worker_kill":
            status = _worker_kill(res, plan, api, part, out, env, rdir, run_timeout_s)
        else:
            status = _run_datagen(cmd, env, log, run_timeout_s, killing, out, act)
        for timer in timers:
            timer.join()  # the host is back before any rerun
        res.runs.append(status)
        sims = [sim_path, *(h.sim_gpus for h in hosts)]
        if plan.fault == "kill9_no_rerun" and status.startswith("killed"):
            res.outlive_bound_s = OUTLIVE_BOUND_S + (plan.server_grace_s or 0.0)
            res.outlived_s = _wait_gone(tag, sims, res.outlive_bound_s)  # no rerun cleans up: the run's leash must
        if link is not None:
            if status != "2" or f"refusing to use {link}: it is a symbolic link" not in log.read_text():
                res.errors.append(f"planted {plan.plant}: the run exited {status} without refusing the link")
            link.unlink()  # the operator removes it and reruns
        if plan.fault == "manifest_traversal" and (out / "_manifest.json").is_file():
            status = _hostile_manifest(res, out, cmd, env, log)
            res.runs.append(status)
        if mounted:  # the operator frees space: grow the filesystem in place
            subprocess.run(["mount", "-o", "remount,size=256m", str(out)], check=True)
        reruns = 0
        done = _done_rows(out)
        progressed = True
        # A fault that recurs on every relaunched server (crash/hang after N requests) can use up a
        # run's relaunch budget (run.max_relaunches, per run) with rows still to do: that run fails,
        # as it should, and the operator reruns. So rerun while runs make progress, up to a hard cap.
        while status != "0" and (reruns < max_reruns or (progressed and reruns < MAX_PROGRESS_RERUNS)):
            reruns += 1
            status = _run_datagen(cmd, env, log, run_timeout_s, None, out)
            res.runs.append(status)
            progressed, done = _done_rows(out) > done, _done_rows(out)
        if status != "0":
            res.errors.append(f"did not complete after {reruns} rerun(s) (see {log})")
        _check_output(res, out, ids, bad)
        v = subprocess.run([DATAGEN, "validate", str(out)], env=env, capture_output=True, text=True, cwd=ROOT)
        res.validate_rc = v.returncode
        if v.returncode != 0:
            (rdir / "validate.log").write_text(v.stdout + v.stderr)
        if holder is not None:
            # hygiene must have SIGKILLed it (it ignores SIGTERM); reap our child so it is not a zombie
            try:
                holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # Processes and GPU memory: poll briefly (a just-killed process is reaped asynchronously).
        end = time.monotonic() + 5
        left = tagged_pids(tag)
        used = sum(_sim_used_mib(p) for p in sims)
        while (left or used) and time.monotonic() < end:
            time.sleep(0.1)
            left, used = tagged_pids(tag), sum(_sim_used_mib(p) for p in sims)
        res.leftovers = [describe_pid(p) for p in left]
        res.gpu_mib_left = used
        kill_pids(left)
        res.outside_changed = tree_digest(sentinel) != before
        if res.outside_changed:
            res.errors.append(f"files outside the output changed: {sentinel}")
    except Exception as exc:  # a harness error fails the round, it does not end the chaos run
        res.errors.append(f"harness: {type(exc).__name__}: {exc}")
        kill_pids(tagged_pids(tag))
    finally:
        for timer in timers:
            timer.join()
        stop_hosts(hosts)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(out)], capture_output=True)
        res.seconds = time.monotonic() - t0
    return res


# --- main ----------------------------------------------------------------------------------------


def print_table(results: list[RoundResult]) -> None:
    header = ("round", "fault", "params", "runs", "rows", "lost", "dup", "rejects", "validate", "left", "gpuMiB",
              "outside", "outlived", "s", "ok")
    rows = [header] + [
        (str(r.round), r.fault, r.params, ",".join(r.runs), f"{r.rows}/{r.expected}", str(r.lost), str(r.duplicated),
         f"{r.rejects}/{r.rejects_expected}", str(r.validate_rc), str(len(r.leftovers)), str(r.gpu_mib_left),
         "changed" if r.outside_changed else "same", "-" if r.outlived_s is None else f"{r.outlived_s:.1f}s",
         f"{r.seconds:.0f}", "yes" if r.ok else "NO")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        for e in r.errors + [f"leftover process {x}" for x in r.leftovers]:
            print(f"round {r.round} ({r.fault}): {e}")
    by_fault: dict[str, list[bool]] = {}
    for r in results:
        by_fault.setdefault(r.fault, []).append(r.ok)
    print("\nper fault: " + ", ".join(f"{f} {sum(v)}/{len(v)}" for f, v in sorted(by_fault.items())))
    print(f"lost rows {sum(r.lost for r in results)}, duplicated rows {sum(r.duplicated for r in results)}, "
          f"leftover processes {sum(len(r.leftovers) for r in results)}, "
          f"GPU MiB left {sum(r.gpu_mib_left for r in results)}, "
          f"rounds with files outside OUT changed {sum(r.outside_changed for r in results)}, "
          f"longest a killed run's server lived on "
          f"{max((r.outlived_s for r in results if r.outlived_s is not None), default=0.0):.1f} s; "
          f"{sum(r.ok for r in results)}/{len(results)} rounds passed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--round", type=int, action="append", dest="only",
                    help="run only this round (replay); repeatable")
    ap.add_argument("--faults", help=f"comma-separated subset of {','.join(FAULTS)} (in this order)")
    ap.add_argument("--quick", action="store_true", help="smaller datasets")
    ap.add_argument("--max-reruns", type=int, default=4)
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds per `datagen run`")
    ap.add_argument("--work-dir", help="keep round directories here (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",")] if args.faults else None
    if faults and (unknown := set(faults) - set(FAULTS)):
        ap.error(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rounds = args.only if args.only else list(range(args.rounds))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="datagen-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed {args.seed}, rounds {rounds if args.only else len(rounds)}, work dir {work}", flush=True)
    (work / "prefect").mkdir(exist_ok=True)
    api = PrefectApi(work / "prefect")
    results: list[RoundResult] = []
    try:
        try:
            api.start()
        except RuntimeError as exc:
            print(f"chaos: {exc}", file=sys.stderr)
            return 2
        for k in rounds:
            plan = plan_round(args.seed, k, faults, args.quick)
            print(f"-- round {k}: {plan.fault} {plan.describe()} rows {plan.datasets} shard {plan.shard_size} "
                  f"conc {plan.concurrency}", flush=True)
            r = run_round(plan, work, api, args.max_reruns, args.run_timeout)
            results.append(r)
            print(f"   runs {','.join(r.runs)} rows {r.rows}/{r.expected} lost {r.lost} dup {r.duplicated} "
                  f"rejects {r.rejects}/{r.rejects_expected} validate {r.validate_rc} left {len(r.leftovers)} "
                  f"gpu {r.gpu_mib_left} MiB {r.seconds:.0f}s {'ok' if r.ok else 'FAILED'}"
                  + "".join(f"\n   ! {e}" for e in r.errors), flush=True)
    finally:
        api.stop()
    print()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "rounds": [dict(asdict(r), ok=r.ok) for r in results]},
                                              indent=2) + "\n")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\nreplay a failing round: python bench/chaos.py --seed {args.seed} --round {failed[0].round}"
              + (f" --faults {args.faults}" if args.faults else "") + (" --quick" if args.quick else "")
              + f" --work-dir DIR (kept: {work})", file=sys.stderr)
    elif not args.work_dir and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
