"""SGLang server lifecycle: a validated config, the command line, launch, readiness and a clean stop.

Errors::

    ServerError
    ├── ServerConfigError   the config is invalid (raised by ServerConfig itself)
    ├── LaunchFailed        the server exited, hung past the deadline, or could not be started;
    │                       carries .failure (kind + one-line explanation), .log_tail, .exit_status,
    │                       .attempts (filled in by the tuner), .log_path
    └── StopFailed          the group was killed but hygiene did not verify the GPUs clean

The server runs in its own session (process group), so stopping it is one ``killpg`` that reaches
every scheduler, even one reparented to PID 1. Readiness is ``/health_generate`` answering 200 while
the process is alive (shared/reference/sglang.md); a 200 from anything else proves nothing.

API key: SGLang reads ``--api-key`` only from its command line, which any user can read in ``ps``.
With a key, the launcher starts ``python -c <stub> <module> <flags>``: the bootstrap takes the key
from the environment variable ``DATAGEN_SERVER_API_KEY`` (popped, so SGLang's spawned children do not
inherit it), appends ``--api-key`` to ``sys.argv`` in memory only (``/proc/PID/cmdline`` keeps the
original argv) and copies the server's output to the log with the key replaced by ``***`` (SGLang
logs ``server_args=ServerArgs(..., api_key=...)`` at startup). Trade-off: one extra process (the
session leader, mirroring the server's exit status), and the key stays readable in
``/proc/<leader>/environ`` by the same user and root, as any environment secret is.

Remote targets (``ssh://``, ``pct://``): the server is started detached through ``tasks.targets`` with
its log on the target, still bound to the target's loopback; the flow reaches it through an SSH local
port forward (``ssh -N -L``, same key/known-hosts settings as tasks.targets). Binding SGLang to a routable address
would expose an API that is unauthenticated by default to the whole network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

__all__ = [
    "API_KEY_ENV",
    "Failure",
    "LaunchFailed",
    "ServerConfig",
    "ServerConfigError",
    "ServerError",
    "ServerHandle",
    "StartupProgress",
    "StopFailed",
    "build_command",
    "classify_failure",
    "launch",
    "launch_argv",
    "parse_progress",
    "stop_server",
]

log = logging.getLogger(__name__)

API_KEY_ENV = "DATAGEN_SERVER_API_KEY"
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
# Flags the launcher sets itself; in extra_args they would silently fight the tuner or leak secrets.
_MANAGED_FLAGS = frozenset(
    {
        "--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--tp", "--host", "--port",
        "--mem-fraction-static", "--api-key", "--reasoning-parser", "--served-model-name",
        "--context-length", "--max-running-requests", "--chunked-prefill-size",
        "--enable-hierarchical-cache", "--hicache-size", "--hicache-ratio",
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--trust-remote-code",
    }
)


class ServerError(RuntimeError):
    """Base of every error this module raises."""


class ServerConfigError(ServerError, ValueError):
    """A ServerConfig field is invalid; the message names the field and the value."""


# --------------------------------------------------------------------------------------------------
# Config and command line


@dataclass(frozen=True)
class ServerConfig:
    """What to launch. Validated on construction (raises ServerConfigError)."""

    model_path: str
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float | None = None
    reasoning_parser: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    trust_remote_code: bool = False
    enable_hierarchical_cache: bool = False
    hicache_size: float | None = None
    hicache_ratio: float | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()
    backend: Literal["sglang", "emulator"] = "sglang"
    python: str = sys.executable
    gpus: tuple[int, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ServerConfigError:
            return ServerConfigError(f"server config: {name}={getattr(self, name)!r}: {why}")

        if not str(self.model_path).strip():
            raise bad("model_path", "must not be empty")
        if self.backend not in ("sglang", "emulator"):
            raise bad("backend", "must be 'sglang' or 'emulator'")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise bad("tp_size", "must be an integer >= 1")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise bad("port", "must be an integer in 1..65535")
        if not self.host.strip():
            raise bad("host", "must not be empty")
        f = self.mem_fraction_static
        if f is not None and not 0.0 < f < 1.0:
            raise bad("mem_fraction_static", "must be between 0 and 1 (exclusive)")
        for name in ("context_length", "max_running_requests", "chunked_prefill_size",
                     "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise bad(name, "must be a positive integer")
        if self.reasoning_parser is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.reasoning_parser):
            raise bad("reasoning_parser", "must be a parser name such as qwen3 or deepseek-r1")
        if self.hicache_size is not None and self.hicache_size <= 0:
            raise bad("hicache_size", "must be > 0 (GB per rank)")
        if self.hicache_ratio is not None and self.hicache_ratio <= 0:
            raise bad("hicache_ratio", "must be > 0")
        if (self.hicache_size is not None or self.hicache_ratio is not None) and not self.enable_hierarchical_cache:
            raise bad("enable_hierarchical_cache", "hicache_size/hicache_ratio need the hierarchical cache enabled")
        spec_set = any(
            getattr(self, n) is not None
            for n in ("speculative_draft_model_path", "speculative_num_steps",
                      "speculative_eagle_topk", "speculative_num_draft_tokens")
        )
        if self.speculative_algorithm is None and spec_set:
            raise bad("speculative_algorithm", "speculative_* settings need an algorithm (e.g. EAGLE3)")
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise bad("speculative_algorithm", f"must be one of {', '.join(SPECULATIVE_ALGORITHMS)}")
            if self.speculative_algorithm in ("EAGLE", "EAGLE3") and not self.speculative_draft_model_path:
                raise bad("speculative_draft_model_path", f"{self.speculative_algorithm} needs a draft model")
        if self.api_key is not None and not self.api_key:
            raise ServerConfigError("server config: api_key must not be empty (use None for no key)")
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in _MANAGED_FLAGS:
                raise ServerConfigError(
                    f"server config: extra_args contains {flag}, which the launcher sets itself; "
                    "use the config field instead"
                )
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
                raise bad("gpus", "must be distinct non-negative GPU indexes")
            if len(self.gpus) < self.tp_size:
                raise bad("gpus", f"tp_size={self.tp_size} needs at least that many GPUs")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def module(self) -> str:
        return "sglang.launch_server" if self.backend == "sglang" else "emulator"

    def gpu_indexes(self) -> list[int]:
        """The GPUs the server uses: the configured ones, else 0..tp_size-1."""
        return list(self.gpus[: self.tp_size]) if self.gpus is not None else list(range(self.tp_size))


def format_fraction(fraction: float) -> str:
    """A fraction as SGLang gets it on the command line: at most 3 decimals, no trailing zeros."""
    return f"{round(fraction, 3):g}"


def server_flags(cfg: ServerConfig, fraction: float | None) -> list[str]:
    """The launch_server flags for ``cfg`` (no executable, no API key)."""
    args = ["--model-path", cfg.model_path, "--tp-size", str(cfg.tp_size),
            "--host", cfg.host, "--port", str(cfg.port)]
    if fraction is not None:
        args += ["--mem-fraction-static", format_fraction(fraction)]
    if cfg.trust_remote_code:
        args.append("--trust-remote-code")
    optional: list[tuple[str, object]] = [
        ("--served-model-name", cfg.served_model_name),
        ("--context-length", cfg.context_length),
        ("--max-running-requests", cfg.max_running_requests),
        ("--chunked-prefill-size", cfg.chunked_prefill_size),
        ("--reasoning-parser", cfg.reasoning_parser),
    ]
    for flag, value in optional:
        if value is not None:
            args += [flag, str(value)]
    if cfg.enable_hierarchical_cache:
        args.append("--enable-hierarchical-cache")
        if cfg.hicache_size is not None:
            args += ["--hicache-size", f"{cfg.hicache_size:g}"]
        if cfg.hicache_ratio is not None:
            args += ["--hicache-ratio", f"{cfg.hicache_ratio:g}"]
    if cfg.speculative_algorithm is not None:
        args += ["--speculative-algorithm", cfg.speculative_algorithm]
        for flag, value in (
            ("--speculative-draft-model-path", cfg.speculative_draft_model_path),
            ("--speculative-num-steps", cfg.speculative_num_steps),
            ("--speculative-eagle-topk", cfg.speculative_eagle_topk),
            ("--speculative-num-draft-tokens", cfg.speculative_num_draft_tokens),
        ):
            if value is not None:
                args += [flag, str(value)]
    args += list(cfg.extra_args)
    return args


def build_command(cfg: ServerConfig, fraction: float | None) -> list[str]:
    """The plain ``python -m sglang.launch_server ...`` (or ``-m emulator``) command for ``cfg``.

    ``fraction`` None leaves ``--mem-fraction-static`` out (SGLang computes its default). The API key
    is never part of it; ``launch_argv`` is what is actually executed.
    """
    return [cfg.python, "-m", cfg.module, *server_flags(cfg, fraction)]


BOOTSTRAP_ENV = "DATAGEN_SERVER_BOOTSTRAP"
# With an API key the server runs as `python -c "<_STUB>" <module> <flags>`; the stub executes this
# code from the environment (so `ps` shows a short line). The process forks: the child puts the key
# in sys.argv in memory only and runs the module as `-m` would, with stdout/stderr into a pipe; the
# parent (the session leader, which the launcher watches) copies the pipe to the log with the key
# replaced by ***, ignores SIGTERM/SIGINT/SIGHUP (the group signal reaches the child directly), and
# when the child ends, drains the pipe and ends the same way (same exit code, or the same signal).
# Fd-level redaction is needed: SGLang logs server_args (api_key included) and writers may bypass
# sys.stderr.
_BOOTSTRAP = r"""import os, select, signal, sys
E = os.environ
key = E.pop("DATAGEN_SERVER_API_KEY")
E.pop("DATAGEN_SERVER_BOOTSTRAP", None)
mod, args = sys.argv[1], sys.argv[2:]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)
    import runpy
    sys.argv = [mod, *args, "--api-key", key]
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
    sys.exit(0)
