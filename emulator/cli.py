"""``datagen emulator`` / ``python -m emulator``: the SGLang stand-in's main process.

Takes ``python -m sglang.launch_server`` flags plus ``--emu-*`` flags (docs/emulator.md, "The SGLang emulator and
simulated GPUs"). Exit status as SGLang's: 2 usage error, 1 model dir missing or port taken, otherwise
0 after a SIGTERM (requests drained, children ended), death by SIGKILL (-9) after a scheduler failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import shlex
import signal
import sys
import time
from typing import Any

import psutil

from emulator.logs import log, raw
from emulator.nodes import NodeLink, check_nodes, dummy_health_server, join, node_fault
from emulator.procs import Child, RankSpec, start_detokenizer, start_scheduler
from emulator.profile import ModelInfo, load_model

__all__ = ["build_parser", "main"]

_STARTED = time.monotonic()  # /server_info's tokenizer_e2e startup timing counts from here


def build_parser() -> argparse.ArgumentParser:
    """The launch_server flags datagen may pass, plus the emulator's own ``--emu-*`` flags."""
    p = argparse.ArgumentParser(prog="python -m sglang.launch_server", allow_abbrev=False,
                                description="The SGLang emulator: SGLang's launch_server flags datagen passes, "
                                            "its startup, endpoints and failures, on simulated GPUs (docs/emulator.md).")
    sglang = p.add_argument_group("SGLang's flags (accepted as launch_server does; see its --help)")

    def a(*flags: str, **kw: Any) -> None:
        kw.setdefault("help", "as SGLang's")
        sglang.add_argument(*flags, **kw)

    a("--model-path", "--model", dest="model_path", required=True)
    a("--tokenizer-path", default=None)
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    a("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    a("--base-gpu-id", type=int, default=0)
    a("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None)
    a("--dist-timeout", type=int, default=None)
    a("--trust-remote-code", action="store_true")
    a("--served-model-name", default=None)
    a("--context-length", type=int, default=None)
    a("--mem-fraction-static", type=float, default=None)
    a("--max-running-requests", type=int, default=None)
    a("--max-queued-requests", type=int, default=None)
    a("--max-total-tokens", type=int, default=None)
    a("--max-prefill-tokens", type=int, default=16384)
    a("--chunked-prefill-size", type=int, default=8192)
    a("--cuda-graph-max-bs", type=int, default=None)
    a("--disable-cuda-graph", action="store_true")
    a("--enable-hierarchical-cache", action="store_true")
    a("--hicache-ratio", type=float, default=2.0)
    a("--hicache-size", type=int, default=0)
    a("--hicache-write-policy", default="write_through_selective")
    a("--reasoning-parser", default=None)
    a("--tool-call-parser", default=None)
    a("--log-level", default="info")
    a("--log-level-http", default=None)
    a("--api-key", default=None)
    a("--enable-metrics", action="store_true")
    a("--dtype", default="auto")
    a("--load-format", default="auto")
    a("--kv-cache-dtype", default="auto")
    a("--attention-backend", default=None)
    a("--schedule-policy", default="fcfs")
    a("--disable-radix-cache", action="store_true")
    a("--random-seed", type=int, default=None)
    a("--watchdog-timeout", type=float, default=300)
    a("--stream-interval", type=int, default=1)
    a("--skip-server-warmup", action="store_true")
    a("--speculative-algorithm", default=None)
    a("--speculative-draft-model-path", default=None)
    a("--speculative-num-steps", type=int, default=None)
    a("--speculative-eagle-topk", type=int, default=None)
    a("--speculative-num-draft-tokens", type=int, default=None)
    e = p.add_argument_group("emulator (not SGLang flags)")
    e.add_argument("--emu-profile", default="auto", choices=["auto", "demo", "generic"],
                   help="memory and speed model: the demo model's, a generic one, or picked from the model (auto)")
    e.add_argument("--emu-load-time", type=float, default=1.0, help="seconds loading weights")
    e.add_argument("--emu-graph-time", type=float, default=0.3, help="seconds capturing CUDA graphs")
    e.add_argument("--emu-warmup-time", type=float, default=0.5,
                   help="after binding, /health answers 503 this long")
    e.add_argument("--emu-crash-after", type=int, default=None,
                   help="the server dies (scheduler crash) after this many requests")
    e.add_argument("--emu-hang-after", type=int, default=None,
                   help="the server stops answering after this many requests (a hang)")
    e.add_argument("--emu-503-rate", type=float, default=0.0,
                   help="fraction of /generate requests answered 503")
    e.add_argument("--emu-bad-body-rate", type=float, default=0.0,
                   help="fraction of /generate answers sent as a 200 with a truncated, non-JSON body")
    e.add_argument("--emu-ignore-sigterm", action="store_true", help="ignore SIGTERM (only SIGKILL stops it)")
    e.add_argument("--emu-orphan-on-crash", action="store_true",
                   help="on a crash, leave a scheduler child holding GPU memory (the field reports' orphan)")
    e.add_argument("--emu-prefill-us-per-token", type=float, default=5.0,
                   help="prefill time per prompt token (microseconds)")
    e.add_argument("--emu-decode-ms-per-step", type=float, default=2.0,
                   help="decode time per step of the running batch (milliseconds)")
    e.add_argument("--emu-output-tokens", type=int, default=96, help="mean output length (tokens)")
    e.add_argument("--emu-output-tokens-if", action="append", metavar="TEXT=N", default=None,
                   help="prompts holding TEXT have a mean output length of N tokens (repeatable; the first "
                        "match wins): a test's long rows")
    e.add_argument("--emu-output-sigma", type=float, default=0.0,
                   help="log-normal sigma of output lengths (same mean; 0: uniform 0.5x..1.5x)")
    e.add_argument("--emu-seed", type=int, default=0, help="seed of the emulated outputs and faults")
    e.add_argument("--emu-health-timeout", type=float, default=20.0,
                   help="seconds /health_generate waits for a generation before it fails")
    e.add_argument("--emu-host-mem-gib", type=float, default=None,
                   help="host memory (GiB): loading more fails as SGLang does (default: unlimited)")
    e.add_argument("--emu-drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish")
    e.add_argument("--emu-request-log", default=os.environ.get("DATAGEN_EMU_REQUEST_LOG") or None,
                   help="append 'recv RID' when a /generate request arrives and 'done RID' when it is "
                        "answered (default: $DATAGEN_EMU_REQUEST_LOG)")
    e.add_argument("--emu-request-times", metavar="PATH", default=None,
                   help="append 'recv RID T' and 'done RID T' (T: the wall clock, seconds) as --emu-request-log "
                        "does: a test's timeline of the server's requests")
    # A gate for tests: /generate requests wait while this file exists (runs held at a known point).
    e.add_argument("--emu-node-fault", action="append", metavar="RANK:FAULT", default=None,
                   help="a fault on node RANK of a server over several nodes only: never-join, or "
                        "crash-after=S (its scheduler fails S s after the join); repeatable")
    e.add_argument("--emu-hold-while", metavar="PATH", default=None,
                   help="/generate requests wait while this file exists (tests hold runs at a known point)")
    return p


class Main:
    """The main process: forks the children, serves HTTP, and kills its tree like SGLang."""

    def __init__(self, args: argparse.Namespace, model: ModelInfo) -> None:
        self.args = args
        self.model = model
        self.children: list[Child] = []
        self.dying = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.link: NodeLink | None = None  # a server over several nodes: the links to the others

    # ------------------------------------------------------------------ several nodes
    def peer_lost(self, text: str) -> None:
        """Another node is gone (node 0's view): every later collective blocks, as NCCL's would."""
        st = self.state
        if st is not None:
            st.hung = True
            st.engine.halted = True

    def shutdown_by_node0(self) -> None:
        log("Received the rank-0 ShutdownReq broadcast: stopping the schedulers")
        self.kill_tree(include_parent=False)
        os._exit(0)

    def on_sigterm_follower(self, signum: int, frame: object) -> None:
        log(f"SIGTERM received on node_rank {self.args.node_rank}; waiting for the rank-0 ShutdownReq broadcast "
            "to stop the schedulers.")

    def follow(self) -> None:
        """Node rank >= 1 after its schedulers are up: no HTTP, it waits on them (SGLang's
        non-zero nodes do) and dies with them; a lost node 0 leaves it waiting."""
        a = self.args
        fault, after_s = node_fault(a)
        log(f"node {a.node_rank} of {a.nnodes}: schedulers ready; node 0 serves HTTP")
        dummy_health_server(a.host, a.port)
        assert self.link is not None
        self.link.on_shutdown = self.shutdown_by_node0
        crash_at = time.monotonic() + after_s if fault == "crash-after" else None
        fds = {c.from_child: c for c in self.children if c.rank is not None}
        while True:
            timeout = None if crash_at is None else max(0.0, crash_at - time.monotonic())
            ready, _, _ = select.select(list(fds), [], [], timeout)
            if crash_at is not None and time.monotonic() >= crash_at:
                crash_at = None
                self.crash_scheduler("RuntimeError: emulated scheduler failure (--emu-node-fault "
                                     f"{a.node_rank}:crash-after={after_s:g})")
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data and not self.dying:
                    time.sleep(0.5)  # a failing child's SIGQUIT first
                    log(f"Scheduler or DataParallelController {fds[fd].pid} terminated with 1")
                    self.kill_tree()

    # ------------------------------------------------------------------ dying like SGLang
    def kill_tree(self, include_parent: bool = True) -> None:
        """SIGKILL every descendant except an orphan-designated scheduler, then ourselves (unless not
        ``include_parent``: then the caller exits)."""
        self.dying = True
        spared = {c.pid for c in self.children if c.orphan}
        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            procs = []
        for p in procs:
            if p.pid in spared:
                continue
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        if include_parent:
            os.kill(os.getpid(), signal.SIGKILL)
        psutil.wait_procs([p for p in procs if p.pid not in spared], timeout=5)

    def on_sigquit(self, signum: int, frame: object) -> None:
        log("Received sigquit from a child process. It usually means the child failed.")
        self.kill_tree()

    def on_sigterm(self, signum: int, frame: object) -> None:
        log(f"SIGTERM received. signum={signum} frame={frame!r}. Draining requests and shutting down...")
        if self.loop is None or self.state is None:
            self.kill_tree()
            return
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))  # type: ignore[union-attr]

    state = None  # ServerState once serving

    def _children_died(self) -> bool:
        """Whether a scheduler or the detokenizer has ended (a zombie counts: we have not reaped it)."""
        for c in self.children:
            try:
                if psutil.Process(c.pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    async def _drain(self) -> None:
        st = self.state
        assert st is not None
        st.phase = "shutting_down"
        # SGLang's SIGTERM watchdog looks a moment later; children that the same signal ended (a
        # SIGTERM to the whole group) fail its health check, and it force-exits by SIGKILL.
        await asyncio.sleep(0.3)
        if self._children_died():
            log("Signal SIGTERM received while health check failed. Force exiting.")
            self.kill_tree()
        deadline = time.monotonic() + float(self.args.emu_drain_timeout)
        eng = st.engine
        while (eng.running or eng.waiting) and not eng.halted and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.link is not None:
            self.link.broadcast_shutdown()
        log("Graceful shutdown completed. Killing the process tree.")
        # As SGLang after a drain: its children killed, the main process returns and exits 0.
        self.kill_tree(include_parent=False)
        os._exit(0)

    def crash_scheduler(self, exc_line: str) -> None:
        """Order this node's first rank (rank 0 on node 0) to raise ``exc_line``: it logs, SIGQUITs
        us, and we kill the tree."""
        rank0 = next(c for c in self.children if c.rank is not None)
        try:
            os.write(rank0.to_child, ("crash\t" + exc_line.replace("\n", "\\n") + "\n").encode())
        except OSError:
            self.kill_tree()

    # ------------------------------------------------------------------ startup
    def gpu_for_rank(self, rank: int) -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        idx = self.args.base_gpu_id + rank
        if visible:
            entries = [v.strip() for v in visible.split(",") if v.strip()]
            if idx >= len(entries):
                return 10_000 + idx  # no such device: the scheduler fails with "invalid device ordinal"
            try:
                return int(entries[idx])
            except ValueError:
                return 10_000 + idx
        return idx

    def start_children(self) -> list[dict[str, object]]:
        a = self.args
        local = a.tp_size * a.pp_size // a.nnodes  # this node's ranks; one node: tp_size
        for i in range(local):
            rank = a.node_rank * local + i
            spec = RankSpec(
                rank=rank, gpu=self.gpu_for_rank(i), tp=a.tp_size, fraction=a.mem_fraction_static,
                load_time_s=a.emu_load_time, graph_time_s=a.emu_graph_time,
                chunked_prefill_size=a.chunked_prefill_size, max_prefill_tokens=a.max_prefill_tokens,
                max_running_requests=a.max_running_requests, context_length=a.context_length,
                ignore_sigterm=a.emu_ignore_sigterm,
                orphan=a.emu_orphan_on_crash and i == local - 1,
            )
            self.children.append(start_scheduler(spec, self.model))
        self.children.append(start_detokenizer(a.emu_ignore_sigterm))
        reports = []
        for c in self.children:
            if c.rank is None:
                continue
            line = b""
            while not line.endswith(b"\n"):
                try:
                    chunk = os.read(c.from_child, 65536)
                except InterruptedError:
                    continue
                if not chunk:
                    time.sleep(0.5)  # let a failing child's SIGQUIT arrive first
                    log(f"Rank {c.rank} scheduler is dead. Please check if there are relevant logs.")
                    self.kill_tree()
                line += chunk
            reports.append(json.loads(line))
        return reports

    def check_host_memory(self, kv_gib: float) -> None:
        a = self.args
        if not a.enable_hierarchical_cache:
            return
        per_rank = float(a.hicache_size) if a.hicache_size else kv_gib * a.hicache_ratio
        want = per_rank * a.tp_size
        have = a.emu_host_mem_gib
        if have is None:
            have = psutil.virtual_memory().available / 2**30
        if want > have:
            self.crash_scheduler(
                f"ValueError: Not enough host memory available. Requesting {per_rank:.2f} GB but only have "
                f"{have / a.tp_size:.2f} GB free. Please reduce the size of the hierarchical cache."
            )
            signal.pause()

    # ------------------------------------------------------------------ serving
    async def serve(self, memory: dict[str, object]) -> None:
        # Imported here, after start_children() forked the ranks: the schedulers start without the
        # HTTP stack, and the main process reaches "Load weight begin" without paying its import.
        from aiohttp import web

        from emulator.engine import Engine, EngineConfig
        from emulator.server import ServerState, build_app
        from emulator.textgen import format_for_model

        a = self.args
        self.loop = asyncio.get_running_loop()
        engine = Engine(
            EngineConfig(
                max_running_requests=a.max_running_requests,
                chunked_prefill_size=a.chunked_prefill_size,
                max_queued_requests=a.max_queued_requests,
                prefill_us_per_token=a.emu_prefill_us_per_token,
                decode_ms_per_step=a.emu_decode_ms_per_step,
                headroom_mib=float(memory["headroom"]) * 1024,  # type: ignore[arg-type]
                activation_mib_per_token=self.model.profile.activation_mib_per_token,
                total_gib=float(memory["total_gib"]),  # type: ignore[arg-type]
                held_gib=float(memory["total_gib"]) - float(memory["headroom"]),  # type: ignore[arg-type]
                # --max-total-tokens caps the KV pool, as in SGLang
                kv_tokens=min(int(memory["kv_tokens"]),  # type: ignore[call-overload]
                              a.max_total_tokens or int(memory["kv_tokens"])),  # type: ignore[call-overload]
                radix_cache=not a.disable_radix_cache,
            ),
            on_oom=self.crash_scheduler,
        )
        engine.start()
        st = ServerState(
            args=a, model=self.model, fmt=format_for_model(self.model.model_type, self.model.architecture),
            engine=engine, context_length=a.context_length,
            served_model_name=a.served_model_name, memory=memory, on_crash=self.crash_scheduler,
            rng_503=random.Random(a.emu_seed) if a.emu_503_rate > 0 or a.emu_bad_body_rate > 0 else None, startup_s=time.monotonic() - _STARTED,
            request_log=open(a.emu_request_log, "a", buffering=1) if a.emu_request_log else None,  # noqa: SIM115
            request_times=open(a.emu_request_times, "a", buffering=1) if a.emu_request_times else None,  # noqa: SIM115
        )
        self.state = st
        for c in self.children:
            self.loop.add_reader(c.from_child, self._child_gone, c)
        runner = web.AppRunner(build_app(st), access_log=None, handle_signals=False)
        await runner.setup()
        raw(f"INFO:     Started server process [{os.getpid()}]")
        raw("INFO:     Waiting for application startup.")
        raw("INFO:     Application startup complete.")
        try:
            await web.TCPSite(runner, a.host, a.port, backlog=2048).start()
        except OSError as exc:
            raw(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                f"('{a.host}', {a.port}): {(exc.strerror or str(exc)).lower()}")
            for c in self.children:
                if not c.orphan:
                    try:
                        os.kill(c.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            os._exit(1)
        raw(f"INFO:     Uvicorn running on http://{a.host}:{a.port} (Press CTRL+C to quit)")
        if not a.skip_server_warmup:
            await asyncio.sleep(a.emu_warmup_time)
            log("Prefill batch. #new-seq: 1, #new-token: 6, #cached-token: 0, token usage: 0.00, "
                "#running-req: 0, #queue-req: 0, ", tp=0)
        if st.phase == "starting" and not (self.link is not None and self.link.lost.is_set()):
            st.phase = "ready"
            log("The server is fired up and ready to roll!")
        await asyncio.get_running_loop().create_future()

    def _child_gone(self, c: Child) -> None:
        assert self.loop is not None
        try:
            data = os.read(c.from_child, 65536)
        except OSError:
            data = b""
        if data:
            return
        self.loop.remove_reader(c.from_child)
        if self.dying:
            return

        def confirm() -> None:
            if not self.dying:
                who = "detokenizer" if c.rank is None else f"Rank {c.rank} scheduler"
                log(f"{who} is dead. Please check if there are relevant logs.")
                self.kill_tree()

        # a failing child SIGQUITs us before it exits; give that signal the first word
        self.loop.call_later(0.5, confirm)


def _finish_args(args: argparse.Namespace, model: ModelInfo) -> None:
    args.emu_max_running_requests_given = args.max_running_requests  # /server_info reports it as given
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    if args.context_length is None:
        args.context_length = model.context_length
    if args.mem_fraction_static is None:
        args.mem_fraction_static = 0.88
    if args.max_running_requests is None:
        args.max_running_requests = 2048 if args.emu_decode_ms_per_step <= 0 else 256


EMU_ARGS_ENV = "DATAGEN_EMU_ARGS"


def _env_emu_args() -> list[str]:
    """``--emu-*`` flags from ``$DATAGEN_EMU_ARGS`` (shell words), after the command line's: a fault
    for one server of a run (its environment is a per-target flag) without changing its command
    line, which the rows' fingerprint holds. Other flags there are a usage error."""
    words = shlex.split(os.environ.get(EMU_ARGS_ENV, ""))
    bad = [w for w in words if w.startswith("-") and not w.startswith("--emu-")]
    if bad:
        print(f"emulator: ${EMU_ARGS_ENV} takes --emu-* flags only, got {bad[0]}", file=sys.stderr)
        raise SystemExit(2)
    return words


def main(argv: list[str] | None = None) -> int:
    """Run the emulator. Returns only on a usage error (2) or a missing model dir (1)."""
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args([*given, *_env_emu_args()])
    except SystemExit as exc:
        return int(exc.code or 0)
    args.emu_launch_argv = given  # /server_info's launch_command, as SGLang reports sys.argv
    refused = check_nodes(args)
    if refused is not None:  # SGLang checks its parallel sizes before it loads anything
        raw("Traceback (most recent call last):")
        raw('  File "/sgl-workspace/sglang/python/sglang/launch_server.py", line 11, in <module>')
        raw("    server_args = prepare_server_args(sys.argv[1:])")
        raw(refused)
        return 1
    if not 0 < (args.mem_fraction_static or 0.5) < 1:
        parser.error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    try:
        model = load_model(args.model_path, args.emu_profile)
    except OSError as exc:
        raw("Traceback (most recent call last):")
        raw('  File "/sgl-workspace/sglang/python/sglang/launch_server.py", line 11, in <module>')
        raw("    server_args = prepare_server_args(sys.argv[1:])")
        raw(f"OSError: {exc}")
        return 1
    _finish_args(args, model)
    shown = {k: v for k, v in vars(args).items() if not k.startswith("emu_")}
    log("server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")")
    m = Main(args, model)
    signal.signal(signal.SIGQUIT, m.on_sigquit)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.emu_ignore_sigterm else m.on_sigterm)
    if args.node_rank > 0 and not args.emu_ignore_sigterm:
        signal.signal(signal.SIGTERM, m.on_sigterm_follower)
    if args.nnodes > 1:
        m.link = join(args)
        m.link.on_lost = m.peer_lost
        m.link.watch()
    reports = m.start_children()
    if args.node_rank > 0:
        m.follow()
    rank0 = reports[0]
    m.check_host_memory(float(rank0["kv"]))  # type: ignore[arg-type]
    try:
        asyncio.run(m.serve(rank0))
    except KeyboardInterrupt:
        m.kill_tree()
    return 1


if __name__ == "__main__":
    sys.exit(main())
