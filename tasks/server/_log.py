"""What a server's log says: the failure classifier and the startup-progress parser.

``classify_failure`` (re-exported by tasks.server._tuner) reads the log text and exit status of a failed
launch; ``parse_progress`` folds SGLang's startup lines into a ``StartupProgress``. Both accept the
old and new forms of SGLang's log lines and never raise.

Errors: ``LaunchFailed`` (a ServerError) carries the classified ``Failure``, the log tail, the exit
status, the command, the log path and the fraction SGLang said it used, of a launch that did not
become ready.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tasks.server._config import ServerError, format_fraction

__all__ = [
    "Failure",
    "FailureKind",
    "LaunchFailed",
    "StartupProgress",
    "classify_failure",
    "effective_fraction",
    "explanation",
    "log_tail",
    "parse_progress",
]

FailureKind = Literal[
    "too_high", "too_low", "host_memory", "port_in_use", "bad_flag", "model_not_found", "weights_too_big",
    "kv_pool_exhausted", "timeout", "unknown",
]


@dataclass(frozen=True)
class Failure:
    """Why a launch (or a running server) failed: a kind, a one-line explanation, the evidence line.

    ``suggested_fraction``: the --mem-fraction-static SGLang itself names as the least that fits
    ("Raise --mem-fraction-static above Y"), when the log says one; the next launch should go above it.
    """

    kind: FailureKind
    explanation: str
    evidence: str = ""
    suggested_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SIGKILLED = ("a scheduler was killed (SIGKILL, most likely the kernel's OOM killer: see `dmesg`) while it "
              "started: free host RAM or start fewer servers on this host")
# Matched only right after a line that names a dead scheduler (see _names_dead_scheduler).
_DEAD_SCHEDULER_SIGKILL = re.compile(r"\bExit code: -9\b")
_RAISE_FRACTION = "the KV cache pool does not fit in the static memory: raise --mem-fraction-static"
_LOWER_FRACTION = "too little GPU memory left for CUDA graphs and activations: lower --mem-fraction-static"

# Checked in this order: the first rule whose pattern matches any line wins. Specific causes come
# before the OOM family because an OOM can be a consequence (e.g. a port clash never is).
_RULES: list[tuple[FailureKind, re.Pattern[str], str]] = [
    # The OS's wording, and SGLang's own port check ("rpc_port at N is not available in 30 seconds.
    # rpc_port is used by a process already.") for --port and the ports derived from it.
    ("port_in_use", re.compile(r"address already in use|\[Errno 98\]|EADDRINUSE|"
                               r"is not available in \d+ seconds|is used by a process already", re.I),
     "the port is taken by another process: stop it or choose another --port"),
    ("bad_flag", re.compile(r"error: (unrecognized arguments|argument |the following arguments are required)"),
     "SGLang rejected a command-line flag: fix or remove it in the server config (extra_args)"),
    ("model_not_found", re.compile(
        r"Repository Not Found|RepositoryNotFoundError|HFValidationError|LocalEntryNotFoundError|"
        r"is not a local folder and is not a valid model identifier|"
        r"does not appear to have a file named config\.json|Can't load the configuration of|"
        r"Unrecognized model in |"
        r"No such file or directory: .*(config\.json|model)", re.I),
     "the model path does not exist or is not a model directory on the target: check model_path"),
    # A gated Hugging Face repository the credentials given cannot read: as permanent as a missing one.
    ("model_not_found", re.compile(r"GatedRepoError|Cannot access gated repo|access a gated repo", re.I),
     "the model repository is gated: request access on Hugging Face and give the server an HF_TOKEN "
     "that has it (or point model_path at a local copy)"),
    ("host_memory", re.compile(r"Not enough host memory"),
     "not enough host RAM for the hierarchical cache: lower --hicache-size/--hicache-ratio or free RAM"),
    # The engine names the OOM killer as the likely cause of a scheduler SIGKILLed while it starts.
    # The multimodal (diffusion) runtime says it in two lines: "Rank 0 scheduler is dead." then
    # "Exit code: -9" (matched on the second line, when a dead scheduler was just named).
    ("host_memory", re.compile(r"scheduler died during initialization \(exit code: -9\)"), _SIGKILLED),
    ("host_memory", _DEAD_SCHEDULER_SIGKILL, _SIGKILLED),
    ("too_low", re.compile(
        r"Not enough memory\. Please try to increase --mem-fraction-static|"
        r"Loaded weights leave no GPU memory for the KV cache|"
        # hybrid-Mamba and sliding-window pools: "... or increase --mem-fraction-static"
        r"(state cache is too small to serve any requests|Not enough GPU memory for hybrid|"
        r"leaves no room for the full KV pool|cannot fit ONE worst-case request).*(increase|Raise) "
        r"--mem-fraction-static"), _RAISE_FRACTION),
    # The token allocator found the KV pool full: a bigger pool helps, a smaller one makes it worse.
    # The request-slot pool likewise: "alloc_req_slots runs out of memory. Please set a smaller number
    # for `--max-running-requests`".
    ("kv_pool_exhausted", re.compile(r"(Prefill|Decode) out of memory\. Try to lower your batch size|"
                                     r"runs out of memory\. Please set a smaller number for .--max-running-requests"),
     "the KV cache pool ran out of free tokens for the running requests (not GPU memory): lower "
     "--max-running-requests or --chunked-prefill-size, or raise --mem-fraction-static; never lower it"),
    # "Capture cuda graph failed: <cause>" is memory only when the cause is an OOM (matched here);
    # a gloo or `invalid argument` cause is not about the fraction and stays unrecognised.
    ("too_high", re.compile(
        r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory", re.I), _LOWER_FRACTION),
]

_SUGGESTED = re.compile(r"Raise --mem-fraction-static above ([0-9]*\.?[0-9]+)")


def explanation(kind: FailureKind) -> str:
    """The one-line advice for ``kind`` (as classify_failure gives it); "" for kinds without a rule."""
    return next((text for k, _, text in _RULES if k == kind), "")


def log_tail(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of ``text`` (what a LaunchFailed carries)."""
    return "\n".join(text.splitlines()[-lines:])


