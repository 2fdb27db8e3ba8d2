"""Async client for SGLang's native ``POST /generate``, with retries that know SGLang.

Transport: aiohttp + orjson, the one HTTP stack of inference (the fastest measured: decision 08 and
docs/benchmarks.md; a benchmark that compares transports brings its own). The retry policy (transport errors, timeouts, 5xx, ``abort`` finishes; 503 "queue full" on its own
budget; never other 4xx) and the liveness short-cut are in docs/decisions/08-retries.md.

Errors::

    ClientError
    ├── ServerGone         retries exhausted: the server stopped answering (carries the last error)
    └── RequestRejected    a 4xx the client must not retry (status, server message)
        └── PromptTooLong  the prompt exceeds the model's context length (the row goes to rejects)

A prompt that fits but leaves less room than ``max_new_tokens`` is not an error: SGLang answers 400
naming the context length and the prompt's tokens, and the client resends once with the budget
that fits (``GenerateResult.capped``). Counting the tokens first (``/tokenize``) would cost every
request a round trip; this costs one only to the requests that overflow.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import yarl

from tasks.errors import DatagenError
from tasks.inference._budget import ContextOverflow, capped_sampling
from tasks.redact import redact_text

__all__ = [
    "DEFAULT_CONCURRENCY",
    "ClientConfig",
    "ClientError",
    "ClientStats",
    "GenerateClient",
    "GenerateResult",
    "PromptTooLong",
    "RequestRejected",
    "ServerGone",
    "batch_slots",
    "cached_tokens",
    "default_concurrency",
    "server_error_message",
]

DEFAULT_CONCURRENCY = 128
# SGLang's phrasings for an over-long input (400, or an abort finish with status_code 400).
_TOO_LONG = re.compile(
    r"longer than the model's context length|exceeds the maximum allowed length|"
    r"maximum context length|is too long|context length",
    re.IGNORECASE,
)
_DUPLICATE_RID = re.compile(r"duplicate request id", re.IGNORECASE)
_QUEUE_FULL = re.compile(r"queue is full", re.IGNORECASE)


class ClientError(DatagenError):
    """Base of the client's errors."""


class ServerGone(ClientError):
    """The server stopped answering: retries exhausted on transport errors, timeouts or 5xx.

    ``rows_done`` and ``result`` are filled in by tasks.inference when it re-raises this after
    stopping a run (finished rows are in the journal: nothing is lost).
    """

    def __init__(self, message: str, *, last_error: str = "", rows_done: int = 0, result: Any = None) -> None:
        super().__init__(message)
        self.last_error = last_error
        self.rows_done = rows_done
        self.result = result


class RequestRejected(ClientError):
    """The server answered 4xx: the request itself is wrong; retrying cannot help."""

    def __init__(self, status: int, message: str, rid: str | None = None) -> None:
        super().__init__(f"server rejected request {rid!r} with HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.rid = rid


class PromptTooLong(RequestRejected):
    """The prompt does not fit the model's context length (``message`` is the server's)."""


@dataclass(frozen=True)
class ClientConfig:
    """Connection, timeout and retry settings. Validated on construction (ValueError)."""

    concurrency: int = DEFAULT_CONCURRENCY  # connection pool size; the driver bounds in-flight requests
    connect_timeout_s: float = 10.0
    # A whole /generate call: long reasoning at a few tokens/s per request takes many minutes.
    request_timeout_s: float = 3600.0
    max_attempts: int = 6
    # 503 "The request queue is full." means alive but busy (--max-queued-requests): retried this many
    # times more, with backoff, before such answers count as failures.
    max_overload_retries: int = 100
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if min(self.connect_timeout_s, self.request_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based): exponential, capped, full jitter."""
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return random.uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class GenerateResult:
    """One finished generation. ``finish_reason`` is the type: stop, length or abort."""

    rid: str
    text: str
    finish_reason: str
    finish_detail: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any]
    latency_s: float
    attempts: int
    max_new_tokens: int | None = None  # the budget sent for this answer (None: the server's default)
    capped: bool = False  # max_new_tokens was lowered to fit the model's context
    server_s: float = 0.0  # its share of its server's time (tasks/inference/_ledger.py)
    ledger: Any = field(default=None, compare=False, repr=False)  # the ledger that counted it


@dataclass
class ClientStats:
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def server_error_message(body: bytes) -> str:
    """The message in an SGLang error body (``{"message"}``, ``{"error": {"message"}}``, ``{"detail"}``)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:2000]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])
    return str(data)[:2000]


