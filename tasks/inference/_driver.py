"""The inference driver: stream a dataset through ``/generate`` into committed Parquet shards.

``open_dataset`` runs a dataset's guards once, under the output's lock and before any server is
needed: it binds the dataset to its input fingerprint and shard size, undoes half-finished commits,
refuses sampling, samples per prompt, regeneration mode or a parser other than its rows'
(``check_resume``). ``run_dataset`` (holding the lock, opening the dataset unless given it opened)
then streams the input once: committed shards and journaled
``(id, sample)`` rows are skipped, every generation is journaled as it arrives, and a shard commits
once every sample of every record of its slice is accounted for. Memory is flat in the dataset size
(a bounded queue feeds ``concurrency`` workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tasks.inference._client import GenerateClient, ServerGone, default_concurrency
from tasks.inference._dispatch import Dispatcher, ServerPool
from tasks.inference._gc import young_generation
from tasks.inference._ledger import Mode
from tasks.inference._pool import InferencePool
from tasks.inference._provenance import (
    Provenance,
    engine_of,
    model_revision,
    new_run_id,
    next_attempt,
    template_hash,
)
from tasks.inference._records import DatasetResult, DatasetSpec, ShardProgress, estimate_records
from tasks.inference._resume import check_resume
from tasks.inference._settings import AUTO, InferenceSettings
from tasks.prompts import ChatTemplate, InputRow, input_fingerprint, iter_dataset
from tasks.reasoning import parser_for_model, tags_for
from tasks.shards import InputSlice, OutputDir, ShardRecord

__all__ = ["OpenedDataset", "canary_size", "open_dataset", "run_dataset", "run_dataset_async", "run_sync"]

T = TypeVar("T")


def input_slices(path: Path, dataset: str, shard_size: int) -> Iterator[InputSlice]:
    """The input's slices of ``shard_size`` records in order, as ``OutputDir.rebuild_dataset`` checks them.

    Raises:
        OSError: the input is unreadable.
    """
    current = InputSlice(0)
    for pos, item in enumerate(iter_dataset(path, dataset)):
        if pos // shard_size != current.index:
            yield current
            current = InputSlice(pos // shard_size)
        current.lines.append(item.line)
        if isinstance(item, InputRow):
            current.ids[item.id] = item.line
    if current.lines:
        yield current


def _first_error(exc: BaseException) -> BaseException:
    """The error that stopped a TaskGroup (its first non-cancellation exception)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        if not inner:
            return exc
        exc = inner[0]
    return exc


class OpenedDataset:
    """A dataset bound to its output and checked, before any request (:func:`open_dataset`).

    A plain object, not a dataclass: Prefect draws it as the data an inference task takes from
    the task that opened it, without reaching into its fields (the parser name is the config's).
    """

    __slots__ = ("__weakref__", "complete", "problems", "reasoning_parser", "recovered", "shards", "spec",
                 "template")

    def __init__(self, spec: DatasetSpec, reasoning_parser: str | None, template: ChatTemplate | None,
                 recovered: dict[str, int], *, complete: bool = False, shards: int = 0,
                 problems: list[str] | None = None) -> None:
        self.spec, self.reasoning_parser, self.template, self.recovered = spec, reasoning_parser, template, recovered
        self.complete = complete  # every shard committed: nothing to generate, no server needed
        self.shards = shards  # committed shards
        self.problems = problems or []  # journal lines skipped as unusable (OutputDir.journal_problems)

    def __repr__(self) -> str:
        return f"OpenedDataset({self.spec.name!r}, parser={self.reasoning_parser!r})"


def open_dataset(spec: DatasetSpec, out: OutputDir, settings: InferenceSettings, *,
                 check_intact: bool = True) -> OpenedDataset:
    """Bind ``spec`` to ``out`` and run its guards, once, before a server is needed: the reasoning
    parser and chat template load, lost manifest entries are rebuilt from the shard files proven to
    be this input's slices, the dataset is bound to its input fingerprint and shard size, half-done
    commits are undone, committed shards are checked intact (unless the caller checked the whole
    output) and the rows' sampling, samples, regeneration mode and parser must match
    (``check_resume``, recorded in the manifest). The caller holds the output's lock.

    Raises:
        ValueError: unknown reasoning parser.
        TemplateError: the model's chat template does not load.
        InputChanged, DamagedShards, UnrecordedShards, OSError: as for :func:`run_dataset`.
    """
    spec = DatasetSpec(spec.name, Path(spec.path), spec.template_kwargs)
    model_dir = settings.model_dir
    reasoning_parser = _reasoning_parser(settings)
    template = ChatTemplate.from_model_dir(model_dir) if model_dir is not None else None
    fingerprint = input_fingerprint(spec.path)
    generation = {"samples": settings.samples, "regenerate": settings.regenerate}
    rebuilt: list[int] = []
    if out.unrecorded_shards(spec.name):
        # The manifest was lost: adopt the shard files proven to be this input's slices, or refuse;
        # never let recovery delete them as uncommitted.
        rebuilt = out.rebuild_dataset(
            spec.name, input_path=str(spec.path.resolve()), input_fingerprint=fingerprint,
            shard_size=settings.shard_size, slices=input_slices(spec.path, spec.name, settings.shard_size),
            generation=generation)
    out.open_dataset(spec.name, input_path=str(spec.path.resolve()), input_fingerprint=fingerprint,
                     shard_size=settings.shard_size)
    recovered = out.recover(spec.name)
    if rebuilt:
        recovered["rebuilt_shards"] = len(rebuilt)
    if check_intact:
        out.check_intact(spec.name)
    check_resume(out, spec.name, settings.sampling, reasoning_parser, record=True, generation=generation)
    entry = (out.read_manifest() or {"datasets": {}})["datasets"].get(spec.name) or {}
    return OpenedDataset(spec, reasoning_parser, template, recovered, complete=bool(entry.get("complete")),
                         shards=len(entry.get("shards") or {}), problems=out.journal_problems(spec.name))


