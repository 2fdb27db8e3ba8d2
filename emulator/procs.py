"""The emulator's forked children: one scheduler per TP rank and a detokenizer.

Each scheduler runs SGLang's startup memory sequence on its simulated GPU under its own pid, reports
the numbers over a pipe (one JSON line), then waits for orders (``crash\t<text>``). Children die
with their parent (PR_SET_PDEATHSIG), except the one ``--emu-orphan-on-crash`` picks.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass

import setproctitle

from emulator.logs import log
from emulator.profile import MemoryError_, ModelInfo, RankMemory, plan_rank_memory
from emulator.simgpu import SimGpuError, SimGpuOutOfMemory, SimGpus, sim_path_from_env

__all__ = ["Child", "RankSpec", "start_scheduler", "start_detokenizer", "traceback_text"]

PR_SET_PDEATHSIG = 1
PRIVATE_GPU_MIB = 97887


@dataclass
class Child:
    """A forked child as the main process sees it."""

    pid: int
    title: str
    rank: int | None
    to_child: int  # write end of the order pipe
    from_child: int  # read end of the report pipe
    orphan: bool = False


@dataclass(frozen=True)
class RankSpec:
    """What one scheduler rank needs to start."""

    rank: int
    gpu: int
    tp: int
    fraction: float
    load_time_s: float
    graph_time_s: float
    chunked_prefill_size: int
    max_prefill_tokens: int
    max_running_requests: int
    context_length: int
    ignore_sigterm: bool
    orphan: bool


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become(title: str, parent: int, pdeathsig: bool, ignore_sigterm: bool) -> None:
    """Common child setup after fork: title, death signal, default signal dispositions."""
    setproctitle.setproctitle(title)
    for sig in (signal.SIGQUIT, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_sigterm else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if pdeathsig:
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def traceback_text(exc_line: str, where: str = "init") -> str:
    """A Python-looking traceback ending in ``exc_line``, as SGLang's scheduler logs it."""
    frames = {
        "init": [
            ('sglang/srt/managers/scheduler.py", line 2950, in run_scheduler_process',
             "scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)"),
            ('sglang/srt/model_executor/model_runner.py", line 321, in initialize',
             "self.init_memory_pool(min_per_gpu_memory, server_args.max_running_requests)"),
        ],
        "run": [
            ('sglang/srt/managers/scheduler.py", line 2968, in run_scheduler_process',
             "scheduler.event_loop_overlap()"),
            ('sglang/srt/managers/scheduler.py", line 1034, in event_loop_overlap',
             "batch_result = self.run_batch(batch)"),
            ('sglang/srt/model_executor/model_runner.py", line 2011, in forward_extend',
             "return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)"),
        ],
    }[where]
    lines = ["Traceback (most recent call last):"]
    for loc, code in frames:
        lines.append(f'  File "/sgl-workspace/sglang/python/{loc}')
        lines.append(f"    {code}")
    lines.append(exc_line)
    return "\n".join(lines)


def _fail(rank: int, parent: int, exc_line: str, where: str, orphan: bool) -> None:
    """Log SGLang's scheduler exception, SIGQUIT the parent, exit (the orphan lingers instead)."""
    log("Scheduler hit an exception: " + traceback_text(exc_line, where), tp=rank)
    try:
        os.kill(parent, signal.SIGQUIT)
    except ProcessLookupError:
        pass
    if orphan:
        _linger()
    os._exit(1)


def _linger() -> None:
    """Stay alive, holding simulated GPU memory, until killed."""
    while True:
        signal.pause()


def _gib(x: float) -> str:
    return f"{x:.2f}"