os.close(w)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
k = key.encode()
buf = b""
def out(data):
    data = data.replace(k, b"***")
    while data:
        data = data[os.write(1, data):]
def pump(timeout):
    global buf
    if not select.select([r], [], [], timeout)[0]:
        return False
    d = os.read(r, 65536)
    if not d:
        return None
    buf += d
    i = buf.rfind(b"\n") + 1
    if i == 0 and len(buf) > (1 << 20):
        i = len(buf) - len(k)
    if i > 0:
        out(buf[:i])
        buf = buf[i:]
    return True
status = None
open_ = True
while status is None:
    if open_ and pump(0.2) is None:
        open_ = False
    elif not open_:
        select.select([], [], [], 0.2)
    done, st = os.waitpid(pid, os.WNOHANG)
    if done:
        status = os.waitstatus_to_exitcode(st)
while open_:
    got = pump(0.3)
    open_ = bool(got)
out(buf)
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
os._exit(status)
"""
_STUB = f"import os;exec(os.environ[{BOOTSTRAP_ENV!r}])"


def launch_argv(cfg: ServerConfig, fraction: float | None) -> list[str]:
    """The argv actually executed: ``build_command`` or, with an API key, the key-hiding bootstrap."""
    if cfg.api_key is None:
        return build_command(cfg, fraction)
    return [cfg.python, "-c", _STUB, cfg.module, *server_flags(cfg, fraction)]


def launch_env(cfg: ServerConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of the server: ``base`` (default os.environ) + cfg.env + GPU selection + key."""
    env = dict(os.environ if base is None else base)
    env.update(cfg.env)
    env["PYTHONUNBUFFERED"] = "1"  # progress and the last error reach the log file at once
    if cfg.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    if cfg.api_key is not None:
        env[API_KEY_ENV] = cfg.api_key
        env[BOOTSTRAP_ENV] = _BOOTSTRAP
    else:
        env.pop(API_KEY_ENV, None)
        env.pop(BOOTSTRAP_ENV, None)
    return env