def _reasoning_parser(settings: InferenceSettings) -> str | None:
    """The run's reasoning parser (``AUTO``: the model's), checked to exist.

    Raises:
        ValueError: unknown parser (the message names the valid ones).
    """
    parser = settings.reasoning_parser
    if parser == AUTO:
        parser = parser_for_model(settings.model_dir) if settings.model_dir is not None else None
    if parser is not None:
        tags_for(parser)
    return parser


async def run_dataset_async(
    spec: DatasetSpec,
    out_dir: str | Path,
    servers: ServerPool,
    settings: InferenceSettings,
    *,
    opened: OpenedDataset | None = None,
    on_shard_committed: Callable[[ShardRecord], Any] | None = None,
    progress: Callable[[ShardProgress], Any] | None = None,
    on_canary: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> DatasetResult:
    """The async form of :func:`run_dataset` (same arguments, same errors)."""
    if opened is None:
        _reasoning_parser(settings)  # an unknown parser is refused before the output is created
    out = OutputDir(out_dir)
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    run_info = _lock_info(settings.run_info)
    with out.ensure_locked(run_info):
        if opened is None:
            opened = await loop.run_in_executor(None, open_dataset, spec, out, settings)
        return await _generate(opened, out, servers, settings, run_info, started, on_shard_committed=on_shard_committed,
                               progress=progress, on_canary=on_canary)


async def _generate(
    opened: OpenedDataset,
    out: OutputDir,
    servers: ServerPool,
    settings: InferenceSettings,
    run_info: Mapping[str, Any],
    started: float,
    *,
    on_shard_committed: Callable[[ShardRecord], Any] | None,
    progress: Callable[[ShardProgress], Any] | None,
    on_canary: Callable[[list[dict[str, Any]]], Any] | None,
) -> DatasetResult:
    """Stream an opened dataset through the server(s) into committed shards (the lock is held)."""
    spec, loop, model_dir = opened.spec, asyncio.get_running_loop(), settings.model_dir
    first = servers.first()
    cfg = settings.client
    cfg = dataclasses.replace(cfg, api_key=first.api_key if first.api_key is not None else cfg.api_key)
    async with GenerateClient(first.url, cfg) as probe:
        info = await probe.server_info()  # engine version, and the defaults below
    conc = settings.concurrency or default_concurrency(info)
    cfg = dataclasses.replace(cfg, concurrency=conc)
    # The workers are every server's slots (those still launching included); with prefix-aware
    # dispatch twice as many, so a freed slot can choose among waiting rows the one whose prefix its
    # server holds (the servers still never take more than their slots).
    affinity = servers.size() > 1 and settings.dispatch == "prefix"
    workers = servers.capacity(conc) * (2 if affinity else 1)
    result = DatasetResult(spec.name, str(out.path), settings.shard_size, workers, recovered=dict(opened.recovered))
    result.shards_skipped = len(out.committed_indices(spec.name))
    model_name = settings.model_name
    if model_name is None:
        model_name = str((info or {}).get("served_model_name") or (info or {}).get("model_path")
                         or (Path(model_dir).name if model_dir else "unknown"))
    provenance = await loop.run_in_executor(
        None, _provenance, out, spec.name, model_dir, opened.template, info, run_info.get("flow_run"))
    async with Dispatcher(servers, cfg, settings.concurrency, affinity=affinity) as client:
        driver = InferencePool(
            spec, out, client, shard_size=settings.shard_size, concurrency=workers,
            sampling=settings.sampling, reasoning_parser=opened.reasoning_parser, template=opened.template,
            model_name=model_name, server_fingerprint=first.fingerprint,
            on_shard_committed=on_shard_committed, progress=progress, result=result,
            canary=(canary_size(settings.canary_rows, conc), on_canary) if on_canary is not None else None,
            truncation=settings.truncation,
            provenance=provenance, order_window=settings.window_for(conc),
            samples=settings.samples, regenerate=settings.regenerate,
        )
        driver.committed = out.committed_indices(spec.name)
        driver.total_estimate = estimate_records(spec.path)
        servers.set_mode(Mode.ROWS)
        try:
            with young_generation():  # decision 114: rows in flight are not garbage
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
            servers.set_mode(Mode.BETWEEN)
            _finish(result, client, out, spec.name, started)
    return result


def _provenance(out: OutputDir, dataset: str, model_dir: str | Path | None, template: ChatTemplate | None,
                server_info: Mapping[str, Any] | None, flow_run: Any) -> Provenance:
    """The provenance of this call's rows; counts the call as the next attempt of its run (the
    Prefect flow run's, else a new local run id)."""
    run_id = str(flow_run) if flow_run else new_run_id()
    engine, version = engine_of(server_info)
    return Provenance(
        model_revision=model_revision(model_dir), engine=engine, engine_version=version,
        chat_template_hash=template_hash(template.source if template is not None else None),
        run_id=run_id, attempt=next_attempt(out, dataset, run_id),
    )


def canary_size(canary_rows: int, concurrency: int) -> int:
    """How many rows the canary judges: ``canary_rows``, at most half the concurrency (at least 1),
    so that a failing canary stops the run before the server has answered twice the concurrency,
    the requests in flight included (0: no canary)."""
    return min(canary_rows, max(1, concurrency // 2))


def _lock_info(run_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The lock body's extra fields; the Prefect flow run id when running inside one."""
    info = dict(run_info or {})
    if info.get("flow_run") is None and "prefect" in sys.modules:
        try:
            # Imported only when Prefect already is: this module must not load it (its settings
            # are read at import, and plain callers of run_dataset do not use Prefect).
            from prefect.runtime import flow_run  # noqa: PLC0415

            info["flow_run"] = flow_run.get_id()
        except Exception:  # outside a flow run, or an older Prefect: the body just lacks it
            info.pop("flow_run", None)
    return info


def _finish(result: DatasetResult, client: Dispatcher, out: OutputDir, dataset: str,
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
            out.remove_journal_dir(dataset)
    if entry.get("num_shards") is not None:
        result.shards_total = int(entry["num_shards"])


def run_dataset(
    spec: DatasetSpec,
    out_dir: str | Path,
    servers: ServerPool,
    settings: InferenceSettings,
    *,
    opened: OpenedDataset | None = None,
    on_shard_committed: Callable[[ShardRecord], Any] | None = None,
    progress: Callable[[ShardProgress], Any] | None = None,
    on_canary: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> DatasetResult:
    """Generate one dataset into ``out_dir`` through ``servers``, resuming whatever is done.

    Callable from a thread that runs an event loop (it then runs the loop in a helper thread).

    Args:
        spec: the dataset's name and input file.
        out_dir: the output directory (its lock is taken, or reused when the caller holds it).
        servers: the run's servers, each request going to whichever has a free slot (a server that
            is gone is dropped and its unfinished requests go to the others); one server is
            ``ServerPool.of(Endpoint(url, fingerprint))``. Their fingerprint is the rows'
            ``server`` column.
        settings: shard size, concurrency, sampling, reasoning parser, model, client settings.
        opened: the dataset as :func:`open_dataset` bound and checked it under the caller's lock
            (its guards then do not run again); None: opened here.
        on_shard_committed: called with each committed shard's record (e.g. the validation gate).
        progress: called with a ``ShardProgress`` after each commit.
        on_canary: called once with the first ``canary_size(settings.canary_rows, concurrency)`` rows
            this run generates (journal records), as soon as the last of them is journaled (e.g.
            ``tasks.validation.check_canary``); not called when the run generates fewer.

    Raises:
        ServerGone: no server is left and none is coming back (a server's retries exhausted or its
            process dead); ``rows_done``/``result`` set.
        RequestRejected: a non-retryable 4xx (e.g. bad sampling params or API key).
        InputChanged: the input or the shard size differs from the one the output was bound to, or
            the sampling or parser from those of the rows it holds (``check_resume``).
        DamagedShards: a committed shard's file is missing or changed (``datagen repair`` un-commits it).
        UnrecordedShards: shard files that no manifest records are not this input's slices.
        OutputLocked: another live process holds the output.
        TemplateError: the model's chat template does not load.
        ValueError: unknown reasoning parser.
        OSError: the input is unreadable.
        Exception: whatever ``on_shard_committed`` or ``on_canary`` raises.
    """
    return run_sync(run_dataset_async(spec, out_dir, servers, settings, opened=opened,
                                      on_shard_committed=on_shard_committed, progress=progress, on_canary=on_canary),
                    "datagen-inference")


def run_sync(coro: Coroutine[Any, Any, T], thread_name: str) -> T:
    """Run ``coro`` to its end from synchronous code: here, or in a thread named ``thread_name``
    when this thread already runs an event loop (``asyncio.run`` cannot be nested in it); its error
    is raised in the caller's thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:
        # Outside the except clause of the loop probe: an error of the run must not carry the
        # probe's "no running event loop" as its context.
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name=thread_name)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]
