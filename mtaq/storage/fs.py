"""The file-system interface of the storage layer, and its real implementation on ``os``.

This module holds the only ``os.fsync`` calls in mtaq (a test keeps it so). Everything the log does to the
disk goes through :class:`FileSystem`, so that tests can substitute a file system that forgets what was
never made durable (the crash file system of issue 4, after SQLite's crash VFS).

What must always hold: :meth:`File.write` writes all of ``data`` or raises, and on failure leaves the file
as long as it was before (no half record); a new directory entry is durable only after :meth:`fsync_dir`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Protocol

__all__ = ["File", "FileSystem", "OsFileSystem", "fsync_fd", "make_durable_dirs", "replace_file", "syncfs_fd"]


class File(Protocol):
    """An open file: positional reads, appends at the end, truncation and fsync."""

    path: str

    def size(self) -> int:
        """Current length in bytes (including writes not yet made durable)."""
        ...

    def append(self, data: bytes) -> int:
        """Write ``data`` at the end; return the offset it starts at. Raises OSError; no partial data stays."""
        ...

    def pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at end of file)."""
        ...

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes."""
        ...

    def fsync(self) -> None:
        """Make every write so far durable. Raises OSError (e.g. EIO); callers must treat that as fatal."""
        ...

    def close(self) -> None: ...


class FileSystem(Protocol):
    """What the log needs from a file system. Paths are strings; directories are created by ``makedirs``."""

    def open(self, path: str, *, create: bool = False) -> File:
        """Open ``path`` read-write; with ``create`` it must not exist yet (O_EXCL)."""
        ...

    def read_file(self, path: str) -> bytes: ...

    def listdir(self, path: str) -> list[str]: ...

    def makedirs(self, path: str) -> None: ...

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames, unlinks) durable."""
        ...

    def rename(self, src: str, dst: str) -> None: ...

    def unlink(self, path: str) -> None: ...

    def exists(self, path: str) -> bool: ...

    def free_bytes(self, path: str) -> int:
        """Bytes available to this process on the file system holding ``path``."""
        ...


class _OsFile:
    __slots__ = ("_fd", "_size", "path")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._size = os.fstat(fd).st_size

    def size(self) -> int:
        return self._size

    def append(self, data: bytes) -> int:
        start = self._size
        view = memoryview(data)
        done = 0
        try:
            while done < len(view):
                n = os.pwrite(self._fd, view[done:], start + done)
                if n == 0:  # pragma: no cover - pwrite returns >0 or raises
                    raise OSError(errno.EIO, "short write")
                done += n
        except OSError:
            try:
                os.ftruncate(self._fd, start)  # no half record left behind
            except OSError:
                pass
            raise
        self._size = start + len(view)
        return start

    def pread(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        self._size = size

    def fsync(self) -> None:
        # fdatasync(2): the data and the metadata a later read needs (the size an append or a truncate set, the
        # blocks); not the times. A segment is only ever read by offset, so that is all its durability needs
        # (as LevelDB's and PostgreSQL's logs on Linux), and ext4 may spend less on it (stop 57, after a 2 KiB
        # append on a virtio disk, 4 alternating runs' medians: 0.30-0.34 ms against 0.29-0.42 for fsync).
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class OsFileSystem:
    """The real file system."""

    def open(self, path: str, *, create: bool = False) -> File:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        return _OsFile(path, os.open(path, flags, 0o600))

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def free_bytes(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


def fsync_fd(fd: int) -> None:
    """fsync an open file descriptor (the maildrop's files, written outside the log: mtaq.storage.maildrop).
    Raises OSError; a failure is never retried and trusted (GUIDE I6)."""
    os.fsync(fd)


def syncfs_fd(fd: int) -> None:
    """syncfs(2) the file system that holds the open file ``fd``: every write and directory entry on it is on
    disk when this returns (Linux reports write-back errors since 5.8). For a directory entry made by a process
    that may not open its directory (a local user in the mode-1733 maildrop, which only the daemon can read),
    where :meth:`FileSystem.fsync_dir` is refused. Raises OSError."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def make_durable_dirs(fs: FileSystem, directory: str) -> None:
    """Create ``directory`` and any missing ancestors, and make every entry on its path durable: each
    directory's parent is fsync'd, outermost first, for the directories that exist too. An earlier start
    killed between a mkdir and its parent's fsync leaves an entry that only the page cache holds; a power cut
    in a later run would take the spool with it, and every message that run acknowledged (found by the
    crash-state explorer with receipts in the later run: ``bench/explore.py --later-receive``). So once this
    returns a power cut cannot take any of them away. An existing ancestor that cannot be opened to be
    fsync'd (no read permission for this user: ``PermissionError``) or whose file system says there is
    nothing to fsync (``EROFS``, ``EINVAL``) is passed over. Raises OSError otherwise."""
    chain = []
    d = os.path.abspath(directory)
    while (parent := os.path.dirname(d)) != d:
        chain.append(d)
        d = parent
    for d in reversed(chain):
        made = not fs.exists(d)
        if made:
            fs.makedirs(d)
        try:
            fs.fsync_dir(os.path.dirname(d))
        except OSError as exc:
            # An existing entry that is not ours to make durable: a directory this user cannot open, or a file
            # system that has nothing to write back (read-only, or one that does not fsync directories).
            if made or not (isinstance(exc, PermissionError) or exc.errno in (errno.EROFS, errno.EINVAL)):
                raise


def replace_file(
    fs: FileSystem,
    path: str,
    data: bytes,
    *,
    tmp: str | None = None,
    sync_dir: bool = True,
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Replace ``path`` with ``data`` whole: write ``tmp`` (default ``path + ".tmp"``; one left by a crash is
    removed first), fsync it, call ``before_rename`` (a kill point), rename it over ``path``, and with
    ``sync_dir`` fsync the directory. After a crash ``path`` holds the old content or the new, never a mix;
    with ``sync_dir``, once this returns the new content survives a power cut. Raises OSError."""
    tmp = tmp if tmp is not None else path + ".tmp"
    if fs.exists(tmp):
        fs.unlink(tmp)
    f = fs.open(tmp, create=True)
    try:
        f.append(data)
        f.fsync()
    finally:
        f.close()
    if before_rename is not None:
        before_rename()
    fs.rename(tmp, path)
    if sync_dir:
        fs.fsync_dir(os.path.dirname(path) or ".")
