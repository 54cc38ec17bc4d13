"""The queue log on disk: numbered segments, appends, group commit, reads and start-up tail repair.

The log is a directory of segment files ``000000000001.seg``, ``000000000002.seg``, ... (format in
docs/log_format.md). Appends go to the newest segment; when a record would take it past
``segment_bytes_max`` bytes the segment is sealed (a SEAL record) and a new one is created.

Group commit (GUIDE §3): :meth:`Log.append` writes at once (into the page cache) and returns the record's
position and a log sequence number (LSN); ``await log.commit(lsn)`` resolves when one fsync round that
covers ``lsn`` has finished. One round fsyncs every segment written since the last round, in order, and the
directory when a segment was created, so a record is acknowledged only when everything before it is durable.
Records that are only book-keeping (START, FINISH, replacement envelopes) are appended without waiting and
ride on the next round.

What must always hold:

* nothing is acknowledged from a segment whose directory entry is not durable;
* after an fsync fails, nothing more is appended or acknowledged: every waiter and every later call gets
  :class:`StorageFatal`, the process exits, and recovery re-reads what is really on disk (GUIDE I6);
* a failed append leaves no partial record (the file is cut back) and raises :class:`StorageFull` (ENOSPC)
  or :class:`StorageError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import math
import os
import queue
import secrets
import threading
import time
import weakref
import zlib
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from mtaq.core.errors import CorruptRecord, StorageError, StorageFatal, StorageFull
from mtaq.core.frame import (
    FRAME_HEADER_BYTES,
    RECORD_BYTES_MAX,
    SEGMENT_FLAG_START,
    SEGMENT_HEADER_BYTES,
    BadFrame,
    Frame,
    HeaderError,
    Problem,
    SegmentHeader,
    SegmentScan,
    decode_frame,
    decode_segment_header,
    encode_frame,
    encode_segment_header,
    frame_crc,
    frame_head,
    salvage_segment_header,
    scan_segment,
)
from mtaq.core.records import (
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    PayloadError,
    Pos,
    Record,
    RecordType,
    SealRecord,
    StartRecord,
    decode_payload,
    encode_data_prefix,
    encode_payload,
)
from mtaq.storage.fs import File, FileSystem, make_durable_dirs
from mtaq.testing import killpoints

FILES_OPEN_MAX = 64  # segment files kept open for reading (besides those being written)
PIECE_BYTES = 64 * 1024  # bytes per read of Log.read_payload
RESERVE_NAME = "reserve"  # LOG_DIR/reserve: room kept for a full disk (Log.keep_reserve)
RESERVE_BYTES = 1 << 20
"""Bytes of the reserve file: a new segment and a few thousand records (STARTs, DELIVERY records, FINISHes)
of the deliveries that free space, and the checkpoint that lets reclamation delete their segments."""

__all__ = ["ENVELOPES_LISTED_MAX", "FILES_OPEN_MAX", "FREE_BYTES_TTL_S", "KEYED_SEGMENTS_MAX", "PIECE_BYTES", "RESERVE_BYTES", "RESERVE_NAME", "Log",
           "LogStats", "OpenReport", "RecoveredEnvelopes", "SyncClosed", "SyncThread", "list_segments", "release_reserve", "scan_log", "segment_path",
           "storage_error"]

_SUFFIX = ".seg"
FREE_BYTES_TTL_S = 0.25  # how old the free-space figure of Log.free_bytes may be, in seconds


ENVELOPES_LISTED_MAX = 1 << 20
"""Positions of the ENVELOPE frames a Log appended that it keeps listed for the queue runners (8 bytes each:
8 MiB at most); when there are more, the oldest half is dropped. (16,384 Pos objects before, about 90 bytes
each: a flush of a 100,000-message backlog appends 100,000 replacement envelopes, and every runner walked
the frames of all but the newest 16,384.)"""


# A position as one integer (the envelope lists of Log and RecoveredEnvelopes): segment << 34 | offset. A
# segment holds at most 4 GiB and one record (256 MiB) more (config.segment_bytes_max), so an offset < 2**33;
# once a segment numbered KEYED_SEGMENTS_MAX or more is appended to, nothing is listed any more (the cursors
# walk the frames; Log.next_envelope answers False), and recovery lists nothing (RecoveredEnvelopes).
_OFFSET_BITS = 34
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
KEYED_SEGMENTS_MAX = 1 << (63 - _OFFSET_BITS)


def _key(pos: Pos) -> int:
    return pos.segment << _OFFSET_BITS | pos.offset


def _pos(key: int) -> Pos:
    return Pos(key >> _OFFSET_BITS, key & _OFFSET_MASK)


def _next_listed(listed: array[int], pos: Pos, end: Pos) -> Pos | None:
    """The first position in ``listed`` (keys, ascending) at or after ``pos`` and before ``end``, or None."""
    i = bisect_left(listed, _key(pos))
    if i < len(listed) and (key := listed[i]) < _key(end):
        return _pos(key)
    return None


class RecoveredEnvelopes:
    """Where recovery read the ENVELOPE frames of the segments of earlier runs, by queue runner: what
    :meth:`Log.next_envelope` is for the frames this process appends, for the frames it found (issue 36.4).

    Recovery reads every frame of the segments from ``floor`` to ``end`` (the segment this process appends
    to) and checks each one's checksum (DATA frames included); damage it finds is moved aside and reported
    then. A runner's cursor in that stretch therefore need not walk and check the frames again, nor decode
    the envelopes of other runners: it goes straight to the next envelope of its own
    (:meth:`mtaq.storage.cursor.LogCursor.peek_envelope` with ``runner``), which it still reads and checks.
    ``runner`` is the runner that reads the envelope (``min(EnvelopeRecord.runner, runners - 1)``; parked
    envelopes are not listed). Positions are kept as 8-byte integers (8 MB for a million envelopes), added
    in log order; ``end.segment`` must be below ``KEYED_SEGMENTS_MAX`` (recovery lists nothing otherwise).
    """

    __slots__ = ("_by_runner", "end", "floor")

    def __init__(self, floor: Pos, end: Pos) -> None:
        self.floor = floor
        self.end = end
        self._by_runner: dict[int, array[int]] = {}

    def add(self, runner: int, pos: Pos) -> None:
        """List the envelope at ``pos`` (in ``[floor, end)``, after every one listed before) for ``runner``."""
        listed = self._by_runner.get(runner)
        if listed is None:
            listed = self._by_runner[runner] = array("q")
        listed.append(_key(pos))

    def __len__(self) -> int:
        return sum(len(a) for a in self._by_runner.values())

    def next(self, runner: int, pos: Pos, end: Pos) -> Pos | None:
        """The first envelope of ``runner`` at or after ``pos`` and before ``end``; None if there is none.
        A binary search, no I/O."""
        listed = self._by_runner.get(runner)
        return _next_listed(listed, pos, end) if listed else None


def segment_path(directory: str, number: int) -> str:
    """Path of segment ``number`` in the log directory."""
    return os.path.join(directory, f"{number:012d}{_SUFFIX}")


def list_segments(fs: FileSystem, directory: str) -> list[int]:
    """Segment numbers present in ``directory``, ascending (other files are ignored)."""
    out = []
    for name in fs.listdir(directory):
        stem, _, ext = name.rpartition(".")
        if "." + ext == _SUFFIX and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def scan_log(fs: FileSystem, directory: str, *, decode: bool = True) -> Iterator[SegmentScan]:
    """Read every segment of the log in order, without changing anything (for dump and verify)."""
    for n in list_segments(fs, directory):
        yield scan_segment(n, fs.read_file(segment_path(directory, n)), decode=decode)


def _set_result(fut: asyncio.Future[Any], result: object = None) -> None:
    """Set ``fut``'s result unless it is done already (cancelled, or settled by a failure)."""
    if not fut.done():
        fut.set_result(result)


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for f in waiters:
        if not f.done():
            f.set_result(None)


