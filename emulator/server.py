"""The emulator's HTTP side: SGLang's endpoints, JSON shapes and status codes on aiohttp."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from emulator.engine import Engine, QueueFull, Req
from emulator.profile import ModelInfo
from emulator.textgen import (
    TOKEN_RE,
    ReasoningFormat,
    generate,
    skip_special_tokens,
)

__all__ = ["ServerState", "build_app"]

SGLANG_VERSION = "0.5.23"
_JSON = "application/json"


@dataclass
class ServerState:
    """Everything the handlers share."""

    args: Any  # argparse.Namespace of the launch
    model: ModelInfo
    fmt: ReasoningFormat
    engine: Engine
    context_length: int
    served_model_name: str
    memory: dict[str, Any]
    on_crash: Callable[[str], None]
    phase: str = "starting"  # starting | ready | shutting_down
    hung: bool = False
    generate_count: int = 0
    held: int = 0  # /generate requests waiting on --emu-hold-while now
    rng_503: random.Random | None = None
    startup_s: float = 0.0  # from the start of the main process until it served
    request_log: Any = None  # an open text file (--emu-request-log): tests count requests per rid
    request_times: Any = None  # an open text file (--emu-request-times): the same with the wall clock
    rids: set[str] = field(default_factory=set)  # rids in flight: SGLang refuses a second one

    def log_request(self, event: str, reqs: list[Any]) -> None:
        if self.request_log is not None:
            self.request_log.write("".join(f"{event} {r.rid}\n" for r in reqs))
            self.request_log.flush()  # a killed server's log must hold every request it saw
        if self.request_times is not None:
            now = time.time()
            self.request_times.write("".join(f"{event} {r.rid} {now:.6f}\n" for r in reqs))
            self.request_times.flush()


def _graphs(decode: float) -> dict[str, float]:
    """SGLang's per-graph figures (timings or GB): the emulator captures the decode graph only."""
    return {"prefill": 0.0, "decode": decode, "target_verify": 0.0, "draft_prefill": 0.0, "draft_decode": 0.0,
            "draft_extend": 0.0}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _error(message: str, status: int = 400, kind: str = "Bad Request") -> web.Response:
    return _json({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)


def _value_error(message: str, status: int = 400) -> web.Response:
    """SGLang's answer to a request its tokenizer manager refuses (a ValueError)."""
    return _json({"error": {"message": message}}, status)


# The sampling_params fields SGLang 0.5.23's /generate contract admits, in the order its message lists them.
_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
    "choice",
)


def _contract_error(sps: Any) -> web.Response | None:
    """SGLang's schema check of a /generate body: an unknown sampling key is refused before anything."""
    for sp in sps if isinstance(sps, list) else [sps]:
        for key in sp if isinstance(sp, dict) else ():
            if key not in _SAMPLING_FIELDS:
                expected = ", ".join(f"`{f}`" for f in _SAMPLING_FIELDS)
                return _json({"error": f"unknown field `{key}`, expected one of {expected}"}, 400)
    return None


def _queue_full() -> web.Response:
    return _error("The request queue is full.", 503, "503")


async def _never() -> web.Response:
    await asyncio.get_running_loop().create_future()
    raise AssertionError("unreachable")


def _token_ids(tokens: list[str], extra: int) -> list[int]:
    ids = [100 + zlib.crc32(t.encode()) % 150000 for t in tokens]
    ids.extend(100 + (len(ids) + i) % 150000 for i in range(extra))
    return ids


def _meta(st: ServerState, r: Req, final: bool, upto: int | None = None) -> dict[str, Any]:
    now = time.monotonic()
    done = r.total if upto is None else upto
    # SGLang 0.5.23's keys, in its order.
    return {
        "id": r.rid,
        "finish_reason": r.output.finish_reason if final else None,
        "prompt_tokens": r.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": done,
        "cached_tokens": r.cached,
        "weight_versions": [{"version": "default", "start": 0, "end": done}],
        "cached_tokens_details": None,
        "dp_rank": None,
        "e2e_latency": (r.finished_at or now) - r.created,
        "response_sent_to_client_ts": time.time(),
    }


def _result(st: ServerState, r: Req) -> dict[str, Any]:
    out = r.output
    return {
        "text": out.text,
        "output_ids": _token_ids(out.tokens, out.extra),
        "meta_info": _meta(st, r, True),
    }