# --------------------------------------------------------------------------------------------------
# Failure classification (re-exported by tasks.tuner)

FailureKind = Literal[
    "too_high", "too_low", "host_memory", "port_in_use", "bad_flag", "model_not_found", "weights_too_big",
    "timeout", "unknown",
]


@dataclass(frozen=True)
class Failure:
    """Why a launch (or a running server) failed: a kind, a one-line explanation, the evidence line."""

    kind: FailureKind
    explanation: str
    evidence: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# Checked in this order: the first kind whose pattern matches any line wins. Specific causes come
# before the OOM family because an OOM can be a consequence (e.g. a port clash never is).
_RULES: list[tuple[FailureKind, re.Pattern[str], str]] = [
    ("port_in_use", re.compile(r"address already in use|\[Errno 98\]", re.I),
     "the port is taken by another process: stop it or choose another --port"),
    ("bad_flag", re.compile(r"error: (unrecognized arguments|argument |the following arguments are required)"),
     "SGLang rejected a command-line flag: fix or remove it in the server config (extra_args)"),
    ("model_not_found", re.compile(
        r"Repository Not Found|RepositoryNotFoundError|HFValidationError|LocalEntryNotFoundError|"
        r"is not a local folder and is not a valid model identifier|"
        r"does not appear to have a file named config\.json|Can't load the configuration of|"
        r"No such file or directory: .*(config\.json|model)", re.I),
     "the model path does not exist or is not a model directory on the target: check model_path"),
    ("host_memory", re.compile(r"Not enough host memory available"),
     "not enough host RAM for the hierarchical cache: lower --hicache-size/--hicache-ratio or free RAM"),
    ("too_low", re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static"),
     "the KV cache pool does not fit in the static memory: raise --mem-fraction-static"),
    ("too_high", re.compile(
        r"Capture cuda graph failed|CUDA out of memory|OutOfMemoryError|Prefill out of memory|"
        r"Decode out of memory|CUDA error: out of memory", re.I),
     "too little GPU memory left for CUDA graphs and activations: lower --mem-fraction-static"),
]