# Launch arguments that hold credentials (api_key, admin_api_key, ssl_keyfile_password, ...).
_SECRET_FIELD = re.compile(r"api_key|password|secret|(^|_)token$", re.I)
# The same arguments as flags in /server_info's launch_command (SGLang's sys.argv): their values.
_SECRET_FLAG = re.compile(r"(--[\w-]*(?:api-key|password|secret|token)[\w-]*)(=|\s+)(\S+)", re.I)


def _without_secrets(info: dict[str, Any], known: list[str]) -> dict[str, Any]:
    """``info`` without its credential fields, and with their values (and ``known`` secrets)
    replaced by *** wherever else they appear (``launch_command`` repeats the flags)."""
    found = [str(v) for k, v in info.items() if _SECRET_FIELD.search(k) and isinstance(v, str) and v]
    hide = [*found, *(k for k in known if k)]

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return _SECRET_FLAG.sub(r"\1\2***", redact_text(value, hide))
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return {k: clean(v) for k, v in info.items() if not _SECRET_FIELD.search(k)}


def default_concurrency(server_info: dict[str, Any] | None) -> int:
    """In-flight requests that keep the server's batch full: 2x its batch slots, else 128.

    The slots are ``max_running_requests`` when it was set at launch, else what the schedulers
    resolved (``internal_states[*].effective_max_running_requests_per_dp``, summed over DP ranks):
    SGLang reports ``max_running_requests`` as given, None by default. Twice the slots keeps
    SGLang's queue non-empty, so a finished slot is refilled at once rather than after a client
    round trip; capped at 1024 to bound sockets and client memory.
    """
    mrr = batch_slots(server_info)
    if mrr is not None:
        return max(16, min(1024, 2 * mrr))
    return DEFAULT_CONCURRENCY


def batch_slots(server_info: dict[str, Any] | None) -> int | None:
    """The server's batch slots: ``max_running_requests`` as set at launch, else what its schedulers
    resolved (``internal_states[*].effective_max_running_requests_per_dp``, summed over DP ranks);
    None when it says neither."""
    info = server_info or {}
    mrr = info.get("max_running_requests")
    if not (isinstance(mrr, int) and mrr > 0):
        states = info.get("internal_states")
        per_dp = [s.get("effective_max_running_requests_per_dp") for s in states or [] if isinstance(s, dict)]
        mrr = sum(n for n in per_dp if isinstance(n, int) and n > 0) if isinstance(states, list) else None
    return mrr if isinstance(mrr, int) and mrr > 0 else None


