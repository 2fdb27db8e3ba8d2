"""The async worker pool of tasks.inference: stream the input, generate, journal, commit shards.

``InferencePool.run(input_iter)`` reads the input once (in chunks, by a reader thread) and feeds ``concurrency``
worker tasks through a bounded queue, so only in-flight items, one reordering window (rows sent in
``tasks.inference._order.SendQueue``, for the server's prefix cache) and per-open-shard counters
live in memory. A work item is one sample of one input record; ``samples`` items per record, all in
the record's shard. A shard whose slice is fully accounted for (each ``(record, sample)`` generated or
resumed, or rejected) is committed by one committer thread, in the order shards complete: a
straggler holds back only its own shard, and the workers never wait for a commit, which keeps the
server's batch full. With ``regenerate="all"`` an item is a whole conversation: each finished turn
but the last is journaled as it arrives, so a resumed run continues from the last finished turn.

Errors propagate out of ``run`` as the TaskGroup's ``BaseExceptionGroup``: ``ServerGone`` and
``RequestRejected`` from the client, ``OSError`` from the journal or the commit, ``RuntimeError``
when a shard's journal does not hold its slice, and whatever ``on_shard_committed``, ``progress``
or the canary's callback raise. ``run`` always closes the journals and waits for a running commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tasks.inference._budget import TruncationPolicy, capped_sampling
from tasks.inference._client import GenerateResult, PromptTooLong, cached_tokens
from tasks.inference._dispatch import Dispatcher
from tasks.inference._ledger import Mode
from tasks.inference._order import Gate, SendQueue
from tasks.inference._provenance import Provenance
from tasks.inference._records import DatasetResult, DatasetSpec, ShardProgress
from tasks.inference._rows import RowBuilder, conversation_slots, public_reject, request_id
from tasks.prompts import Reject
from tasks.reasoning import request_sampling
from tasks.shards import Journal, JournalContents, OutputDir, ShardRecord, reject_units, rows_to_table

__all__ = ["InferencePool"]

READ_CHUNK = 64  # input records the reader thread reads per hand-over


class _OpenShard:
    """Counters of a shard being filled; its rows live only in the journal. Units are
    ``(record, sample)`` pairs."""

    __slots__ = ("index", "journal", "done_keys", "done_units", "whole_rejects", "turns", "accounted",
                 "expected", "generated", "resumed", "rejects", "prompt_tokens", "completion_tokens",
                 "started", "committing", "latencies")

    def __init__(self, index: int, journal: Journal, contents: Any) -> None:
        self.index = index
        self.journal = journal
        self.done_keys: set[tuple[str, int]] = set(contents.rows)
        self.done_units: set[tuple[int, int]] = contents.units
        self.whole_rejects: set[int] = contents.whole_rejects
        self.turns: dict[tuple[str, int], dict[int, dict[str, Any]]] = contents.turns
        self.accounted = 0
        self.expected: int | None = None
        self.generated = 0
        self.resumed = 0
        self.rejects = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.started = time.monotonic()
        self.committing = False
        self.latencies: list[float] = []  # of the rows generated in this run (the ETA's distribution)


@dataclass
class _Item:
    shard: _OpenShard
    pos: int
    row: Any  # tasks.prompts.InputRow
    sample: int
    prompt: str  # the prompt of the (first) turn
    think_in_prompt: bool
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)  # journaled turns (regenerate="all")
    gate: Gate | None = None  # set on a prefix group's leader: its answer releases the group's siblings


class InferencePool:
    """One dataset's run over an open client: see the module docstring."""

    def __init__(
        self,
        spec: DatasetSpec,
        out: OutputDir,
        client: Dispatcher,
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
        provenance: Provenance,
        canary: tuple[int, Callable[[list[dict[str, Any]]], Any]] | None = None,
        truncation: TruncationPolicy | None = None,
        order_window: int = 1,
        samples: int = 1,
        regenerate: str = "last",
    ) -> None:
        self.spec = spec
        self.out = out
        self.client = client
        self.shard_size = shard_size
        self.concurrency = concurrency
        self.sampling = dict(sampling)  # as configured: the rows' `sampling` column
        self.request_sampling = request_sampling(self.sampling, reasoning_parser)  # what is sent
        self.truncation = truncation or TruncationPolicy()
        self.samples = samples
        self.regenerate = regenerate
        self.rows = RowBuilder(
            dataset=spec.name, parser=reasoning_parser, model_name=model_name,
            sampling_json=RowBuilder.sampling_text(self.sampling), server_fingerprint=server_fingerprint,
            template=template, template_kwargs=spec.template_kwargs, truncation_json=self.truncation.to_json(),
            provenance=provenance, base_seed=int(self.sampling.get("sampling_seed", 0)),
        )
        # Rows to generate are sent in windows of this many, in ``prefix_order`` (1: input order).
        self.order_window = max(1, order_window)
        self.window: list[_Item] = []
        self.on_shard_committed = on_shard_committed
        self.progress = progress
        self.result = result
        # unique per run: rids of two runs of the same ids on one shared server never collide
        self.run_tag = secrets.token_hex(4)
        self.canary_size = canary[0] if canary is not None else 0
        self.on_canary: Callable[[list[dict[str, Any]]], Any] | None = canary[1] if canary is not None else None
        self.canary: list[dict[str, Any]] = []
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
        # Held from a shard's commit to the end of its gate: no shard commits past a gate that fails.
        self.commit_turn = asyncio.Lock()
        self.commits_halted = False  # a commit or its gate failed: no later shard commits
        # rows handed to the send queue and taken from it by a worker, and whether the input is read
        self.rows_sent = self.rows_taken = 0
        self.input_read = False

    # -- shards ------------------------------------------------------------------------------------

    def _open(self, index: int) -> _OpenShard:
        shard = self.shards.get(index)
        if shard is None:
            shard = _OpenShard(index, self.out.journal(self.spec.name, index),
                               self.out.read_journal(self.spec.name, index))
            self.shards[index] = shard
        return shard

    def _account(self, shard: _OpenShard, tg: asyncio.TaskGroup, units: int = 1) -> None:
        shard.accounted += units
        self._maybe_commit(shard, tg)

    def _maybe_commit(self, shard: _OpenShard, tg: asyncio.TaskGroup) -> None:
        if shard.committing or shard.expected is None or shard.accounted < shard.expected:
            return
        shard.committing = True
        tg.create_task(self._commit(shard))

    def _commit_sync(self, shard: _OpenShard) -> ShardRecord:
        shard.journal.close()
        # The journal's rows as one Arrow table, built once: read without the per-row storability
        # check, and again with it only when the build fails (a line an older run left that the
        # schema cannot hold: the checked read skips it, and a later good copy of its row counts).
        contents = shard.journal.contents(check_rows=False)
        lo, hi = shard.index * self.shard_size, (shard.index + 1) * self.shard_size
        try:
            rows = self._shard_rows(contents, lo, hi)
            table = rows_to_table(rows)
        except (KeyError, TypeError, ValueError, pa.ArrowException):
            contents = shard.journal.contents()
            rows = self._shard_rows(contents, lo, hi)
            table = rows_to_table(rows)
        rejects = [public_reject(r) for (p, _), r in sorted(contents.rejects.items()) if lo <= p < hi]
        units = len(rows) + reject_units(rejects, self.samples)
        if units != shard.expected:
            raise RuntimeError(
                f"shard {shard.index} of {self.spec.name}: journal holds {len(rows)} rows + "
                f"{len(rejects)} rejects ({units} of {shard.expected} record samples) "
                f"(journal {shard.journal.path})"
            )
        return self.out.commit_shard(self.spec.name, shard.index, table, rejects, samples=self.samples)

    def _shard_rows(self, contents: JournalContents, lo: int, hi: int) -> list[dict[str, Any]]:
        """The journal's rows of positions ``lo`` to ``hi``, in input order, in their stored form."""
        rows = sorted((r for r in contents.rows.values() if lo <= int(r.get("_pos", lo)) < hi),
                      key=lambda r: (int(r.get("_pos", 0)), int(r.get("sample", 0))))
        return [self.rows.with_current_split(RowBuilder.with_budget(r)) for r in rows]

    async def _commit(self, shard: _OpenShard) -> None:
        """Commit ``shard``, report it, then run the gate (``on_shard_committed``), one shard at a
        time in the order they filled (asyncio's lock is first come, first served): rows go on being
        generated and journaled meanwhile, but the next shard commits only after this one's gate
        passed, so a gate that stops the run leaves no shard committed after the one it judged."""
        async with self.commit_turn:
            # The turn is handed to the next waiter as a failing gate's error leaves it, before the
            # TaskGroup cancels that waiter; a commit already in the committer thread would then finish
            # regardless. So a turn that ended in an error stops every later commit here.
            if self.commits_halted:
                return
            try:
                record = await asyncio.get_running_loop().run_in_executor(self.executor, self._commit_sync, shard)
                await self._after_commit(shard, record)
            except BaseException:
                self.commits_halted = True
                raise

    async def _after_commit(self, shard: _OpenShard, record: ShardRecord) -> None:
        self.shards.pop(shard.index, None)
        self.committed.add(shard.index)
        self.result.shards_committed_now += 1
        self.rows_committed += record.rows + record.rejects
        if self.progress is not None:
            self.progress(self._progress(shard, record))
        if self.on_shard_committed is not None:
            # After the progress report: a shard the gate stops on is committed, and counted.
            await asyncio.get_running_loop().run_in_executor(self.executor, self.on_shard_committed, record)

    def _progress(self, shard: _OpenShard, record: ShardRecord) -> ShardProgress:
        elapsed = max(1e-9, time.monotonic() - shard.started)
        retries = self.client.stats.retries - self.retries_reported
        self.retries_reported = self.client.stats.retries
        records = self.total_rows if self.total_rows is not None else self.total_estimate
        total = None if records is None else records * self.samples  # rows and rejects count per sample
        done = self.rows_before + self.rows_committed
        run_elapsed = time.monotonic() - self.started
        eta = None
        if total is not None and self.rows_committed > 0:
            eta = max(0.0, (total - done) * run_elapsed / self.rows_committed)
        shards_total = None if records is None or self.total_rows is None else -(-records // self.shard_size)
        return ShardProgress(
            dataset=self.spec.name, shard=shard.index, rows=record.rows, rows_generated=shard.generated,
            rejects=record.rejects, prompt_tokens=shard.prompt_tokens,
            completion_tokens=shard.completion_tokens, elapsed_s=elapsed,
            tokens_per_s=shard.completion_tokens / elapsed, retries=retries,
            shards_committed=len(self.committed), shards_total=shards_total,
            dataset_rows_done=done, dataset_rows_total=total, eta_s=eta,
            latencies_s=tuple(shard.latencies), in_flight=self.concurrency,
        )

    def _close_slice(self, index: int, expected: int, tg: asyncio.TaskGroup) -> None:
        if index in self.committed:
            return
        shard = self._open(index)
        shard.expected = expected * self.samples
        self._maybe_commit(shard, tg)

    def _journal_reject(self, shard: _OpenShard, pos: int, line: int, reason: str, raw: str,
                        row_id: str | None = None, status: int | None = None, sample: int | None = None) -> None:
        shard.journal.append(self.rows.reject(pos, line, reason, raw, row_id=row_id, status=status, sample=sample))
        shard.rejects += 1
        self.result.rejects += 1

    # -- the run -----------------------------------------------------------------------------------

    async def run(self, input_iter: Iterable[Any]) -> None:
        """Generate every record of ``input_iter`` not yet committed or journaled; see the module
        docstring for what it raises."""
        # input order: a bounded FIFO; prefix order: room for a whole window, so the workers can take
        # rows behind a held group's siblings
        queue = SendQueue(self.concurrency if self.order_window == 1 else self.order_window + self.concurrency)
        try:
            async with asyncio.TaskGroup() as tg:
                workers = [tg.create_task(self._worker(queue, tg)) for _ in range(self.concurrency)]
                await self._read(input_iter, queue, tg)
                for _ in workers:
                    await queue.put(None)
        finally:
            # A commit thread cannot be interrupted: let it finish before the lock is released, and
            # before the journals are closed here (a commit closes its shard's journal itself).
            self.executor.shutdown(wait=True)
            for shard in self.shards.values():
                shard.journal.close()

    async def _rows(self, input_iter: Iterable[Any]) -> AsyncIterator[tuple[int, Any]]:
        """``(position, item)`` of the input, read in chunks by a thread of its own: a slow input (a
        stalled file system, a long skipped run to parse) stalls the reading only, while answers
        keep arriving and shards keep committing (and the ledger sees the server idle)."""
        it = iter(input_iter)
        loop = asyncio.get_running_loop()
        reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datagen-read")
        pos = 0
        try:
            while chunk := await loop.run_in_executor(reader, lambda: list(itertools.islice(it, READ_CHUNK))):
                for item in chunk:
                    yield pos, item
                    pos += 1
        finally:
            reader.shutdown(wait=True)

    async def _read(self, input_iter: Iterable[Any], queue: SendQueue,
                    tg: asyncio.TaskGroup) -> None:
        size = self.shard_size
        pos = -1
        async for pos, item in self._rows(input_iter):
            index = pos // size
            if pos % 256 == 255:
                await asyncio.sleep(0)  # let workers and commits run while parsing a long skipped run
            if index not in self.committed:
                shard = self._open(index)
                if isinstance(item, Reject):
                    if pos not in shard.whole_rejects:
                        self._journal_reject(shard, pos, item.line, item.reason, item.raw)
                    self._account(shard, tg, self.samples)
                else:
                    await self._feed(shard, pos, item, queue, tg)
            if pos % size == size - 1:
                self._close_slice(index, size, tg)
        await self._flush(queue)
        self.input_read = True
        self._maybe_drain()
        total = pos + 1
        self.total_rows = total
        if total % size:
            self._close_slice(total // size, total % size, tg)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.out.set_dataset_totals, self.spec.name, total)
        self.result.shards_total = -(-total // size)

    def _maybe_drain(self) -> None:
        """Once the input is read and every row of it taken by a worker, the servers' empty slots
        are the dataset's straggler tail: their ledgers count them as drain."""
        if self.input_read and self.rows_taken == self.rows_sent:
            self.client.pool.set_mode(Mode.DRAIN)

    async def _send(self, item: _Item, queue: SendQueue) -> None:
        """Queue ``item`` for the workers, through the reordering window when there is one."""
        self.rows_sent += 1
        if self.order_window == 1:
            await queue.put(item)
            return
        self.window.append(item)
        if len(self.window) >= self.order_window:
            await self._flush(queue)

    async def _flush(self, queue: SendQueue) -> None:
        """Queue the window's rows in cache-aware order. Which shard a row belongs to is its input
        position's, and the shard stores its rows by position: only the send order changes."""
        window, self.window = self.window, []
        if window:
            await queue.put_window(window, [it.prompt for it in window])

    async def _feed(self, shard: _OpenShard, pos: int, item: Any, queue: SendQueue,
                    tg: asyncio.TaskGroup) -> None:
        """Queue the samples of input row ``item`` that its shard's journal does not account for."""
        todo = [k for k in range(self.samples) if pos not in shard.whole_rejects
                and (item.id, k) not in shard.done_keys and (pos, k) not in shard.done_units]
        resumed = self.samples - len(todo)
        shard.resumed += resumed
        self.result.rows_resumed += resumed
        if resumed:
            self._account(shard, tg, resumed)
        if not todo:
            return
        if self.regenerate == "all" and item.prompt is None:
            prompt, reason = self.rows.render(item, item.messages[:conversation_slots(item.messages)[0]])
        else:
            prompt, reason = self.rows.prompt_for(item)
        if prompt is None:
            if resumed:  # some samples are done: reject the others one by one
                for k in todo:
                    self._journal_reject(shard, pos, item.line, reason, item.raw, row_id=item.id, sample=k)
            else:
                self._journal_reject(shard, pos, item.line, reason, item.raw, row_id=item.id)
            self._account(shard, tg, len(todo))
            return
        think = self.rows.opens_think(prompt)
        for k in todo:
            await self._send(_Item(shard, pos, item, k, prompt, think, shard.turns.get((item.id, k), {})), queue)

    def _feed_canary(self, row: dict[str, Any]) -> None:
        """Collect the first generated rows; hand them over once there are ``canary_size``."""
        if len(self.canary) >= self.canary_size or self.on_canary is None:
            return
        self.canary.append(row)
        if len(self.canary) == self.canary_size:
            self.on_canary(list(self.canary))

    async def _worker(self, queue: SendQueue, tg: asyncio.TaskGroup) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            self.rows_taken += 1
            self._maybe_drain()
            shard = item.shard
            try:
                if self.regenerate == "all":
                    row = await self._conversation(item)
                else:
                    row = await self._last_turn(item)
            finally:
                if item.gate is not None:  # a prefix group's leader answered: its siblings may go
                    await queue.open(item.gate)
            if row is not None:
                shard.journal.append(row)
                shard.generated += 1
                self.result.rows_generated += 1
            self._account(shard, tg)
            if row is not None:
                self._feed_canary(row)

    def _params(self, item: _Item) -> dict[str, Any]:
        return {**self.request_sampling, "sampling_seed": self.rows.seed(item.row.id, item.sample)}

    async def _generate(self, item: _Item, prompt: str, turn: int) -> GenerateResult | None:
        """One request of ``item``; None when the prompt is too long (the sample is then rejected)."""
        try:
            res = await self.client.generate(prompt, self._params(item),
                                             rid=request_id(item.row.id, item.sample, turn, self.run_tag))
        except PromptTooLong as exc:
            at = f" at turn {turn}" if turn else ""
            self._reject_sample(item, f"prompt too long{at}: {exc.message}", exc.status)
            return None
        self._count(item, res)
        return res

    def _count(self, item: _Item, res: GenerateResult) -> None:
        """Tokens and latency of one answered request (every request: a discarded truncated answer too)."""
        shard = item.shard
        shard.prompt_tokens += res.prompt_tokens
        shard.completion_tokens += res.completion_tokens
        shard.latencies.append(res.latency_s)
        self.result.prompt_tokens += res.prompt_tokens
        self.result.cached_tokens += cached_tokens(res.meta_info)
        self.result.completion_tokens += res.completion_tokens

    def _reject_sample(self, item: _Item, reason: str, status: int | None = None) -> None:
        # One sample only unless there is one: another sample's conversation may still fit.
        sample = item.sample if self.samples > 1 else None
        self._journal_reject(item.shard, item.pos, item.row.line, reason, item.row.raw, row_id=item.row.id,
                             status=status, sample=sample)

    async def _last_turn(self, item: _Item) -> dict[str, Any] | None:
        res = await self._generate(item, item.prompt, 0)
        if res is None:
            return None
        res, regenerated = await self._regenerate_truncated(item, res)
        self.result.rows_capped += res.capped
        return self.rows.generated(item.row, item.pos, item.prompt, item.think_in_prompt, res, regenerated,
                                   sample=item.sample)

    async def _conversation(self, item: _Item) -> dict[str, Any] | None:
        """Every assistant turn of ``item``'s conversation in order, each from the model's own earlier
        turns; turns journaled by an earlier run are reused, never sent again."""
        row = item.row
        messages = [dict(m) for m in row.messages]
        slots = [len(messages)] if row.prompt is not None else conversation_slots(messages)
        earlier: list[dict[str, Any]] = []
        for t, slot in enumerate(slots):
            last = t == len(slots) - 1
            done = None if last else item.turns.get(t)
            if done is None or done.get("message_index") != slot:
                if t == 0:
                    prompt, think = item.prompt, item.think_in_prompt
                else:
                    rendered, reason = self.rows.render(row, messages[:slot])
                    if rendered is None:
                        self._reject_sample(item, f"{reason} (turn {t})")
                        return None
                    prompt, think = rendered, self.rows.opens_think(rendered)
                res = await self._generate(item, prompt, t)
                if res is None:
                    return None
                if last:
                    return self.rows.generated(row, item.pos, prompt, think, res, sample=item.sample,
                                               messages=messages, turns=earlier)
                done = self.rows.turn(row, item.pos, item.sample, t, slot, think, res)
                item.shard.journal.append(done)
            earlier.append(done)
            messages[slot] = {"role": "assistant", "content": str(done["content"])}
        raise AssertionError("unreachable: the last slot returns")

    async def _regenerate_truncated(self, item: _Item, res: GenerateResult) -> tuple[GenerateResult, int]:
        """The answer to store for a row whose first answer is ``res``, and how many times it was
        generated again with a larger budget (``truncation``) because it finished by length.

        Only the stored answer reaches the journal: a run killed during a regeneration generates
        the row again from its first budget when resumed, and stores it once.
        """
        policy = self.truncation
        done = 0
        while res.finish_reason == "length" and done < policy.retries:
            # A length finish under SGLang's default budget used all of it.
            budget = res.max_new_tokens if res.max_new_tokens is not None else res.completion_tokens
            context = await self.client.context_limit()
            nxt = policy.next_budget(budget, res.prompt_tokens, context)
            if nxt is None:
                break
            try:
                again = await self.client.generate(item.prompt, capped_sampling(self._params(item), nxt),
                                                   rid=request_id(item.row.id, item.sample, 0, self.run_tag))
            except PromptTooLong:  # the larger budget does not fit after all: keep what fits
                break
            if again.max_new_tokens is not None and again.max_new_tokens <= budget:
                self.client.discard(again)
                break  # the server capped it to no more than before: nothing to gain from it
            self._count(item, again)
            done += 1
            self.result.truncation_retries += 1
            self.client.discard(res)  # generated, and replaced: wasted GPU-time in the ledger
            res = again
        return res, done