def classify_failure(log_text: str, exit_status: int | None) -> Failure:
    """Classify a failed server from its log text and exit status (None when unknown).

    Exit status 2 without a recognisable line is still an argparse error (SGLang's usage errors).
    A CUDA OOM while weights load is "weights_too_big" (not fixed by any fraction). Never raises.
    """
    lines = log_text.splitlines()
    for kind, pattern, explanation in _RULES:
        for i, line in enumerate(lines):
            if pattern.search(line):
                if kind == "too_high" and _loading_weights(lines[:i]):
                    # Weights load before the static pool is sized: no fraction changes this.
                    return Failure("weights_too_big", _WEIGHTS_EXPLANATION, line.strip()[:500])
                return Failure(kind, explanation, line.strip()[:500])
    if exit_status == 2:
        evidence = next((ln for ln in reversed(lines) if "error" in ln.lower()), "")
        return Failure("bad_flag", _RULES[1][2], evidence.strip()[:500])
    evidence = next((ln for ln in reversed(lines) if _ERRORISH.search(ln)), "")
    status = "unknown" if exit_status is None else str(exit_status)
    return Failure("unknown", f"the server stopped (exit status {status}) for a reason not recognised: "
                   "read the log tail", evidence.strip()[:500])


_WEIGHTS_EXPLANATION = ("the model weights do not fit in GPU memory (OOM while loading weights, before "
                        "--mem-fraction-static applies): use more GPUs (--tp-size) or a smaller/quantized model")


def _loading_weights(before: list[str]) -> bool:
    """Whether the log before an OOM shows weight loading begun and not finished."""
    began = any("Load weight begin" in ln for ln in before)
    return began and not any("Load weight end" in ln for ln in before)


_ERRORISH = re.compile(r"Error|error:|Exception|Traceback|failed|Killed", re.I)


def effective_fraction(log_text: str) -> float | None:
    """The --mem-fraction-static SGLang actually used, when its log says (server_args or error line)."""
    found = re.findall(r"mem_fraction_static=([0-9.]+)", log_text)
    try:
        return float(found[-1].rstrip(".")) if found else None
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------
# Startup progress


@dataclass
class StartupProgress:
    """What SGLang's startup lines said so far. Memory in GiB as SGLang prints it ("GB")."""

    phase: str = "starting"  # starting, weights_loaded, kv_cache, cuda_graph, http_up, ready
    weights_gib: float | None = None
    avail_after_weights_gib: float | None = None
    kv_tokens: int | None = None
    max_total_num_tokens: int | None = None
    headroom_gib: float | None = None  # avail mem after graph capture, lowest rank
    ranks_reported: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_RANK = re.compile(r"\bTP(\d+)\]")
_P_WEIGHTS = re.compile(r"Load weight end\..*?avail mem=([0-9.]+) GB, mem usage=([0-9.]+) GB")
_P_KV = re.compile(r"KV Cache is allocated\..*?#tokens: (\d+)")
_P_GRAPH_BEGIN = re.compile(r"Capture (?:target decode )?cuda graph begin", re.I)
_P_GRAPH_END = re.compile(r"Capture (?:target decode )?cuda graph end\..*?avail mem=([0-9.]+) GB", re.I)
_P_MAXTOK = re.compile(r"max_total_num_tokens=(\d+).*?available_gpu_mem=([0-9.]+) GB")
_P_HTTP = re.compile(r"Uvicorn running on")
_P_READY = re.compile(r"The server is fired up and ready to roll")


def parse_progress(text: str, progress: StartupProgress | None = None) -> StartupProgress:
    """Fold SGLang startup log ``text`` into ``progress`` (a new one when None) and return it.

    Accepts the old and new line forms of shared/reference/sglang.md. Per-rank values keep the
    worst rank (lowest headroom, highest weights). Never raises.
    """
    p = progress or StartupProgress()
    graph_end: dict[int, float] = {}
    for line in text.splitlines():
        rank_m = _RANK.search(line)
        rank = int(rank_m.group(1)) if rank_m else 0
        if m := _P_WEIGHTS.search(line):
            avail, used = float(m.group(1)), float(m.group(2))
            p.weights_gib = max(p.weights_gib or 0.0, used)
            p.avail_after_weights_gib = min(p.avail_after_weights_gib or avail, avail)
            p.phase = _later(p.phase, "weights_loaded")
        elif m := _P_KV.search(line):
            p.kv_tokens = int(m.group(1))
            p.phase = _later(p.phase, "kv_cache")
        elif _P_GRAPH_BEGIN.search(line):
            p.phase = _later(p.phase, "cuda_graph")
        elif m := _P_GRAPH_END.search(line):
            graph_end[rank] = min(graph_end.get(rank, float("inf")), float(m.group(1)))
        elif m := _P_MAXTOK.search(line):
            p.max_total_num_tokens = int(m.group(1))
            if not graph_end:  # graphs disabled: the memory left after the pools is the headroom
                avail = float(m.group(2))
                p.headroom_gib = avail if p.headroom_gib is None else min(p.headroom_gib, avail)
        elif _P_HTTP.search(line):
            p.phase = _later(p.phase, "http_up")
        elif _P_READY.search(line):
            p.phase = _later(p.phase, "ready")
    if graph_end:
        low = min(graph_end.values())
        p.headroom_gib = low if p.headroom_gib is None else min(p.headroom_gib, low)
        p.ranks_reported = max(p.ranks_reported, len(graph_end))
    return p


