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

This module is the public surface and the entry points; the parts live next to it:
``inference_records`` (DatasetSpec, DatasetResult, ShardProgress), ``inference_rows`` (journal
rows, rejects, the reasoning split) and ``inference_pool`` (the reader, the workers, the commits).

Errors: ``ServerGone`` (retries exhausted; ``rows_done``/``result`` set, finished rows are in the
journal), ``RequestRejected`` (a non-retryable 4xx, e.g. bad sampling params or API key),
``InputChanged``/``OutputLocked`` (tasks.shards), and whatever ``on_shard_committed`` raises (the
shard it was called for stays committed; nothing else is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tasks.inference._client import (
    ClientConfig,
    GenerateClient,
    RequestRejected,
    ServerGone,
    default_concurrency,
)
from tasks.inference._pool import InferencePool
from tasks.inference._records import (
    DEFAULT_SAMPLING,
    DatasetResult,
    DatasetSpec,
    ShardProgress,
    estimate_records,
    fingerprint_server,
)
from tasks.shards import OutputDir, ShardRecord

__all__ = [
    "DatasetResult",
    "DatasetSpec",
    "RequestRejected",
    "ServerGone",
    "ShardProgress",
    "ShardRecord",
    "fingerprint_server",
    "run_dataset",
    "run_dataset_async",
    "run_inputs",
]

_AUTO = "auto"


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
            driver = InferencePool(
                spec, out, client, shard_size=shard_size, concurrency=conc,
                sampling=sampling if sampling is not None else DEFAULT_SAMPLING,
                reasoning_parser=reasoning_parser, template=template, model_name=model_name,
                server_fingerprint=server_fingerprint or fingerprint_server(info),
                on_shard_committed=on_shard_committed, progress=progress, result=result,
            )
            driver.committed = out.committed_indices(spec.name)
            driver.total_estimate = estimate_records(spec.path)
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
    server raises ``ServerGone`` at once instead of after every retry; see tasks.inference._client).

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
