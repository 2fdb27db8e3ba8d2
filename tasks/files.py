"""Files and directories: the one module that opens, creates, renames or deletes a file datagen keeps.

Inside an output directory everything goes through ``Dir``, a directory held open: subdirectories
are opened relative to their parent's handle with ``O_NOFOLLOW``, files are created, read, renamed,
listed and deleted relative to a handle, so a name swapped for a symlink at any moment is refused
(``UnsafeFile``), never followed, and nothing outside the output is created, changed or deleted
(docs/architecture.md, "Threat model"). tests/unit/test_file_ops.py fails when code elsewhere in the
product reaches a file by name.

A replaced file is written to a temp file in the same directory, fsynced, renamed over the target and
the directory fsynced, so a reader sees the old or the new content, never half of one, and a crash
keeps whichever was last made durable. A failed write removes its temp file; a crash may leave one
behind, recognisable by ``TMP_MARK`` in its name. The by-path helpers (``atomic_write_json``,
``append_durable``...) are for files outside any output (the run directory, the fraction memory): they
hold the file's directory open and do the same.
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
    "Dir",
    "json_bytes",
    "read_json_object",
    "TMP_MARK",
    "UnsafeFile",
    "WriteFailed",
    "append_durable",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_writer",
    "naming",
    "open_below",
    "open_for_write",
    "read_nofollow",
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


def _refusal(path: Path | str, st: os.stat_result, *, directory: bool = False, owned: bool = True,
             link: Callable[[], str] | None = None) -> str | None:
    """Why a file (or, with ``directory``, a directory to write into) with status ``st`` must not be
    used, or None when it may. ``owned``: another user's is refused too. ``link`` reads a symlink's
    target for the message (default: by ``path``)."""
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"it is a symbolic link to {link() if link else os.readlink(path)}"
        except OSError:
            return "it is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if owned and st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}"
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# An open refused (a link or the wrong kind) whose name looks right a moment later: something is
# renaming it back and forth. Refused all the same.
_CHANGING = "it is being replaced: it was a symbolic link or the wrong kind of file when opened ({}), and is not now"


def _component(name: str, where: Path) -> str:
    """``name`` when it is one plain path component (no ``/``, not ``.`` or ``..``, not empty)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafeFile(where / name if name else where, f"{name!r} is not a plain file name", directory=True)
    return name