def classify_failure(log_text: str, exit_status: int | None) -> Failure:
    """Classify a failed server from its log text and exit status (None when unknown).

    Exit status 2 without a recognisable line is still an argparse error (SGLang's usage errors).
    A CUDA OOM while weights load is "weights_too_big" (not fixed by any fraction). A "too_low"
    failure carries the fraction SGLang suggests, when it names one. Never raises.
    """
    lines = log_text.splitlines()
    # Message lines first: a traceback's indented source line ("raise HFValidationError(") names the
    # error without saying what went wrong.
    order = sorted(range(len(lines)), key=lambda i: lines[i][:1] in (" ", "\t"))
    for kind, pattern, advice in _RULES:
        for i in order:
            line = lines[i]
            if pattern.search(line):
                if pattern is _DEAD_SCHEDULER_SIGKILL and not _names_dead_scheduler(lines[max(0, i - 3):i]):
                    continue
                if kind == "too_high" and _loading_weights(lines[:i]):
                    # Weights load before the static pool is sized: no fraction changes this.
                    return Failure("weights_too_big", _WEIGHTS_EXPLANATION, line.strip()[:500])
                suggested = _suggested_fraction(line) if kind == "too_low" else None
                return Failure(kind, advice, line.strip()[:500], suggested)
    refused = _refused_argument(lines)
    if refused:
        return Failure("bad_flag", explanation("bad_flag"), refused[:500])
    if exit_status == 2:
        evidence = next((ln for ln in reversed(lines) if "error" in ln.lower()), "")
        return Failure("bad_flag", explanation("bad_flag"), evidence.strip()[:500])
    evidence = next((ln for ln in reversed(lines) if _ERRORISH.search(ln)), "")
    status = "unknown" if exit_status is None else str(exit_status)
    return Failure("unknown", f"the server stopped (exit status {status}) for a reason not recognised: "
                   "read the log tail", evidence.strip()[:500])


# SGLang 0.5.23 checks flag combinations after parsing them (server_args.py and its arg_groups/
# hooks), as a ValueError: e.g. --enable-deterministic-inference with a CPU attention backend.
_ARG_CHECK_FRAME = re.compile(r'File ".*sglang/srt/(arg_groups/[^"]+|server_args\.py)"')
_VALUE_ERROR = re.compile(r"^\s*ValueError: ")


def _refused_argument(lines: list[str]) -> str:
    """The ValueError line of a traceback raised while SGLang checks its arguments ("" if none):
    a flag (combination) it refuses, which no relaunch fixes."""
    for i, line in enumerate(lines):
        if _VALUE_ERROR.match(line) and any(_ARG_CHECK_FRAME.search(ln) for ln in lines[max(0, i - 40):i]):
            return line.strip()
    return ""


def _names_dead_scheduler(before: list[str]) -> bool:
    """Whether the lines just before an "Exit code: -9" say a scheduler died (not some other child)."""
    return any("scheduler is dead" in ln for ln in before)


def _suggested_fraction(line: str) -> float | None:
    m = _SUGGESTED.search(line)
    if m is None:
        return None
    value = float(m.group(1))
    return value if 0.0 < value < 1.0 else None


_WEIGHTS_EXPLANATION = ("the model weights do not fit in GPU memory (OOM while loading weights, before "
                        "--mem-fraction-static applies): use more GPUs (--tp-size) or a smaller/quantized model")


def _loading_weights(before: list[str]) -> bool:
    """Whether the log before an OOM shows weight loading begun and not finished."""
    began = any("Load weight begin" in ln for ln in before)
    return began and not any("Load weight end" in ln for ln in before)