def _partial(st: ServerState, r: Req, n: int) -> dict[str, Any]:
    """The streamed chunk after ``n`` generated tokens (cumulative text)."""
    toks = r.output.tokens
    final = n >= r.total
    shown = toks if final else toks[: min(n, len(toks))]
    return {
        "text": "".join(shown),
        "output_ids": _token_ids(shown, r.output.extra if final else max(0, n - len(toks))),
        "meta_info": _meta(st, r, final, upto=n),
    }


def _check_params(sp: dict[str, Any]) -> str | None:
    """SGLang's SamplingParams.verify messages for the fields datagen sends."""
    mnt = sp.get("max_new_tokens", 128)
    if mnt is not None and (not isinstance(mnt, int) or mnt < 0):
        return f"max_new_tokens must be at least 0, got {mnt}."
    t = sp.get("temperature", 1.0)
    if not isinstance(t, int | float) or t < 0:
        return f"temperature must be a non-negative finite number, got {t}."
    tp = sp.get("top_p", 1.0)
    if not isinstance(tp, int | float) or not 0 < tp <= 1:
        return f"top_p must be in (0, 1], got {tp}."
    n = sp.get("n", 1)
    if not isinstance(n, int) or n < 1:
        return f"n must be at least 1, got {n}."
    stop = sp.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        return "stop must be a string or a list of strings."
    return None


def _max_req_len(st: ServerState) -> int:
    """SGLang's per-request token limit: the context and the KV pool, less one."""
    kv = int(st.memory.get("kv_tokens") or 0)
    return min(st.context_length - 1, kv - 1) if kv > 0 else st.context_length - 1


def _length_error(st: ServerState, n_prompt: int, max_new_tokens: int | None) -> str | None:
    """SGLang's 400 message for a request that does not fit (None: it fits), checked in its order:
    the tokenizer manager's prompt and prompt + budget checks, then the scheduler's input limit
    (its request limit less 5), which it answers as an abort with status 400."""
    context = st.context_length
    if n_prompt >= context:
        return f"The input ({n_prompt} tokens) is longer than the model's context length ({context} tokens)."
    if max_new_tokens is not None and max_new_tokens + n_prompt > context:
        return (f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {max_new_tokens + n_prompt} tokens: {n_prompt} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit.")
    limit = _max_req_len(st) - 5
    if n_prompt >= limit:
        return (f"Input length ({n_prompt} tokens) exceeds the maximum allowed length ({limit} tokens). "
                f"Use a shorter input or enable --allow-auto-truncate.")
    return None


def _mean_tokens(st: ServerState, prompt: str | None) -> int:
    """The mean output length: ``--emu-output-tokens``, or the ``--emu-output-tokens-if`` length of
    the first text the prompt holds (a test's long rows)."""
    for rule in st.args.emu_output_tokens_if or []:
        text, _, n = rule.rpartition("=")
        if prompt is not None and text and text in prompt:
            return int(n)
    return int(st.args.emu_output_tokens)


def _make_req(
    st: ServerState, prompt: str | None, ids: list[int] | None, sp: dict[str, Any], rid: str | None, sample: int
) -> Req | web.Response:
    tokens: tuple[Any, ...]
    if prompt is not None:
        tokens = tuple(TOKEN_RE.findall(prompt))
        key: Any = prompt
    else:
        assert ids is not None
        tokens = tuple(ids)
        key = tokens
    n_prompt = len(tokens)
    refused = _length_error(st, n_prompt, sp.get("max_new_tokens", 128))
    if refused is not None:
        return _json({"error": {"message": refused}}, 400)
    low, high = sp.get("min_new_tokens", 0), sp.get("max_new_tokens", 128)
    if isinstance(low, int) and isinstance(high, int) and not 0 <= low <= high:  # SamplingParams.verify, after
        return _json({"error": {"message": f"min_new_tokens must be in [0, max_new_tokens({high})], got {low}."}},
                     400)
    stop = sp.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    mnt = sp.get("max_new_tokens", 128)
    # The scheduler's silent bound (init_req_max_new_tokens): one slot short of its request limit.
    mnt = min(1 << 30 if mnt is None else int(mnt), _max_req_len(st) - n_prompt - 1)
    # Greedy decoding (temperature 0) ignores the seed and the sample index, as SGLang's does.
    sampled = float(sp.get("temperature", 1.0)) > 0
    seed_parts = (st.args.emu_seed, sp.get("sampling_seed") if sampled else None, sample if sampled else 0)
    fmt = st.fmt
    tail = prompt.rstrip() if prompt is not None else ""
    opened = bool(fmt.start) and tail.endswith(fmt.start)
    closed = bool(fmt.end) and tail.endswith(fmt.end)
    out = generate(
        repr((key, seed_parts)),
        fmt,
        seed=int(st.args.emu_seed),
        mean_tokens=_mean_tokens(st, prompt),
        length_sigma=float(st.args.emu_output_sigma),
        max_new_tokens=mnt,
        stop=[s for s in stop if isinstance(s, str)],
        eos_token_id=st.model.eos_token_id,
        opened=opened,
        closed=closed,
        ignore_eos=bool(sp.get("ignore_eos")),
    )
    if sp.get("skip_special_tokens", True):
        out = skip_special_tokens(out)
    return Req(rid=rid or uuid.uuid4().hex, prompt_tokens=n_prompt, output=out, created=time.monotonic(),
               key=tokens)


async def _read_json(request: web.Request) -> Any:
    body = await request.read()
    try:
        return orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as exc:
        detail = [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {},
                   "ctx": {"error": str(exc)}}]
        raise web.HTTPBadRequest(
            body=orjson.dumps({"object": "error", "message": f"1 validation error:\n  {detail[0]}\n\n"
                               f"  POST {request.path} {detail}", "type": "Bad Request", "param": None,
                               "code": 400}),
            content_type=_JSON,
        ) from None