class _Transient(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class GenerateClient:
    """One async HTTP client for a run: ``async with GenerateClient(url, cfg) as c: await c.generate(...)``.

    ``server_alive``: optional liveness check of the server process (module docstring); it may block
    (an SSH round trip), so it runs in a worker thread. Not thread-safe; use it from one event loop.
    """

    # A liveness answer is reused this long by requests that fail at the same moment.
    ALIVE_CHECK_TTL_S = 0.25

    def __init__(self, base_url: str, config: ClientConfig | None = None,
                 server_alive: Callable[[], bool] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.config = config or ClientConfig()
        self._server_alive = server_alive
        self._alive_check: asyncio.Future[bool] | None = None
        self._alive_checked_at = 0.0
        self._known_dead = False
        # The model's context length, once known (an over-budget answer names it; ``context_limit``).
        self.context_length: int | None = None
        self._context_asked: asyncio.Future[int | None] | None = None
        self.stats = ClientStats()
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}  # parsing the URL on every request costs ~10% of the client's CPU
        self._headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            self._headers["Authorization"] = f"Bearer {self.config.api_key}"

    async def __aenter__(self) -> GenerateClient:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=cfg.concurrency),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s),
            headers=self._headers, cookie_jar=aiohttp.DummyCookieJar(),  # SGLang sets no cookies
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- raw requests ------------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One HTTP exchange. Raises ``_Transient`` for transport errors and timeouts."""
        if self._session is None:
            raise RuntimeError("GenerateClient used outside `async with`")
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.base_url + path)
        try:
            async with self._session.request(method, url, data=body) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if _is_refused(exc):
                kind = "refused"
            elif isinstance(exc, TimeoutError):
                kind = "timeout"
            else:
                kind = "transport"
            raise _Transient(kind, f"{type(exc).__name__}: {exc}") from exc

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """GET ``path``; the JSON object on 200, None on any other status or a transport error."""
        try:
            status, body = await self._request("GET", path)
        except _Transient:
            return None
        if status != 200:
            return None
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None

    async def get_text(self, path: str) -> str | None:
        """GET ``path``; the body as text on 200, None on any other status or a transport error."""
        try:
            status, body = await self._request("GET", path)
        except _Transient:
            return None
        return body.decode("utf-8", "replace") if status == 200 else None

    async def server_info(self) -> dict[str, Any] | None:
        """``/server_info`` (or the older ``/get_server_info``) without its secrets, None when neither
        answers. SGLang reports its launch arguments there, the API key in plain text among them."""
        info = await self.get_json("/server_info") or await self.get_json("/get_server_info")
        return None if info is None else _without_secrets(info, [self.config.api_key or ""])

    async def context_limit(self) -> int | None:
        """The model's context length: the one an over-budget answer named, else ``/v1/models``'s
        ``max_model_len`` (asked once per client; SGLang's ``/server_info`` has ``context_length``
        only when it was set at launch). None when the server reports none."""
        if self.context_length is not None:
            return self.context_length
        if self._context_asked is None:
            self._context_asked = asyncio.ensure_future(self._ask_context())
        known = await asyncio.shield(self._context_asked)
        if self.context_length is None:
            self.context_length = known
        return self.context_length

    async def _ask_context(self) -> int | None:
        models = await self.get_json("/v1/models") or {}
        data = models.get("data")
        for model in data if isinstance(data, list) else []:
            limit = model.get("max_model_len") if isinstance(model, dict) else None
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                return limit
        return None

    # A process killed with SIGKILL closes its sockets before it is a zombie: a check at the first
    # connection error can still see it alive. It is asked again this much later (measured: a
    # killed emulator was dropped 0.3 s after its death, one retry's backoff, without it).
    ALIVE_RECHECK_S = 0.05

    def _alive_settled(self) -> bool:
        """``server_alive`` (in a worker thread), asked again after ALIVE_RECHECK_S when it says alive."""
        assert self._server_alive is not None
        if not self._server_alive():
            return False
        time.sleep(self.ALIVE_RECHECK_S)
        return self._server_alive()

    async def _process_dead(self) -> bool:
        """True when ``server_alive`` says the server process is dead; False when alive, unknown
        (no callable, or it raised) or still being checked by another request."""
        if self._server_alive is None:
            return False
        if self._known_dead:
            return True
        now = time.monotonic()
        check = self._alive_check
        if check is None or (check.done() and now - self._alive_checked_at > self.ALIVE_CHECK_TTL_S):
            check = self._alive_check = asyncio.ensure_future(asyncio.to_thread(self._alive_settled))
            self._alive_checked_at = now
        try:
            alive = await asyncio.shield(check)  # shared: one cancelled waiter must not cancel it
        except Exception:  # a check that fails says nothing: keep retrying
            return False
        self._known_dead = alive is False
        return self._known_dead

    # -- /generate ---------------------------------------------------------------------------------

    async def generate(self, text: str, sampling_params: dict[str, Any], rid: str) -> GenerateResult:
        """Generate for one prompt with retries (module docstring).

        A ``max_new_tokens`` the prompt leaves no room for is lowered to the room the server names,
        and the request sent again at once (``GenerateResult.capped``).

        Raises ``PromptTooLong`` (the prompt alone does not fit), ``RequestRejected`` (other 4xx),
        ``ServerGone`` (retries exhausted, or at the first transport error once ``server_alive``
        says the process is dead). An ``abort`` finish that persists through every attempt is
        returned.
        """
        cfg = self.config
        body = orjson.dumps({"text": text, "sampling_params": sampling_params, "rid": rid})
        capped = False
        last = ""
        attempt = 0  # failures that count towards max_attempts
        overloaded = 0  # "queue is full" answers: the server is alive, just busy
        resend = False  # the request was changed to fit: no failure to back off from
        while attempt < cfg.max_attempts:
            if (attempt or overloaded) and not resend:
                self.stats.retries += 1
                await asyncio.sleep(cfg.backoff_s(max(1, attempt + min(overloaded, 6))))
            resend = False
            self.stats.requests += 1
            started = time.perf_counter()
            try:
                status, payload = await self._request("POST", "/generate", body)
            except _Transient as exc:
                self.stats.count_error(exc.kind)
                last = exc.detail
                attempt += 1
                if await self._process_dead():
                    raise ServerGone(
                        f"{self.base_url} stopped answering: its server process is dead (request {rid!r}: "
                        f"{last})",
                        last_error=last,
                    ) from exc
                continue
            latency = time.perf_counter() - started
            if status != 200:
                message = server_error_message(payload)
                last = f"HTTP {status}: {message}"
                if status == 503 and _QUEUE_FULL.search(message) and overloaded < cfg.max_overload_retries:
                    self.stats.count_error("http_503")
                    overloaded += 1
                    continue
                if 400 <= status < 500 and not _DUPLICATE_RID.search(message):
                    over = ContextOverflow.parse(message)
                    if over is not None and not capped and 1 <= over.room < over.max_new_tokens:
                        self.context_length = over.context_length
                        # what SGLang's scheduler generates in full, not the room the 400 names
                        sampling_params = capped_sampling(sampling_params, over.generable)
                        body = orjson.dumps({"text": text, "sampling_params": sampling_params, "rid": rid})
                        capped = resend = True
                        continue
                    if _TOO_LONG.search(message):
                        raise PromptTooLong(status, message, rid)
                    raise RequestRejected(status, message, rid)
                self.stats.count_error("duplicate_rid" if _DUPLICATE_RID.search(message) else f"http_{status}")
                attempt += 1
                continue
            budget = sampling_params.get("max_new_tokens")
            try:
                result = _parse_generate(rid, payload, latency, attempt + 1,
                                         budget if isinstance(budget, int) else None, capped)
            except _BadAnswer as exc:
                # a truncated or garbled body (a proxy, a dropped connection mid-body): retried with
                # backoff like a transport error, and the server dropped only when it persists
                self.stats.count_error("bad_body")
                last = str(exc)
                attempt += 1
                continue
            if result.finish_reason == "abort":
                message = str(result.finish_detail.get("message", ""))
                if _TOO_LONG.search(message):
                    raise PromptTooLong(int(result.finish_detail.get("status_code") or 400), message, rid)
                self.stats.count_error("abort")
                last = f"aborted: {message}"
                attempt += 1
                if attempt < cfg.max_attempts:
                    continue
            return result
        raise ServerGone(
            f"{self.base_url} stopped answering: request {rid!r} failed {cfg.max_attempts} times; "
            f"last error: {last}",
            last_error=last,
        )


class _BadAnswer(Exception):
    """A 200 from /generate whose body is not SGLang's answer (never stored as a row)."""


