"""Power cuts for the kill -9 harness: make the real daemon lose what it never made durable.

``kill -9`` alone cannot catch a missing fsync: the killed process's writes stay in the page cache and
the restarted daemon reads them back. With ``MTAQ_TEST_FS=powercut`` in its environment the daemon uses
:class:`PowerCutFileSystem`, the real file system plus a ledger (``SPOOL/.powercut-ledger``, one line per
event, written without fsync since only the process dies) of what was made durable: the size of a file
at each successful fsync, the entries of a directory at each directory fsync, and renames. After killing
the daemon, the harness calls :func:`cut`, which undoes what a power cut would have lost:

* a file whose directory entry was never made durable by a directory fsync is removed;
* every other file is cut back to its size at its last fsync (0 if it was never fsync'd).

With ``reorder`` (a :class:`random.Random`), the cut is what a disk's out-of-order write-back leaves: of
the unsynced bytes of a file, each 4 KiB page (``PAGE_BYTES``, aligned to the file) independently either
reached the disk whole or not at all; pages that did not are zeros where a later page survived, and the
file ends after the last page that survived (or at its last fsync). That is how an earlier record can be
lost while a later one survives (ALICE, OSDI 2014).

The ledger outlives the process: it is appended to by every run on the spool and read whole by
:func:`cut`, so a run killed without a cut (``kill -9`` alone: its unsynced writes stay in the page cache
and the next run reads them) leaves its unsynced bytes droppable by a cut after any later run, unless a
later run fsyncs them (an fsync records the file's size whoever wrote it) or a later cut kept them. A file
created anew (``create=True``), truncated or unlinked forgets what was fsync'd under its name before
(``C``, ``T`` and ``U`` lines), so that a new file of an old name is not trusted with the old one's size.

Not simulated: an unlink or a rename whose directory fsync never came is not undone (the old contents are
gone), and written-but-unsynced data is never garbled (the in-process crash file system,
:mod:`mtaq.testing.crashfs`, covers garbling).

``MTAQ_TEST_FS=powercut-nofsync`` is the negative control: fsync and directory fsync do nothing and are
not recorded, as if durability were broken; a harness run with it must find acknowledged mail lost.

Nothing here is used unless the environment variable is set (tests and ``bench/crash.py`` only).
"""

from __future__ import annotations

import os
import random
import threading

from mtaq.storage.fs import File, FileSystem, OsFileSystem

__all__ = ["LEDGER_NAME", "PAGE_BYTES", "PowerCutFileSystem", "cut", "from_env"]

LEDGER_NAME = ".powercut-ledger"
PAGE_BYTES = 4096
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
        self._fs._record("T", self.path, str(size))  # bytes rewritten past ``size`` are not durable yet

    def fsync(self) -> None:
        if not self._fs.fsync_works:
            return
        size = self._inner.size()  # what this fsync covers for sure (appends can land while it runs)
        self._inner.fsync()
        self._fs._record("F", self.path, str(size))

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
        path = os.path.join(spool, LEDGER_NAME)
        self._ledger = open(path, "a", encoding="utf-8", buffering=1)
        if self._ledger.tell() > 0:
            with open(path, "rb") as f:  # an earlier run killed mid-line: start this run's lines on a line of their own
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._ledger.write("\n")

    def _record(self, *fields: str) -> None:
        with self._lock:
            self._ledger.write("\t".join(fields) + "\n")

    def open(self, path: str, *, create: bool = False) -> File:
        f = _LedgerFile(self, super().open(path, create=create), os.path.abspath(path))
        if create:
            self._record("C", f.path)  # a new file: nothing of it is durable, whatever an old one of its name was
        return f

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self._record("U", os.path.abspath(path))

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


