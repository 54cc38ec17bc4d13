"""Power cuts for the kill -9 harness: make the real daemon lose what it never made durable.

``kill -9`` alone cannot catch a missing fsync: the killed process's writes stay in the page cache and
the restarted daemon reads them back. With ``MTAQ_TEST_FS=powercut`` in its environment the daemon uses
:class:`PowerCutFileSystem`, the real file system plus a ledger (``SPOOL/.powercut-ledger``, one line per
event, written without fsync since only the process dies) of what was made durable: the size of a file
at each successful fsync, the entries of a directory at each directory fsync, and renames. After killing
the daemon, the harness calls :func:`cut`, which undoes what a power cut would have lost:

* a file whose directory entry was never made durable by a directory fsync is removed;
* every other file is cut back to its size at its last fsync (0 if it was never fsync'd).

Not simulated: an unlink or a rename whose directory fsync never came is not undone (the old contents are
gone), and written-but-unsynced data is always dropped, never garbled (the in-process crash file system,
:mod:`mtaq.testing.crashfs`, covers garbling and reordering).

``MTAQ_TEST_FS=powercut-nofsync`` is the negative control: fsync and directory fsync do nothing and are
not recorded, as if durability were broken; a harness run with it must find acknowledged mail lost.

Nothing here is used unless the environment variable is set (tests and ``bench/crash.py`` only).
"""

from __future__ import annotations

import os
import threading

from mtaq.storage.fs import File, FileSystem, OsFileSystem

__all__ = ["LEDGER_NAME", "PowerCutFileSystem", "cut", "from_env"]

LEDGER_NAME = ".powercut-ledger"
ENV = "MTAQ_TEST_FS"


class _LedgerFile:
    """A real file whose successful fsyncs are written to the ledger."""

    __slots__ = ("_fs", "_inner", "path")

    def __init__(self, fs: PowerCutFileSystem, inner: File, path: str) -> None:
        self._fs = fs
        self._inner = inner
        self.path = path

    def size(self) -> int:
        return self._inner.size()

    def append(self, data: bytes) -> int:
        return self._inner.append(data)

    def pread(self, offset: int, length: int) -> bytes:
        return self._inner.pread(offset, length)

    def truncate(self, size: int) -> None:
        self._inner.truncate(size)

    def fsync(self) -> None:
        if not self._fs.fsync_works:
            return
        self._inner.fsync()
        self._fs._record("F", self.path, str(self._inner.size()))

    def close(self) -> None:
        self._inner.close()


class PowerCutFileSystem(OsFileSystem):
    """:class:`OsFileSystem` that keeps a ledger of what is durable (see the module docstring).

    ``fsync_works=False`` turns every fsync into a no-op that records nothing (the negative control).
    """

    def __init__(self, spool: str, *, fsync_works: bool = True) -> None:
        os.makedirs(spool, exist_ok=True)
        self.fsync_works = fsync_works
        self._lock = threading.Lock()  # fsyncs run in the commit thread and in checkpoint threads
        self._ledger = open(os.path.join(spool, LEDGER_NAME), "a", encoding="utf-8", buffering=1)

    def _record(self, *fields: str) -> None:
        with self._lock:
            self._ledger.write("\t".join(fields) + "\n")

    def open(self, path: str, *, create: bool = False) -> File:
        return _LedgerFile(self, super().open(path, create=create), os.path.abspath(path))

    def fsync_dir(self, path: str) -> None:
        if not self.fsync_works:
            return
        super().fsync_dir(path)
        path = os.path.abspath(path)
        self._record("D", path, *sorted(os.listdir(path)))

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._record("R", os.path.abspath(src), os.path.abspath(dst))


def from_env(spool: str) -> FileSystem | None:
    """The file system ``MTAQ_TEST_FS`` asks for (``powercut`` or ``powercut-nofsync``), or None if unset.

    Raises ValueError for any other value, so that a typo cannot silently test the wrong thing.
    """
    mode = os.environ.get(ENV, "")
    if not mode:
        return None
    if mode not in ("powercut", "powercut-nofsync"):
        raise ValueError(f"{ENV}={mode!r}: expected 'powercut' or 'powercut-nofsync'")
    return PowerCutFileSystem(spool, fsync_works=mode == "powercut")


def cut(spool: str) -> dict[str, int]:
    """Apply a power cut to ``spool`` after the daemon was killed; returns what it undid.

    Returns ``{"files_removed": n, "files_cut": n, "bytes_dropped": n}``. Every regular file under the
    spool (the ledger excepted) is judged by the ledger: removed if its directory was fsync'd without it
    (or never fsync'd at all), else cut back to its last fsync'd size. Shard directories (``shard-k``) are
    cut by their own ledgers.
    """
    synced: dict[str, int] = {}
    listing: dict[str, set[str]] = {}
    path = os.path.join(spool, LEDGER_NAME)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        lines = []
    for line in lines[:-1]:  # the last piece is "" or a line cut by the kill
        kind, *rest = line.split("\t")
        if kind == "F" and len(rest) == 2 and rest[1].isdigit():
            synced[rest[0]] = int(rest[1])
        elif kind == "D" and rest:
            listing[rest[0]] = set(rest[1:])
        elif kind == "R" and len(rest) == 2:
            src, dst = rest
            if src in synced:
                synced[dst] = synced.pop(src)
            else:
                synced.pop(dst, None)
    out = {"files_removed": 0, "files_cut": 0, "bytes_dropped": 0}
    root = os.path.abspath(spool)
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            # The shards of a sharded spool (mtaq.workers) keep their own ledgers: each is cut by its own.
            for d in [d for d in dirs if d.startswith("shard-") and d[6:].isdigit()]:
                dirs.remove(d)
                for k, v in cut(os.path.join(root, d)).items():
                    out[k] += v
        for name in files:
            p = os.path.join(dirpath, name)
            if p == os.path.join(root, LEDGER_NAME):
                continue
            size = os.path.getsize(p)
            if name not in listing.get(dirpath, set()):
                os.unlink(p)
                out["files_removed"] += 1
                out["bytes_dropped"] += size
                continue
            keep = synced.get(p, 0)
            if size > keep:
                os.truncate(p, keep)
                out["files_cut"] += 1
                out["bytes_dropped"] += size - keep
    return out
