"""What to launch: the validated ``ServerConfig``, its SGLang command line, and the API-key bootstrap.

Errors::

    ServerError           base of every tasks.server* error
    └── ServerConfigError a config field is invalid (raised by ServerConfig itself)

API key: never on a command line. With a key, the launcher runs a small bootstrap (``launch_argv``)
that takes it from ``DATAGEN_SERVER_API_KEY`` in the environment, puts it in the server's
``sys.argv`` in memory only, and copies the server's output to the log with the key replaced by
``***``; docs/decisions/05-api-key.md gives the trade-off.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from tasks.errors import DatagenError
from tasks.redact import redact_text, secret_forms

__all__ = [
    "API_KEY_ENV",
    "BACKENDS",
    "Backend",
    "BOOTSTRAP_ENV",
    "DEFAULT_PORT",
    "SPECULATIVE_ALGORITHMS",
    "ServerConfig",
    "ServerConfigError",
    "ServerError",
    "build_command",
    "flag_value",
    "format_fraction",
    "launch_argv",
    "launch_env",
    "log_file_name",
    "redact",
    "server_flags",
]

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
        # a server over several nodes: the launcher derives these per node (docs/configuration.md)
        "--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr",
    }
)
MAX_NODES = 64  # nodes of one server; SGLang has no bound, a bound keeps a typo from fanning out


class ServerError(DatagenError, RuntimeError):
    """Base of every error this module raises."""


class ServerConfigError(ServerError, ValueError):
    """A ServerConfig field is invalid; the message names the field and the value, ``field`` the
    field's name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# SGLang's own default --port: a remote server's port when the partition names none.
DEFAULT_PORT = 30000
# What serves the model: SGLang, or the emulator standing in for it (no GPU).
Backend = Literal["sglang", "emulator"]
BACKENDS: tuple[str, ...] = get_args(Backend)