def _reorder_cut(path: str, keep: int, size: int, rng: random.Random) -> tuple[int, int]:
    """Keep each unsynced 4 KiB page of ``path`` (bytes ``keep``..``size``) with probability 1/2, zero the
    others, end the file after the last kept page; returns (bytes dropped, pages kept)."""
    first = keep // PAGE_BYTES
    last = (size - 1) // PAGE_BYTES
    kept = [i for i in range(first, last + 1) if rng.random() < 0.5]
    new_size = min(size, (kept[-1] + 1) * PAGE_BYTES) if kept else keep
    with open(path, "r+b") as f:
        for i in range(first, last + 1):
            if i in kept:
                continue
            start, end = max(keep, i * PAGE_BYTES), min(new_size, (i + 1) * PAGE_BYTES)
            if start < end:
                f.seek(start)
                f.write(bytes(end - start))
        f.truncate(new_size)
    dropped = (size - new_size) + sum(max(0, min(new_size, (i + 1) * PAGE_BYTES) - max(keep, i * PAGE_BYTES))
                                      for i in range(first, last + 1) if i not in kept)
    return dropped, len(kept)


def cut(spool: str, *, reorder: random.Random | None = None) -> dict[str, int]:
    """Apply a power cut to ``spool`` after the daemon was killed; returns what it undid.

    Returns ``{"files_removed": n, "files_cut": n, "bytes_dropped": n, "pages_kept": n}``. Every regular file
    under the spool (the ledger excepted) is judged by the ledger: removed if its directory was fsync'd
    without it (or never fsync'd at all), else cut back to its last fsync'd size, or, with ``reorder``,
    left with a random subset of its unsynced pages (see the module docstring). Shard directories
    (``shard-k``) are cut by their own ledgers.
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
        elif kind == "T" and len(rest) == 2 and rest[1].isdigit():
            if rest[0] in synced:
                synced[rest[0]] = min(synced[rest[0]], int(rest[1]))
        elif kind in ("C", "U") and len(rest) == 1:
            synced.pop(rest[0], None)
        elif kind == "D" and rest:
            listing[rest[0]] = set(rest[1:])
        elif kind == "R" and len(rest) == 2:
            src, dst = rest
            if src in synced:
                synced[dst] = synced.pop(src)
            else:
                synced.pop(dst, None)
    out = {"files_removed": 0, "files_cut": 0, "bytes_dropped": 0, "pages_kept": 0}
    removed: list[str] = []  # files the cut took: a later file of the same name starts from nothing
    after: list[str] = []  # files left: what the cut leaves is what the disk holds from now on
    root = os.path.abspath(spool)
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            # The shards of a sharded spool (mtaq.daemon.workers) keep their own ledgers: each is cut by its own.
            for d in [d for d in dirs if d.startswith("shard-") and d[6:].isdigit()]:
                dirs.remove(d)
                for k, v in cut(os.path.join(root, d), reorder=reorder).items():
                    out[k] += v
        for name in files:
            p = os.path.join(dirpath, name)
            if p == os.path.join(root, LEDGER_NAME):
                continue
            size = os.path.getsize(p)
            if name not in listing.get(dirpath, set()):
                os.unlink(p)
                removed.append(p)
                out["files_removed"] += 1
                out["bytes_dropped"] += size
                continue
            keep = synced.get(p, 0)
            after.append(p)
            if size > keep:
                out["files_cut"] += 1
                if reorder is not None:
                    dropped, pages = _reorder_cut(p, keep, size, reorder)
                    out["bytes_dropped"] += dropped
                    out["pages_kept"] += pages
                else:
                    os.truncate(p, keep)
                    out["bytes_dropped"] += size - keep
    # After the cut, what survived is on the disk: a later cut must not take away the unsynced pages this
    # one kept, which the next start read and built on.
    with open(path, "a", encoding="utf-8") as f:
        if lines[-1:] not in ([], [""]):
            f.write("\n")  # the kill cut the last line: the cut's lines start on a line of their own
        for p in removed:
            f.write(f"U\t{p}\n")
        for p in after:
            if os.path.exists(p):
                f.write(f"F\t{p}\t{os.path.getsize(p)}\n")
        for d in sorted({os.path.dirname(p) for p in after}):
            f.write("\t".join(["D", d, *sorted(os.listdir(d))]) + "\n")
    return out