_ERRORISH = re.compile(r"Error|error:|Exception|Traceback|failed|Killed", re.I)
_FRACTION_SAID = re.compile(
    r"(?:mem_fraction_static=|'mem_fraction_static': |--mem-fraction-static=)([0-9.]+(?:e-?[0-9]+)?)")


def effective_fraction(log_text: str) -> float | None:
    """The --mem-fraction-static SGLang actually used, when its log says (server_args or error line).

    Reads ``server_args`` printed as ``ServerArgs(mem_fraction_static=X, ...)`` or as a dict
    (``{'mem_fraction_static': X, ...}``), and the error lines' ``mem_fraction_static=X`` /
    ``--mem-fraction-static=X``; the last one in the text wins.
    """
    found = _FRACTION_SAID.findall(log_text)
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


# The scheduler's log prefix names its rank: "TP3", or with other parallelism "DP0 PP1 TP3 EP3".
_RANK = re.compile(r"\[[^\]]*?\b((?:(?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+ ?)+)\]")
_P_WEIGHTS = re.compile(r"Load weight end\..*?avail mem=([0-9.]+) GB, mem usage=(-?[0-9.]+) GB")
_P_KV = re.compile(r"KV Cache is allocated\..*?#tokens: (\d+)")
# "Capture cuda graph", "Capture target decode CUDA graph" (or CPU/NPU/XPU graph), and the speculative
# forms: "target verify", "draft decode", "draft extend", "<role> prefill", "UNO tree draft",
# "Frozen-KV MTP draft". The last graph's avail mem is the lowest of the rank.
_P_GRAPH_BEGIN = re.compile(r"Capture (?:[\w-]+ ){0,5}graph begin", re.I)
_P_GRAPH_END = re.compile(r"Capture (?:[\w-]+ ){0,5}graph end\..*?avail mem=([0-9.]+) GB", re.I)
# On CPU the same line says available_cpu_mem: host memory, which is no GPU headroom.
_P_MAXTOK = re.compile(r"max_total_num_tokens=(\d+).*?available_(gpu|cpu)_mem=([0-9.]+) GB")
_P_HTTP = re.compile(r"Uvicorn running on")
# each rank joins the others here (torch.distributed); over several nodes it waits for every node
_P_PARALLEL = re.compile(r"Init parallel begin|Init torch distributed begin")
_P_READY = re.compile(r"The server is fired up and ready to roll")


def parse_progress(text: str, progress: StartupProgress | None = None) -> StartupProgress:
    """Fold SGLang startup log ``text`` into ``progress`` (a new one when None) and return it.

    Accepts the old and new forms of SGLang's log lines. Per-rank values keep the
    worst rank (lowest headroom, highest weights). Never raises.
    """
    p = progress or StartupProgress()
    graph_end: dict[str, float] = {}
    for line in text.splitlines():
        rank_m = _RANK.search(line)
        rank = rank_m.group(1).strip() if rank_m else ""
        if _P_PARALLEL.search(line):
            p.phase = _later(p.phase, "parallel_init")
        elif m := _P_WEIGHTS.search(line):
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
            if not graph_end and m.group(2) == "gpu":  # graphs disabled: what the pools left is the headroom
                avail = float(m.group(3))
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


_PHASES = ["starting", "parallel_init", "weights_loaded", "kv_cache", "cuda_graph", "http_up", "ready"]


def _later(current: str, new: str) -> str:
    return new if _PHASES.index(new) > _PHASES.index(current) else current



class LaunchFailed(ServerError):
    """A launch did not become ready. ``failure.kind`` says which way to move (see classify_failure).

    ``effective``: the --mem-fraction-static the server's whole log says it used (its server_args
    line is near the top, long gone from ``log_tail``); None when the log does not say.
    """

    # Kinds a relaunch with the same config cannot fix; every other kind (a taken port, a timeout, an
    # unexplained exit) may succeed on the next attempt. Decided per instance, hence a property where
    # DatagenError has a class attribute.
    PERMANENT_KINDS: frozenset[str] = frozenset({"bad_flag", "model_not_found", "host_memory"})
    # Kinds the fraction search (tasks.server._tuner) answers itself: once it gives up on them, a
    # retry of the launch stage would only repeat the search (one owner per retry layer:
    # docs/architecture.md "Retries").
    SEARCHED_KINDS: frozenset[str] = frozenset({"too_high", "too_low"})

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        return self.failure.kind not in self.PERMANENT_KINDS | self.SEARCHED_KINDS

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
        effective: float | None = None,
    ) -> None:
        self.failure = failure
        self.log_tail = log_tail
        self.attempts = list(attempts)
        self.exit_status = exit_status
        self.log_path = log_path
        self.command = list(command)
        self.fraction = fraction
        self.effective = effective
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

