"""A file system that fails on demand: the real one (``OsFileSystem``), except that fsync can raise EIO and
appends can raise a chosen errno (ENOSPC). It stands in for a failing disk, which a test cannot get for real.
The full crash file system (drop unsynced writes, forget directory entries) is :mod:`mtaq.testing.crashfs`.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mtaq.storage.fs import File, OsFileSystem

__all__ = ["FaultyFileSystem"]


class _FaultyFile:
    def __init__(self, inner: File, fs: FaultyFileSystem) -> None:
        self._inner = inner
        self._fs = fs
        self.path = inner.path
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        self.closed = True
        self._inner.close()

    def fsync(self) -> None:
        if self._fs.fsync_delay_s:
            time.sleep(self._fs.fsync_delay_s)  # runs in the log's fsync thread, like a slow disk
        if self._fs.fsync_gate is not None:
            self._fs.fsync_gate.wait()  # a disk that answers only when the test says so
        if self._fs.fail_fsync:
            raise OSError(errno.EIO, "Input/output error")
        if self.closed:
            # What the closed descriptor gives when its number was not reused; when it was, the real
            # os.fsync would silently sync another file: a use after close is always reported here.
            raise OSError(errno.EBADF, f"fsync of {self.path} after it was closed")
        self._inner.fsync()

    def pread(self, offset: int, n: int) -> bytes:
        if self._fs.fail_pread is not None:
            raise OSError(self._fs.fail_pread, "injected read failure")
        data = self._inner.pread(offset, n)
        if self._fs.reads is not None:
            self._fs.reads.append((self.path, offset, len(data), threading.current_thread().name))
        return data

    def append(self, data: bytes) -> int:
        if self._fs.fail_append is not None:
            raise OSError(self._fs.fail_append, "injected failure")
        with self._fs.lock:
            if self._fs.room is not None:
                if len(data) > self._fs.room:
                    raise OSError(errno.ENOSPC, "No space left on device (injected: room used up)")
                self._fs.room -= len(data)
        return self._inner.append(data)

    def truncate(self, size: int) -> None:
        if self._fs.fail_truncate is not None:
            raise OSError(self._fs.fail_truncate, "injected truncate failure")
        self._inner.truncate(size)


class FaultyFileSystem(OsFileSystem):
    """Set ``fail_fsync = True``, ``fail_append = errno.ENOSPC`` or ``fail_create = errno.ENOSPC`` (creating a
    file, e.g. the next segment) to make the next calls fail, ``fail_open = errno.EMFILE`` (opening an
    existing file), ``fail_pread = errno.EIO`` (reading) or ``fail_truncate = errno.EIO``, and ``fsync_delay_s`` to make every fsync that
    slow. ``opened`` counts the files opened. ``room = N`` (bytes) is a nearly full disk: appends take from it,
    and one larger than what is left fails with ENOSPC and writes nothing (None: no limit); an unlink gives
    the file's bytes back. ``reads`` set to a
    list records every read as ``(path, offset, bytes read, thread name)``."""

    def __init__(self) -> None:
        self.fsync_delay_s = 0.0
        self.fsync_gate: threading.Event | None = None
        self.fail_fsync = False
        self.fail_append: int | None = None
        self.fail_create: int | None = None
        self.fail_open: int | None = None
        self.fail_pread: int | None = None
        self.fail_truncate: int | None = None
        self.opened = 0
        self.room: int | None = None
        self.reads: list[tuple[str, int, int, str]] | None = None
        self.lock = threading.Lock()
        self.before_read_file: Callable[[str], None] | None = None

    def read_file(self, path: str) -> bytes:
        """As :class:`OsFileSystem`, after calling ``before_read_file(path)`` when set (in the reading thread)."""
        if self.before_read_file is not None:
            self.before_read_file(path)
        return super().read_file(path)

    def free_bytes(self, path: str) -> int:
        """As :class:`OsFileSystem`, but never more than ``room`` when it is set."""
        free = super().free_bytes(path)
        return free if self.room is None else min(free, self.room)

    def unlink(self, path: str) -> None:
        """As :class:`OsFileSystem`; on a disk with ``room`` set, the file's bytes become room again."""
        size = os.path.getsize(path) if self.room is not None and os.path.exists(path) else 0
        super().unlink(path)
        with self.lock:
            if self.room is not None:
                self.room += size

    def open(self, path: str, *, create: bool = False) -> File:
        if create and self.fail_create is not None:
            raise OSError(self.fail_create, "injected failure creating a file")
        if not create and self.fail_open is not None:
            raise OSError(self.fail_open, "injected failure opening a file")
        self.opened += 1
        return _FaultyFile(super().open(path, create=create), self)
