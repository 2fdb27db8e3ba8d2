"""GPU hygiene: find every process holding the selected GPUs, end it safely, prove the GPUs are clean.

``clean_gpus`` discovers GPU memory and holders through the probe (``tasks.gpus``, one round trip
per phase on a remote target), plans here which processes to end and which to spare, then has the
probe end them (SIGTERM, grace, SIGKILL) and poll memory until every selected GPU is under the
threshold. The verdict is "clean", "not_clean" or "unknown" (GPUs unreadable; never clean).
"""

from __future__ import annotations

import base64
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from tasks import gpus as probe
from tasks.errors import DatagenError
from tasks.targets import CommandResult, Target, parse_target, remote_python, run_command

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_GRACE_S",
    "DEFAULT_THRESHOLD_MIB",
    "GpuFinding",
    "GpusNotClean",
    "NoGpus",
    "HygieneReport",
    "ProbeFailed",
    "ProcessFinding",
    "clean_gpus",
    "parse_gpu_list",
    "port_listeners",
]

# An idle GPU does not read 0 MiB on every driver (context/reserved memory); a leftover model or KV
# cache is tens of GiB. 1 GiB separates the two with margin.
DEFAULT_THRESHOLD_MIB = 1024
DEFAULT_GRACE_S = 10.0
DEFAULT_DEADLINE_S = 30.0
KILL_WAIT_S = 5.0  # after SIGKILL: longer means D state or a dead driver, reported not awaited


class ProbeFailed(DatagenError, RuntimeError):
    """The GPU probe could not run on the target. Carries the command's exit status and output."""

    retryable = True  # a probe over SSH that timed out or lost its connection may answer next time

    def __init__(self, target: Target, result: CommandResult | None, reason: str) -> None:
        self.target = target
        self.result = result
        tail = ""
        if result is not None:
            text = (result.stdout + "\n" + result.stderr).strip().splitlines()
            tail = f" (exit {result.exited}): " + " | ".join(text[-8:])
        super().__init__(f"GPU probe on {target} failed: {reason}{tail}")


class GpusNotClean(DatagenError, RuntimeError):
    """Hygiene could not verify the GPUs clean. ``report`` is the `HygieneReport` when one was given."""

    retryable = True  # the driver releases a killed process's memory late

    def __init__(self, message: str, report: HygieneReport | None = None) -> None:
        self.report = report
        super().__init__(message)


class NoGpus(GpusNotClean):
    """No GPU can be read on the target at all (no NVIDIA driver, no simulated GPUs): retrying the
    same step cannot help; the message says how to run on such a machine."""

    retryable = False


@dataclass
class GpuFinding:
    index: int
    uuid: str
    name: str
    total_mib: int | None
    before_mib: int | None
    after_mib: int | None = None


@dataclass
class ProcessFinding:
    """One process hygiene looked at. ``action`` is "kill" or "spare"; ``reason`` says why."""

    pid: int
    user: str | None
    cmdline: str
    gpus: list[int]
    mib: int | None
    action: str
    reason: str
    sources: list[str] = field(default_factory=list)
    ended_by: str | None = None  # "SIGTERM" | "SIGKILL" | "gone before signal" | None
    state: str | None = None  # final /proc state letter of a survivor ("D": uninterruptible)
    survived: bool = False


