"""`datagen demo`: the whole pipeline on the bundled samples, against the SGLang emulator on
simulated GPUs; no GPU, no SGLang and no Prefect server needed (ephemeral API).

    datagen demo [--out DIR] [--resume]

Prints where the Parquet went, rows per dataset, the validation summary, the elapsed time and,
when a Prefect server is up (`datagen up`), the UI link. The previous demo output is replaced
unless ``--resume``. Simulated GPUs are created under the output directory when
``DATAGEN_SIM_GPUS`` is unset.

Exit codes: 0 the demo completed and validated; 1 it failed; 2 usage or configuration error, or
another demo is writing the output (as `datagen run`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from datagen._cli import EXIT_OK, exit_code_for, exit_codes, parse_args, reports_errors
from datagen.cmd_run import failure_label, run_flow, ui_url, verdict_line
from tasks.config import ConfigError, load_partition
from tasks.shards import OutputDir, OutputLocked


@reports_errors("datagen demo")
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="datagen demo", description=__doc__.split("\n\n")[0],
                                epilog=exit_codes(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output directory (default: the demo partition's, data/out/demo)")
    p.add_argument("--resume", action="store_true", help="keep and resume the previous demo output")
    args = parse_args(p, argv)
    if isinstance(args, int):
        return args
    try:
        cfg = load_partition("demo")
    except ConfigError as exc:
        print(f"datagen demo: {failure_label(exc, 'failed')}: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    out = Path(args.out).resolve() if args.out else cfg.output_root
    holder = OutputDir(out).lock_holder() if out.exists() else None
    if holder is not None:  # another demo is writing there: leave its output alone
        locked = OutputLocked(out / "_lock", holder)
        print(f"datagen demo: {failure_label(locked, 'failed')}: {locked}", file=sys.stderr)
        return exit_code_for(locked)
    if not args.resume and OutputDir(out).read_file("_manifest.json") is not None:
        # only ever a previous demo output (it has a datagen manifest); rmtree walks by handle
        # (shutil.rmtree.avoids_symlink_attacks): a link inside is removed, never followed
        shutil.rmtree(out)
    t0 = time.monotonic()
    print(f"datagen demo: {len(cfg.datasets)} datasets -> {out} (emulator, simulated GPUs)", flush=True)
    code, result = run_flow("demo", {"out": str(out), "backend": "emulator"})
    elapsed = time.monotonic() - t0
    if code != EXIT_OK:
        print(f"datagen demo: {failure_label(result, 'failed')}: {result}", file=sys.stderr)
        print(f"elapsed: {elapsed:.1f} s", file=sys.stderr)
        return code
    manifest = OutputDir(out).read_manifest() or {"datasets": {}}
    print()
    print(f"Parquet: {out}/<dataset>/shard-*.parquet")
    for name, ds in sorted(manifest.get("datasets", {}).items()):
        shards = ds.get("shards", {})
        rows = sum(int(s.get("rows", 0)) for s in shards.values())
        print(f"  {name}: {rows} rows in {len(shards)} shards -> {out / name}")
    print()
    print(verdict_line(result["validation"], out))
    print(f"elapsed: {elapsed:.1f} s")
    ui = ui_url()
    if ui:
        print(f"Prefect UI: {ui}")
    print(next_steps(out, sorted(manifest.get("datasets", {})), ui))
    return EXIT_OK


def next_steps(out: Path, datasets: list[str], ui: str | None) -> str:
    """What a new user does after the demo: look at rows, export them, try their own prompts, and
    see the same pipeline run through Prefect."""
    first = datasets[0] if datasets else "glaive_like"
    home = Path.cwd()
    rel = out.relative_to(home) if out.is_relative_to(home) else out
    see = "open the UI above" if ui else "`make up`, then `.venv/bin/prefect deployment run datagen/demo --watch`"
    return "\n".join([
        "",
        "next:",
        f"  the dataset card        {rel}/README.md",
        f"  a few rows              .venv/bin/python -c \"import pyarrow.parquet as pq; "
        f"print(pq.read_table('{rel}/{first}').slice(0, 2).to_pylist())\"",
        f"  training JSONL          .venv/bin/datagen export {rel} --format sharegpt --out /tmp/{first}.jsonl",
        "  your own prompts        .venv/bin/datagen run --input my.jsonl --backend emulator --out /tmp/try",
        f"  through Prefect         {see}",
    ])
