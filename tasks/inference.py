"""The inference driver: stream a dataset through ``/generate`` into committed Parquet shards.

``run_dataset`` holds the output's lock (or reuses the caller's), binds the dataset to its input
fingerprint and the shard size (``InputChanged`` otherwise), undoes half-finished commits, then
streams the input once:

- records of committed shards are skipped; in an open shard, ids already in the journal are skipped
  (they are not regenerated; rows journaled under another reasoning parser are split again from their
  raw text when the shard commits);
- input rejects, over-long prompts (HTTP 400 from the server) and template failures are journaled
  as rejects; every finished generation is journaled as a row the moment it arrives;
- when every record of a shard's slice is accounted for, the shard is committed (tasks.shards) in a
  worker thread, ``on_shard_committed(ShardRecord)`` runs, then ``progress(ShardProgress)``.

Requests are issued by ``concurrency`` worker tasks fed through a bounded queue, so memory is flat in
the dataset size: the input is streamed, and only in-flight items and per-open-shard counters live
in memory. Shards commit out of order when a straggler holds one back; the workers never wait for
a commit, which keeps the server's batch full.

Errors: ``ServerGone`` (retries exhausted; ``rows_done``/``result`` set, finished rows are in the
journal), ``RequestRejected`` (a non-retryable 4xx, e.g. bad sampling params or API key),
``InputChanged``/``OutputLocked`` (tasks.shards), and whatever ``on_shard_committed`` raises (the
shard it was called for stays committed; nothing else is lost).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tasks.client import (
    ClientConfig,
    GenerateClient,
    PromptTooLong,
    RequestRejected,
    ServerGone,
    default_concurrency,
)
from tasks.shards import InputChanged, Journal, OutputDir, OutputLocked, ShardRecord

__all__ = [
    "DatasetResult",
    "DatasetSpec",
    "InputChanged",
    "OutputLocked",
    "RequestRejected",
    "ServerGone",
    "ShardProgress",
    "ShardRecord",
    "fingerprint_server",
    "run_dataset",
    "run_dataset_async",
    "run_inputs",
]

DEFAULT_SAMPLING: Mapping[str, Any] = {"max_new_tokens": 4096}
_AUTO = "auto"


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: its name (the output folder) and input file (JSONL or Parquet)."""

    name: str
    path: Path
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # e.g. enable_thinking


