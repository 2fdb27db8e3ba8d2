"""Per-row provenance: which model revision, engine, chat template, run and attempt made a row.

``Provenance`` is what every row of one ``run_dataset`` call shares; ``model_revision`` hashes the
model directory's config and weights index, ``template_hash`` the chat template source,
``engine_of`` reads the engine from ``/server_info``, and ``next_attempt`` counts the calls of one
run on one dataset in the output's manifest. ``hf_snapshot`` names the Hub repository and commit of a
model directory inside a Hugging Face cache (for the dataset card).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PROVENANCE_COLUMNS",
    "Provenance",
    "engine_of",
    "hf_snapshot",
    "model_revision",
    "new_run_id",
    "next_attempt",
    "template_hash",
]

# The row columns this module fills (tasks.schema.ROW_SCHEMA, provenance block).
PROVENANCE_COLUMNS = ("model_revision", "engine", "engine_version", "chat_template_hash", "run_id", "attempt")
# Files whose bytes identify the weights without reading them: the config and the shard index.
_CONFIG_FILES = ("config.json",)
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HASH_CHARS = 16


def _short(h: hashlib._Hash) -> str:
    return f"sha256:{h.hexdigest()[:_HASH_CHARS]}"


def model_revision(model_dir: str | Path | None) -> str | None:
    """``sha256:<16 hex>`` of the model directory's ``config.json`` and weights index.

    Without an index (a single-file model), the names and sizes of the weight files stand in for
    it: hashing the weights themselves would read gigabytes. The same files under another path or
    from another download give the same value. None when the directory is unknown or unreadable
    here (a model on a remote target only), or holds neither a config nor weights.
    """
    if model_dir is None:
        return None
    root = Path(model_dir)
    h = hashlib.sha256()
    found = False
    try:
        for name in (*_CONFIG_FILES, *_INDEX_FILES):
            path = root / name
            if path.is_file():
                h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
                found = True
        if not any((root / n).is_file() for n in _INDEX_FILES):
            for path in sorted(root.iterdir()):
                if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
                    h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
                    found = True
    except OSError:
        return None
    return _short(h) if found else None


def hf_snapshot(model_dir: str | Path | None) -> tuple[str, str] | None:
    """``(repo_id, commit)`` when ``model_dir`` is a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>``), else None."""
    if model_dir is None:
        return None
    path = Path(model_dir)
    parent, repo = path.parent, path.parent.parent
    if parent.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    return repo.name.removeprefix("models--").replace("--", "/"), path.name


def template_hash(source: str | None) -> str | None:
    """``sha256:<16 hex>`` of a chat template's source text (None: no template)."""
    if source is None:
        return None
    return _short(hashlib.sha256(source.encode("utf-8")))


def engine_of(server_info: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """``(engine, version)`` from ``/server_info``: ``("sglang", "0.5.23")``; the emulator names
    itself ``emulator``; the version is None when the server does not report one."""
    info = server_info or {}
    version = info.get("version")
    name = "emulator" if info.get("emulator") is True else "sglang"
    return name, str(version) if version is not None else None


def new_run_id() -> str:
    """A run id for a ``run_dataset`` call outside a Prefect flow run."""
    return f"local-{uuid.uuid4().hex[:12]}"


def next_attempt(out: Any, dataset: str, run_id: str) -> int:
    """Count one more call of run ``run_id`` on ``dataset`` in ``out``'s manifest and return it
    (1-based): a task retry or a server relaunch inside one flow run is the next attempt.

    Needs the output's lock (``out`` is a ``tasks.shards.OutputDir`` whose dataset is open).

    Raises:
        OSError: the manifest cannot be written.
    """
    manifest = out.read_manifest() or {"datasets": {}}
    entry = manifest["datasets"].setdefault(dataset, {})
    attempts = entry.get("attempts")
    if not isinstance(attempts, dict):
        attempts = entry["attempts"] = {}
    n = int(attempts.get(run_id) or 0) + 1
    attempts[run_id] = n
    out.write_manifest(manifest)
    return n


@dataclass(frozen=True)
class Provenance:
    """What every row of one ``run_dataset`` call records about how it was made."""

    model_revision: str | None
    engine: str
    engine_version: str | None
    chat_template_hash: str | None  # of the template; rows with a pre-rendered prompt record None
    run_id: str
    attempt: int

    def columns(self, templated: bool) -> dict[str, Any]:
        """The provenance columns of a row (``templated``: its prompt was rendered by the template)."""
        return {
            "model_revision": self.model_revision,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "chat_template_hash": self.chat_template_hash if templated else None,
            "run_id": self.run_id,
            "attempt": self.attempt,
        }