class Dir:
    """A directory held open: every operation on what lies in it is relative to this handle.

    The one way datagen touches files inside an output (see docs/architecture.md, "Threat model"): a
    subdirectory is opened relative to its parent's handle with ``O_DIRECTORY|O_NOFOLLOW`` and checked
    with ``fstat``; files are created ``O_CREAT|O_EXCL|O_NOFOLLOW``, read ``O_NOFOLLOW``, renamed with
    ``dir_fd``, listed from the handle and deleted with ``unlinkat`` after a ``follow_symlinks=False``
    stat. A name swapped for a symlink at any moment is refused (``UnsafeFile``), never followed; a
    directory swapped after it was opened keeps receiving what datagen writes, wherever inside the
    output it was moved. ``path`` is for messages only and never used to reach a file.

    The handle is closed by ``close()``, by leaving a ``with`` block, or when the object is dropped.
    """

    __slots__ = ("_fd", "path", "__weakref__")

    def __init__(self, fd: int, path: Path | str) -> None:
        self._fd: int | None = fd
        self.path = Path(path)

    @classmethod
    def open(cls, path: Path | str, *, create: bool = False) -> Dir:
        """A directory reached by its path: an output the user chose (it may be a symbolic link; its
        parent is trusted) or a directory outside any output.

        Raises:
            UnsafeFile: ``path`` is not a directory.
            OSError: it is missing (without ``create``) or cannot be opened.
        """
        if create:
            os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise UnsafeFile(path, "it is not a directory", directory=True) from None
        return cls(fd, path)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: directory handle is closed")
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Dir({str(self.path)!r}, fd={self._fd})"

    def reopen(self) -> Dir:
        """A second handle on the same directory (its own open file description: for a ``flock``)."""
        return Dir(os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd), self.path)

    @property
    def key(self) -> tuple[int, int]:
        """``(device, inode)``: the directory's identity, whatever its name now."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    # -- looking -------------------------------------------------------------------------------

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own status (a symlink is not followed), or None when it is missing."""
        try:
            return os.stat(_component(name, self.path), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def names(self) -> list[str]:
        """The entries' names, sorted (listed from the handle)."""
        return sorted(os.listdir(self.fd))

    def files(self, suffix: str = "") -> list[str]:
        """Sorted names of the regular files (not symlinks) ending with ``suffix``."""
        with os.scandir(self.fd) as it:
            return sorted(e.name for e in it if e.name.endswith(suffix) and e.is_file(follow_symlinks=False))

    def _refuse(self, name: str, st: os.stat_result, *, directory: bool = False, owned: bool = True) -> None:
        why = _refusal(self.path / name, st, directory=directory, owned=owned,
                       link=lambda: os.readlink(name, dir_fd=self.fd))
        if why is not None:
            raise UnsafeFile(self.path / name, why, directory=directory)

    # -- directories ---------------------------------------------------------------------------

    def sub(self, name: str, *, create: bool = False) -> Dir | None:
        """Subdirectory ``name``, opened relative to this handle (None when missing, without ``create``).

        Raises:
            UnsafeFile: it is a symlink, not a directory, or another user's.
        """
        _component(name, self.path)
        if create:
            with contextlib.suppress(FileExistsError):  # checked below whatever it is
                os.mkdir(name, 0o777, dir_fd=self.fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file (or a link, on some kernels)
            st = self.lstat(name)
            if st is not None:
                self._refuse(name, st, directory=True)
            raise UnsafeFile(self.path / name, _CHANGING.format(exc.strerror or exc), directory=True) from exc
        d = Dir(fd, self.path / name)
        d._refuse_self()
        return d

    def _refuse_self(self) -> None:
        st = os.fstat(self.fd)
        if st.st_uid != os.geteuid():
            self.close()
            raise UnsafeFile(self.path, f"it is owned by uid {st.st_uid}", directory=True)

    def walk(self, *names: str, create: bool = False) -> Dir | None:
        """The directory ``names`` below this one, each step a ``sub`` (None when one is missing)."""
        current: Dir | None = self
        for name in names:
            assert current is not None
            current = current.sub(name, create=create)
            if current is None:
                return None
        return current

    def remove_dir(self, name: str) -> bool:
        """Remove the empty subdirectory ``name``; False when it is missing or not empty.

        Raises:
            UnsafeFile: it is a symlink or not a directory.
        """
        st = self.lstat(name)
        if st is None:
            return False
        self._refuse(name, st, directory=True, owned=False)
        try:
            os.rmdir(name, dir_fd=self.fd)
        except (FileNotFoundError, OSError) as exc:
            if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True

    def fsync(self) -> None:
        """Make this directory's entries (a create, rename or unlink in it) durable."""
        with naming(self.path):
            os.fsync(self.fd)

    # -- files ---------------------------------------------------------------------------------

    def open_file(self, name: str, flags: int, mode: int = 0o644) -> int:
        """Open file ``name`` without following a symlink; returns the descriptor.

        ``O_NOFOLLOW`` and ``O_CLOEXEC`` are added; a file opened for writing must be a regular file
        owned by the running user, one opened for reading a regular file (checked on the descriptor).

        Raises:
            UnsafeFile: a symlink, not a regular file, or (writing) another user's.
            FileNotFoundError: missing, without ``O_CREAT``.
        """
        _component(name, self.path)
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        try:
            # O_NONBLOCK: opening a planted FIFO would otherwise wait for a peer forever.
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP is how O_NOFOLLOW reports a symlink
            st = None
            with contextlib.suppress(OSError):
                st = self.lstat(name)
            if st is not None:
                self._refuse(name, st, owned=writing)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):  # it was one a moment ago
                raise UnsafeFile(self.path / name, _CHANGING.format(exc.strerror or exc)) from exc
            raise
        try:
            self._refuse(name, os.fstat(fd), owned=writing)
            if not flags & os.O_NONBLOCK:
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str) -> bytes:
        """The whole content of file ``name``.

        Raises:
            FileNotFoundError: it is missing.
            UnsafeFile: it is a symlink or not a regular file.
        """
        with self.reader(name) as f:
            return f.read()

    def reader(self, name: str) -> IO[bytes]:
        """File ``name`` opened for reading (binary; pyarrow reads Parquet from it)."""
        return os.fdopen(self.open_file(name, os.O_RDONLY), "rb")

    @contextlib.contextmanager
    def writer(self, name: str, mode: str = "wb", encoding: str = "utf-8") -> Iterator[IO[Any]]:
        """Replace file ``name`` with what the ``with`` block writes, atomically and durably.

        A temp file (``TMP_MARK`` in its name) is created ``O_EXCL`` in this directory, fsynced and
        renamed over ``name`` within the handle, then the directory is fsynced. On an exception the
        temp file is removed and ``name`` keeps its old content (or stays absent).

        Raises:
            ValueError: ``mode`` is neither ``"w"`` nor ``"wb"``.
            UnsafeFile: ``name`` is a symlink, not a regular file, or another user's.
            WriteFailed: the disk or quota is full.
        """
        if mode not in ("w", "wb"):
            raise ValueError(f"atomic writer mode must be 'w' or 'wb', not {mode!r}")
        target = self.path / _component(name, self.path)
        st = self.lstat(name)
        if st is not None:  # the rename would replace a planted link, not write through it: say so
            self._refuse(name, st)
        tmp = f"{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except UnsafeFile:
            raise
        except OSError as exc:  # name the file asked for, not the temp file beside it
            if exc.errno in _OUT_OF_ROOM:
                raise WriteFailed(target, exc) from exc
            raise type(exc)(exc.errno, f"{exc.strerror} (writing it through a temp file beside it)",
                            str(target)) from exc
        try:
            with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
                yield f
                with naming(target):
                    f.flush()
                    os.fsync(f.fileno())
            with naming(target):
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            if isinstance(exc, OSError) and not isinstance(exc, WriteFailed) and exc.errno in _OUT_OF_ROOM:
                raise WriteFailed(target, exc) from exc
            raise
        with naming(target):
            os.fsync(self.fd)

    def write(self, name: str, data: bytes) -> None:
        """Replace file ``name`` with ``data`` atomically and durably (see ``writer``)."""
        with self.writer(name) as f:
            f.write(data)

    def append(self, name: str, data: bytes) -> None:
        """Append ``data`` to file ``name`` (created if missing) and fsync it.

        Raises:
            UnsafeFile: a symlink, not a regular file, or another user's.
            WriteFailed: the disk or quota is full.
        """
        with naming(self.path / name):
            fd = self.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)

    def remove(self, name: str) -> bool:
        """Remove file ``name`` (``unlinkat``: never through a link); False when it is missing.

        Raises:
            UnsafeFile: it is a symlink or not a regular file (nothing is removed).
        """
        st = self.lstat(name)
        if st is None:
            return False
        self._refuse(name, st, owned=False)
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` within this directory (``renameat``: links are moved, not followed)."""
        os.replace(_component(src, self.path), _component(dst, self.path), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def point(self, name: str, target: str) -> None:
        """Make ``name`` a symlink to ``target`` atomically (a temp link renamed over it), durably: for
        ``latest``, a link datagen owns. A ``name`` that is a directory is refused.

        Raises:
            UnsafeFile: ``name`` is a directory.
        """
        st = self.lstat(name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise UnsafeFile(self.path / name, "it is a directory, not a link datagen made", directory=True)
        tmp = f".{_component(name, self.path)}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        os.symlink(target, tmp, dir_fd=self.fd)
        try:
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
        self.fsync()

    def readlink(self, name: str) -> str | None:
        """The target of symlink ``name``, or None when it is missing or not a link."""
        try:
            return os.readlink(_component(name, self.path), dir_fd=self.fd)
        except OSError:
            return None

    def target_key(self, name: str) -> tuple[int, int] | None:
        """``(device, inode)`` of what ``name`` leads to, a symlink followed (a look, nothing is opened);
        None when it leads nowhere."""
        try:
            st = os.stat(_component(name, self.path), dir_fd=self.fd)
        except OSError:
            return None
        return st.st_dev, st.st_ino


def open_below(path: Path | str, flags: int, mode: int = 0o644, *, create_dir: bool = False) -> int:
    """Open file ``path`` whose directory lies inside the output (a server log, ``OUT/_logs/x.log``): the
    directory is opened relative to its parent's handle with ``O_NOFOLLOW`` (created with
    ``create_dir``), the file relative to it (``Dir.open_file``). Returns the descriptor.

    Raises:
        UnsafeFile: the directory or the file is a symlink, not what it should be, or another user's.
        FileNotFoundError: the file (without ``O_CREAT``) or the directory (without ``create_dir``) is missing.
    """
    path = Path(path)
    with Dir.open(path.parent.parent, create=create_dir) as parent:
        d = parent.sub(path.parent.name, create=create_dir)
        if d is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path.parent))
        with d:
            return d.open_file(path.name, flags, mode)


def _parent(path: Path | str, how: str = "") -> tuple[Dir, str]:
    """A file's directory held open (reached by its path: a file outside any output) and its name.

    Raises:
        FileNotFoundError: the directory is missing (naming the file asked for, and ``how``).
    """
    path = Path(path)
    try:
        return Dir.open(path.parent), path.name
    except FileNotFoundError as exc:
        raise FileNotFoundError(exc.errno, f"{exc.strerror}{how}", str(path)) from None


_VIA_TEMP = " (writing it through a temp file beside it)"


def open_for_write(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` (outside any output) for writing without following a symlink; return the descriptor.

    As ``Dir.open_file``, on the file's directory reached by its path.

    Raises:
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the file cannot be opened.
    """
    d, name = _parent(path)
    with d:
        return d.open_file(name, flags, mode)


def read_nofollow(path: Path | str) -> bytes:
    """The bytes of file ``path``, opened ``O_NOFOLLOW`` relative to its directory's handle.

    Raises:
        FileNotFoundError: it is missing.
        UnsafeFile: it is a symlink or not a regular file.
    """
    d, name = _parent(path)
    with d:
        return d.read(name)


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Replace ``path`` (outside any output) with what the ``with`` block writes, atomically: ``Dir.writer``
    on its directory.

    Raises:
        ValueError: ``mode`` is neither ``"w"`` nor ``"wb"``.
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the temp file cannot be written, synced or renamed (``path`` is unchanged).
    """
    d, name = _parent(path, _VIA_TEMP)
    with d, d.writer(name, mode, encoding) as f:
        yield f


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replace ``path`` (outside any output) with ``data`` atomically and durably.

    Raises:
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    d, name = _parent(path, _VIA_TEMP)
    with d:
        d.write(name, data)