async def _finished(reqs: list[Req]) -> None:
    """Wait until the engine has finished every submitted request."""
    for r in reqs:
        assert r.done is not None
        await r.done


class _Api:
    """SGLang's endpoints over one ServerState: each handler a method, :func:`build_app` the routes."""

    def __init__(self, st: ServerState) -> None:
        self.st, self.engine = st, st.engine

    def ready_or_503(self) -> web.Response | None:
        if self.st.phase != "ready":
            return web.Response(status=503)
        return None

    async def ready(self, request: web.Request) -> web.Response:
        return self.ready_or_503() or web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        if self.st.hung and self.st.phase == "ready":
            # SGLang waits this long for the 1-token generation before answering 503
            await asyncio.sleep(float(self.st.args.emu_health_timeout))
            return web.Response(status=503)
        return self.ready_or_503() or web.Response(status=200)

    def _admit_faults(self) -> web.Response | None:
        """Per-request faults: hang, crash, 503 rate, bad 200 bodies (status 299 here, sent as 200). None
        when the request hangs; a 200 response when it may proceed."""
        self.st.generate_count += 1
        a = self.st.args
        if self.st.hung or self.engine.halted:
            return None  # caller awaits forever
        if a.emu_hang_after is not None and self.st.generate_count > a.emu_hang_after:
            self.st.hung = True
            self.engine.halted = True
            return None
        if a.emu_crash_after is not None and self.st.generate_count > a.emu_crash_after:
            self.engine.halted = True
            self.st.on_crash(f"RuntimeError: emulated scheduler failure (--emu-crash-after {a.emu_crash_after})")
            return None
        if self.st.rng_503 is not None and self.st.rng_503.random() < a.emu_503_rate:
            return _queue_full()
        if self.st.rng_503 is not None and self.st.rng_503.random() < a.emu_bad_body_rate:
            # what a proxy that cuts or rewrites answers gives: a 200 whose body is not the JSON answer
            return web.Response(status=299, body=b'{"text": "cut off mid-ans', content_type="application/json")
        return web.Response(status=200)

    async def _hold(self) -> None:
        """Wait while the --emu-hold-while file exists, counted in the ``emu_held_requests`` metric."""
        path = self.st.args.emu_hold_while
        if not path or not os.path.exists(path):
            return
        self.st.held += 1
        try:
            while os.path.exists(path):
                await asyncio.sleep(0.05)
        finally:
            self.st.held -= 1

    async def generate_handler(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        if not isinstance(body, dict):
            return _value_error("The request body must be a JSON object.")
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            return _value_error("Either text, input_ids or input_embeds should be provided.")
        if given[0] == "input_embeds":
            return _value_error("input_embeds is not supported by the emulator.")
        contract = _contract_error(body.get("sampling_params"))
        if contract is not None:
            return contract
        await self._hold()
        fault = self._admit_faults()
        if fault is None:
            return await _never()
        if fault.status == 299:
            return web.Response(status=200, body=fault.body, content_type="application/json")
        if fault.status != 200:
            return fault
        text = body.get("text")
        ids = body.get("input_ids")
        batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
        prompts: list[tuple[str | None, list[int] | None]]
        if text is not None:
            prompts = [(t, None) for t in (text if isinstance(text, list) else [text])]
            if not all(isinstance(t, str) for t, _ in prompts):
                return _value_error("text must be a string or a list of strings.")
        else:
            id_lists: list[Any] = list(ids) if batch and isinstance(ids, list) else [ids]
            if not all(isinstance(i, list) and all(isinstance(x, int) for x in i) for i in id_lists):
                return _value_error("input_ids must be a list of ints or a list of lists of ints.")
            prompts = [(None, i) for i in id_lists]
        if not prompts:
            return _value_error("Either text, input_ids or input_embeds should be provided.")
        sps = body.get("sampling_params") or {}
        if isinstance(sps, list):
            if len(sps) != len(prompts):
                return _value_error("The number of sampling_params does not match the number of prompts.")
        elif isinstance(sps, dict):
            sps = [sps] * len(prompts)
        else:
            return _value_error("sampling_params must be a dict or a list of dicts.")
        rids = body.get("rid")
        if isinstance(rids, str):
            rids = [rids] if not batch else None
        if rids is not None and (not isinstance(rids, list) or len(rids) != len(prompts)):
            return _value_error("The rid should be a string or a list of strings with the same length as the batch.")
        reqs: list[Req] = []
        for i, ((t, ii), sp) in enumerate(zip(prompts, sps, strict=True)):
            if not isinstance(sp, dict):
                return _value_error("sampling_params must be a dict or a list of dicts.")
            msg = _check_params(sp)
            if msg:
                return _value_error(msg)
            n = int(sp.get("n", 1))
            for k in range(n):
                rid = rids[i] if rids else None
                if rid is not None and n > 1:
                    rid = f"{rid}_{k}"
                made = _make_req(self.st, t, ii, sp, rid, k)
                if isinstance(made, web.Response):
                    return made
                reqs.append(made)
        # SGLang's tokenizer manager: a rid already in flight (or twice in one request) is a ValueError
        given = [r.rid for r in reqs if r.rid is not None]
        for k, rid in enumerate(given):
            if rid in self.st.rids or rid in given[:k]:
                if self.st.request_log is not None:
                    self.st.request_log.write(f"duplicate {rid}\n")
                return _value_error(f"Duplicate request ID detected: {rid}")
        try:
            self.engine.submit(reqs)
        except QueueFull:
            return _queue_full()
        self.st.rids.update(given)
        try:
            self.st.log_request("recv", reqs)
            many = batch or len(reqs) > 1
            if body.get("stream"):
                return await self._stream(request, reqs, many)
            await _finished(reqs)
            self.st.log_request("done", reqs)
            if many:
                return _json([_result(self.st, r) for r in reqs])
            return _json(_result(self.st, reqs[0]))
        finally:
            self.st.rids.difference_update(given)

    async def _stream(self, request: web.Request, reqs: list[Req], many: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        for idx, r in enumerate(reqs):
            sent = 0
            while True:
                n = r.generated
                while sent < n:
                    sent += 1
                    chunk = _partial(self.st, r, sent)
                    if many:
                        chunk["index"] = idx
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if sent >= r.total:
                    break
                r.waiter = loop.create_future()
                await r.waiter
            if r.total == 0:
                await resp.write(b"data: " + orjson.dumps(_partial(self.st, r, 0)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def model_info(self, request: web.Request) -> web.Response:
        return _json({
            "model_path": self.st.args.model_path,
            "served_model_name": self.st.served_model_name,
            "tokenizer_path": self.st.args.tokenizer_path or self.st.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": self.st.args.load_format,
            "reasoning_parser": self.st.args.reasoning_parser,
            "tool_call_parser": self.st.args.tool_call_parser,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.st.model.model_type,
            "architectures": [self.st.model.architecture],
        })

    async def server_info(self, request: web.Request) -> web.Response:
        # api_key included, in plain text, as SGLang reports it: datagen must never store this raw.
        info = {k: v for k, v in vars(self.st.args).items() if not k.startswith("emu_")}
        info.update({
            # The schedulers' handshake answer: "ready" whenever the HTTP side answers at all.
            "status": "ready",
            "max_running_requests": self.st.args.emu_max_running_requests_given,
            "launch_command": " ".join(self.st.args.emu_launch_argv),
            # SGLang's startup timings (s), per phase.
            "startup_time": {
                "load_weight": float(self.st.args.emu_load_time), "kv_cache_allocation": 0.0,
                "scheduler_e2e": float(self.st.args.emu_load_time + self.st.args.emu_graph_time),
                "cuda_graph": _graphs(decode=float(self.st.args.emu_graph_time)), "tokenizer_e2e": self.st.startup_s,
            },
            "version": SGLANG_VERSION,
            "max_total_num_tokens": self.st.memory["kv_tokens"],
            "emulator": True,
            "internal_states": [{
                "last_gen_throughput": round(self.engine.last_gen_throughput, 3),
                "memory_usage": {
                    "weight": round(self.st.memory["weights"], 2),
                    "kvcache": round(self.st.memory["kv"], 2),
                    "startup_available": round(self.st.memory["headroom"] + self.st.memory["graph"], 2),
                    "token_capacity": self.st.memory["kv_tokens"],
                    "token_capacity_swa": None,
                    "graph": _graphs(decode=round(self.st.memory["graph"], 2)),
                },
                "effective_max_running_requests_per_dp": self.st.args.max_running_requests,
                "avail_gpu_mem_gb": round(self.st.memory["headroom"], 2),
            }],
        })
        return _json(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)\n")
        busy = bool(self.engine.running or self.engine.waiting)
        if not busy:
            self.engine.flush_cache()
        return web.Response(text=text, status=400 if busy else 200)

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.st.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sglang", "root": self.st.served_model_name, "parent": None, "max_model_len": self.st.context_length,
        }]})

    async def metrics(self, request: web.Request) -> web.Response:
        label = f'{{model_name="{self.st.served_model_name}"}}'
        rows = [
            ("num_running_reqs", "gauge", "The number of running requests.", len(self.engine.running)),
            ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", len(self.engine.waiting)),
            ("token_usage", "gauge", "The token usage.", self.engine.token_usage()),
            ("gen_throughput", "gauge", "The generation throughput (token/s).", self.engine.last_gen_throughput),
            ("max_running_requests", "gauge", "Batch slots (--max-running-requests).",
             self.st.args.max_running_requests),
            ("prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.engine.prompt_tokens_total),
            ("cached_tokens_total", "counter", "Number of cached prompt tokens.", self.engine.cached_tokens_total),
            ("generation_tokens_total", "counter", "Number of generation tokens processed.",
             self.engine.generation_tokens_total),
            ("num_requests_total", "counter", "Number of requests processed.", self.engine.requests_total),
            ("emu_busy_slot_seconds_total", "counter",
             "Emulator only: integral over time of the number of running requests.", self.engine.busy_seconds()),
            ("emu_held_requests", "gauge", "Emulator only: requests waiting on --emu-hold-while.", self.st.held),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            base = name[: -len("_total")] if kind == "counter" else name
            lines.append(f"# HELP sglang:{base} {help_text}")
            lines.append(f"# TYPE sglang:{base} {kind}")
            lines.append(f"sglang:{name}{label} {float(value)}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def build_app(st: ServerState) -> web.Application:
    """The aiohttp application serving SGLang's endpoints from ``st``."""
    api, api_key = _Api(st), st.args.api_key
    middlewares = []
    if api_key:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            path = request.path
            if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
                return await handler(request)
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
                return _json({"error": "Unauthorized"}, 401)
            return await handler(request)

        middlewares.append(auth)

    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    app.router.add_get("/health", api.health)
    app.router.add_get("/health_generate", api.health)
    app.router.add_get("/ready", api.ready)
    app.router.add_post("/generate", api.generate_handler)
    for p in ("/model_info", "/get_model_info"):
        app.router.add_get(p, api.model_info)
    for p in ("/server_info", "/get_server_info"):
        app.router.add_get(p, api.server_info)
    app.router.add_route("*", "/flush_cache", api.flush_cache)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/metrics", api.metrics)
    return app
