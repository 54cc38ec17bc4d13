"""An in-memory file system that forgets, on a simulated power loss, whatever was never made durable.

:class:`CrashFileSystem` implements the :class:`~mtaq.storage.fs.FileSystem` protocol entirely in memory,
so that the real log can be driven to a crash at a chosen moment and reopened on what a disk could hold
afterwards. It follows SQLite's crash VFS (``src/test6.c``, "crash" and ``test_vfs.c``: unsynced sectors are
written, dropped or garbled at a crash) and LevelDB's fault-injection test (``db/fault_injection_test.cc``:
per file the size as of the last sync, new files whose directory was never synced are deleted, and
``DropUnsyncedFileData`` / ``DropRandomUnsyncedFileData``).

What it models:

* every file has *durable* contents (as of its last :meth:`File.fsync`) and *current* contents, and keeps
  the writes and truncations made since that fsync in order;
* every directory has *durable* entries (as of its last :meth:`fsync_dir`) and *current* entries, and keeps
  the changes made since (creations, ``makedirs``, unlinks, renames). A file's fsync'd data is durable
  even if its entry is not, but a file whose entry never became durable is unreachable after a crash
  (POSIX: ``fsync`` of a file does not make its name durable; ext4 happens to do so, others do not);
* :meth:`CrashFileSystem.crash` (power loss) rebuilds every reachable file from its durable contents and
  its unsynced changes, and every directory from its durable entries and its unsynced changes. Mode
  ``"keep"`` keeps everything (``kill -9`` with the page cache intact), ``"drop"`` keeps nothing unsynced,
  ``"random"`` decides per change: a write is kept, dropped, garbled (random bytes of the same length) or
  kept only as a prefix (a torn write); either in order (write-back stopped at some write) or
  independently (the page cache writes back out of order), so a write after a dropped one may be kept,
  and the dropped region then reads as zeros; an unsynced truncation is undone or not; each unsynced
  directory change survives or not independently (created files vanish, unlinked ones reappear with
  their durable contents, renames are undone);
* after a crash every open :class:`File` is dead: any call raises ``OSError(EBADF)``;
* for enumerating crash states rather than sampling them (ALICE, CrashMonkey; :mod:`mtaq.testing.explorer`):
  :meth:`CrashFileSystem.pending` lists every unsynced change in the order made, :meth:`CrashFileSystem.crash_to`
  is a power cut that keeps exactly a chosen subset (and tears chosen writes), :meth:`CrashFileSystem.kill`
  is a ``kill -9`` that leaves the page cache as it is (a later cut can still take it),
  :meth:`CrashFileSystem.snapshot` / :meth:`CrashFileSystem.restore` copy the whole state at any moment,
  and ``on_op`` is called after every operation (a snapshot at every system call);
* injected faults: the N-th fsync (file or directory) from now raises EIO and makes nothing durable
  (``fail_fsync_at``); the N-th append raises a chosen errno and leaves the file unchanged
  (``fail_write_errno`` with ``fail_write_at``); the N-th append writes a prefix and raises ENOSPC
  (``short_write_at``), cutting the file back as :class:`~mtaq.storage.fs.OsFileSystem` does (the
  prefix write and the cut are both unsynced changes, so a crash may still show the prefix).

What it does not model: metadata other than names and sizes (no modes, owners, times, link counts),
hard links other than those a crash can produce, sparse-file or block allocation, ``O_APPEND`` or
concurrent writers to one file, read errors, the "fsyncgate" behaviour of Linux (after an fsync EIO the
kernel may mark the pages clean and a later fsync succeed although the data is lost; here the writes
simply stay unsynced), ordering between directories (each directory's changes are decided on their
own, which is weaker than a journalling file system and is what POSIX promises), and sector-sized
tearing (a torn write keeps a prefix of any length).

Every operation is appended to :attr:`CrashFileSystem.ops` as a small tuple (see its docstring).
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mtaq.storage.fs import File

if TYPE_CHECKING:
    from mtaq.storage.fs import FileSystem

__all__ = ["CRASH_MODES", "Change", "CrashFileSystem", "FsSnapshot"]

CRASH_MODES = ("random", "drop", "keep")

Op = tuple[str | int, ...]


@dataclass(slots=True)
class _Write:
    offset: int
    data: bytes
    seq: int = 0  # CrashFileSystem._seq when made: the order of every unsynced change (pending, crash_to)


@dataclass(slots=True)
class _Truncate:
    size: int
    seq: int = 0


@dataclass(eq=False, slots=True)
class _Inode:
    """A regular file: durable contents, current contents, and the changes between them, in order."""

    durable: bytes = b""
    data: bytearray = field(default_factory=bytearray)
    pending: list[_Write | _Truncate] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _DirOp:
    kind: str  # "link" (create, makedirs, rename's arrival), "unlink" (also rename's departure), "rename"
    name: str
    node: _Inode | _Dir
    new_name: str = ""
    seq: int = 0


@dataclass(eq=False, slots=True)
class _Dir:
    """A directory: durable entries, current entries, and the changes between them, in order."""

    durable: dict[str, _Inode | _Dir] = field(default_factory=dict)
    entries: dict[str, _Inode | _Dir] = field(default_factory=dict)
    pending: list[_DirOp] = field(default_factory=list)


def _norm(path: str) -> str:
    """Absolute, normalised path with single slashes (``//x`` becomes ``/x``)."""
    parts = [p for p in os.path.abspath(os.fspath(path)).split("/") if p]
    return "/" + "/".join(parts)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def _oserror(code: int, path: str) -> OSError:
    """``OSError(code, strerror, path)``; the constructor picks the subclass (FileNotFoundError, ...)."""
    return OSError(code, os.strerror(code), path)


def _write_at(buf: bytearray, offset: int, data: bytes) -> None:
    if not data:
        return
    if offset > len(buf):
        buf.extend(bytes(offset - len(buf)))  # a hole reads as zeros
    buf[offset : offset + len(data)] = data


def _truncate(buf: bytearray, size: int) -> None:
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(bytes(size - len(buf)))


def _apply_dir_op(entries: dict[str, _Inode | _Dir], op: _DirOp) -> None:
    """Apply ``op`` to ``entries`` if it still makes sense there (replay after a crash may skip some)."""
    if op.kind == "link":
        entries[op.name] = op.node
    elif op.kind == "unlink":
        if entries.get(op.name) is op.node:
            del entries[op.name]
    elif entries.get(op.name) is op.node:  # rename within one directory: atomic
        del entries[op.name]
        entries[op.new_name] = op.node


def _rebuild_tree(
    root: _Dir, dir_op_survives: Callable[[_DirOp], bool], file_after: Callable[[_Inode], bytearray]
) -> _Dir:
    """The tree a power loss leaves: each directory from its durable entries and the pending changes that
    ``dir_op_survives`` keeps (asked in order, directories visited depth first by sorted name); each reachable
    file from ``file_after`` (its contents after the crash). Everything in the result is durable."""
    memo: dict[int, _Inode | _Dir] = {}

    def rebuild_dir(d: _Dir) -> _Dir:
        done = memo.get(id(d))
        if done is not None:
            assert isinstance(done, _Dir)
            return done
        new = _Dir()
        memo[id(d)] = new
        entries = dict(d.durable)
        for op in d.pending:
            if dir_op_survives(op):
                _apply_dir_op(entries, op)
        for name in sorted(entries):
            node = entries[name]
            new.entries[name] = rebuild_dir(node) if isinstance(node, _Dir) else rebuild_file(node)
        new.durable = dict(new.entries)
        return new

    def rebuild_file(f: _Inode) -> _Inode:
        done = memo.get(id(f))
        if done is not None:
            assert isinstance(done, _Inode)
            return done
        buf = file_after(f)
        new = _Inode(durable=bytes(buf), data=bytearray(buf))
        memo[id(f)] = new
        return new

    return rebuild_dir(root)


@dataclass(frozen=True, slots=True)
class Change:
    """One change not yet made durable (see :meth:`CrashFileSystem.pending`).

    ``seq`` orders every change of the file system as it was made. ``kind`` is ``"write"`` (``path`` is
    the file, ``offset`` and ``nbytes`` the bytes written), ``"truncate"`` (``size``), or a change of the
    directory ``path``: ``"link"`` (a creation, a makedirs or a rename's arrival: ``name``), ``"unlink"``
    (also a rename's departure) or ``"rename"`` (within the directory, atomic: ``name`` -> ``new_name``).
    """

    seq: int
    kind: str
    path: str
    offset: int = 0
    nbytes: int = 0
    size: int = 0
    name: str = ""
    new_name: str = ""

    def __str__(self) -> str:
        if self.kind == "write":
            return f"#{self.seq} write {self.path}@{self.offset}+{self.nbytes}"
        if self.kind == "truncate":
            return f"#{self.seq} truncate {self.path} to {self.size}"
        tail = f" -> {self.new_name}" if self.kind == "rename" else ""
        return f"#{self.seq} {self.kind} {self.path.rstrip('/')}/{self.name}{tail}"


class FsSnapshot:
    """The whole state of a :class:`CrashFileSystem` at one moment (durable and current contents, and the
    changes in between), detached from it: :meth:`CrashFileSystem.restore` makes a new file system from it,
    as often as wanted. Taking one copies the tree's structure, not file contents (bytes are shared)."""

    __slots__ = ("_root", "_seq", "ops")

    def __init__(self, root: _Dir, seq: int, ops: int) -> None:
        self._root = root
        self._seq = seq
        self.ops = ops  # how many operations the file system had recorded


def _copy_tree(root: _Dir) -> _Dir:
    """A structural copy of ``root``: new nodes, shared immutable bytes and change records."""
    memo: dict[int, _Inode | _Dir] = {}

    def node(n: _Inode | _Dir) -> _Inode | _Dir:
        done = memo.get(id(n))
        if done is not None:
            return done
        if isinstance(n, _Inode):
            f = _Inode(durable=n.durable, data=bytearray(n.data), pending=list(n.pending))
            memo[id(n)] = f
            return f
        d = _Dir()
        memo[id(n)] = d
        d.durable = {k: node(v) for k, v in n.durable.items()}
        d.entries = {k: node(v) for k, v in n.entries.items()}
        d.pending = [_DirOp(op.kind, op.name, node(op.node), op.new_name, op.seq) for op in n.pending]
        return d

    out = node(root)
    assert isinstance(out, _Dir)
    return out


class _CrashFile:
    """An open file of a :class:`CrashFileSystem`; dead (EBADF) once closed or after a crash."""

    __slots__ = ("_closed", "_fs", "_generation", "_inode", "path")

    def __init__(self, fs: CrashFileSystem, path: str, inode: _Inode) -> None:
        self._fs = fs
        self._inode = inode
        self._generation = fs.crashes
        self._closed = False
        self.path = path

    def _check(self) -> _Inode:
        if self._closed or self._generation != self._fs.crashes:
            raise _oserror(errno.EBADF, self.path)
        return self._inode

    def size(self) -> int:
        with self._fs.lock:
            return len(self._check().data)

    def append(self, data: bytes) -> int:
        with self._fs.lock:
            inode = self._check()
            start = len(inode.data)
            fail, short = self._fs._append_faults()
            if fail is not None:
                self._fs._record(("append-failed", self.path, start, fail))
                raise _oserror(fail, self.path)
            if short:
                # Like _OsFile: part of the data went in, the disk filled up, the file is cut back.
                part = bytes(data[: len(data) // 2])
                self._fs._write(self.path, inode, start, part)
                self._fs._truncate(self.path, inode, start)
                self._fs._record(("append-failed", self.path, start, errno.ENOSPC))
                raise _oserror(errno.ENOSPC, self.path)
            self._fs._write(self.path, inode, start, bytes(data))
            return start

    def pread(self, offset: int, length: int) -> bytes:
        with self._fs.lock:
            inode = self._check()
            if offset < 0 or length < 0:
                raise _oserror(errno.EINVAL, self.path)
            return bytes(inode.data[offset : offset + length])

    def truncate(self, size: int) -> None:
        with self._fs.lock:
            inode = self._check()
            if size < 0:
                raise _oserror(errno.EINVAL, self.path)
            self._fs._truncate(self.path, inode, size)

    def fsync(self) -> None:
        with self._fs.lock:
            inode = self._check()
            if self._fs._fsync_fault():
                self._fs._record(("fsync-failed", self.path))
                raise _oserror(errno.EIO, self.path)
            inode.durable = bytes(inode.data)
            inode.pending.clear()
            self._fs._record(("fsync", self.path))

    def close(self) -> None:
        with self._fs.lock:
            self._check()
            self._closed = True


class CrashFileSystem:
    """An in-memory :class:`~mtaq.storage.fs.FileSystem` with durable and current state, and :meth:`crash`.

    Paths are strings, made absolute and normalised (``os.path.abspath``); ``/`` always exists and is
    durable. Errors are the ``OSError`` subclasses the real calls raise (FileNotFoundError,
    FileExistsError, NotADirectoryError, IsADirectoryError).

    :attr:`ops` records every operation in order, as tuples:
    ``("create", path)``, ``("makedirs", path)`` (one per directory made), ``("append", path, offset,
    nbytes)``, ``("append-failed", path, offset, errno)``, ``("truncate", path, size)``,
    ``("fsync", path)``, ``("fsync-failed", path)``, ``("fsync_dir", path)``, ``("fsync_dir-failed", path)``,
    ``("rename", src, dst)``, ``("unlink", path)``, ``("crash", mode)`` (mode ``"chosen"`` for
    :meth:`crash_to`), ``("kill",)``.

    Fault injection (counted from when the attribute is set; each fires once, then resets to None):

    * ``fail_fsync_at = N``: the N-th fsync (file or directory) raises EIO and makes nothing durable;
    * ``fail_write_errno = E`` with ``fail_write_at = N``: the N-th append raises ``OSError(E)`` and
      leaves the file unchanged; with ``fail_write_at = None`` every append fails until
      ``fail_write_errno`` is reset;
    * ``short_write_at = N``: the N-th append writes the first half of its data, then the file is cut
      back and ENOSPC raised.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the log fsyncs from a worker thread
        self._root = _Dir()
        self.ops: list[Op] = []
        self.crashes = 0
        self.fail_fsync_at: int | None = None
        self.fail_write_errno: int | None = None
        self.fail_write_at: int | None = None
        self.short_write_at: int | None = None
        self._seq = 0  # numbers every change as it is made (the order pending() lists them in)
        # Called after every operation is recorded in ``ops`` (with the lock held), e.g. to take a
        # snapshot() at every system call (mtaq.testing.explorer). Must not raise.
        self.on_op: Callable[[Op], None] | None = None

    def _record(self, op: Op) -> None:
        self.ops.append(op)
        if self.on_op is not None:
            self.on_op(op)

    # ------------------------------------------------------------------------------------ fault counters
    def _fsync_fault(self) -> bool:
        if self.fail_fsync_at is None:
            return False
        self.fail_fsync_at -= 1
        if self.fail_fsync_at > 0:
            return False
        self.fail_fsync_at = None
        return True

    def _append_faults(self) -> tuple[int | None, bool]:
        """(errno to fail this append with, or None; whether this append is short). Counts one append."""
        fail: int | None = None
        if self.fail_write_errno is not None:
            if self.fail_write_at is None:
                fail = self.fail_write_errno
            else:
                self.fail_write_at -= 1
                if self.fail_write_at <= 0:
                    fail, self.fail_write_errno, self.fail_write_at = self.fail_write_errno, None, None
        short = False
        if self.short_write_at is not None:
            self.short_write_at -= 1
            if self.short_write_at <= 0:
                self.short_write_at = None
                short = True
        return fail, short

    # ------------------------------------------------------------------------------------ changes
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _write(self, path: str, inode: _Inode, offset: int, data: bytes) -> None:
        _write_at(inode.data, offset, data)
        inode.pending.append(_Write(offset, data, self._next_seq()))
        self._record(("append", path, offset, len(data)))

    def _truncate(self, path: str, inode: _Inode, size: int) -> None:
        _truncate(inode.data, size)
        inode.pending.append(_Truncate(size, self._next_seq()))
        self._record(("truncate", path, size))

    def _dir_change(self, d: _Dir, op: _DirOp) -> None:
        op.seq = self._next_seq()
        _apply_dir_op(d.entries, op)
        d.pending.append(op)

    # ------------------------------------------------------------------------------------ lookups
    def _lookup(self, path: str) -> _Inode | _Dir | None:
        """The node at normalised ``path``, None if missing; NotADirectoryError if a parent is a file."""
        node: _Inode | _Dir = self._root
        for name in _parts(path):
            if not isinstance(node, _Dir):
                raise _oserror(errno.ENOTDIR, path)
            nxt = node.entries.get(name)
            if nxt is None:
                return None
            node = nxt
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        """The directory holding normalised ``path`` and the last name; raises if the directory is missing."""
        parent = self._lookup(os.path.dirname(path))
        if parent is None:
            raise _oserror(errno.ENOENT, path)
        if not isinstance(parent, _Dir):
            raise _oserror(errno.ENOTDIR, path)
        return parent, os.path.basename(path)

    def _file(self, path: str) -> _Inode:
        node = self._lookup(path)
        if node is None:
            raise _oserror(errno.ENOENT, path)
        if isinstance(node, _Dir):
            raise _oserror(errno.EISDIR, path)
        return node

    def _dir(self, path: str) -> _Dir:
        node = self._lookup(path)
        if node is None:
            raise _oserror(errno.ENOENT, path)
        if not isinstance(node, _Dir):
            raise _oserror(errno.ENOTDIR, path)
        return node

    # ------------------------------------------------------------------------------------ FileSystem
    def open(self, path: str, *, create: bool = False) -> File:
        """Open ``path`` read-write; with ``create`` it must not exist yet (O_CREAT|O_EXCL)."""
        with self.lock:
            path = _norm(path)
            if not create:
                return _CrashFile(self, path, self._file(path))
            if path == "/":
                raise _oserror(errno.EEXIST, path)
            parent, name = self._parent(path)
            if name in parent.entries:
                raise _oserror(errno.EEXIST, path)
            inode = _Inode()
            self._dir_change(parent, _DirOp("link", name, inode))
            self._record(("create", path))
            return _CrashFile(self, path, inode)

    def read_file(self, path: str) -> bytes:
        with self.lock:
            return bytes(self._file(_norm(path)).data)

    def listdir(self, path: str) -> list[str]:
        with self.lock:
            return sorted(self._dir(_norm(path)).entries)

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents (``exist_ok=True``); each new entry is unsynced in its parent."""
        with self.lock:
            path = _norm(path)
            d = self._root
            cur = ""
            parts = _parts(path)
            for i, name in enumerate(parts):
                cur += "/" + name
                nxt = d.entries.get(name)
                if nxt is None:
                    nxt = _Dir()
                    self._dir_change(d, _DirOp("link", name, nxt))
                    self._record(("makedirs", cur))
                elif not isinstance(nxt, _Dir):
                    raise _oserror(errno.EEXIST if i == len(parts) - 1 else errno.ENOTDIR, cur)
                d = nxt

    def fsync_dir(self, path: str) -> None:
        """Make the directory's current entries durable (not its subdirectories' entries)."""
        with self.lock:
            path = _norm(path)
            d = self._dir(path)
            if self._fsync_fault():
                self._record(("fsync_dir-failed", path))
                raise _oserror(errno.EIO, path)
            d.durable = dict(d.entries)
            d.pending.clear()
            self._record(("fsync_dir", path))

    def rename(self, src: str, dst: str) -> None:
        """POSIX rename: replaces a file at ``dst``; within one directory the change is atomic at a crash,
        across directories it is an unlink and a link that a crash decides separately."""
        with self.lock:
            src, dst = _norm(src), _norm(dst)
            node = self._lookup(src)
            if node is None:
                raise _oserror(errno.ENOENT, src)
            if src == "/" or dst == "/" or dst.startswith(src + "/"):
                raise _oserror(errno.EINVAL, dst)
            sdir, sname = self._parent(src)
            ddir, dname = self._parent(dst)
            old = ddir.entries.get(dname)
            if old is node:
                return
            if isinstance(old, _Dir):
                if not isinstance(node, _Dir):
                    raise _oserror(errno.EISDIR, dst)
                if old.entries:
                    raise _oserror(errno.ENOTEMPTY, dst)
            elif old is not None and isinstance(node, _Dir):
                raise _oserror(errno.ENOTDIR, dst)
            if sdir is ddir:
                self._dir_change(sdir, _DirOp("rename", sname, node, dname))
            else:
                self._dir_change(sdir, _DirOp("unlink", sname, node))
                self._dir_change(ddir, _DirOp("link", dname, node))
            self._record(("rename", src, dst))

    def unlink(self, path: str) -> None:
        with self.lock:
            path = _norm(path)
            inode = self._file(path)
            parent, name = self._parent(path)
            self._dir_change(parent, _DirOp("unlink", name, inode))
            self._record(("unlink", path))

    def free_bytes(self, path: str) -> int:
        """As much as anyone needs: the crash file system lives in memory."""
        return 1 << 62

    def exists(self, path: str) -> bool:
        with self.lock:
            try:
                return self._lookup(_norm(path)) is not None
            except OSError:
                return False

    # ------------------------------------------------------------------------------------ crash
    def crash(self, rng: random.Random, *, mode: str = "random") -> None:
        """Power loss: keep what was durable, and of the rest what ``mode`` (and ``rng``) decide.

        Afterwards the state is what the disk holds (everything durable, nothing pending) and every
        open file is dead. The outcome depends only on the operations so far, ``mode`` and ``rng``.
        """
        if mode not in CRASH_MODES:
            raise ValueError(f"crash mode {mode!r} is not one of {CRASH_MODES}")
        with self.lock:
            self._root = self._rebuild(rng, mode)
            self.crashes += 1
            self._record(("crash", mode))

    def kill(self) -> None:
        """``kill -9`` of the process: every open :class:`File` is dead (EBADF); nothing else changes. The
        page cache keeps every unsynced change, which a later :meth:`crash` (power cut) can still take."""
        with self.lock:
            self.crashes += 1
            self._record(("kill",))

    def pending(self) -> list[Change]:
        """Every change not yet durable, in the order made (ascending ``seq``): writes and truncations of
        files (reachable now or through a durable entry or a pending directory change), and directory
        changes. These are what a power cut may keep or lose (:meth:`crash_to`). Changes nothing."""
        with self.lock:
            out: list[Change] = []
            seen: set[int] = set()
            stack: list[tuple[str, _Inode | _Dir]] = [("/", self._root)]
            while stack:
                path, n = stack.pop()
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if isinstance(n, _Inode):
                    for c in n.pending:
                        if isinstance(c, _Write):
                            out.append(Change(c.seq, "write", path, offset=c.offset, nbytes=len(c.data)))
                        else:
                            out.append(Change(c.seq, "truncate", path, size=c.size))
                    continue
                for op in n.pending:
                    out.append(Change(op.seq, op.kind, path, name=op.name, new_name=op.new_name))
                children: dict[str, _Inode | _Dir] = {**n.durable, **n.entries}
                for op in n.pending:
                    children.setdefault(op.new_name or op.name, op.node)
                for name in sorted(children, reverse=True):
                    stack.append((os.path.join(path, name), children[name]))
            out.sort(key=lambda c: c.seq)
            return out

    def crash_to(self, keep: Collection[int], torn: Mapping[int, int] | None = None) -> None:
        """Power loss with every outcome chosen: of the unsynced changes (:meth:`pending`), exactly those
        whose ``seq`` is in ``keep`` reach the disk; ``torn`` maps the ``seq`` of a write to how many of its
        first bytes reach the disk (a torn write; it need not be in ``keep``). A lost write reads as zeros
        where a later kept write extended the file past it (out-of-order write-back); a lost truncation
        is undone; a lost directory change is undone (a created file vanishes, an unlinked one is back
        with its durable contents, a rename is undone). Deterministic; afterwards as :meth:`crash`."""
        keep = frozenset(keep)
        torn = dict(torn or {})

        def file_after(f: _Inode) -> bytearray:
            buf = bytearray(f.durable)
            for c in f.pending:
                if isinstance(c, _Truncate):
                    if c.seq in keep:
                        _truncate(buf, c.size)
                elif c.seq in torn:
                    _write_at(buf, c.offset, c.data[: torn[c.seq]])
                elif c.seq in keep:
                    _write_at(buf, c.offset, c.data)
            return buf

        with self.lock:
            self._root = _rebuild_tree(self._root, lambda op: op.seq in keep, file_after)
            self.crashes += 1
            self._record(("crash", "chosen"))

    def snapshot(self) -> FsSnapshot:
        """The whole state now (see :class:`FsSnapshot`); later changes do not affect it."""
        with self.lock:
            return FsSnapshot(_copy_tree(self._root), self._seq, len(self.ops))

    @classmethod
    def restore(cls, snap: FsSnapshot) -> CrashFileSystem:
        """A new file system in the state of ``snap`` (as a new process finds it after ``kill -9``: durable
        and unsynced changes as they were, no file open), with an empty ``ops`` list and no faults set."""
        fs = cls()
        fs._root = _copy_tree(snap._root)
        fs._seq = snap._seq
        return fs

    def _rebuild(self, rng: random.Random, mode: str) -> _Dir:
        def survives() -> bool:
            return mode == "keep" or (mode == "random" and rng.random() < 0.5)

        def file_after(f: _Inode) -> bytearray:
            buf = bytearray(f.durable)
            writes = [c for c in f.pending if isinstance(c, _Write)]
            fates = self._write_fates(rng, mode, len(writes))
            i = 0
            for change in f.pending:
                if isinstance(change, _Truncate):
                    if survives():
                        _truncate(buf, change.size)
                    continue
                fate = fates[i]
                i += 1
                data = change.data
                if fate == "drop":
                    continue
                if fate == "garble":
                    data = rng.randbytes(len(data))
                elif fate == "torn":
                    data = data[: rng.randrange(len(data))] if data else data
                _write_at(buf, change.offset, data)
            return buf

        return _rebuild_tree(self._root, lambda _op: survives(), file_after)

    @staticmethod
    def _write_fates(rng: random.Random, mode: str, n: int) -> list[str]:
        """Fate of each unsynced write of one file: "keep", "drop", "garble" or "torn" (a prefix kept)."""
        if mode == "keep":
            return ["keep"] * n
        if mode == "drop" or n == 0:
            return ["drop"] * n
        if rng.random() < 0.5:
            # In order: write-back stopped somewhere; the write it stopped in may be torn or garbled.
            cut = rng.randrange(n + 1)
            fates = ["keep"] * cut + ["drop"] * (n - cut)
            if cut < n:
                fates[cut] = rng.choice(("drop", "torn", "garble"))
            return fates
        # Out of order: each write on its own.
        return rng.choices(("keep", "drop", "garble", "torn"), weights=(4, 2, 1, 1), k=n)

    # ------------------------------------------------------------------------------------ inspection
    def _walk(self, root: _Dir) -> Iterator[tuple[str, _Inode | _Dir]]:
        seen: set[int] = set()
        stack: list[tuple[str, _Dir]] = [("", root)]
        while stack:
            prefix, d = stack.pop()
            if id(d) in seen:
                continue
            seen.add(id(d))
            for name in sorted(d.entries):
                node = d.entries[name]
                path = f"{prefix}/{name}"
                yield path, node
                if isinstance(node, _Dir):
                    stack.append((path, node))

    def files(self) -> dict[str, bytes]:
        """Every reachable file and its current contents (including unsynced writes)."""
        with self.lock:
            return {p: bytes(n.data) for p, n in self._walk(self._root) if isinstance(n, _Inode)}

    def dirs(self) -> set[str]:
        """Every reachable directory (current entries), ``/`` included."""
        with self.lock:
            return {"/"} | {p for p, n in self._walk(self._root) if isinstance(n, _Dir)}

    def durable_snapshot(self) -> dict[str, bytes]:
        """What a crash in mode ``"drop"`` would leave: the files reachable through durable entries, with
        their durable contents. Changes nothing."""
        with self.lock:
            root = self._rebuild(random.Random(0), "drop")
            return {p: bytes(n.data) for p, n in self._walk(root) if isinstance(n, _Inode)}

    def unsynced(self) -> dict[str, int]:
        """Files with changes not yet fsync'd, and how many changes each has (for tests' own checks)."""
        with self.lock:
            return {p: len(n.pending) for p, n in self._walk(self._root) if isinstance(n, _Inode) and n.pending}


def _conforms(fs: CrashFileSystem, f: _CrashFile) -> tuple[FileSystem, File]:
    """Never called: makes mypy check that the classes satisfy the protocols of mtaq.storage.fs."""
    return fs, f
