"""Find the places in source code that reach a file by its name (issue 47's static check).

A call counts when it opens, creates, renames, lists or deletes a path: the builtin ``open``, ``os``
and ``shutil`` functions that do, the ``pathlib.Path`` methods that do, pyarrow.parquet's readers and
writers, ``Dir.open`` and the by-path helpers of ``tasks.files``. A look that changes nothing
(``os.path.exists``, ``Path.is_dir``) does not count. ``tasks/files.py`` is the owner and is not
scanned. The scan is syntactic: a method of another type with a ``Path`` method's name counts too,
which is why ``tasks.files.Dir`` names its methods ``read``, ``write``, ``remove``, ``remove_dir``.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

__all__ = ["by_name_calls", "scan_source"]

OS_OPS = {"open", "mkdir", "makedirs", "unlink", "remove", "rmdir", "rename", "renames", "replace", "scandir",
          "listdir", "symlink", "link", "truncate", "removedirs", "mkfifo", "chmod", "chown", "utime"}
SHUTIL_OPS = {"rmtree", "copy", "copy2", "copyfile", "copytree", "move", "copyfileobj"}
PATH_METHODS = {"open", "write_text", "write_bytes", "read_text", "read_bytes", "unlink", "mkdir", "rmdir",
                "rename", "touch", "iterdir", "glob", "rglob", "symlink_to", "hardlink_to"}
PQ_OPS = {"read_table", "ParquetFile", "write_table", "read_metadata", "read_schema", "ParquetWriter",
          "ParquetDataset"}
BY_PATH_HELPERS = {"atomic_write_json", "atomic_write_bytes", "atomic_write_text", "atomic_writer",
                   "append_durable", "open_for_write", "fsync_dir", "read_nofollow", "open_below",
                   "read_json_object", "check_replaceable"}


def _kind(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        if f.id == "open":
            return "open()"
        return f.id if f.id in BY_PATH_HELPERS else None
    if not isinstance(f, ast.Attribute):
        return None
    base = f.value.id if isinstance(f.value, ast.Name) else None
    if base == "os" and f.attr in OS_OPS:
        return f"os.{f.attr}"
    if base == "shutil" and f.attr in SHUTIL_OPS:
        return f"shutil.{f.attr}"
    if base == "pq" and f.attr in PQ_OPS:
        return f"pq.{f.attr}"
    if base == "Dir" and f.attr == "open":
        return "Dir.open"
    if base in ("os", "shutil", "pq"):
        return None
    if f.attr in BY_PATH_HELPERS:
        return f.attr
    if f.attr in PATH_METHODS:
        return f".{f.attr}()"
    if f.attr == "replace" and len(call.args) == 1 and not call.keywords and base != "dataclasses":
        return ".replace()"  # Path.replace(target); str.replace takes two
    return None


def scan_source(source: str) -> collections.Counter[str]:
    """``"<function> <kind>"`` of each by-name call in ``source``, counted."""
    found: collections.Counter[str] = collections.Counter()

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*stack, child.name])
                continue
            if isinstance(child, ast.Call):
                kind = _kind(child)
                if kind is not None:
                    found[f"{'.'.join(stack) or '<module>'} {kind}"] += 1
            visit(child, stack)

    visit(ast.parse(source), [])
    return found


def by_name_calls(root: Path, packages: tuple[str, ...], owner: str) -> dict[str, collections.Counter[str]]:
    """The by-name calls of every module of ``packages`` under ``root`` but ``owner``, by module path."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = path.relative_to(root).as_posix()
            if module == owner:
                continue
            found = scan_source(path.read_text())
            if found:
                out[module] = found
    return out
