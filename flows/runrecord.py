"""What a flow run started, on disk, for its state hooks.

A hook may run in another process (the process worker runs ``on_crashed`` after the flow process
was SIGKILLed), so the flow writes ``$DATAGEN_STATE_DIR/runs/<flow_run_id>.json`` with its targets,
the simulated-GPU file it used and the pid/process group of every server it launched; the hook
reads it to clean exactly those.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tasks.config import state_dir

__all__ = ["clear", "read", "update"]


def _path(flow_run_id: str) -> Path:
    return state_dir() / "runs" / f"{flow_run_id}.json"


def read(flow_run_id: str) -> dict[str, Any]:
    try:
        data = json.loads(_path(flow_run_id).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update(flow_run_id: str | None, **fields: Any) -> None:
    """Merge ``fields`` into the record (atomic rename). ``servers`` entries are appended."""
    if not flow_run_id:
        return
    path = _path(flow_run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read(flow_run_id)
    servers = data.get("servers", [])
    for s in fields.pop("servers", []):
        servers.append(s)
    data.update(fields)
    data["servers"] = servers
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def clear(flow_run_id: str | None) -> None:
    if flow_run_id:
        _path(flow_run_id).unlink(missing_ok=True)
