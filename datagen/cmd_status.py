"""`datagen status OUT_DIR`: how far an output is, who writes it, what memory fraction was learned.

    datagen status [OUT_DIR] [--json]

    datagen status OUT_DIR --end-stale

Without OUT_DIR: only the remembered fractions. With it, prints shards committed/total and rows per dataset, open journals, committed shards whose file is
missing or fails its sha256, the lock holder (host, pid, flow run) when a live process holds
``OUT/_lock``, the flow runs of this output that Prefect still shows Running (or Pending,
Cancelling) although their process on this host is gone (a worker or control host killed: the zombie
automation of `datagen up` crashes them within its bound; ``--end-stale`` marks them Crashed now,
which frees their deployment's slot), the last validation verdict, and the ``--mem-fraction-static`` values
tasks.server._tuner remembers: per host, model, tp and GPU, the fraction, headroom (GiB), the lowest
fraction that OOMed at run time, and where it is kept (the Prefect Variable's name, or the file).

Exit codes:
  0  printed; every committed shard matches the manifest (--end-stale: and every stale run was ended)
  1  printed; a committed shard is missing or damaged (listed; `datagen repair OUT_DIR` un-commits
     it so the next run generates it again)
  2  OUT_DIR is not a datagen output (a file, no manifest, or a manifest that is not one) or usage
     error
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import httpx

from datagen._cli import EXIT_FAILED, EXIT_OK, exit_codes, parse_args, reports_errors
from datagen._prefect_api import PrefectApi
from flows import runrecord
from tasks.inference import RunLedger
from tasks.server import FileStore, FractionMemory, default_file, list_remembered
from tasks.shards import OutputDir

LAST_RUN = "_last_run.json"  # flows.summary.LAST_RUN: written by the run (its summary), read here


def status(out: Path) -> dict[str, Any]:
    """The status document of an output directory.

    Raises:
        FileNotFoundError: ``out`` has no manifest.
        NotADirectoryError: ``out`` is a file.
        ManifestError: the manifest is not one.
    """
    od = OutputDir(out)
    try:
        od.open_root()
    except OSError:  # tasks.files says it is not a directory
        raise NotADirectoryError(f"{out} is a file, not an output directory: give the directory that holds "
                                 "_manifest.json") from None
    manifest = od.read_manifest()
    if manifest is None:
        raise FileNotFoundError(f"{out}: no _manifest.json (not a datagen output, or nothing committed yet)")
    datasets: dict[str, Any] = {}
    for name, ds in sorted(manifest.get("datasets", {}).items()):
        shards = ds.get("shards", {}) or {}
        datasets[name] = {
            "shards_committed": len(shards),
            "shards_total": ds.get("num_shards"),
            "rows": sum(int(s.get("rows", 0)) for s in shards.values()),
            "rejects": sum(int(s.get("rejects", 0)) for s in shards.values()),
            "total_rows": ds.get("total_rows"),
            # what the dataset makes: its input records x samples per record (rows and rejects count
            # per sample); None until the input was read to the end
            "expected_rows": _expected_rows(ds),
            "open_journals": od.open_journals(name),
            "damaged": [d.to_dict() for d in od.damaged_shards(name)],
        }
    return {"out_dir": str(out), "shard_size": manifest.get("shard_size"), "datasets": datasets,
            "lock_holder": od.lock_holder(), "stale_runs": stale_runs(out), "validation": _validation(out, datasets),
            "last_run": _last_run(od), **_fractions()}


def _last_run(od: OutputDir) -> dict[str, Any] | None:
    """The last run's summary as it left it in the output (``_last_run.json``: verdict, rows, the
    GPU-time ledger), None when no run wrote one; ``{"error"}`` when it cannot be read."""
    try:
        data = od.read_file(LAST_RUN)
        doc = json.loads(data) if data is not None else None
    except (OSError, ValueError) as exc:
        return {"error": f"{LAST_RUN} unreadable: {exc}"}
    return doc if isinstance(doc, dict) else None


STALE_STATES = ("RUNNING", "PENDING", "CANCELLING")


def stale_runs(out: Path) -> list[dict[str, Any]]:
    """The flow runs of ``out`` (by this host's run records) whose process here is gone while the
    Prefect API (``$PREFECT_API_URL``; none set: nothing to compare, an empty list) still says they
    run: ``{"flow_run", "name", "state", "host", "pid"}``."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        return []
    where = str(out.resolve())
    dead = [(run_id, r) for run_id, r in runrecord.dead_runs() if r.out_dir and Path(r.out_dir).resolve() == Path(where)]
    found = []
    try:
        with PrefectApi(url, timeout=10.0) as http:
            for run_id, record in dead:
                resp = http.get(f"/flow_runs/{run_id}")
                if resp.status_code == 404:
                    continue
                run = resp.raise_for_status().json()
                state = (run.get("state") or {}).get("type")
                if state in STALE_STATES and record.owner is not None:
                    found.append({"flow_run": run_id, "name": run.get("name"), "state": state,
                                  "host": record.owner.host, "pid": record.owner.pid})
    except httpx.HTTPError as exc:
        return [{"error": f"the Prefect API at {url} did not answer: {exc}"}]
    return found


def end_stale(url: str, runs: list[dict[str, Any]]) -> list[str]:
    """Mark each stale run Crashed (forced: its process cannot report anything any more); returns
    the ids ended.

    Raises:
        httpx.HTTPError: the API refused or did not answer.
    """
    ended = []
    with PrefectApi(url, timeout=10.0) as http:
        for r in runs:
            if "flow_run" not in r:
                continue
            message = (f"datagen status --end-stale: its flow-run process (host {r['host']}, pid {r['pid']}) is gone; "
                       "the next run resumes after the committed shards")
            http.post(f"/flow_runs/{r['flow_run']}/set_state",
                      json={"state": {"type": "CRASHED", "name": "Crashed", "message": message},
                            "force": True}).raise_for_status()
            ended.append(r["flow_run"])
    return ended


def _validation(out: Path, datasets: dict[str, Any]) -> dict[str, Any] | None:
    """The last report's verdict, and whether it still describes the output: it is stale when the
    output's rows changed since, and says nothing final while a dataset is unfinished."""
    try:
        data = OutputDir(out).read_file("_validation.json")
        if data is None:
            return None
        doc = json.loads(data)
    except (OSError, ValueError):
        return {"verdict": "unreadable"}
    if not isinstance(doc, dict):
        return {"verdict": "unreadable"}
    rows_now = sum(d["rows"] for d in datasets.values())
    unfinished = sorted(n for n, d in datasets.items()
                        if d["shards_total"] is None or d["shards_committed"] < d["shards_total"])
    return {"verdict": doc.get("verdict"), "rows": doc.get("rows"), "validated_at": doc.get("validated_at"),
            "stale": doc.get("rows") != rows_now, "unfinished": unfinished,
            "stopped_by": (doc.get("stop") or {}).get("by")}


def _fractions() -> dict[str, Any]:
    """The remembered fractions (``learned_fractions``) and where they were read (``fractions_from``):
    the Prefect API with PREFECT_API_URL set, else this host's file (which keeps a copy of the
    Variables its runs updated), read without importing Prefect (2 s here)."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    try:
        entries = list_remembered() if url else list_remembered(FractionMemory(FileStore(default_file())))
    except Exception as exc:  # the memory store is advisory here
        entries = [{"error": str(exc)}]
    return {"learned_fractions": entries, "fractions_from": f"prefect:{url}" if url else f"file:{default_file()}"}


def _expected_rows(entry: dict[str, Any]) -> int | None:
    total = entry.get("total_rows")
    gen = entry.get("generation")
    samples = gen.get("samples") if isinstance(gen, dict) else None
    if not isinstance(total, int):
        return None
    return total * (samples if isinstance(samples, int) and samples >= 1 else 1)


def render(doc: dict[str, Any]) -> str:
    lines = [f"output {doc['out_dir']} (shard size {doc['shard_size']})"]
    for name, d in doc["datasets"].items():
        total = d["shards_total"] if d["shards_total"] is not None else "?"
        journals = f", open journals {d['open_journals']}" if d["open_journals"] else ""
        damaged = f", {len(d['damaged'])} damaged" if d["damaged"] else ""
        expected = f" of {d['expected_rows']}" if d.get("expected_rows") is not None else ""
        lines.append(f"  {name}: {d['shards_committed']}/{total} shards{damaged}, {d['rows'] + d['rejects']}{expected} "
                     f"rows and rejects ({d['rows']} rows, {d['rejects']} rejects){journals}")
        lines.extend(f"    damaged shard {x['shard']} ({x['file']}): {x['problem']}" for x in d["damaged"])
    if any(d["damaged"] for d in doc["datasets"].values()):
        lines.append(f"damaged shards: run `datagen repair {doc['out_dir']}` to un-commit them; the next run "
                     f"generates them again")
    holder = doc["lock_holder"]
    if holder:
        lines.append("lock: held by " + ", ".join(f"{k}={v}" for k, v in holder.items() if v is not None))
    else:
        lines.append("lock: free")
    for r in doc.get("stale_runs") or []:
        if "error" in r:
            lines.append(f"stale runs: unknown ({r['error']})")
            continue
        lines.append(f"stale run: Prefect says {r['name']} ({r['flow_run']}) is {r['state']}, but its process (host "
                     f"{r['host']}, pid {r['pid']}) is gone; the zombie automation marks it Crashed once its "
                     f"heartbeats are overdue; end it now: datagen status {doc['out_dir']} --end-stale")
    lines.append(f"validation: {_render_validation(doc['validation'], doc['out_dir'])}")
    lines.extend(_render_last_run(doc.get("last_run")))
    lines.extend(render_fractions(doc["learned_fractions"]))
    lines.extend(_fractions_note(doc.get("fractions_from", "")))
    return "\n".join(lines)


def _render_validation(v: dict[str, Any] | None, out: str) -> str:
    if v is None:
        return "not run"
    if v.get("verdict") == "unreadable":
        return f"unreadable _validation.json: run `datagen validate {out}`"
    when = f"{v['verdict']} ({v.get('rows') or 0:,} rows, validated {v.get('validated_at')})"
    if v.get("stopped_by"):
        when += f", the run was stopped by {v['stopped_by']}"
    if v.get("unfinished"):
        return (f"not final: {', '.join(v['unfinished'])} unfinished (last report: {when}); a rerun finishes "
                "and validates it")
    if v.get("stale"):
        return f"out of date (last report: {when}, before the rows changed): run `datagen validate {out}`"
    return when


def _render_last_run(run: dict[str, Any] | None) -> list[str]:
    if run is None:
        return ["last run: none recorded in this output"]
    if "error" in run:
        return [f"last run: {run['error']}"]
    head = (f"last run: {run.get('verdict')}, {run.get('rows_new', 0):,} rows generated in "
            f"{run.get('wall_s', 0.0):,.0f} s")
    ledger = RunLedger.from_dict(run.get("ledger"))
    if ledger is None:
        return [head + " (no server ran)"]
    return [head + "; GPU-time ledger:", *ledger.text_lines("  ")]


def _fractions_note(source: str) -> list[str]:
    if not source.startswith("file:"):
        return []
    return [f"  (read from {source[5:]}, where each run on this host keeps a copy of what it learned; "
            "set PREFECT_API_URL to read the Prefect server's Variables)"]


def render_fractions(entries: list[dict[str, Any]]) -> list[str]:
    """One line per remembered fraction, for people."""
    if not entries:
        return ["learned memory fraction: none yet"]
    lines = []
    for e in entries:
        if "error" in e:
            lines.append(f"learned memory fraction: unavailable ({e['error']})")
            continue
        fraction = "SGLang's default" if e.get("fraction") is None else f"{e['fraction']:g}"
        notes = [f"headroom {e['headroom_gib']:g} GiB" if e.get("headroom_gib") is not None else "headroom unknown"]
        if e.get("runtime_oom_at") is not None:
            notes.append(f"runtime OOM at {e['runtime_oom_at']:g}")
        if e.get("updated_at"):
            notes.append(f"updated {e['updated_at']}")
        lines.append(f"learned memory fraction: {fraction} for {e.get('what') or e.get('key')} "
                     f"({'; '.join(notes)}) [{e.get('store')}: {e.get('where')}]")
    return lines


@reports_errors("datagen status")
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="datagen status", description="Status of an output directory.",
                                epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", help="an output directory (without it: the remembered fractions only)")
    p.add_argument("--json", action="store_true", help="the status document as JSON")
    p.add_argument("--end-stale", action="store_true",
                   help="mark this output's stale runs (Running in Prefect, their process here gone) Crashed")
    args = parse_args(p, argv)
    if isinstance(args, int):
        return args
    if args.out_dir is None:
        fractions = _fractions()["learned_fractions"]
        print(json.dumps({"learned_fractions": fractions}, indent=1, default=str) if args.json
              else "\n".join(render_fractions(fractions)))
        return EXIT_OK
    doc = status(Path(args.out_dir))
    if args.end_stale:
        if not os.environ.get("PREFECT_API_URL", "").strip():
            raise ValueError("--end-stale changes run states on the Prefect server: set PREFECT_API_URL to its API "
                             "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)")
        ended = end_stale(os.environ["PREFECT_API_URL"].strip(), doc["stale_runs"])
        doc["ended_stale"] = ended
        doc["stale_runs"] = [r for r in doc["stale_runs"] if r.get("flow_run") not in ended]
        if not args.json:
            print("\n".join(f"ended stale run {r}: Crashed (its deployment's slot is free)" for r in ended)
                  or "no stale run to end")
    print(json.dumps(doc, indent=1, default=str) if args.json else render(doc))
    return EXIT_FAILED if any(d["damaged"] for d in doc["datasets"].values()) else EXIT_OK