def _scheduler_main(spec: RankSpec, model: ModelInfo, parent: int, rd: int, wr: int) -> None:
    title = "sglang::scheduler" if spec.tp == 1 else f"sglang::scheduler_TP{spec.rank}"
    _become(title, parent, pdeathsig=not spec.orphan, ignore_sigterm=spec.ignore_sigterm)
    tp = spec.rank
    sim: SimGpus | None = None
    total_mib, used_mib = PRIVATE_GPU_MIB, 0
    try:
        if sim_path_from_env():
            sim = SimGpus()
            snap = sim.snapshot()
            gpus = {g["index"]: g for g in snap["gpus"]}
            if spec.gpu not in gpus:
                _fail(tp, parent, "RuntimeError: CUDA error: invalid device ordinal", "init", False)
            total_mib, used_mib = int(gpus[spec.gpu]["total_mib"]), int(gpus[spec.gpu]["used_mib"])
    except SimGpuError as exc:
        _fail(tp, parent, f"RuntimeError: CUDA error: no CUDA-capable device is detected ({exc})", "init", False)
    free_gib = (total_mib - used_mib) / 1024.0 - model.profile.context_gib
    if sim is not None:
        try:
            sim.set_allocation(spec.gpu, int(model.profile.context_gib * 1024))
        except SimGpuOutOfMemory:
            _fail(tp, parent, "RuntimeError: CUDA error: out of memory", "init", False)
    log(f"Load weight begin. avail mem={_gib(free_gib)} GB", tp)
    try:
        plan = plan_rank_memory(model, total_mib, used_mib, spec.fraction, spec.tp)
        plan_error = None
    except MemoryError_ as exc:
        plan_error = exc
    t0 = time.monotonic()
    time.sleep(spec.load_time_s)

    def hold(mib: float) -> None:
        if sim is None:
            return
        try:
            sim.set_allocation(spec.gpu, int(round(mib)))
        except SimGpuOutOfMemory as exc:
            _fail(tp, parent, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                  f"{exc.requested_mib / 1024:.2f} GiB. GPU {spec.gpu} has a total capacity of "
                  f"{exc.total_mib / 1024:.2f} GiB of which {exc.free_mib:.2f} MiB is free.", "init", False)

    if plan_error is not None and plan_error.kind == "weights":
        _fail(tp, parent, plan_error.message, "init", False)
    weights = model.profile.weights_gib_total / spec.tp
    ctx = model.profile.context_gib
    hold((ctx + weights) * 1024)
    log(f"Load weight end. elapsed={time.monotonic() - t0:.2f} s, type={model.architecture}, "
        f"dtype={model.dtype}, avail mem={_gib(free_gib - weights)} GB, mem usage={_gib(weights)} GB.", tp)
    if plan_error is not None and plan_error.kind == "kv":
        _fail(tp, parent, plan_error.message, "init", False)
    if plan_error is not None:  # graph: the pool fits, the capture does not
        kv = free_gib - weights - (total_mib / 1024.0) * (1 - spec.fraction)
        tokens = int(kv * 2**30 // model.kv_bytes_per_token(spec.tp))
        hold((ctx + weights + kv) * 1024)
        log(f"KV Cache is allocated. #tokens: {tokens}, K size: {_gib(kv / 2)} GB, V size: {_gib(kv / 2)} GB", tp)
        after = (total_mib / 1024.0) * (1 - spec.fraction) - model.profile.pool_overhead_gib
        log(f"Memory pool end. avail mem={_gib(max(after, 0.0))} GB", tp)
        log("Capture cuda graph begin. This can take up to several minutes. "
            f"avail mem={_gib(max(after - model.profile.graph_step_gib, 0.0))} GB", tp)
        time.sleep(spec.graph_time_s)
        _fail(tp, parent, "Exception: " + plan_error.message + "\nPossible solutions: 1. set "
              "--mem-fraction-static to a smaller value (e.g., 0.8 or 0.7) 2. set --cuda-graph-max-bs to "
              "a smaller value (e.g., 16) 3. disable torch compile by not using --enable-torch-compile "
              "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss) "
              "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose", "init", False)
    assert plan_error is None
    p: RankMemory = plan
    hold((ctx + weights + p.kv) * 1024)
    log(f"KV Cache is allocated. #tokens: {p.kv_tokens}, K size: {_gib(p.kv / 2)} GB, V size: {_gib(p.kv / 2)} GB", tp)
    hold((ctx + weights + p.kv + model.profile.pool_overhead_gib) * 1024)
    log(f"Memory pool end. avail mem={_gib(p.pool_end_avail)} GB", tp)
    log(f"Capture cuda graph begin. This can take up to several minutes. avail mem={_gib(p.graph_begin_avail)} GB", tp)
    t1 = time.monotonic()
    time.sleep(spec.graph_time_s)
    hold(p.held_mib)
    log(f"Capture cuda graph end. Time elapsed: {time.monotonic() - t1:.2f} s. mem usage={_gib(p.graph)} GB. "
        f"avail mem={_gib(p.headroom)} GB.", tp)
    if spec.rank == 0:
        log(f"max_total_num_tokens={p.kv_tokens}, chunked_prefill_size={spec.chunked_prefill_size}, "
            f"max_prefill_tokens={spec.max_prefill_tokens}, max_running_requests={spec.max_running_requests}, "
            f"context_len={spec.context_length}, available_gpu_mem={_gib(p.headroom)} GB", tp)
    report = {"ok": True, "pid": os.getpid(), "gpu": spec.gpu, **asdict(p)}
    os.write(wr, (json.dumps(report) + "\n").encode())
    _serve_orders(spec, parent, rd)


def _serve_orders(spec: RankSpec, parent: int, rd: int) -> None:
    buf = b""
    while True:
        try:
            chunk = os.read(rd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            if spec.orphan:
                _linger()
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd, _, arg = line.decode().partition("\t")
            if cmd == "crash":
                _fail(spec.rank, parent, arg.replace("\\n", "\n"), "run", spec.orphan)


def _fork(target_title: str, rank: int | None, body) -> Child:  # type: ignore[no-untyped-def]
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(to_w)
            os.close(from_r)
            body(parent, to_r, from_w)
        except BaseException:  # a child must never return into the parent's code
            traceback.print_exc()
        os._exit(1)
    os.close(to_r)
    os.close(from_w)
    return Child(pid=pid, title=target_title, rank=rank, to_child=to_w, from_child=from_r)


def start_scheduler(spec: RankSpec, model: ModelInfo) -> Child:
    """Fork scheduler rank ``spec.rank``; it starts loading at once."""
    title = "sglang::scheduler" if spec.tp == 1 else f"sglang::scheduler_TP{spec.rank}"
    child = _fork(title, spec.rank, lambda parent, rd, wr: _scheduler_main(spec, model, parent, rd, wr))
    child.orphan = spec.orphan
    return child


def start_detokenizer(ignore_sigterm: bool) -> Child:
    """Fork the detokenizer: it only exists (and dies with its parent)."""

    def body(parent: int, rd: int, wr: int) -> None:
        _become("sglang::detokenizer", parent, pdeathsig=True, ignore_sigterm=ignore_sigterm)
        while True:
            try:
                if not os.read(rd, 4096):
                    os._exit(0)
            except InterruptedError:
                continue

    return _fork("sglang::detokenizer", None, body)