_PHASES = ["starting", "weights_loaded", "kv_cache", "cuda_graph", "http_up", "ready"]


def _later(current: str, new: str) -> str:
    return new if _PHASES.index(new) > _PHASES.index(current) else current


# --------------------------------------------------------------------------------------------------
# Handle and errors


@dataclass(eq=False)
class ServerHandle:
    """A server datagen started and saw ready. ``pid`` leads its own session: ``pgid == pid``."""

    pid: int
    pgid: int
    url: str
    log_path: str
    fraction: float | None
    target: str
    command: list[str]
    gpus: list[int]
    progress: StartupProgress
    ready_s: float
    member_pids: list[int] = field(default_factory=list)  # group members seen at readiness
    api_key: str | None = field(default=None, repr=False)
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tunnel: Any = field(default=None, repr=False)

    @property
    def headroom_gib(self) -> float | None:
        return self.progress.headroom_gib

    def is_alive(self) -> bool:
        """Whether the server's main process still runs (a zombie counts as dead)."""
        if self._popen is not None:
            return self._popen.poll() is None
        return _remote_alive(self.target, self.pid)

    def exit_status(self) -> int | None:
        """The main process's exit status (negative: killed by that signal); None while alive/unknown."""
        return self._popen.poll() if self._popen is not None else None

    def read_log(self, max_bytes: int = 4 << 20) -> str:
        """The server log (its last ``max_bytes``), from the target."""
        return _read_log(self.target, self.log_path, max_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "pgid": self.pgid, "url": self.url, "log_path": self.log_path,
            "fraction": self.fraction, "target": self.target, "headroom_gib": self.headroom_gib,
            "progress": self.progress.to_dict(), "ready_s": round(self.ready_s, 3), "gpus": self.gpus,
            "command": redact(self.command, self.api_key),
        }


class LaunchFailed(ServerError):
    """A launch did not become ready. ``failure.kind`` says which way to move (see classify_failure)."""

    def __init__(
        self,
        failure: Failure,
        log_tail: str,
        attempts: Sequence[Any] = (),
        *,
        exit_status: int | None = None,
        log_path: str | None = None,
        command: Sequence[str] = (),
        fraction: float | None = None,
        message: str | None = None,
    ) -> None:
        self.failure = failure
        self.log_tail = log_tail
        self.attempts = list(attempts)
        self.exit_status = exit_status
        self.log_path = log_path
        self.command = list(command)
        self.fraction = fraction
        super().__init__(message or self._render())

    def _render(self) -> str:
        frac = "SGLang default" if self.fraction is None else format_fraction(self.fraction)
        status = "still running (killed)" if self.exit_status is None else str(self.exit_status)
        tail = "\n".join("    " + ln for ln in self.log_tail.splitlines()[-15:]) or "    (empty)"
        return (
            f"server launch failed ({self.failure.kind}) at --mem-fraction-static {frac}: "
            f"{self.failure.explanation}\n"
            f"  evidence: {self.failure.evidence or '-'}\n"
            f"  exit status: {status}\n"
            f"  command: {shlex.join(self.command)}\n"
            f"  log: {self.log_path}\n  last lines:\n{tail}"
        )


class StopFailed(ServerError):
    """The server's group was killed, but hygiene did not verify its GPUs clean. ``.report`` has why."""

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)


def redact(argv: Sequence[str], secret: str | None) -> list[str]:
    """``argv`` with ``secret`` replaced by ``***`` (for logs and reports)."""
    if not secret:
        return list(argv)
    return [a.replace(secret, "***") for a in argv]


# --------------------------------------------------------------------------------------------------
# Launch


def _is_local(target: Any) -> bool:
    if isinstance(target, str):
        return target.strip() in ("", "local")
    return getattr(target, "kind", "local") == "local"


def _target_str(target: Any) -> str:
    return target if isinstance(target, str) else str(target)