@dataclass
class HygieneReport:
    target: str
    backend: str
    selected_gpus: list[int]
    gpus: list[GpuFinding]
    processes: list[ProcessFinding]
    verdict: str  # "clean" | "not_clean" | "unknown"
    dry_run: bool
    threshold_mib: int
    grace_s: float
    deadline_s: float
    duration_s: float = 0.0
    waited_s: float = 0.0
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.verdict == "clean"

    @property
    def survivors(self) -> list[ProcessFinding]:
        return [p for p in self.processes if p.survived]

    @property
    def killed(self) -> list[ProcessFinding]:
        return [p for p in self.processes if p.action == "kill"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clean"] = self.clean
        d["survivors"] = [p.pid for p in self.survivors]
        d["d_state"] = [{"pid": p.pid, "cmdline": p.cmdline, "state": p.state}
                        for p in self.survivors if p.state == "D"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A readable multi-line account: verdict, memory per GPU, each process and its fate."""
        mode = " (dry run)" if self.dry_run else ""
        lines = [f"GPU hygiene on {self.target}{mode}: {self.verdict.upper().replace('_', ' ')} "
                 f"in {self.duration_s:.2f} s (backend {self.backend}, threshold {self.threshold_mib} MiB)"]
        if self.error:
            lines.append(f"  error: {self.error}")
        for g in self.gpus:
            after = "" if self.dry_run else f" -> {_mib(g.after_mib)}"
            lines.append(f"  GPU {g.index} {g.name}: {_mib(g.before_mib)}{after} of {_mib(g.total_mib)}")
        for p in self.processes:
            where = f" GPU {','.join(map(str, p.gpus))}" if p.gpus else ""
            mem = f" {p.mib} MiB" if p.mib is not None else ""
            head = f"  {p.action:5} pid {p.pid} ({p.user or '?'}){where}{mem} {_short(p.cmdline)}"
            if p.action == "kill" and not self.dry_run:
                fate = (f"SURVIVED in state {p.state}" + (" (uninterruptible: D)" if p.state == "D" else "")
                        if p.survived else f"ended by {p.ended_by}")
                lines.append(f"{head}: {p.reason}; {fate}")
            else:
                lines.append(f"{head}: {p.reason}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def _mib(v: int | None) -> str:
    return "? MiB" if v is None else f"{v} MiB"


def _short(cmdline: str, width: int = 80) -> str:
    return cmdline if len(cmdline) <= width else cmdline[: width - 3] + "..."


def parse_gpu_list(value: str | list[int] | tuple[int, ...] | None) -> list[int] | None:
    """``"0,1"`` or ``[0, 1]`` -> ``[0, 1]``; None or ``"all"`` -> None (every GPU).

    An empty selection is refused: an unset shell variable (``--gpus "$GPUS"``) must not widen a
    cleanup to every GPU of the host, so "all" has to be said.

    Raises:
        ValueError: an empty selection, or an item that is not a GPU index.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip() == "all":
            return None
        if not value.strip():
            raise ValueError("empty GPU list: name the GPUs (e.g. 0,1) or say 'all'")
        items: list[Any] = [v.strip() for v in value.split(",")]
    else:
        items = list(value)
        if not items:
            raise ValueError("empty GPU list: name the GPUs (e.g. [0, 1]) or pass None for every GPU")
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or not (isinstance(item, int) or (isinstance(item, str) and item.isdigit())):
            raise ValueError(f"bad GPU list {value!r}: {item!r} is not a GPU index")
        if int(item) not in out:
            out.append(int(item))
    return out


# --------------------------------------------------------------------------- probe transport


@lru_cache(maxsize=1)
def _bootstrap() -> str:
    """A ``python3 -c`` program carrying tasks/gpus.py compressed (small, and no quoting blow-up)."""
    with open(probe.__file__, "rb") as f:
        packed = base64.b64encode(zlib.compress(f.read(), 9)).decode()
    return f"import base64,zlib;exec(compile(zlib.decompress(base64.b64decode('{packed}')),'datagen-gpu-probe','exec'))"


def _call(target: Target, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    if target.is_local:
        return probe.handle(request)
    argv = [remote_python(target), "-c", _bootstrap(), json.dumps(request)]
    res = run_command(target, argv, timeout_s=timeout_s)
    lines = res.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ProbeFailed(target, res, "no answer from the probe")
    if "error" in answer and request["op"] == "clean":
        raise ProbeFailed(target, res, str(answer["error"]))
    return answer


# --------------------------------------------------------------------------- planning


def _spare_reason(pid: int, info: dict[str, Any] | None, protected: set[int], euid: int,
                  include_other_users: bool) -> str | None:
    if info is None:
        return "not visible in this PID namespace (pid reported by the GPU backend only): cannot signal it"
    if pid in protected:
        return "the hygiene process or one of its ancestors"
    if pid == 1:
        return "PID 1"
    if info["kernel_thread"]:
        return "kernel thread"
    argv0 = os.path.basename(info["cmdline"].split(" ", 1)[0]) if info["cmdline"] else ""
    for name in (info["name"], argv0):
        if name in probe.PROTECTED_NAMES or name.startswith("dcgm"):
            return f"system GPU daemon ({name})"
    if info["uid"] != euid and not include_other_users:
        return f"belongs to another user ({info['user']}); pass --all-users to include it"
    return None


def _plan(found: dict[str, Any], selected: list[int], include_other_users: bool,
          extra_pids: tuple[int, ...]) -> list[ProcessFinding]:
    procs: dict[int, dict[str, Any]] = {int(k): v for k, v in found["procs"].items()}
    protected = set(found["self"]["protected"])
    euid = int(found["self"]["euid"])
    minor_to_index = {g["minor"]: g["index"] for g in found["gpus"] if g["minor"] is not None}

    # pid -> (selected GPUs, unselected GPUs, MiB on selected, sources, why)
    seen: dict[int, dict[str, Any]] = {}

    def note(pid: int, gpu: int | None, mib: int | None, source: str, why: str = "") -> None:
        e = seen.setdefault(pid, {"sel": set(), "unsel": set(), "mib": None, "sources": set(), "why": why})
        e["sources"].add(source)
        if why and not e["why"]:
            e["why"] = why
        if gpu is None:
            return
        if gpu in selected:
            e["sel"].add(gpu)
            if mib is not None:
                e["mib"] = (e["mib"] or 0) + mib
        else:
            e["unsel"].add(gpu)

    for u in found["gpu_users"]:
        note(int(u["pid"]), int(u["gpu"]), u["mib"], u["source"])
    for pid, info in procs.items():
        for dev in info["devices"]:
            if dev[6:].isdigit():  # /dev/nvidiaN; nvidiactl/-uvm alone say nothing about which GPU
                idx = minor_to_index.get(int(dev[6:]), int(dev[6:]))
                if idx not in seen.get(pid, {}).get("sel", set()) | seen.get(pid, {}).get("unsel", set()):
                    note(pid, idx, None, "/dev/" + dev)
                else:
                    seen[pid]["sources"].add("/dev/" + dev)
    for root in extra_pids:
        for pid, info in procs.items():
            if pid == root or info["pgid"] == root:
                note(pid, None, None, "server", f"in process group {root} of a server datagen started")

    findings: dict[int, ProcessFinding] = {}
    for pid, e in sorted(seen.items()):
        pinfo = procs.get(pid)
        holds = bool(e["sel"]) or e["why"]
        reason = _spare_reason(pid, pinfo, protected, euid, include_other_users)
        if reason is None and not holds:
            reason = f"holds only unselected GPU(s) {','.join(map(str, sorted(e['unsel'])))}"
        why = e["why"] or f"holds selected GPU(s) {','.join(map(str, sorted(e['sel'])))}"
        findings[pid] = ProcessFinding(
            pid=pid, user=pinfo["user"] if pinfo else None, cmdline=pinfo["cmdline"] if pinfo else "",
            gpus=sorted(e["sel"] | e["unsel"]), mib=e["mib"], action="spare" if reason else "kill",
            reason=reason or why, sources=sorted(e["sources"]),
        )

    # Whole trees: descendants of every process to be killed, by ppid from the /proc table.
    children: dict[int, list[int]] = {}
    for pid, info in procs.items():
        children.setdefault(info["ppid"], []).append(pid)
    todo = [p for p, f in findings.items() if f.action == "kill"]
    while todo:
        parent = todo.pop()
        for child in sorted(children.get(parent, [])):
            if child in findings:
                continue
            cinfo = procs[child]
            reason = _spare_reason(child, cinfo, protected, euid, include_other_users)
            findings[child] = ProcessFinding(
                pid=child, user=cinfo["user"], cmdline=cinfo["cmdline"], gpus=[], mib=None,
                action="spare" if reason else "kill", reason=reason or f"descendant of {parent}",
                sources=["tree"],
            )
            if reason is None:
                todo.append(child)
    return sorted(findings.values(), key=lambda f: (f.action != "kill", f.pid))


def _kept_by_spared(users: list[dict[str, Any]], findings: list[ProcessFinding], selected: list[int],
                    threshold_mib: int) -> dict[int, tuple[int, list[int]]]:
    """Selected GPUs on which spared processes alone hold more than ``threshold_mib``: GPU ->
    (their MiB, their pids). No wait makes these GPUs clean."""
    spared = {f.pid for f in findings if f.action == "spare"}
    held: dict[int, dict[int, int]] = {}
    for u in users:
        pid, gpu = int(u["pid"]), int(u["gpu"])
        if pid in spared and gpu in selected and u["mib"] is not None:
            per_pid = held.setdefault(gpu, {})
            per_pid[pid] = max(per_pid.get(pid, 0), int(u["mib"]))
    return {gpu: (sum(per_pid.values()), sorted(per_pid)) for gpu, per_pid in held.items()
            if sum(per_pid.values()) > threshold_mib}


# --------------------------------------------------------------------------- entry point


def gpu_names(target: str | Target = "local", timeout_s: float = 60.0) -> dict[int, str]:
    """GPU index -> model name on ``target`` (empty when no GPU can be read there).

    Args:
        target: where the GPUs are.
        timeout_s: seconds the probe may take.

    Raises:
        TargetError: the target string or a target setting is bad.
        TargetUnreachable: the target cannot be connected to.
        ProbeFailed: the probe could not run on the target.
    """
    found = _call(parse_target(target), {"op": "discover"}, timeout_s=timeout_s)
    return {int(g["index"]): str(g["name"]) for g in found.get("gpus", [])}


def port_listeners(target: str | Target, port: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The TCP sockets listening on ``port`` on ``target`` and the processes holding them, as
    ``tasks.gpus.port_listeners`` reports them there.

    Raises:
        TargetError: the target string or a target setting is bad.
        TargetUnreachable: the target cannot be connected to.
        ProbeFailed: the probe could not run on the target or could not read its sockets.
    """
    t = parse_target(target)
    found = _call(t, {"op": "listeners", "port": int(port)}, timeout_s=timeout_s)
    if "listeners" not in found:
        raise ProbeFailed(t, None, str(found.get("error") or "no listeners in the answer"))
    return list(found["listeners"])


def clean_gpus(
    target: str | Target = "local",
    gpus: str | list[int] | tuple[int, ...] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    threshold_mib: int = DEFAULT_THRESHOLD_MIB,
    deadline_s: float = DEFAULT_DEADLINE_S,
    dry_run: bool = False,
    include_other_users: bool = False,
    extra_pids: tuple[int, ...] | list[int] = (),
) -> HygieneReport:
    """Find, end and verify every holder of the selected GPUs on ``target``.

    Args:
        target: where the GPUs are (a target string or ``Target``).
        gpus: GPU indices (``"0,1"`` or a list); None or "" selects all GPUs.
        grace_s: seconds between SIGTERM and SIGKILL.
        threshold_mib: the most memory a GPU may use and still count as clean.
        deadline_s: seconds to wait, after the kills, for memory to drop under the threshold.
        dry_run: plan and report without signalling anything.
        include_other_users: also end other users' processes.
        extra_pids: pids / process-group ids of servers datagen started; their groups are ended even
            when not seen on a GPU.

    Raises:
        TargetError: the target string or a target setting is bad.
        TargetUnreachable: the target cannot be connected to.
        ValueError: a bad GPU list, or a GPU index the target does not have.
        ProbeFailed: the probe could not run on the target (e.g. no python3 there).
    """
    t0 = time.monotonic()
    tgt = parse_target(target)
    selected_arg = parse_gpu_list(gpus)
    if grace_s < 0 or deadline_s < 0 or threshold_mib < 0:
        raise ValueError("grace_s, deadline_s and threshold_mib must not be negative")
    found = _call(tgt, {"op": "discover"}, timeout_s=60)
    if "procs" not in found:
        raise ProbeFailed(tgt, None, str(found.get("error", "malformed discovery answer")))
    indices = [g["index"] for g in found["gpus"]]
    if found["error"]:
        report = HygieneReport(
            target=str(tgt), backend=found["backend"], selected_gpus=selected_arg or [], gpus=[],
            processes=[], verdict="unknown", dry_run=dry_run, threshold_mib=threshold_mib,
            grace_s=grace_s, deadline_s=deadline_s, error=found["error"],
        )
        report.duration_s = time.monotonic() - t0
        return report
    missing = [i for i in selected_arg or [] if i not in indices]
    if missing:
        raise ValueError(f"GPU(s) {','.join(map(str, missing))} do not exist on {tgt} "
                         f"(it has {len(indices)}: {','.join(map(str, indices))})")
    selected = selected_arg if selected_arg is not None else indices
    findings = _plan(found, selected, include_other_users, tuple(int(p) for p in extra_pids))
    report = HygieneReport(
        target=str(tgt), backend=found["backend"], selected_gpus=selected,
        gpus=[GpuFinding(g["index"], g["uuid"], g["name"], g["total_mib"], g["used_mib"])
              for g in found["gpus"] if g["index"] in selected],
        processes=findings, verdict="unknown", dry_run=dry_run, threshold_mib=threshold_mib,
        grace_s=grace_s, deadline_s=deadline_s, notes=list(found["notes"]),
    )
    to_kill = [f for f in findings if f.action == "kill"]
    if dry_run:
        under = all(g.before_mib is not None and g.before_mib <= threshold_mib for g in report.gpus)
        report.verdict = "clean" if under and not to_kill else "not_clean"
        report.duration_s = time.monotonic() - t0
        return report

    procs = found["procs"]
    kept = _kept_by_spared(found["gpu_users"], findings, selected, threshold_mib)
    request = {
        "op": "clean",
        "targets": [{"pid": f.pid, "start": procs[str(f.pid)]["start"]} for f in to_kill],
        "grace_s": grace_s, "kill_wait_s": KILL_WAIT_S, "gpus": selected,
        "threshold_mib": threshold_mib,
        # Memory of processes hygiene spares is not released by waiting: one reading, no wait.
        "deadline_s": 0.0 if kept else deadline_s,
    }
    answer = _call(tgt, request, timeout_s=grace_s + KILL_WAIT_S + deadline_s + 60)
    by_pid = {f.pid: f for f in findings}
    for t in answer["terminated"]:
        f = by_pid.get(t["pid"])
        if f is None:  # forked by a target while it was being terminated
            f = ProcessFinding(pid=t["pid"], user=None, cmdline="", gpus=[], mib=None, action="kill",
                               reason="child forked during termination", sources=["tree"])
            findings.append(f)
            by_pid[f.pid] = f
        f.ended_by, f.state, f.survived = t["ended_by"], t["state"], bool(t["alive"])
    wait = answer["wait"]
    after = {g["index"]: g["used_mib"] for g in wait["gpus"]}
    for g in report.gpus:
        g.after_mib = after.get(g.index)
    report.waited_s = float(wait["waited_s"])
    if wait["error"]:
        report.verdict, report.error = "unknown", wait["error"]
    elif report.survivors or not wait["reached"] or kept:
        report.verdict = "not_clean"
        for gpu, (mib, pids) in sorted(kept.items()):
            report.notes.append(f"GPU {gpu}: {mib} MiB held by spared pid(s) {','.join(map(str, pids))}: "
                                "it cannot become clean while they run, so the memory deadline was not waited")
        over = [g.index for g in report.gpus if g.after_mib is None or g.after_mib > threshold_mib]
        if over:
            report.notes.append(f"GPU(s) {','.join(map(str, over))} still above {threshold_mib} MiB "
                                f"after {report.waited_s:.1f} s")
    else:
        report.verdict = "clean"
    report.duration_s = time.monotonic() - t0
    return report