_T = TypeVar("_T")


class SyncClosed(RuntimeError):
    """A call to a :class:`SyncThread` after its :meth:`SyncThread.shutdown` (the log was closed)."""


class SyncThread:
    """The one thread that runs a log's fsync calls (``Log._commit_loop``: one round at a time), so that the
    event loop never waits for the disk.

    It replaces a one-thread ``ThreadPoolExecutor``: ``loop.run_in_executor`` cost 0.10 ms a round more than
    the same ``fdatasync`` called inline, this thread 0.06 ms (uvloop, idle loop, 2 KiB appended, the ways
    alternating, medians of 1,500 rounds, 3 runs; docs/performance.md, "Stop 59"). Here the thread takes a call from a
    ``queue.SimpleQueue``, runs it, and hands the result to the caller's loop with one
    ``call_soon_threadsafe``; the executor also took the pool's locks, a work item, a concurrent Future and
    its callbacks on both sides.

    :meth:`call` returns a future of the caller's running loop that gets the call's result or the exception
    it raised (OSError from an fsync). Calls run one at a time in the order made. A caller that stops
    waiting (its future cancelled) does not stop the call: it runs to its end and its result is dropped.

    The thread starts on the first call (again in a child made by fork(2), which has none). It is a daemon
    thread: the daemon's stop is kill -9, and an exit does not wait for a call in flight (the executor's
    thread was joined at exit; nothing is acknowledged before its fsync returned either way). It keeps no
    reference to this object, nor to a call once run: :meth:`shutdown`, or this object being
    garbage-collected, ends it after the calls already made (its end mark is put on the queue by a
    ``weakref.finalize``; ``SimpleQueue.put`` may be called from one, in any thread). A call after
    :meth:`shutdown` raises :class:`SyncClosed`.
    """

    __slots__ = ("__weakref__", "_calls", "_closed", "_ender", "_lock", "_pid", "_thread")

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any],
                                             tuple[object, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # call and shutdown, from any thread: no call queued after the end mark
        self._thread: threading.Thread | None = None
        self._ender: weakref.finalize[..., SyncThread] | None = None  # queues the end mark once
        self._pid = os.getpid()  # the process whose thread this is
        self._closed = False

    def call(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """Run ``fn(*args)`` in the thread; the returned future (of the running loop) gets what it returns or
        raises. Must be called from a running event loop. Raises SyncClosed after :meth:`shutdown`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            if self._closed:
                raise SyncClosed("the log is closed: no fsync round can run")
            if self._thread is None:
                self._thread = threading.Thread(target=_sync_thread_run, args=(self._calls,), name="mtaq-fsync",
                                                daemon=True)
                self._thread.start()
                self._ender = weakref.finalize(self, _sync_thread_end, self._calls)
                self._ender.atexit = False
            self._calls.put((loop, fut, fn, args))
        return fut

    def _forked(self) -> None:
        """In a child made by fork(2): no thread, and the parent's queue and lock may have been held by one of
        its threads at the fork. Fresh ones; the parent's end mark is not this process's to queue."""
        if self._ender is not None:
            self._ender.detach()
        self._ender, self._thread = None, None
        self._calls = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def shutdown(self, wait: bool = False) -> None:
        """End the thread once the calls already made have run (``wait``: and wait for that); later calls
        raise SyncClosed."""
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            self._closed = True
            thread, ender = self._thread, self._ender
        if ender is not None:
            ender()  # the end mark after the calls made (a finalize runs at most once)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


def _sync_thread_end(calls: queue.SimpleQueue[Any]) -> None:
    """Queue the end mark for a :class:`SyncThread`'s thread (its shutdown, or the object collected)."""
    calls.put(None)


def _sync_thread_run(calls: queue.SimpleQueue[Any]) -> None:
    """A :class:`SyncThread`'s thread: the calls in order until the end mark. Between calls it holds nothing
    of the last one (its function is a bound method of the Log: holding it would keep the Log, and so the
    SyncThread, from being collected, and the thread from ending)."""
    while True:
        item = calls.get()
        if item is None:
            return
        loop, fut, fn, args = item
        item = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller, as the executor did
            done: Callable[[], None] = functools.partial(_settle_exception, fut, exc)
        else:
            done = functools.partial(_set_result, fut, result)
            result = None
        fn = args = fut = None
        try:
            loop.call_soon_threadsafe(done)
        except Exception:  # the caller's loop is closed (RuntimeError): nobody waits any more
            pass
        loop = done = None  # type: ignore[assignment]


def _settle_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class _Callback:
    """A commit waiter that is a function called at the end of the covering round (see Log.when_durable); it
    answers the part of the Future interface that the commit loop and Log._fail use."""

    __slots__ = ("_done", "fn", "t0", "timer")

    def __init__(self, fn: Callable[[StorageFatal | None], None], timer: Callable[[float], None] | None) -> None:
        self.fn = fn
        self.t0 = time.monotonic()
        self.timer = timer
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, _result: None) -> None:
        self._finish(None)

    def set_exception(self, exc: BaseException) -> None:
        assert isinstance(exc, StorageFatal)
        self._finish(exc)

    def _finish(self, exc: StorageFatal | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            if exc is None and self.timer is not None:
                self.timer(time.monotonic() - self.t0)
            self.fn(exc)
        except Exception as err:  # never break the commit loop: report it as asyncio reports a callback's error
            asyncio.get_running_loop().call_exception_handler(
                {"message": "exception in a Log.when_durable callback", "exception": err})


@dataclass
class LogStats:
    """Counters since the process started."""

    records_appended: int = 0
    bytes_appended: int = 0
    commit_rounds: int = 0  # group-commit rounds (each fsyncs all dirty files)
    fsync_calls: int = 0  # file + directory fsync system calls
    fsync_seconds: float = 0.0
    segments_created: int = 0
    reserve_released: int = 0  # times the reserve file was given up for a full disk (issue 31.9)


@dataclass
class OpenReport:
    """What :meth:`Log.open` found and repaired before accepting appends."""

    segments: list[int] = field(default_factory=list)  # present after repair, excluding the new one
    scans: dict[int, SegmentScan] = field(default_factory=dict)  # scans already done (reusable)
    repaired: list[Problem] = field(default_factory=list)  # torn tails truncated, torn segments removed
    unsealed: set[int] = field(default_factory=set)  # segments found unsealed (being written at the crash)
    new_segment: int = 0
    baseline_fsyncs: int = 0  # fsync calls that made every existing segment durable before anything was read


_make_durable_dirs = make_durable_dirs  # the name Log.open uses


def release_reserve(fs: FileSystem, directory: str) -> bool:
    """Delete the reserve file of the log in ``directory`` (``LOG_DIR/reserve``, room kept for a full disk;
    see :meth:`Log.keep_reserve`): True if there was one. Never raises (False on any error). The daemon calls
    this before :meth:`Log.open` when the disk has less than ``RESERVE_BYTES`` free, so that sealing the
    last segment, creating the new one, recovery and the deliveries that free space can be written."""
    try:
        fs.unlink(os.path.join(directory, RESERVE_NAME))
    except OSError:
        return False
    return True


def _durable_baseline(fs: FileSystem, directory: str, numbers: list[int]) -> int:
    """Make every existing segment, the log directory and its parent (the spool) durable before anything is read or
    trusted (GUIDE I7; PostgreSQL's ``SyncDataDirectory`` after a crash). A run killed with kill -9 leaves
    its unsynced writes in the page cache: this run would read them back, act on them and checkpoint past
    them, and a power cut one run later could still take them. Returns the number of fsync calls. Raises
    OSError (the caller makes it a StorageError: the daemon does not start on a spool it cannot sync)."""
    calls = 0
    for n in numbers:
        f = fs.open(segment_path(directory, n))
        try:
            f.fsync()
        finally:
            f.close()
        calls += 1
    fs.fsync_dir(directory)
    fs.fsync_dir(os.path.dirname(os.path.abspath(directory)))  # the spool: the checkpoint's rename
    return calls + 2


class _SourceError(Exception):
    """An OSError raised by the pieces of a record (reading its source), not by the log's own file."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _source(pieces: Iterable[bytes]) -> Iterator[bytes]:
    it = iter(pieces)
    while True:
        try:
            piece = next(it)
        except StopIteration:
            return
        except OSError as exc:
            raise _SourceError(exc) from exc
        yield piece


def _chain(first: bytes, rest: Iterable[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def storage_error(exc: OSError, what: str) -> StorageError:
    """The StorageError for ``exc`` met while doing ``what``: StorageFull (452 4.3.1) when the disk or the
    quota is full, else StorageError (451 4.3.0)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: {exc.strerror}")
    return StorageError(f"{what}: {exc.strerror or exc}")


class Log:
    """An open queue log: appends to the newest segment; reads anywhere. Create with :meth:`open`."""

    def __init__(self, fs: FileSystem, directory: str, *, segment_bytes_max: int) -> None:
        self.fs = fs
        self.directory = directory
        self.segment_bytes_max = segment_bytes_max
        self.stats = LogStats()
        self._cur: File | None = None
        self._cur_no = 0
        self._cur_salt = 0
        self._cur_records = 0
        self._cur_sealed = False
        self._files: dict[int, File] = {}  # open segments (read handles and the current one)
        self._salts: dict[int, int] = {}
        self._appended_lsn = 0
        self._durable_lsn = 0
        self._end = Pos(0, 0)  # just past the last appended record
        self._durable_end = Pos(0, 0)  # just past the last durable record
        self._durable_waiters: list[asyncio.Future[None]] = []
        # Seconds the readers of the durable end wait after it moves before they are woken (0: the next loop
        # turn); those of several rounds in that time are woken together. See durable_advanced.
        self.durable_wake_s = 0.0
        self._wake_pending: list[asyncio.Future[None]] | None = None  # readers a timer will wake
        self._dirty: dict[int, File] = {}
        self._syncing: set[int] = set()  # segments whose files the running commit round is fsyncing
        self._dir_dirty = False
        # (lsn, future or callback, when the round may wait until: 0.0 = at once, whether it is a client's: the
        # spacing counts only those); see commit(linger_s=), when_durable, _space
        self._waiters: list[tuple[int, asyncio.Future[None] | _Callback, float, bool]] = []
        self._hurry: asyncio.Future[None] | None = None  # a lingering round's wait; done when it may go on
        # Seconds from the start of one commit round to the start of the next while two or more callers want
        # one at once (0: as soon as the last one ends); see _space.
        self.round_spacing_s = 0.0
        self._round_started = -math.inf  # time.monotonic() when the last round started
        self._commit_task: asyncio.Task[None] | None = None
        self._failed: StorageFatal | None = None
        self._syncer = SyncThread()  # runs the fsync calls of each commit round (_commit_loop)
        self.on_fatal: list[Callable[[StorageFatal], None]] = []
        # Told how long each commit() that had to wait waited, in seconds (metrics; must be cheap).
        self.on_commit_seconds: Callable[[float], None] | None = None
        # Records the cursors decoded lately, and frames a cursor checksummed before stepping over them lately
        # (mtaq.storage.cursor), oldest first. OrderedDicts: the cursor evicts the oldest with popitem(last=False),
        # O(1); a plain dict's ``del d[next(iter(d))]`` walks every slot deleted since its last resize (up to a
        # third of CONFIRMED_MAX), about 90 us a frame once full: the drain of a 100,000-message backlog slowed
        # as it went (issue 36.1).
        self.decoded: OrderedDict[Pos, Record] = OrderedDict()
        self.confirmed: OrderedDict[Pos, None] = OrderedDict()
        # Where this process appended ENVELOPE frames, in log order: every one at or after _envelopes_floor
        # is listed (None: nothing listed yet). The queue runners jump from one to the next (next_envelope).
        self._envelopes: array[int] = array("q")  # segment << 34 | offset (RecoveredEnvelopes' keys)
        self._envelopes_floor: Pos | None = None
        # Every frame this process appended before this position has been checksummed by some cursor once
        # (or reported): a cursor that jumps from envelope to envelope walks, checking, what lies past it.
        self.checked_end: Pos | None = None
        # The envelopes recovery found in the segments of earlier runs, by runner (None until it lists them).
        self.recovered: RecoveredEnvelopes | None = None
        # Segment headers found damaged (and salvaged) when a segment was opened for reading, not yet reported
        # by a cursor (LogCursor reports each once through its on_corrupt).
        self.header_problems: dict[int, Problem] = {}
        self.unreadable_reported: set[int] = set()  # segments whose header is beyond salvage, reported once
        self.files_open_max = FILES_OPEN_MAX
        self._readers: OrderedDict[int, None] = OrderedDict()  # segments opened for reading, oldest first
        self._free = 0  # free_bytes(): the last statvfs answer, when, and bytes_appended then
        self._free_at: float | None = None
        self._free_base = 0
        self._kept = 0  # holders of segments_kept(): no segment is deleted meanwhile

    # ----------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, fs: FileSystem, directory: str, *, segment_bytes_max: int) -> tuple[Log, OpenReport]:
        """Open (creating if needed) the log in ``directory``; repair the newest segment's tail; start a new segment.

        First every existing segment and the directory are fsync'd (the durable baseline, GUIDE I7): what
        this run reads of earlier runs is on disk, not only in the page cache. The newest segment is scanned: a torn tail is truncated, a segment whose header never reached the
        disk is removed, and the segment is sealed. Appends then go to a fresh segment, so the rest of
        recovery can read the old ones while mail is accepted. Raises StorageError when the disk refuses.
        """
        log = cls(fs, directory, segment_bytes_max=segment_bytes_max)
        report = OpenReport()
        try:
            _make_durable_dirs(fs, directory)
            nums = list_segments(fs, directory)
            report.baseline_fsyncs = _durable_baseline(fs, directory, nums)
            highest = max(nums, default=0)
            while nums:
                n = nums[-1]
                path = segment_path(directory, n)
                scan = scan_segment(n, fs.read_file(path), skip_data=True)  # bodies: checksummed, not decoded
                if scan.header is None:
                    torn = scan.torn_tail
                    if torn is not None:  # created, header never durable: nothing in it was acknowledged
                        fs.unlink(path)
                        fs.fsync_dir(directory)
                        report.repaired.append(torn)
                        nums.pop()
                        continue
                    report.scans[n] = scan  # corrupt header: left for recovery to report
                    break
                if not scan.sealed:
                    report.unsealed.add(n)
                if scan.torn_tail is not None or not scan.sealed:
                    f = fs.open(path)
                    try:
                        if scan.torn_tail is not None:
                            f.truncate(scan.valid_end)
                            report.repaired.append(scan.torn_tail)
                        if not scan.sealed:
                            rtype, payload = encode_payload(SealRecord(segment=n, records=scan.frames))
                            f.append(encode_frame(int(rtype), payload, scan.header.salt))
                        f.fsync()
                        scan.valid_end = f.size()
                    finally:
                        f.close()
                    # The scan handed on describes the repaired segment: sealed, no torn tail.
                    scan.sealed = True
                    scan.problems = [p for p in scan.problems if p.kind != "torn-tail"]
                report.scans[n] = scan
                break
            report.segments = nums
            log._new_segment(highest + 1, at_start=True)
            report.new_segment = log._cur_no
            assert log._cur is not None
            log._cur.fsync()
            fs.fsync_dir(directory)
            log._dirty.clear()
            log._dir_dirty = False
            log._end = log._durable_end = Pos(log._cur_no, SEGMENT_HEADER_BYTES)
            log._envelopes_floor = log._end  # everything from here on is appended by this Log
            log.checked_end = log._end
        except OSError as exc:
            raise storage_error(exc, f"opening log {directory}") from exc
        return log, report

    def _new_segment(self, number: int, *, at_start: bool = False) -> None:
        salt = secrets.randbits(32)
        path = segment_path(self.directory, number)
        try:
            f = self._create_segment(path, number, salt, at_start)
        except OSError as exc:
            # A full disk: the room the reserve kept lets the log go on (at a start, recovery and the deliveries
            # that free space; issue 31.9). Without a reserve the error stands.
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.release_reserve():
                raise
            f = self._create_segment(path, number, salt, at_start)
        self._cur, self._cur_no, self._cur_salt = f, number, salt
        self._cur_records = 0
        self._cur_sealed = False
        self._files[number] = f
        self._salts[number] = salt
        self._dirty[number] = f
        self._dir_dirty = True
        self.stats.segments_created += 1

    def _create_segment(self, path: str, number: int, salt: int, at_start: bool = False) -> File:
        f = self.fs.open(path, create=True)
        try:
            f.append(encode_segment_header(SegmentHeader(segment=number, salt=salt, created=int(time.time()),
                                                         flags=SEGMENT_FLAG_START if at_start else 0)))
        except OSError:
            f.close()
            try:
                self.fs.unlink(path)
            except OSError:
                pass
            raise
        return f

    def release_reserve(self) -> bool:
        """:func:`release_reserve` of this log (counted in ``stats.reserve_released``). Called when a segment
        cannot be created for want of space, and by the daemon when its checkpoint cannot be written for
        that reason. Never raises (False on any error)."""
        if not release_reserve(self.fs, self.directory):
            return False
        self.stats.reserve_released += 1
        return True

    def keep_reserve(self, nbytes: int, *, free_at_least: int) -> bool:
        """Make the reserve file of ``nbytes`` bytes when there is none and the disk has at least
        ``free_at_least`` bytes free; True when made now. Its room is given back by :meth:`release_reserve`
        when the disk is full, so that a start on a full disk can still create its segment, recover and
        deliver (which frees space), as Postfix keeps ``queue_minfree`` for deliveries. Its bytes are written
        and fsync'd (allocated), its name is not (a reserve lost in a power cut is made again). Safe in a
        thread (it touches only the reserve). Raises OSError (nothing of it left behind)."""
        path = os.path.join(self.directory, RESERVE_NAME)
        if self.fs.exists(path) or self.fs.free_bytes(self.directory) < free_at_least:
            return False
        tmp = path + ".tmp"
        if self.fs.exists(tmp):
            self.fs.unlink(tmp)
        f = self.fs.open(tmp, create=True)
        try:
            chunk = bytes(PIECE_BYTES)
            left = nbytes
            while left > 0:
                f.append(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
            f.fsync()
        except OSError:
            f.close()
            self.fs.unlink(tmp)
            raise
        f.close()
        self.fs.rename(tmp, path)
        return True

    def _roll(self) -> None:
        """Seal the current segment (if not yet) and create the next one."""
        if not self._cur_sealed:
            assert self._cur is not None
            rtype, payload = encode_payload(SealRecord(segment=self._cur_no, records=self._cur_records,
                                                       durable=self._durable_end))
            self._cur.append(encode_frame(int(rtype), payload, self._cur_salt))
            self._cur_sealed = True
            self._dirty[self._cur_no] = self._cur
        self._readers[self._cur_no] = None  # from now on only read: closed when least recently used
        self._new_segment(self._cur_no + 1)
        killpoints.hit("log.roll")  # kill after the k-th roll-over: a sealed segment whose tail is not fsync'd
        # Its write handle counts against files_open_max like any reader (issue 31.12): the oldest go now, and
        # this one, still to be fsync'd, at the end of the round that fsyncs it if it is beyond the bound.
        self._close_readers(self.files_open_max)

    # ----------------------------------------------------------------------------------------- appending
    @property
    def current_segment(self) -> int:
        return self._cur_no

    @property
    def appended_lsn(self) -> int:
        """The LSN of the last record appended (commit it to make everything appended so far durable)."""
        return self._appended_lsn

    @property
    def durable_lsn(self) -> int:
        return self._durable_lsn

    @property
    def failed(self) -> StorageFatal | None:
        return self._failed

    @property
    def end(self) -> Pos:
        """Just past the last appended record (durable or not)."""
        return self._end

    @property
    def durable_end(self) -> Pos:
        """Just past the last record known durable; readers that act on records stop here."""
        return self._durable_end

    async def durable_advanced(self) -> None:
        """Wait until :attr:`durable_end` moves forward: woken in the loop turn after the commit round that moved
        it, or :attr:`durable_wake_s` seconds after (the readers of every round in between together)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._durable_waiters.append(fut)
        await fut

    def segment_size(self, number: int) -> int:
        """Current length in bytes of segment ``number``."""
        return self._file(number)[0].size()

    @contextlib.contextmanager
    def segments_kept(self) -> Iterator[None]:
        """While held (in the event loop, around a reader of whole segments in another thread: the admin
        view), :meth:`delete_segments_before` deletes nothing and returns ``[]``; the next checkpoint
        reclaims. A reader therefore sees every segment that existed when it began: before, reclamation
        could delete the segment of a message's START and FINISH under it, and the message looked live
        (issue 31.7: ``bounce`` sent an "expired" DSN for delivered mail)."""
        self._kept += 1
        try:
            yield
        finally:
            self._kept -= 1

    def delete_segments_before(self, number: int) -> list[int]:
        """Reclaim: unlink every segment numbered below ``number`` (never the current one), oldest first, then
        fsync the directory. A crash in between leaves a suffix of them, which are garbage and deleted again.
        Nothing while :meth:`segments_kept` is held."""
        gone: list[int] = []
        if self._kept:
            return gone
        try:
            for n in self.segments():
                if n >= number or n >= self._cur_no or n in self._dirty or n in self._syncing:
                    break  # never a file a commit round has still to fsync (it would be closed under it)
                f = self._files.pop(n, None)
                if f is not None:
                    f.close()
                self._readers.pop(n, None)
                self._salts.pop(n, None)
                self.fs.unlink(segment_path(self.directory, n))
                gone.append(n)
                killpoints.hit("reclaim.after_first_unlink")
            if gone:
                self.fs.fsync_dir(self.directory)
        except OSError as exc:
            raise storage_error(exc, "deleting segments") from exc
        return gone

    def append(self, record: Record) -> tuple[Pos, int]:
        """Append ``record``; return its position and LSN. Not durable until ``commit(lsn)`` returns.

        Raises StorageFatal after a failed fsync, StorageFull on ENOSPC, StorageError on other write errors;
        in every failure case nothing of the record is left in the log.
        """
        if self._failed is not None:
            raise self._failed
        if (isinstance(record, EnvelopeRecord | StartRecord | DeliveryRecord | FinishRecord)
                and self._durable_end.segment
                and record.durable != self._durable_end):  # a replacement carries its predecessor's: renewed
            # Book-keeping that rides on records written anyway: where the fsync'd prefix ended when this was
            # appended. Recovery takes the largest such claim as a floor of the durable end (docs/log_format.md).
            record = msgspec.structs.replace(record, durable=self._durable_end)
        rtype, payload = encode_payload(record)
        size = FRAME_HEADER_BYTES + len(payload)
        try:
            assert self._cur is not None
            if self._cur_sealed or (
                self._cur_records > 0 and self._cur.size() + size > self.segment_bytes_max
            ):
                self._roll()
            frame = encode_frame(int(rtype), payload, self._cur_salt)
            offset = self._cur.append(frame)
        except OSError as exc:
            raise storage_error(exc, f"appending to segment {self._cur_no}") from exc
        pos, lsn = self._appended(offset, size)
        if rtype == RecordType.ENVELOPE and self._envelopes_floor is not None:
            listed = self._envelopes
            if pos.segment >= KEYED_SEGMENTS_MAX:  # beyond the keys: nothing listed any more (next_envelope: False)
                self._envelopes_floor = None
                self._envelopes = array("q")
            else:
                listed.append(_key(pos))
                if len(listed) > ENVELOPES_LISTED_MAX:  # the oldest half goes: cursors behind it walk the frames
                    del listed[: len(listed) // 2]
                    self._envelopes_floor = _pos(listed[0])
        killpoints.hit("log.append")  # kill after the k-th append (MTAQ_KILL_POINT=log.append / recovery.append)
        return pos, lsn

    def next_envelope(self, pos: Pos, end: Pos) -> Pos | Literal[False] | None:
        """The position of the first ENVELOPE frame at or after ``pos`` and before ``end``, from memory.

        None if there is none; False if this Log cannot tell (``pos`` is before the frames it appended
        itself, or the oldest of those it still lists): the caller reads the frames. Costs a binary search
        over at most ``ENVELOPES_LISTED_MAX`` positions; no I/O.
        """
        floor = self._envelopes_floor
        if floor is None or pos < floor:
            return False
        return _next_listed(self._envelopes, pos, end)

    def _appended(self, offset: int, size: int) -> tuple[Pos, int]:
        """Book-keeping after a frame of ``size`` bytes was written at ``offset`` of the current segment:
        its position and LSN."""
        assert self._cur is not None
        self._cur_records += 1
        self._dirty[self._cur_no] = self._cur
        self._end = Pos(self._cur_no, offset + size)
        self._appended_lsn += 1
        self.stats.records_appended += 1
        self.stats.bytes_appended += size
        return Pos(self._cur_no, offset), self._appended_lsn

    def append_data(self, queue_id: str, body: Callable[[], Iterable[bytes]], body_bytes: int) -> tuple[Pos, int]:
        """Append ``DataRecord(queue_id, body)`` from a body given in pieces, never holding it whole.

        ``body()`` is called twice (the checksum, then the copy) and must give the same ``body_bytes`` bytes
        both times. The frame is byte for byte the one :meth:`append` writes for the same record, so readers
        see no difference. Same return value, durability and errors as :meth:`append`; ValueError if the
        pieces do not add up to ``body_bytes``. Nothing of the record is left in the log after an error.
        """
        prefix = encode_data_prefix(queue_id, body_bytes)
        return self._append_pieces(int(RecordType.DATA), len(prefix) + body_bytes, lambda: _chain(prefix, body()))

    def _append_pieces(self, rtype: int, length: int, pieces: Callable[[], Iterator[bytes]]) -> tuple[Pos, int]:
        if self._failed is not None:
            raise self._failed
        head = frame_head(rtype, length)
        size = FRAME_HEADER_BYTES + length
        try:
            assert self._cur is not None
            if self._cur_sealed or (self._cur_records > 0 and self._cur.size() + size > self.segment_bytes_max):
                self._roll()
            seen = 0

            def counted() -> Iterator[bytes]:
                nonlocal seen
                for piece in _source(pieces()):
                    seen += len(piece)
                    yield piece

            crc = frame_crc(head, counted(), self._cur_salt)
            if seen != length:
                raise ValueError(f"record pieces are {seen} bytes, not {length}")
            start = self._cur.size()
            offset = self._cur.append(head + crc.to_bytes(4, "little"))
            try:
                written = 0
                for piece in _source(pieces()):
                    self._cur.append(piece)
                    written += len(piece)
                if written != length:
                    raise ValueError(f"record pieces changed: {written} bytes, not {length}")
            except BaseException:
                try:
                    self._cur.truncate(start)  # no half record left behind
                except OSError as exc:
                    # A half frame would stay inside the segment, with records appended after it: the log
                    # can take nothing more; the process exits and recovery re-reads the disk.
                    self._fail(exc, "truncating a half-written record failed")
                raise
        except _SourceError as exc:  # the body's source (a temporary file) could not be read: nothing appended
            raise exc.error from None
        except OSError as exc:
            raise storage_error(exc, f"appending to segment {self._cur_no}") from exc
        killpoints.hit("log.append")  # (as in append) after the frame is written whole
        return self._appended(offset, size)

    async def commit(self, lsn: int, *, linger_s: float = 0.0) -> None:
        """Return once every record up to ``lsn`` is durable (one shared fsync round covers many callers).

        ``linger_s`` (seconds) lets the round that covers ``lsn`` start up to that long after this call when
        only lingering callers are waiting: a commit without it (a client waiting for its 250) starts the
        round at once and takes the lingering records with it, so that one fsync covers both (seed 001: "if
        we delay a little we can piggy-back it on a delivery fsync()", here the other way round). The
        delivery records of the queue linger (``Queue.delivery_linger_s``). While another client waits at
        once too, the round starts at most ``round_spacing_s`` after the last one started (:meth:`_space`).

        Raises StorageFatal if the covering fsync failed (the caller must not acknowledge anything).
        """
        await self._commit(lsn, linger_s, client=True)

    async def _commit(self, lsn: int, linger_s: float, *, client: bool) -> None:
        if self._failed is not None:
            raise self._failed
        if lsn <= self._durable_lsn:
            return
        t0 = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._enqueue(lsn, fut, t0 + linger_s if linger_s > 0 else 0.0, client)
        await fut
        if self.on_commit_seconds is not None:
            self.on_commit_seconds(time.monotonic() - t0)

    def when_durable(self, lsn: int, callback: Callable[[StorageFatal | None], None]) -> None:
        """Call ``callback(None)`` once every record up to ``lsn`` is durable, or ``callback(error)`` with the
        StorageFatal of a failed fsync: at once when that is already so, else from the end of the covering
        round (which starts as for commit() without a linger), before any task waiting in commit()
        resumes and before the readers of the durable end. A client's 250 waits for this (Queue.receive):
        the path from the fsync to the reply takes one loop turn, and the delivery of the same message
        (started by a reader) cannot run first. ``callback`` must be quick and must not raise (an exception
        goes to the loop's exception handler). ``on_commit_seconds`` is told the wait, as for commit().
        """
        if self._failed is not None:
            callback(self._failed)
            return
        if lsn <= self._durable_lsn:
            callback(None)
            return
        self._enqueue(lsn, _Callback(callback, self.on_commit_seconds), 0.0, True)

    def _enqueue(self, lsn: int, waiter: asyncio.Future[None] | _Callback, deadline: float, client: bool) -> None:
        """Add a waiter for ``lsn`` (``deadline``: when the round may wait until, 0.0 = at once; ``client``:
        it counts for the spacing, see _space) and see that a commit loop runs; one that does not linger
        ends a lingering round's wait."""
        self._waiters.append((lsn, waiter, deadline, client))
        if deadline == 0.0:
            self._go_on()
        if self._commit_task is None:
            self._commit_task = asyncio.get_running_loop().create_task(self._commit_loop())

    def _go_on(self) -> None:
        if self._hurry is not None:
            _set_result(self._hurry)

    async def _linger(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before a round: while every caller waiting lingers, wait until the earliest of their deadlines or
        until a caller that does not linger comes."""
        waiters = self._waiters
        if not waiters or any(w[2] == 0.0 for w in waiters):
            return
        delay = min(w[2] for w in waiters) - time.monotonic()
        if delay <= 0:
            return
        hurry: asyncio.Future[None] = loop.create_future()
        self._hurry = hurry
        timer = loop.call_later(delay, _set_result, hurry)
        try:
            await hurry
        finally:
            timer.cancel()
            self._hurry = None

    async def _space(self) -> None:
        """Before a round that two or more callers want at once (clients of several sessions under load):
        wait until ``round_spacing_s`` after the last round started, so that one fsync covers the callers of
        that whole time (group commit under load, as PostgreSQL's ``commit_delay`` with ``commit_siblings``).
        Each round costs an fsync and its CPU whatever it covers. A lone caller (one session, one message at
        a time) never waits for this: its fsync is its only wait. Only clients count: not lingering callers,
        nor the queue's own book-keeping (sync_soon, the checkpointer's sync), nor a caller that is gone (its
        future cancelled)."""
        if self.round_spacing_s <= 0:
            return
        at_once = 0
        for _lsn, fut, deadline, client in self._waiters:
            if deadline == 0.0 and client and not fut.done():
                at_once += 1
                if at_once == 2:
                    break
        else:
            return
        delay = self._round_started + self.round_spacing_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def sync(self) -> None:
        """Make everything appended so far durable (book-keeping included). Not a client: it does not count
        for the spacing of rounds (_space)."""
        await self._commit(self._appended_lsn, 0.0, client=False)

    def sync_soon(self) -> None:
        """Ask for a commit round covering everything appended so far, without waiting for it.

        Book-keeping that a runner must see soon (a DSN, a retry due now) rides on the running round when
        there is one (under load, always), and otherwise costs one fsync instead of waiting for the next
        checkpoint. Failures surface through ``on_fatal`` like any other.
        """
        lsn = self._appended_lsn
        if self._failed is not None or lsn <= self._durable_lsn:
            return
        self._enqueue(lsn, _Callback(lambda _error: None, None), 0.0, False)  # a failure reaches on_fatal

    def _sync_files(self, files: list[File], sync_dir: bool) -> int:
        calls = 0
        for f in files:
            f.fsync()
            calls += 1
        if sync_dir:
            self.fs.fsync_dir(self.directory)
            calls += 1
        return calls

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiters and self._failed is None:
                await self._linger(loop)
                await self._space()
                if self._failed is not None:
                    return
                self._round_started = time.monotonic()
                target = self._appended_lsn
                target_end = self._end
                files = [self._dirty[k] for k in sorted(self._dirty)]
                # The files stay open until their fsync is done: the reader cache and reclamation skip them.
                self._syncing = set(self._dirty)
                self._dirty.clear()
                sync_dir, self._dir_dirty = self._dir_dirty, False
                t0 = time.monotonic()
                try:
                    calls = await self._syncer.call(self._sync_files, files, sync_dir)
                except OSError as exc:
                    self._fail(exc)
                    return
                except SyncClosed:  # a commit after close(): fail its waiters, never leave them waiting
                    self._fail(OSError(errno.EBADF, "the log is closed"))
                    return
                finally:
                    self._syncing = set()
                self.stats.fsync_seconds += time.monotonic() - t0
                self.stats.fsync_calls += calls
                self.stats.commit_rounds += 1
                self._durable_lsn = max(self._durable_lsn, target)
                if len(self._readers) > self.files_open_max:  # rolled-over segments fsync'd now (issue 31.12)
                    self._close_readers(self.files_open_max)
                # The callbacks of the round first (a client's 250: Queue.receive), then the tasks waiting in
                # commit() (a delivery's records, which then log and append FINISH): a task is resumed in the
                # order it was woken, and a delivery record that joined the round before a client's message
                # would otherwise hold that client's 250 back behind its book-keeping.
                waiting = []
                later = []
                for w in self._waiters:
                    if w[0] > target:
                        waiting.append(w)
                    elif isinstance(w[1], _Callback):
                        w[1].set_result(None)
                    elif not w[1].done():
                        later.append(w[1])
                for fut in later:
                    if not fut.done():
                        fut.set_result(None)
                self._waiters = waiting
                if target_end > self._durable_end:
                    self._durable_end = target_end
                    waiters, self._durable_waiters = self._durable_waiters, []
                    # Readers of the durable end (the queue runners, which start deliveries) wake after the
                    # committers of this round: a client's 250 goes out before the delivery of the message it
                    # acknowledges begins in the same process (the reply is what the client waits for); with
                    # durable_wake_s, that much later, so that the client's next command is answered first too.
                    if self.durable_wake_s <= 0:
                        loop.call_soon(_wake, waiters)
                    elif self._wake_pending is not None:
                        self._wake_pending += waiters
                    elif waiters:
                        self._wake_pending = waiters
                        loop.call_later(self.durable_wake_s, self._wake_readers)
        finally:
            self._commit_task = None

    def _wake_readers(self) -> None:
        waiters, self._wake_pending = self._wake_pending or [], None
        _wake(waiters)

    def _fail(self, exc: OSError, what: str = "fsync failed") -> None:
        self._failed = StorageFatal(f"{what}: {exc.strerror or exc}; exiting, recovery will re-read the disk")
        self._fail_waiters(self._failed)
        for cb in self.on_fatal:
            cb(self._failed)

    # ----------------------------------------------------------------------------------------- reading
    def segments(self) -> list[int]:
        """Segment numbers present on disk, ascending."""
        return list_segments(self.fs, self.directory)

    def read_segment(self, number: int) -> bytes:
        """The whole file of segment ``number`` (for recovery scans)."""
        return self.fs.read_file(segment_path(self.directory, number))

    def _file(self, number: int) -> tuple[File, int]:
        """The open file of segment ``number`` and its salt. Files of segments read lately stay open, at most
        ``files_open_max`` of them besides those being written (least recently used closed first), so that
        a long-held message or a slow runner cannot run the process out of file descriptors. Raises
        OSError (FileNotFoundError for a reclaimed segment), CorruptRecord for a header beyond salvage."""
        f = self._files.get(number)
        if f is not None:
            if number in self._readers:
                self._readers.move_to_end(number)
            return f, self._salts[number]
        self._close_readers(self.files_open_max - 1)
        f = self.fs.open(segment_path(self.directory, number))
        if number in self._salts:  # reopened after the LRU closed it: the salt is known (no second salvage)
            self._files[number] = f
            self._readers[number] = None
            return f, self._salts[number]
        try:
            self._salts[number] = decode_segment_header(f.pread(0, SEGMENT_HEADER_BYTES)).salt
        except HeaderError as exc:
            # Damaged header: the salt can still come back from the records (rare; reads the file once).
            salvaged = salvage_segment_header(number, f.pread(0, f.size()))
            if salvaged is None:
                f.close()
                raise CorruptRecord(f"segment {number}: {exc}") from exc
            self._salts[number] = salvaged.salt
            # for the cursors to report (scan_segment names the same problem over the same bytes)
            self.header_problems[number] = Problem(
                "corrupt", number, 0, SEGMENT_HEADER_BYTES,
                f"{exc}; checksum salt recovered from the records, which are kept")
        self._files[number] = f
        self._readers[number] = None
        return f, self._salts[number]

    def _close_readers(self, keep: int) -> None:
        """Close the least recently read segment files (never the one being written, nor one waiting for
        its fsync or being fsync'd) until at most ``keep`` are open for reading."""
        for n in list(self._readers):
            if len(self._readers) <= max(0, keep):
                break
            if n == self._cur_no or n in self._dirty or n in self._syncing:
                continue
            del self._readers[n]
            f = self._files.pop(n, None)
            if f is not None:
                f.close()

    def free_bytes(self) -> int:
        """Bytes free on the device holding the log. Raises StorageError if it cannot be read.

        statvfs is asked at most every ``FREE_BYTES_TTL_S`` seconds (it was a system call per message); in
        between, the answer is the last one minus every byte this log appended since (never more than
        what is free, as far as this log is concerned).
        """
        now = time.monotonic()
        if self._free_at is None or now - self._free_at >= FREE_BYTES_TTL_S:
            try:
                self._free = self.fs.free_bytes(self.directory)
            except OSError as exc:
                raise storage_error(exc, f"checking free space of {self.directory}") from exc
            self._free_at, self._free_base = now, self.stats.bytes_appended
        return self._free - (self.stats.bytes_appended - self._free_base)

    def read_bytes(self, segment: int, offset: int, length: int) -> bytes:
        """``length`` raw bytes of segment ``segment`` from ``offset`` (fewer at its end), whatever its
        header holds (this is how damaged regions are copied aside). Raises OSError."""
        f = self.fs.open(segment_path(self.directory, segment))  # its own: it runs in a thread
        try:
            return f.pread(offset, length)
        finally:
            f.close()

    def read(self, pos: Pos) -> Record:
        """The record at ``pos``. Raises CorruptRecord when it does not check out, StorageError on I/O errors."""
        try:
            f, salt = self._file(pos.segment)
            head = f.pread(pos.offset, FRAME_HEADER_BYTES)
            if len(head) < FRAME_HEADER_BYTES:
                raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: beyond end of segment")
            length = int.from_bytes(head[4:8], "little")
            if length > RECORD_BYTES_MAX or pos.offset + FRAME_HEADER_BYTES + length > f.size():
                # A damaged length field: never allocate what it claims (up to 4 GiB).
                raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: frame length {length} runs past "
                                    "the end of the segment")
            buf = head + f.pread(pos.offset + FRAME_HEADER_BYTES, length)
        except FileNotFoundError as exc:
            raise CorruptRecord(f"segment {pos.segment} is missing") from exc
        except OSError as exc:
            raise storage_error(exc, f"reading segment {pos.segment}") from exc
        res = decode_frame(buf, 0, salt)
        if not isinstance(res, Frame):
            why = res.reason if isinstance(res, BadFrame) else "cut off"
            raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: {why}")
        try:
            return decode_payload(res.rtype, res.payload)
        except PayloadError as exc:
            raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: {exc}") from exc

    def salt_of(self, number: int) -> int:
        """The checksum salt of segment ``number``, for :meth:`read_payload` in another thread (call this in the
        event loop: it may open the segment). Raises CorruptRecord (missing, header beyond salvage),
        StorageError."""
        try:
            return self._file(number)[1]
        except FileNotFoundError as exc:
            raise CorruptRecord(f"segment {number} is missing") from exc
        except OSError as exc:
            raise storage_error(exc, f"reading segment {number}") from exc

    def read_payload(self, pos: Pos, rtype: int, *, piece_bytes: int = PIECE_BYTES,
                     salt: int | None = None) -> Iterator[bytes]:
        """The payload of the frame of type ``rtype`` at ``pos``, in order, in pieces of at most
        ``piece_bytes`` bytes, never held whole (issue 15.2: a large message is sent as it is read).

        The frame checksum covers the whole payload, so it can only be checked once every piece has been
        read: the iterator raises CorruptRecord *after* the last piece when the frame does not check out
        (at once for a damaged header, another type or a length past the end of the segment). A consumer
        must treat what it was given as good only when the iteration ended without an error. Raises
        StorageError on I/O errors, CorruptRecord for a missing segment.

        With ``salt`` (the segment's, from :meth:`salt_of`) the segment is read through a file handle of its
        own, closed at the end, never the shared ones: the iteration may then run in another thread (a copy
        forward reads off the event loop, issue 31.10).
        """
        where = f"segment {pos.segment} offset {pos.offset}"
        own: File | None = None
        try:
            if salt is None:
                f, salt = self._file(pos.segment)
            else:
                f = own = self.fs.open(segment_path(self.directory, pos.segment))
            head = f.pread(pos.offset, FRAME_HEADER_BYTES)
            if len(head) < FRAME_HEADER_BYTES:
                raise CorruptRecord(f"{where}: beyond end of segment")
            length = int.from_bytes(head[4:8], "little")
            bad = decode_frame(head[:8] + bytes(4), 0, salt)  # magic, type, flags, length (no payload: NeedMore)
            if isinstance(bad, BadFrame) and length:
                raise CorruptRecord(f"{where}: {bad.reason}")
            if head[2] != rtype:
                raise CorruptRecord(f"{where}: record type {head[2]}, not {rtype}")
            at = pos.offset + FRAME_HEADER_BYTES
            end = at + length
            if end > f.size():
                raise CorruptRecord(f"{where}: frame length {length} runs past the end of the segment")
            crc = zlib.crc32(head[:8], salt)
            while at < end:
                if own is None:
                    f, _salt = self._file(pos.segment)  # each time: the LRU may have closed it in between
                piece = f.pread(at, min(piece_bytes, end - at))
                if not piece:
                    raise CorruptRecord(f"{where}: cut off at {at}")
                crc = zlib.crc32(piece, crc)
                at += len(piece)
                yield piece
        except FileNotFoundError as exc:
            raise CorruptRecord(f"segment {pos.segment} is missing") from exc
        except OSError as exc:
            raise storage_error(exc, f"reading segment {pos.segment}") from exc
        finally:
            if own is not None:
                own.close()
        if crc != int.from_bytes(head[8:12], "little"):
            raise CorruptRecord(f"{where}: checksum mismatch")

    def repair_segment(self, scan: SegmentScan) -> None:
        """Truncate a torn tail of an older, unsealed segment and seal it (a crash at a roll-over)."""
        if scan.header is None or scan.segment == self._cur_no:
            return
        path = segment_path(self.directory, scan.segment)
        try:
            f = self.fs.open(path)
            try:
                if scan.torn_tail is not None:
                    f.truncate(scan.valid_end)
                if not scan.sealed:
                    rtype, payload = encode_payload(SealRecord(segment=scan.segment, records=scan.frames))
                    f.append(encode_frame(int(rtype), payload, scan.header.salt))
                f.fsync()
            finally:
                f.close()
        except OSError as exc:
            raise storage_error(exc, f"repairing segment {scan.segment}") from exc
        old = self._files.pop(scan.segment, None)
        self._readers.pop(scan.segment, None)
        if old is not None:
            old.close()

    def _fail_waiters(self, error: StorageFatal) -> None:
        """Every caller still waiting for a round gets ``error``; a lingering round's wait ends."""
        for w in self._waiters:
            if not w[1].done():
                w[1].set_exception(error)
        self._waiters = []
        self._go_on()

    def close(self) -> None:
        """Release file handles (tests and one-shot tools; the daemon never closes, it crashes). Callers still
        waiting for a commit get StorageFatal: no round will cover them."""
        if self._failed is None and self._waiters:
            self._failed = StorageFatal("the log was closed before a commit round covered the record")
            self._fail_waiters(self._failed)
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()
        self._syncer.shutdown(wait=False)