def _port_taken(host: str, port: int) -> bool:
    """Whether something already listens on host:port (local). A fresh bind is the honest test."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def launch(
    cfg: ServerConfig,
    target: Any = "local",
    fraction: float | None = None,
    log_dir: str | os.PathLike[str] = ".",
    deadline_s: float = 1800.0,
    *,
    on_progress: Callable[[StartupProgress], None] | None = None,
    health_timeout_s: float = 25.0,
) -> ServerHandle:
    """Start the server for ``cfg`` at ``fraction`` and return once ``/health_generate`` answers 200.

    Local targets only start here; remote targets go through ``_launch_remote`` (tasks.targets).
    Raises LaunchFailed (kind from classify_failure, or "timeout" after the whole group was
    killed when ``deadline_s`` passed, or "port_in_use" before starting anything when the port is
    already taken), ServerConfigError for an invalid config.
    """
    if not _is_local(target):
        return _launch_remote(cfg, target, fraction, log_dir, deadline_s,
                              on_progress=on_progress, health_timeout_s=health_timeout_s)
    argv = launch_argv(cfg, fraction)
    shown = build_command(cfg, fraction)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    frac_tag = "default" if fraction is None else format_fraction(fraction)
    log_path = log_dir / f"server-{cfg.port}-{stamp}-{os.getpid()}-f{frac_tag}.log"
    if _port_taken(cfg.host, cfg.port):
        # Never start next to a live listener: its /health_generate 200 would look like ours.
        failure = Failure("port_in_use", _RULES[0][2], f"{cfg.host}:{cfg.port} is already bound")
        raise LaunchFailed(failure, "", exit_status=None, log_path=str(log_path), command=shown,
                           fraction=fraction)
    with open(log_path, "ab") as logf:
        logf.write(f"# datagen launch: {shlex.join(shown)}\n".encode())
        logf.flush()
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            env=launch_env(cfg), start_new_session=True, close_fds=True,
        )
    log.info("launched %s (pid %d, log %s)", shlex.join(shown), popen.pid, log_path)
    handle = ServerHandle(
        pid=popen.pid, pgid=popen.pid, url=cfg.url, log_path=str(log_path), fraction=fraction,
        target="local", command=shown, gpus=cfg.gpu_indexes(), progress=StartupProgress(),
        ready_s=0.0, api_key=cfg.api_key, _popen=popen,
    )
    _await_ready(handle, cfg, deadline_s, on_progress, health_timeout_s)
    handle.member_pids = _group_pids(handle.pgid)
    return handle


def _await_ready(
    handle: ServerHandle,
    cfg: ServerConfig,
    deadline_s: float,
    on_progress: Callable[[StartupProgress], None] | None,
    health_timeout_s: float,
) -> None:
    """Poll until ready, exit or deadline. Raises LaunchFailed (after killing the group on timeout)."""
    start = time.monotonic()
    deadline = start + deadline_s
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    offset = 0
    delay = 0.05
    last_phase = ""
    with httpx.Client(headers=headers, trust_env=False) as client:
        while True:
            chunk, offset = _read_log_from(handle, offset)
            if chunk:
                parse_progress(chunk, handle.progress)
                if handle.progress.phase != last_phase:
                    last_phase = handle.progress.phase
                    log.info("server %s: %s", handle.url, handle.progress.to_dict())
                    if on_progress is not None:
                        on_progress(handle.progress)
            if not handle.is_alive():
                _raise_exited(handle)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _raise_timeout(handle, deadline_s)
            try:
                timeout = httpx.Timeout(min(health_timeout_s, max(remaining, 0.1)), connect=1.0)
                r = client.get(handle.url + "/health_generate", timeout=timeout)
                # A 200 counts only if our process is still the one alive behind the port.
                if r.status_code == 200 and handle.is_alive():
                    chunk, offset = _read_log_from(handle, offset)
                    parse_progress(chunk, handle.progress)
                    handle.progress.phase = "ready"
                    handle.ready_s = time.monotonic() - start
                    if on_progress is not None:
                        on_progress(handle.progress)
                    return
            except httpx.TransportError:
                pass  # connection refused while weights load; timeouts while warming up
            _wait_exit(handle, min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 1.5, 1.0)


def _wait_exit(handle: ServerHandle, timeout: float) -> None:
    """Wait up to ``timeout`` s, returning early if the local server exits (no blind sleep)."""
    if handle._popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            handle._popen.wait(timeout=timeout)
    else:
        time.sleep(timeout)


def _read_log_from(handle: ServerHandle, offset: int) -> tuple[str, int]:
    if handle._popen is None:
        text = handle.read_log()
        return text[offset:], len(text)
    try:
        with open(handle.log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    # Only complete lines: a half-written line would be parsed twice otherwise.
    cut = data.rfind(b"\n") + 1
    return data[:cut].decode("utf-8", "replace"), offset + cut


def _raise_exited(handle: ServerHandle) -> None:
    status = handle.exit_status()
    text = handle.read_log()
    failure = classify_failure(text, status)
    # The group may still hold children (an orphaned scheduler): never leave them behind.
    _kill_group(handle, grace_s=5.0)
    raise LaunchFailed(failure, _tail(text), exit_status=status, log_path=handle.log_path,
                       command=handle.command, fraction=handle.fraction)


def _raise_timeout(handle: ServerHandle, deadline_s: float) -> None:
    _kill_group(handle, grace_s=5.0)
    text = handle.read_log()
    phase = handle.progress.phase
    failure = Failure(
        "timeout",
        f"not ready within {deadline_s:g} s (last phase: {phase}); the process group was killed: "
        "check the log for a hang, or raise the launch deadline for a large model",
        next((ln for ln in reversed(text.splitlines()) if ln.strip()), "").strip()[:500],
    )
    raise LaunchFailed(failure, _tail(text), exit_status=handle.exit_status(), log_path=handle.log_path,
                       command=handle.command, fraction=handle.fraction)


# --------------------------------------------------------------------------------------------------
# Process groups


def _group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` on this host."""
    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return sorted(pids)


