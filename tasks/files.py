"""Durable file writes: the one way this package replaces or appends to a file it keeps.

A replaced file is written to a temp file in the same directory, fsynced, renamed over the target and
the directory fsynced, so a reader sees the old or the new content, never half of one, and a crash
keeps whichever was last made durable. A failed write removes its temp file; a crash may leave one
behind, recognisable by ``TMP_MARK`` in its name.

Every file written here is opened with ``O_NOFOLLOW`` and must be a regular file owned by the
running user (``open_for_write``): a symlink or a foreign file planted in a shared output directory
is refused with ``UnsafeFile`` instead of having its target written. Every directory datagen
creates, writes into or deletes from below an output is checked component by component from the
output down (``checked_dir``): a planted directory symlink, a non-directory or another user's
directory is refused the same way, so nothing outside the output is ever written or removed. (The
output directory itself may be a symlink: the user chose it.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from tasks.errors import DatagenError

__all__ = [
    "read_json_object",
    "TMP_MARK",
    "UnsafeFile",
    "WriteFailed",
    "append_durable",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_writer",
    "check_replaceable",
    "checked_dir",
    "fsync_dir",
    "naming",
    "open_for_write",
]

TMP_MARK = ".tmp-"


class UnsafeFile(DatagenError, OSError):
    """A file datagen would write is a symlink, not a regular file, or owned by another user.

    ``path`` is the refused file; an ``OSError`` so callers that handle unwritable files handle it.
    """

    def __init__(self, path: Path | str, why: str, *, directory: bool = False) -> None:
        self.path = Path(path)
        action, only = (("use", "into real directories inside the output (no symbolic links)") if directory
                        else ("write", "regular files"))
        super().__init__(
            f"refusing to {action} {path}: {why}; datagen writes only {only} owned by the user running it "
            f"(uid {os.geteuid()}): remove or replace {path}, or choose another output"
        )


class WriteFailed(DatagenError, OSError):
    """A write ran out of room (``ENOSPC``, ``EDQUOT``): the operation failed (exit 1), nothing it had
    made durable is lost. ``path`` is the file; ``errno`` the cause."""

    def __init__(self, path: Path | str, exc: OSError) -> None:
        self.path = Path(path)
        super().__init__(exc.errno, exc.strerror)
        self.args = (f"cannot write {path}: {exc.strerror or exc} (errno {exc.errno}); what was committed is "
                     f"kept: free space on that filesystem (`df {self.path.parent}`) and rerun, the run "
                     f"resumes from its last committed shard",)

    def __str__(self) -> str:
        return str(self.args[0])


_OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """Give an ``OSError`` raised in the block the path it concerns: ``WriteFailed`` for a full disk or
    quota, else the same error with ``filename`` set when it had none (``os.write`` and ``fsync`` name
    no file)."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as exc:
        if exc.errno in _OUT_OF_ROOM:
            raise WriteFailed(path, exc) from exc
        if exc.filename is None and not isinstance(exc, UnsafeFile) and exc.errno is not None:
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise


def _refusal(path: Path | str, st: os.stat_result, *, directory: bool = False) -> str | None:
    """Why a file (or, with ``directory``, a directory to write into) with status ``st`` must not be
    used, or None when it may."""
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"it is a symbolic link to {os.readlink(path)}"
        except OSError:
            return "it is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}"
    return None


def checked_dir(root: Path | str, directory: Path | str, *, create: bool = False) -> Path:
    """Check every directory from below ``root`` down to ``directory``; with ``create``, make missing ones.

    Each component is looked at with ``lstat``: a symbolic link (to anywhere), something that is not
    a directory, or a directory of another user is refused. ``directory`` must lie lexically inside
    ``root`` (no ``..``). ``root`` itself is trusted as given. Without ``create`` a missing component
    ends the walk: nothing below it can exist to be followed.

    Args:
        root: the output directory.
        directory: a directory at or below ``root``.
        create: create missing components (mode 0o755 less the umask).

    Returns:
        ``directory``, as a ``Path``.

    Raises:
        UnsafeFile: a component is refused, or ``directory`` leaves ``root``; names the component.
        OSError: a component cannot be created.
    """
    root, directory = Path(root), Path(directory)
    try:
        rel = directory.relative_to(root)
    except ValueError:
        raise UnsafeFile(directory, f"it is not inside the output {root}", directory=True) from None
    if any(part in ("..", ".") for part in rel.parts):
        raise UnsafeFile(directory, f"it leaves the output {root} through '..'", directory=True)
    current = root
    for part in rel.parts:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return directory
            with contextlib.suppress(FileExistsError):  # a concurrent creator: checked below all the same
                os.mkdir(current)
            st = os.lstat(current)
        why = _refusal(current, st, directory=True)
        if why is not None:
            raise UnsafeFile(current, why, directory=True)
    return directory