@dataclass(frozen=True)
class ShardProgress:
    """Progress after a shard commit (issue 6 item 9). Token rates are over the shard's wall time."""

    dataset: str
    shard: int
    rows: int  # rows in the committed shard
    rows_generated: int  # of those, generated in this run (the rest came from the journal)
    rejects: int
    prompt_tokens: int  # of the rows generated in this run
    completion_tokens: int
    elapsed_s: float  # from the shard's first record to its commit
    tokens_per_s: float  # completion tokens/s of this run's rows in this shard
    retries: int  # client retries since the previous progress record
    shards_committed: int  # in the output, this dataset
    shards_total: int | None  # None until the input size is known
    dataset_rows_done: int  # rows + rejects committed for this dataset
    dataset_rows_total: int | None  # an estimate until the input was read to the end
    eta_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DatasetResult:
    """What a run did for one dataset."""

    dataset: str
    out_dir: str
    shard_size: int
    concurrency: int
    shards_total: int | None = None
    shards_committed: int = 0  # in the output after this run
    shards_committed_now: int = 0
    shards_skipped: int = 0  # already committed before this run
    rows_generated: int = 0  # journaled by this run from a server answer
    rows_resumed: int = 0  # found in an open shard's journal and not regenerated
    rejects: int = 0  # journaled by this run
    requests: int = 0  # HTTP requests, retries included
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    complete: bool = False
    recovered: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fingerprint_server(info: Mapping[str, Any] | None) -> str:
    """A short stable hash of a server's launch (its /server_info without run-time state)."""
    if not info:
        return "unknown"
    volatile = {"internal_states", "status", "last_gen_throughput", "pid"}
    stable = {k: v for k, v in info.items() if k not in volatile and isinstance(v, str | int | float | bool)}
    return hashlib.sha256(orjson.dumps(stable, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def _estimate_records(path: Path) -> int | None:
    """Records in the input, cheaply (for the ETA only): Parquet metadata or JSONL newlines."""
    try:
        if path.name.lower().endswith(".parquet"):
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        n, last = 0, b"\n"
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        return n + (0 if last == b"\n" else 1)
    except (OSError, ValueError):
        return None


class _OpenShard:
    """Counters of a shard being filled; its rows live only in the journal."""

    __slots__ = ("index", "journal", "done_ids", "done_pos", "accounted", "expected", "generated",
                 "resumed", "rejects", "prompt_tokens", "completion_tokens", "started", "committing")

    def __init__(self, index: int, journal: Journal, done_ids: set[str], done_pos: set[int]) -> None:
        self.index = index
        self.journal = journal
        self.done_ids = done_ids
        self.done_pos = done_pos
        self.accounted = 0
        self.expected: int | None = None
        self.generated = 0
        self.resumed = 0
        self.rejects = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.started = time.monotonic()
        self.committing = False


@dataclass
class _Item:
    shard: _OpenShard
    pos: int
    row: Any  # tasks.prompts.InputRow
    prompt: str
    think_in_prompt: bool


class _Driver:
    def __init__(
        self,
        spec: DatasetSpec,
        out: OutputDir,
        client: GenerateClient,
        *,
        shard_size: int,
        concurrency: int,
        sampling: Mapping[str, Any],
        reasoning_parser: str | None,
        template: Any,
        model_name: str,
        server_fingerprint: str,
        on_shard_committed: Callable[[ShardRecord], Any] | None,
        progress: Callable[[ShardProgress], Any] | None,
        result: DatasetResult,
    ) -> None:
        self.spec = spec
        self.out = out
        self.client = client
        self.shard_size = shard_size
        self.concurrency = concurrency
        self.sampling = dict(sampling)
        self.sampling_json = orjson.dumps(self.sampling, option=orjson.OPT_SORT_KEYS).decode()
        self.parser = reasoning_parser
        self.template = template
        self.model_name = model_name
        self.server_fingerprint = server_fingerprint
        self.on_shard_committed = on_shard_committed
        self.progress = progress
        self.result = result
        self.shards: dict[int, _OpenShard] = {}
        self.committed: set[int] = set()
        self.total_estimate: int | None = None
        self.total_rows: int | None = None
        self.rows_committed = 0
        self.rows_before = sum(r.rows + r.rejects for r in out.committed_shards(spec.name))
        self.retries_reported = 0
        self.started = time.monotonic()
        # One committer thread: manifest updates are serialised and ordered.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datagen-commit")
        self.commit_futures: list[asyncio.Future[Any]] = []

    # -- shards ------------------------------------------------------------------------------------

    def _open(self, index: int) -> _OpenShard:
        shard = self.shards.get(index)
        if shard is None:
            path = self.out.journal_path(self.spec.name, index)
            contents = Journal.read(path)
            shard = _OpenShard(index, Journal(path), set(contents.rows), contents.positions)
            self.shards[index] = shard
        return shard

    def _account(self, shard: _OpenShard, tg: asyncio.TaskGroup) -> None:
        shard.accounted += 1
        self._maybe_commit(shard, tg)

    def _maybe_commit(self, shard: _OpenShard, tg: asyncio.TaskGroup) -> None:
        if shard.committing or shard.expected is None or shard.accounted < shard.expected:
            return
        shard.committing = True
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self._commit_sync, shard)
        self.commit_futures.append(fut)
        tg.create_task(self._after_commit(shard, fut))

    def _commit_sync(self, shard: _OpenShard) -> ShardRecord:
        shard.journal.close()
        contents = Journal.read(shard.journal.path)
        lo, hi = shard.index * self.shard_size, (shard.index + 1) * self.shard_size
        rows = sorted((r for r in contents.rows.values() if lo <= int(r.get("_pos", lo)) < hi),
                      key=lambda r: int(r.get("_pos", 0)))
        rows = [self._with_current_split(r) for r in rows]
        rejects = [_public_reject(r) for _, r in sorted(contents.rejects.items()) if lo <= _ < hi]
        if len(rows) + len(rejects) != shard.expected:
            raise RuntimeError(
                f"shard {shard.index} of {self.spec.name}: journal holds {len(rows)} rows + "
                f"{len(rejects)} rejects, expected {shard.expected} (journal {shard.journal.path})"
            )
        record = self.out.commit_shard(self.spec.name, shard.index, rows, rejects)
        if self.on_shard_committed is not None:
            self.on_shard_committed(record)
        return record

    async def _after_commit(self, shard: _OpenShard, fut: asyncio.Future[ShardRecord]) -> None:
        record = await fut
        self.shards.pop(shard.index, None)
        self.committed.add(shard.index)
        self.result.shards_committed_now += 1
        self.rows_committed += record.rows + record.rejects
        if self.progress is not None:
            self.progress(self._progress(shard, record))

    def _progress(self, shard: _OpenShard, record: ShardRecord) -> ShardProgress:
        elapsed = max(1e-9, time.monotonic() - shard.started)
        retries = self.client.stats.retries - self.retries_reported
        self.retries_reported = self.client.stats.retries
        total = self.total_rows if self.total_rows is not None else self.total_estimate
        done = self.rows_before + self.rows_committed
        run_elapsed = time.monotonic() - self.started
        eta = None
        if total is not None and self.rows_committed > 0:
            eta = max(0.0, (total - done) * run_elapsed / self.rows_committed)
        shards_total = None if total is None or self.total_rows is None else -(-total // self.shard_size)
        return ShardProgress(
            dataset=self.spec.name, shard=shard.index, rows=record.rows, rows_generated=shard.generated,
            rejects=record.rejects, prompt_tokens=shard.prompt_tokens,
            completion_tokens=shard.completion_tokens, elapsed_s=elapsed,
            tokens_per_s=shard.completion_tokens / elapsed, retries=retries,
            shards_committed=len(self.committed), shards_total=shards_total,
            dataset_rows_done=done, dataset_rows_total=total, eta_s=eta,
        )

    # -- the run -----------------------------------------------------------------------------------

    async def run(self, input_iter: Iterable[Any]) -> None:
        queue: asyncio.Queue[_Item | None] = asyncio.Queue(maxsize=self.concurrency)
        try:
            async with asyncio.TaskGroup() as tg:
                workers = [tg.create_task(self._worker(queue, tg)) for _ in range(self.concurrency)]
                await self._read(input_iter, queue, tg)
                for _ in workers:
                    await queue.put(None)
        finally:
            for shard in self.shards.values():
                shard.journal.close()
            # A commit thread cannot be interrupted: let it finish before the lock is released.
            self.executor.shutdown(wait=True)

    async def _read(self, input_iter: Iterable[Any], queue: asyncio.Queue[_Item | None],
                    tg: asyncio.TaskGroup) -> None:
        from tasks.prompts import Reject, render_row

        size = self.shard_size
        pos = -1
        for pos, item in enumerate(input_iter):
            index = pos // size
            if pos % 256 == 255:
                await asyncio.sleep(0)  # let workers and commits run while parsing a long skipped run
            if index not in self.committed:
                shard = self._open(index)
                if isinstance(item, Reject):
                    if pos in shard.done_pos:
                        self._account(shard, tg)
                    else:
                        self._journal_reject(shard, pos, item.line, item.reason, item.raw)
                        self._account(shard, tg)
                elif item.id in shard.done_ids or pos in shard.done_pos:
                    shard.resumed += 1
                    self.result.rows_resumed += 1
                    self._account(shard, tg)
                else:
                    try:
                        prompt = render_row(item, self.template, **self.spec.template_kwargs) if (
                            item.prompt is None and self.template is not None) else item.prompt
                    except ValueError as exc:  # TemplateError
                        prompt = None
                        reason = f"chat template failed: {exc}"
                    else:
                        reason = "no prompt and no chat template (model dir unknown)"
                    if prompt is None:
                        self._journal_reject(shard, pos, item.line, reason, "", row_id=item.id)
                        self._account(shard, tg)
                    else:
                        await queue.put(_Item(shard, pos, item, prompt, self._opens_think(prompt)))
            if pos % size == size - 1:
                self._close_slice(index, size, tg)
        total = pos + 1
        self.total_rows = total
        if total % size:
            self._close_slice(total // size, total % size, tg)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.out.set_dataset_totals, self.spec.name, total)
        self.result.shards_total = -(-total // size)

    def _close_slice(self, index: int, expected: int, tg: asyncio.TaskGroup) -> None:
        if index in self.committed:
            return
        shard = self._open(index)
        shard.expected = expected
        self._maybe_commit(shard, tg)

    def _with_current_split(self, row: dict[str, Any]) -> dict[str, Any]:
        """A journal row split with another parser (a rerun with a fixed ``--reasoning-parser``)
        split again from its raw text, as `datagen resplit` does for committed shards: the raw text
        does not depend on the parser, so the row need not be generated again."""
        if row.get("reasoning_parser") == self.parser:
            return row
        think_in_prompt = self._opens_think(str(row["prompt"]))
        reasoning, content = self._split(str(row["raw"]), think_in_prompt)
        return {**row, "reasoning": reasoning, "content": content, "reasoning_parser": self.parser,
                "think_in_prompt": think_in_prompt}

    def _opens_think(self, prompt: str) -> bool:
        if not self.parser:
            return False
        from tasks.prompts import opens_think

        return opens_think(prompt, self.parser)

    def _journal_reject(self, shard: _OpenShard, pos: int, line: int, reason: str, raw: str,
                        row_id: str | None = None, status: int | None = None) -> None:
        rec: dict[str, Any] = {"_reject": True, "_pos": pos, "dataset": self.spec.name, "line": line,
                               "reason": reason, "raw": raw}
        if row_id is not None:
            rec["id"] = row_id
        if status is not None:
            rec["status"] = status
        shard.journal.append(rec)
        shard.rejects += 1
        self.result.rejects += 1

    async def _worker(self, queue: asyncio.Queue[_Item | None], tg: asyncio.TaskGroup) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            shard = item.shard
            try:
                res = await self.client.generate(item.prompt, self.sampling, rid=item.row.id)
            except PromptTooLong as exc:
                self._journal_reject(shard, item.pos, item.row.line, f"prompt too long: {exc.message}",
                                     "", row_id=item.row.id, status=exc.status)
                self._account(shard, tg)
                continue
            reasoning, content = self._split(res.text, item.think_in_prompt)
            shard.journal.append({
                "id": item.row.id,
                "dataset": self.spec.name,
                "messages": item.row.messages,
                "prompt": item.prompt,
                "raw": res.text,
                "reasoning": reasoning,
                "content": content,
                "finish_reason": res.finish_reason,
                "prompt_tokens": res.prompt_tokens,
                "completion_tokens": res.completion_tokens,
                "model": self.model_name,
                "sampling": self.sampling_json,
                "server": self.server_fingerprint,
                "reasoning_parser": self.parser,
                "think_in_prompt": item.think_in_prompt,
                "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"),
                "latency_s": res.latency_s,
                "_pos": item.pos,
                "_attempts": res.attempts,
            })
            shard.generated += 1
            shard.prompt_tokens += res.prompt_tokens
            shard.completion_tokens += res.completion_tokens
            self.result.rows_generated += 1
            self.result.prompt_tokens += res.prompt_tokens
            self.result.completion_tokens += res.completion_tokens
            self._account(shard, tg)

    def _split(self, text: str, think_in_prompt: bool) -> tuple[str | None, str]:
        if not self.parser:
            return None, text
        from tasks.reasoning import split_reasoning

        # None keeps the parser's own default (deepseek-r1 is always forced); True forces it.
        return split_reasoning(text, self.parser, force_reasoning=True if think_in_prompt else None)


def _public_reject(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if not k.startswith("_")}


def _first_error(exc: BaseException) -> BaseException:
    """The error that stopped a TaskGroup (its first non-cancellation exception)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        if not inner:
            return exc
        exc = inner[0]
    return exc


async def run_dataset_async(
    spec: DatasetSpec,
    out_dir: str | Path,
    server_url: str,
    *,
    model_dir: str | Path | None,
    shard_size: int,
    concurrency: int | None = None,
    sampling: Mapping[str, Any] | None = None,
    reasoning_parser: str | None = _AUTO,
    server_fingerprint: str | None = None,
    model_name: str | None = None,
    on_shard_committed: Callable[[ShardRecord], Any] | None = None,
    progress: Callable[[ShardProgress], Any] | None = None,
    api_key: str | None = None,
    client_config: ClientConfig | None = None,
    run_info: Mapping[str, Any] | None = None,
    server_alive: Callable[[], bool] | None = None,
) -> DatasetResult:
    """The async form of :func:`run_dataset` (same arguments, same errors)."""
    from tasks.prompts import ChatTemplate, input_fingerprint, iter_dataset

    spec = DatasetSpec(spec.name, Path(spec.path), spec.template_kwargs)
    out = OutputDir(out_dir)
    if reasoning_parser == _AUTO:
        from tasks.reasoning import parser_for_model

        reasoning_parser = parser_for_model(model_dir) if model_dir is not None else None
    if reasoning_parser is not None:
        from tasks.reasoning import tags_for

        tags_for(reasoning_parser)  # ValueError naming the valid parsers, before any request
    template = ChatTemplate.from_model_dir(model_dir) if model_dir is not None else None
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    with out.ensure_locked(_lock_info(run_info)):
        fingerprint = await loop.run_in_executor(None, input_fingerprint, spec.path)
        out.open_dataset(spec.name, input_path=str(spec.path.resolve()), input_fingerprint=fingerprint,
                         shard_size=shard_size)
        recovered = out.recover(spec.name)
        cfg = client_config or ClientConfig()
        async with GenerateClient(server_url, cfg) as probe:
            info = await probe.server_info() if (concurrency is None or server_fingerprint is None
                                                  or model_name is None) else None
        conc = concurrency or default_concurrency(info)
        cfg = ClientConfig(**{**asdict(cfg), "concurrency": conc,
                              "api_key": api_key if api_key is not None else cfg.api_key})
        result = DatasetResult(spec.name, str(out.path), shard_size, conc, recovered=recovered)
        result.shards_skipped = len(out.committed_indices(spec.name))
        if model_name is None:
            model_name = str((info or {}).get("served_model_name") or (info or {}).get("model_path")
                             or (Path(model_dir).name if model_dir else "unknown"))
        async with GenerateClient(server_url, cfg, server_alive=server_alive) as client:
            driver = _Driver(
                spec, out, client, shard_size=shard_size, concurrency=conc,
                sampling=sampling if sampling is not None else DEFAULT_SAMPLING,
                reasoning_parser=reasoning_parser, template=template, model_name=model_name,
                server_fingerprint=server_fingerprint or fingerprint_server(info),
                on_shard_committed=on_shard_committed, progress=progress, result=result,
            )
            driver.committed = out.committed_indices(spec.name)
            driver.total_estimate = _estimate_records(spec.path)
            try:
                await driver.run(iter_dataset(spec.path, spec.name))
            except BaseExceptionGroup as group:
                err = _first_error(group)
                _finish(result, client, out, spec.name, started)
                if isinstance(err, ServerGone):
                    raise ServerGone(
                        f"{err} ({result.rows_generated} rows generated by this run are safe in the "
                        f"journal/shards of {out.path}; rerun to resume)",
                        last_error=err.last_error, rows_done=result.rows_generated, result=result,
                    ) from err
                raise err from None
            finally:
                _finish(result, client, out, spec.name, started)
    return result


def _lock_info(run_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The lock body's extra fields; the Prefect flow run id when running inside one."""
    info = dict(run_info or {})
    if info.get("flow_run") is None and "prefect" in sys.modules:
        try:
            from prefect.runtime import flow_run

            info["flow_run"] = flow_run.get_id()
        except Exception:  # outside a flow run, or an older Prefect: the body just lacks it
            info.pop("flow_run", None)
    return info


def _finish(result: DatasetResult, client: GenerateClient, out: OutputDir, dataset: str,
            started: float) -> None:
    result.requests = client.stats.requests
    result.retries = client.stats.retries
    result.elapsed_s = time.monotonic() - started
    manifest = out.read_manifest() or {"datasets": {}}
    entry = manifest["datasets"].get(dataset) or {}
    result.shards_committed = len(entry.get("shards", {}))
    result.complete = bool(entry.get("complete"))
    if result.complete:
        with contextlib.suppress(OSError):  # an empty journal folder is noise in a finished output
            out.journal_path(dataset, 0).parent.rmdir()
    if entry.get("num_shards") is not None:
        result.shards_total = int(entry["num_shards"])


def run_dataset(spec: DatasetSpec, out_dir: str | Path, server_url: str, **kwargs: Any) -> DatasetResult:
    """Generate one dataset into ``out_dir`` against ``server_url``, resuming whatever is done.

    Keyword arguments: ``model_dir`` (chat template; None: only pre-rendered prompts), ``shard_size``,
    ``concurrency`` (None: 2x the server's max_running_requests, else 128), ``sampling``
    (sampling_params; default max_new_tokens 4096), ``reasoning_parser`` ("auto": inferred from
    model_dir; None: no split), ``server_fingerprint``, ``model_name`` (None: from /server_info),
    ``on_shard_committed(ShardRecord)``, ``progress(ShardProgress)``, ``api_key``, ``client_config``
    (timeouts/retries/transport), ``run_info`` (lock body: flow_run...), ``server_alive`` (liveness of
    the server process, e.g. ``ServerHandle.is_alive``: consulted on connection errors, so that a dead
    server raises ``ServerGone`` at once instead of after every retry; see tasks.client).

    Raises ``ServerGone`` (with ``rows_done``/``result``), ``RequestRejected``, ``InputChanged``,
    ``OutputLocked``, ``tasks.prompts.TemplateError`` (template does not load), ``OSError`` (input
    unreadable), and anything ``on_shard_committed`` raises. Callable from a thread that runs an
    event loop (it then runs the loop in a helper thread).
    """
    coro = run_dataset_async(spec, out_dir, server_url, **kwargs)
    if not _loop_running():
        # Outside the except clause of the loop probe: an error of the run must not carry the
        # probe's "no running event loop" as its context.
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="datagen-inference")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


def _loop_running() -> bool:
    """Whether this thread runs an event loop (``asyncio.run`` cannot be nested in it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _dataset_name(path: Path) -> str:
    stem = path.name.split(".")[0] or "dataset"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip("._-") or "dataset"
    return name[:128]


def run_inputs(
    inputs: Iterable[str | Path],
    out_dir: str | Path,
    server_url: str,
    *,
    model_dir: str | Path | None = None,
    shard_size: int = 1000,
    concurrency: int | None = None,
    sampling: Mapping[str, Any] | None = None,
    reasoning_parser: str | None = _AUTO,
    api_key: str | None = None,
    progress: Callable[[ShardProgress], Any] | None = None,
    on_shard_committed: Callable[[ShardRecord], Any] | None = None,
    run_info: Mapping[str, Any] | None = None,
    client_config: ClientConfig | None = None,
) -> list[DatasetResult]:
    """``datagen run --input PATH... --server-url URL``: ad-hoc datasets against a running server.

    Each input becomes a dataset named after its file stem. ``model_dir`` None: the server's
    ``/model_info`` model_path when that directory exists here (for the chat template and parser).
    The output lock is held across all inputs. Raises what :func:`run_dataset` raises, and
    ``ValueError`` when two inputs map to the same dataset name.
    """
    paths = [Path(p) for p in inputs]
    names = [_dataset_name(p) for p in paths]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"inputs map to the same dataset name(s) {sorted(dupes)}; rename the files")
    if model_dir is None:
        model_dir = _model_dir_from_server(server_url, api_key)
    out = OutputDir(out_dir)
    results = []
    with out.ensure_locked(_lock_info(run_info)):
        for name, path in zip(names, paths, strict=True):
            results.append(run_dataset(
                DatasetSpec(name, path), out_dir, server_url, model_dir=model_dir, shard_size=shard_size,
                concurrency=concurrency, sampling=sampling, reasoning_parser=reasoning_parser,
                api_key=api_key, progress=progress, on_shard_committed=on_shard_committed,
                client_config=client_config,
            ))
    return results


def _model_dir_from_server(server_url: str, api_key: str | None) -> Path | None:
    async def probe() -> dict[str, Any] | None:
        async with GenerateClient(server_url, ClientConfig(concurrency=1, api_key=api_key,
                                                           request_timeout_s=30)) as c:
            return await c.get_json("/model_info") or await c.get_json("/get_model_info")

    info = asyncio.run(probe())
    path = (info or {}).get("model_path")
    if isinstance(path, str) and Path(path).is_dir():
        return Path(path)
    return None