def _alive(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _kill_group(handle: ServerHandle, grace_s: float) -> list[int]:
    """SIGTERM the group, wait up to ``grace_s``, SIGKILL survivors. Returns every pid seen."""
    if handle._popen is None:
        return _kill_group_remote(handle, grace_s)
    seen = set(_group_pids(handle.pgid)) | set(handle.member_pids)
    seen |= {pid for pid in handle.member_pids if pid}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(handle.pgid, signal.SIGTERM)
    if not _wait_gone(handle, grace_s, seen):
        seen |= set(_group_pids(handle.pgid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle.pgid, signal.SIGKILL)
        # Members that left the group (setsid) are still ours: they were seen in it.
        for pid in _alive(sorted(seen)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(handle, 10.0, seen)
    return sorted(seen)


def _wait_gone(handle: ServerHandle, timeout: float, seen: set[int]) -> bool:
    """Poll until the leader is reaped and no group member lives; True when that happened in time."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if handle._popen is not None:
            handle._popen.poll()  # reap the leader so it does not linger as a zombie
        members = _group_pids(handle.pgid)
        seen.update(members)
        if not members and handle.exit_status() is not None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _wait_exit(handle, min(delay, left))
        delay = min(delay * 2, 0.25)


# --------------------------------------------------------------------------------------------------
# Stop


HygieneFn = Callable[..., Any]


def _default_hygiene(target: str, gpus: list[int], extra_pids: list[int], grace_s: float) -> Any:
    """Narrow seam to tasks.hygiene (issue 4), so tests and flows can plug another in."""
    from tasks.hygiene import clean_gpus

    return clean_gpus(target, gpus=gpus, grace_s=grace_s, extra_pids=tuple(extra_pids))


def stop_server(
    handle: ServerHandle,
    grace_s: float = 30.0,
    *,
    hygiene: HygieneFn | None = _default_hygiene,
    verify: bool = True,
) -> Any:
    """Stop a server datagen started: SIGTERM its group, wait ``grace_s``, SIGKILL the group, then
    run hygiene on its GPUs with its pids as ``extra_pids`` (orphans that left the group included).

    Idempotent. Returns the hygiene report (None when ``hygiene`` is None). Raises StopFailed when
    ``verify`` and the report's verdict is not "clean".
    """
    pids = _kill_group(handle, grace_s)
    if handle._tunnel is not None:
        with contextlib.suppress(Exception):
            handle._tunnel.close()
        handle._tunnel = None
    log.info("server %s (pgid %d) stopped; pids %s", handle.url, handle.pgid, pids)
    if hygiene is None:
        return None
    report = hygiene(handle.target, handle.gpus, sorted(set(pids) | set(handle.member_pids)), min(grace_s, 10.0))
    verdict = getattr(report, "verdict", "clean" if getattr(report, "clean", False) else "unknown")
    if verify and verdict != "clean":
        summary = report.summary() if hasattr(report, "summary") else str(report)
        raise StopFailed(f"server {handle.url} stopped but GPUs {handle.gpus} are {verdict}:\n{summary}", report)
    return report


# --------------------------------------------------------------------------------------------------
# Remote targets (tasks.targets, issue 4)


def _read_log(target: str, log_path: str, max_bytes: int) -> str:
    if _is_local(target):
        try:
            with open(log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""
    from tasks.targets import parse_target, run_command

    res = run_command(parse_target(target), ["tail", "-c", str(max_bytes), log_path], timeout_s=30)
    return res.stdout if isinstance(res.stdout, str) else res.stdout.decode("utf-8", "replace")


def _remote_alive(target: str, pid: int) -> bool:
    from tasks.targets import parse_target, run_command

    # `ps -o stat=` tells a zombie apart from a live process; kill -0 would not.
    res = run_command(parse_target(target), ["ps", "-o", "stat=", "-p", str(pid)], timeout_s=30)
    out = res.stdout if isinstance(res.stdout, str) else res.stdout.decode()
    return bool(out.strip()) and not out.strip().startswith("Z")


def _kill_group_remote(handle: ServerHandle, grace_s: float) -> list[int]:
    from tasks.targets import parse_target, run_command

    t = parse_target(handle.target)
    run_command(t, ["kill", "-TERM", "--", f"-{handle.pgid}"], timeout_s=30)
    deadline = time.monotonic() + grace_s
    delay = 0.1
    while time.monotonic() < deadline:
        res = run_command(t, ["pgrep", "-g", str(handle.pgid)], timeout_s=30)
        if not (res.stdout or "").strip():
            return list(handle.member_pids)
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    run_command(t, ["kill", "-KILL", "--", f"-{handle.pgid}"], timeout_s=30)
    return list(handle.member_pids)


def _launch_remote(
    cfg: ServerConfig,
    target: Any,
    fraction: float | None,
    log_dir: str | os.PathLike[str],
    deadline_s: float,
    *,
    on_progress: Callable[[StartupProgress], None] | None,
    health_timeout_s: float,
) -> ServerHandle:
    """Start detached on the target (log on the target), reach it through an SSH local forward."""
    from tasks.targets import parse_target, run_command, start_detached

    if cfg.api_key is not None:
        # tasks.targets.start_detached ships env inside the remote command line (visible in the
        # target's `ps`); refuse rather than leak the key until it can send env over stdin.
        raise ServerError(f"an API key cannot yet be passed to a server on {_target_str(target)} without "
                          "exposing it on the remote command line; launch without api_key there")
    t = parse_target(target) if isinstance(target, str) else target
    tname = _target_str(target)
    argv = launch_argv(cfg, fraction)
    shown = build_command(cfg, fraction)
    frac_tag = "default" if fraction is None else format_fraction(fraction)
    log_path = f"{log_dir}/server-{cfg.port}-{time.strftime('%Y%m%d-%H%M%S')}-f{frac_tag}.log"
    run_command(t, ["mkdir", "-p", str(log_dir)], timeout_s=30)
    env = launch_env(cfg, base={})
    pid = start_detached(t, argv, log_path, env=env)
    tunnel = _open_tunnel(t, cfg.host, cfg.port)
    handle = ServerHandle(
        pid=pid, pgid=pid, url=f"http://127.0.0.1:{tunnel.local_port}", log_path=log_path,
        fraction=fraction, target=tname, command=shown, gpus=cfg.gpu_indexes(),
        progress=StartupProgress(), ready_s=0.0, api_key=cfg.api_key, _tunnel=tunnel,
    )
    try:
        _await_ready(handle, cfg, deadline_s, on_progress, health_timeout_s)
    except BaseException:
        tunnel.close()
        raise
    return handle


class _Tunnel:
    """``ssh -N -L local:host:port`` to the target; SSH settings follow tasks.targets' conventions."""

    def __init__(self, proc: subprocess.Popen[bytes], local_port: int) -> None:
        self.proc = proc
        self.local_port = local_port

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _ssh_argv(t: Any) -> list[str]:
    """``ssh`` options matching tasks.targets' settings (DATAGEN_SSH_KEY, DATAGEN_SSH_KNOWN_HOSTS,
    DATAGEN_SSH_CONNECT_TIMEOUT), so the tunnel authenticates exactly as the command channel does."""
    argv = ["ssh", "-p", str(t.port), "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={os.environ.get('DATAGEN_SSH_CONNECT_TIMEOUT', '10')}"]
    key = os.environ.get("DATAGEN_SSH_KEY")
    if key:
        argv += ["-i", key, "-o", "IdentitiesOnly=yes"]
    known = os.environ.get("DATAGEN_SSH_KNOWN_HOSTS")
    if known:
        argv += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
    return [*argv, f"{t.user}@{t.host}" if t.user else str(t.host)]


def _open_tunnel(t: Any, host: str, port: int) -> _Tunnel:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local_port = int(s.getsockname()[1])
    ssh = _ssh_argv(t)
    # For pct:// the server runs in the container, whose loopback is not the Proxmox host's: there
    # cfg.host must be the container's address as the Proxmox host sees it; the forward goes there.
    argv = [ssh[0], "-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{local_port}:{host}:{port}",
            *ssh[1:]]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 15
    delay = 0.02
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
            if proc.stderr is not None:
                proc.stderr.close()
            raise LaunchFailed(Failure("unknown", f"SSH port forward to {t} failed (exit {proc.returncode})",
                                       err.strip()[-300:]), err, command=argv)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", local_port)) == 0:
                return _Tunnel(proc, local_port)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(delay)
        delay = min(delay * 2, 0.5)
    _Tunnel(proc, local_port).close()
    raise LaunchFailed(Failure("unknown", f"SSH port forward to {t} not up within 15 s"), "", command=argv)