@dataclass(frozen=True)
class ServerConfig:
    """What to launch. Validated on construction (raises ServerConfigError)."""

    model_path: str
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    mem_fraction_static: float | None = None
    reasoning_parser: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    trust_remote_code: bool = False
    enable_hierarchical_cache: bool = False
    hicache_size: int | None = None  # GB of host memory per rank; SGLang parses it as an integer
    hicache_ratio: float | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()
    backend: Backend = "sglang"
    python: str = sys.executable
    gpus: tuple[int, ...] | None = None  # on every node of a multi-node server
    # a server over several nodes: node 0 is the launch's target, these are nodes 1.. (target strings);
    # ``dist_init_addr`` (node 0's HOST:PORT the others join) is picked per launch; ``node_rank`` is
    # the node a command line is for (``for_node``)
    peer_nodes: tuple[str, ...] = ()
    dist_init_addr: str | None = None
    node_rank: int = 0
    # repr=False: the flow puts the hub token (HF_TOKEN) here; a logged config must not show it
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ServerConfigError:
            return ServerConfigError(f"server config: {name}={getattr(self, name)!r}: {why}", name)

        if not str(self.model_path).strip():
            raise bad("model_path", "must not be empty")
        if self.backend not in BACKENDS:
            raise bad("backend", f"must be one of {', '.join(map(repr, BACKENDS))}")
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
        size: object = self.hicache_size
        if size is not None:
            # A whole float (TOML 4.0) is that integer; 2.5 would make SGLang refuse the flag.
            if isinstance(size, float) and size.is_integer():
                object.__setattr__(self, "hicache_size", size := int(size))
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise bad("hicache_size", "must be a positive integer (GB per rank)")
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
            raise ServerConfigError("server config: api_key must not be empty (use None for no key)", "api_key")
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in _MANAGED_FLAGS:
                raise ServerConfigError(
                    f"server config: extra_args contains {flag}, which the launcher sets itself; "
                    "use the config field instead", "extra_args"
                )
        if len(self.peer_nodes) + 1 > MAX_NODES:
            raise bad("peer_nodes", f"{len(self.peer_nodes) + 1} nodes; at most {MAX_NODES}")
        if len(set(self.peer_nodes)) != len(self.peer_nodes):
            raise bad("peer_nodes", "a node is listed twice")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1:
            ranks = self.tp_size * self.pp_size
            if ranks % self.nnodes:
                raise bad("tp_size", f"tp_size x pp_size = {ranks} is not a multiple of the {self.nnodes} nodes "
                                     "(SGLang: tp_size must be divisible by number of nodes)")
            if self.dp_size > 1:
                raise bad("extra_args", f"--dp-size {self.dp_size} over {self.nnodes} nodes: SGLang has no "
                                        "multi-node data-parallel replicas (use one server per node instead)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise bad("dist_init_addr", "must be HOST:PORT")
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
                raise bad("gpus", "must be distinct non-negative GPU indexes")
            if len(self.gpus) < self.gpus_per_node:
                need = (f"tp_size={self.tp_size} needs at least that many GPUs" if self.nnodes == 1 else
                        f"tp_size={self.tp_size} x pp_size={self.pp_size} over {self.nnodes} nodes needs "
                        f"{self.gpus_per_node} GPUs on each node")
                raise bad("gpus", need)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def module(self) -> str:
        return "sglang.launch_server" if self.backend == "sglang" else "emulator"

    @property
    def nnodes(self) -> int:
        """The nodes the server spans (1: one host)."""
        return 1 + len(self.peer_nodes)

    @property
    def pp_size(self) -> int:
        """``--pp-size`` of ``extra_args`` (1 when not given)."""
        return _int_flag(self.extra_args, ("--pp-size", "--pipeline-parallel-size"), 1)

    @property
    def dp_size(self) -> int:
        """``--dp-size`` of ``extra_args`` (1 when not given)."""
        return _int_flag(self.extra_args, ("--dp-size", "--data-parallel-size"), 1)

    @property
    def gpus_per_node(self) -> int:
        """GPUs the server uses on each node: tp_size on one host; tp x pp / nodes over several."""
        return self.tp_size if self.nnodes == 1 else self.tp_size * self.pp_size // self.nnodes

    def gpu_indexes(self) -> list[int]:
        """The GPUs the server uses (on each of its nodes): the configured ones, else 0..n-1."""
        n = self.gpus_per_node
        return list(self.gpus[:n]) if self.gpus is not None else list(range(n))

    def for_node(self, rank: int) -> ServerConfig:
        """The config of node ``rank``'s command line (the same command, its own ``--node-rank``)."""
        return replace(self, node_rank=rank)


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in a command line or ``extra_args`` (``--x V`` or
    ``--x=V``); None when none is given."""
    value = None
    for i, arg in enumerate(args):
        name, eq, text = arg.partition("=")
        if name in names:
            value = text if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def _int_flag(args: Sequence[str], names: tuple[str, ...], default: int) -> int:
    """The integer value of ``names`` in ``args`` (``flag_value``), else ``default`` (also when it is
    not an integer: SGLang refuses that itself)."""
    raw = flag_value(args, *names)
    return int(raw) if raw is not None and raw.strip().isdigit() else default


def format_fraction(fraction: float) -> str:
    """A fraction as SGLang gets it on the command line: at most 3 decimals, no trailing zeros."""
    return f"{round(fraction, 3):g}"


def log_file_name(cfg: ServerConfig, fraction: float | None) -> str:
    """The name of one launch's log: port, time, launcher pid and fraction, so attempts never share one."""
    frac_tag = "default" if fraction is None else format_fraction(fraction)
    return f"server-{cfg.port}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-f{frac_tag}.log"


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
            args += ["--hicache-size", str(cfg.hicache_size)]
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
    if cfg.nnodes > 1:
        args += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank)]
        if cfg.dist_init_addr is not None:
            args += ["--dist-init-addr", cfg.dist_init_addr]
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
# parent (the session leader, which the launcher watches and signals first on a stop) copies the pipe
# to the log with the key replaced by ***, forwards SIGTERM/SIGINT/SIGHUP to the child (the server's
# own main process, which drains on SIGTERM), and when the child ends, drains the pipe and ends the
# same way (same exit code, or death by the same signal; SIGKILL cannot be given a disposition).
# Fd-level redaction is needed: SGLang logs server_args (api_key included) and writers may bypass
# sys.stderr.
_BOOTSTRAP_BODY = r"""import os, select, signal, sys
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
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, forward)
forms = [f.encode("utf-8", "surrogateescape") for f in secret_forms(key)]
longest = max(len(f) for f in forms)
spans_lines = any(b"\n" in f for f in forms)  # a raw key with a newline may straddle a line end
buf = b""
def scrub(data):
    for f in forms:
        data = data.replace(f, b"***")
    return data
def out(data):
    data = scrub(data)
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
    if spans_lines:
        # A key with a newline can straddle a line end: hide every whole one in the buffer, then keep
        # only what may be the start of one (shorter than the longest form) for the next read.
        buf = scrub(buf)
        i = max(0, len(buf) - (longest - 1))
    elif i == 0 and len(buf) > (1 << 20):
        i = len(buf) - longest
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
    if -status not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    os._exit(128 - status)
os._exit(status)
"""
_BOOTSTRAP = inspect.getsource(secret_forms) + _BOOTSTRAP_BODY
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


def redact(argv: Sequence[str], secret: str | None) -> list[str]:
    """``argv`` with every spelling of ``secret`` (``secret_forms``) replaced by ``***`` (for logs and
    reports)."""
    if not secret:
        return list(argv)
    return [redact_text(a, [secret]) for a in argv]