def _parse_generate(rid: str, payload: bytes, latency_s: float, attempts: int, max_new_tokens: int | None,
                    capped: bool) -> GenerateResult:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise _BadAnswer(f"/generate answered 200 with a body that is not JSON: {payload[:200]!r}") from exc
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise _BadAnswer(f"/generate answered 200 without a `text` string: {str(data)[:200]}")
    meta = data.get("meta_info") or {}
    if not isinstance(meta, dict):
        raise _BadAnswer(f"/generate answered 200 with a `meta_info` that is not an object: {str(meta)[:200]}")
    fr = meta.get("finish_reason")
    detail: dict[str, Any]
    if isinstance(fr, dict):
        detail = fr
    elif isinstance(fr, str):
        detail = {"type": fr}
    else:
        detail = {"type": "abort", "message": "no finish_reason in meta_info"}
    return GenerateResult(
        rid=rid,
        text=data["text"],
        finish_reason=str(detail.get("type", "abort")),
        finish_detail=detail,
        prompt_tokens=_token_count(meta, "prompt_tokens"),
        completion_tokens=_token_count(meta, "completion_tokens"),
        meta_info=meta,
        latency_s=latency_s,
        attempts=attempts,
        max_new_tokens=max_new_tokens,
        capped=capped,
    )


def cached_tokens(meta: Mapping[str, Any]) -> int:
    """``meta_info.cached_tokens`` (SGLang's prefix-cache hits for the request); 0 when absent."""
    value = meta.get("cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _token_count(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _BadAnswer(f"/generate answered 200 with meta_info.{key} = {value!r}, not a token count")
    return value


def _is_refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError | aiohttp.ClientConnectorError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