def atomic_write_text(path: Path | str, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` (outside any output) with ``text`` atomically and durably."""
    atomic_write_bytes(path, text.encode(encoding))


def json_bytes(doc: Any, *, indent: int | None = 1, sort_keys: bool = False,
               default: Callable[[Any], Any] | None = None, newline: bool = False) -> bytes:
    """``doc`` as JSON bytes (what ``atomic_write_json`` writes).

    Raises:
        TypeError, ValueError: ``doc`` cannot be serialised.
    """
    text = json.dumps(doc, indent=indent, sort_keys=sort_keys, default=default)
    return (text + "\n" if newline else text).encode("utf-8")


def atomic_write_json(path: Path | str, doc: Any, *, indent: int | None = 1, sort_keys: bool = False,
                      default: Callable[[Any], Any] | None = None, newline: bool = False) -> None:
    """Replace ``path`` (outside any output) with ``doc`` as JSON, atomically and durably.

    ``doc`` is serialised before the file is touched, so a value that cannot be serialised leaves
    ``path`` as it was.

    Raises:
        TypeError, ValueError: ``doc`` cannot be serialised.
        OSError: the write fails (``path`` is unchanged, no temp file is left).
    """
    atomic_write_bytes(path, json_bytes(doc, indent=indent, sort_keys=sort_keys, default=default, newline=newline))


def append_durable(path: Path | str, data: bytes) -> None:
    """Append ``data`` to ``path`` (outside any output; created if missing) and fsync it.

    Raises:
        UnsafeFile: ``path`` is a symlink, not a regular file, or owned by another user.
        OSError: the file cannot be opened, written or synced.
    """
    d, name = _parent(path)
    with d:
        d.append(name, data)


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