def open_for_write(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` for writing without following a symlink; return the descriptor.

    ``O_NOFOLLOW`` and ``O_CLOEXEC`` are added to ``flags``; a file that exists must be a regular
    file owned by the running user (checked on the opened descriptor, so a swap after the check
    cannot redirect the write).

    Args:
        path: the file.
        flags: ``os.open`` flags (e.g. ``os.O_WRONLY | os.O_CREAT | os.O_APPEND``).
        mode: permissions of a file created.

    Raises:
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the file cannot be opened.
    """
    try:
        # O_NONBLOCK: opening a planted FIFO for writing would otherwise wait for a reader forever.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        # ELOOP is how O_NOFOLLOW reports a symlink; a FIFO or socket fails in other ways.
        why = None
        with contextlib.suppress(OSError):
            why = _refusal(path, os.lstat(path))
        if why is not None:
            raise UnsafeFile(path, why) from exc
        raise
    try:
        why = _refusal(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise UnsafeFile(path, why)
    if not flags & os.O_NONBLOCK:
        os.set_blocking(fd, True)
    return fd


def check_replaceable(path: Path | str) -> None:
    """Check that ``path`` is absent or a regular file owned by the running user.

    Raises:
        UnsafeFile: it is a symlink, not a regular file, or owned by another user.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = _refusal(path, st)
    if why is not None:
        raise UnsafeFile(path, why)


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a create or a rename in it) durable.

    Args:
        path: the directory.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    # pid + random: concurrent writers (processes or threads) never share a temp file
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Replace ``path`` with what the ``with`` block writes to the yielded file, atomically.

    The content becomes visible only when the block ends without an exception; on an exception the
    temp file is removed and ``path`` keeps its old content (or stays absent).

    Args:
        path: the file to replace; its directory must exist.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: text encoding for ``"w"``.

    Raises:
        ValueError: ``mode`` is neither ``"w"`` nor ``"wb"``.
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the temp file cannot be written, synced or renamed (``path`` is unchanged).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    # The rename would replace a planted link, not write through it; refusing says what was found.
    check_replaceable(path)
    tmp = _temp_path(path)
    try:
        fd = open_for_write(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except (UnsafeFile, WriteFailed):
        raise
    except OSError as exc:  # name the file asked for, not the temp file beside it
        if exc.errno in _OUT_OF_ROOM:
            raise WriteFailed(path, exc) from exc
        raise type(exc)(exc.errno, f"{exc.strerror} (writing it through a temp file beside it)", str(path)) from exc
    try:
        with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
            yield f
            with naming(path):
                f.flush()
                os.fsync(f.fileno())
        with naming(path):
            os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, WriteFailed) and exc.errno in _OUT_OF_ROOM:
            raise WriteFailed(path, exc) from exc  # raised by the block's own writes (or the close)
        raise
    with naming(path):
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Args:
        path: the file to replace; its directory must exist.
        data: the new content.

    Raises:
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    with atomic_writer(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: Path | str, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically and durably.

    Args:
        path: the file to replace; its directory must exist.
        text: the new content.
        encoding: how ``text`` is encoded.

    Raises:
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: Path | str, doc: Any, *, indent: int | None = 1, sort_keys: bool = False,
                      default: Callable[[Any], Any] | None = None, newline: bool = False) -> None:
    """Replace ``path`` with ``doc`` as JSON, atomically and durably.

    ``doc`` is serialised before the file is touched, so a value that cannot be serialised leaves
    ``path`` as it was.

    Args:
        path: the file to replace; its directory must exist.
        doc: the value to write.
        indent, sort_keys, default: as for ``json.dumps``.
        newline: end the file with a newline.

    Raises:
        TypeError, ValueError: ``doc`` cannot be serialised.
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    text = json.dumps(doc, indent=indent, sort_keys=sort_keys, default=default)
    atomic_write_text(path, text + "\n" if newline else text)


def append_durable(path: Path | str, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing) and fsync it.

    Args:
        path: the file to append to; its directory must exist.
        data: the bytes to append (written whole: short writes are continued).

    Raises:
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the file cannot be opened, written or synced.
    """
    with naming(path):
        fd = open_for_write(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json_object(path: Path | str, what: str | None = None) -> dict[str, Any]:
    """The JSON object stored in ``path`` (a model's config.json, tokenizer_config.json...).

    Args:
        what: what the file is, for the messages (``"model config"``).

    Raises:
        ValueError: the file cannot be read, is not UTF-8 JSON, or holds something other than an object;
            the message names the path.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what}: {exc}" if what else f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is not a JSON object" if what else f"{path}: not a JSON object")
    return data
