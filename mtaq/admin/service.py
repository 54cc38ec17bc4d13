"""Operating the queue: list, size, show, delete, hold, release, flush, bounce (Apache James ADR 31).

Every action is a durable record in the log (a START with ``admin=`` and its conclusion), so it is audited,
survives crashes (recovery completes an action interrupted half-way), and acts on a consistent view:

1. the log is read in a thread up to its durable end P (a :class:`~mtaq.core.view.QueueView` as of P),
   with reclamation held off meanwhile (``Log.segments_kept``: a segment deleted under the reader would
   make the messages concluded in it look live);
2. then, in the event loop and without awaiting, the view is brought forward to the log's current end
   (what workers and runners appended meanwhile, durable or not), the messages are selected and
   *reserved* (``Queue.reserved``): from then on no delivery worker starts one of them (a worker offered a
   reserved envelope declines it, and its runner offers it again later), nor does the parked-copy task;
3. the actions are appended in batches (at most ``ACTION_BATCH_MAX`` messages or ``ACTION_BATCH_S`` of
   work each), and the event loop runs between batches, so SMTP sessions get their 250s while an action
   over 100,000 messages runs (issue 36: done in one turn, ``hold ALL`` held SMTP for 8-15 s); the group
   commits of SMTP and delivery make the batches durable as they go (one fsync for all who wait).
   An offer already on its way to a worker when a message is acted on is *revoked* and dropped;
4. the reservations end, and one commit at the end makes every record durable before the caller hears of
   it.

Every message's START and its conclusion are still appended back to back in one turn (recovery's rules do
not change: a crash between batches leaves complete actions before it and untouched messages after it).

A message under an attempt (active) is not touched: it is reported as skipped ("delivery in progress"),
so a message is delivered or deleted, never both, and never lost.

When the daemon is down, :func:`offline_view` and :func:`offline_size` read the spool directly.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import datetime as dt
import email.parser
import email.policy
import gc
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.errors import CorruptRecord, MtaqError, StorageError
from mtaq.core.frame import (
    SEGMENT_HEADER_BYTES,
    HeaderError,
    Problem,
    SegmentScan,
    decode_segment_header,
    scan_frames,
    scan_segment,
)
from mtaq.core.parking import ADMIN_ACTIONS, QueueCounts
from mtaq.core.records import PARKED, DataRecord, EnvelopeRecord, Pos, RecordType
from mtaq.core.view import Entry, QueueView, Selector, listing_key
from mtaq.queue.runners import Runner
from mtaq.queue.store import Queue
from mtaq.storage.checkpoint import read_checkpoint
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments, segment_path

__all__ = ["ACTION_BATCH_MAX", "ACTION_BATCH_S", "VIEW_KEPT_S", "ActionResult", "AdminError", "AdminService", "Listing", "cursor_of", "format_time",
           "offline_show", "offline_size", "offline_view", "page_of", "parse_cursor"]

# Which states each action applies to (others are skipped with a reason).
_APPLIES = {
    "delete": {"incoming", "deferred", "delayed", "held"},
    "bounce": {"incoming", "deferred", "delayed", "held"},
    "hold": {"incoming", "deferred", "delayed"},
    "release": {"held"},
    "flush": {"incoming", "deferred", "delayed"},
    "delay": {"incoming", "deferred", "delayed"},
}


def format_time(ts: float) -> str:
    """``Sat Nov 21 04:44:50`` (UTC), as mailq prints arrival times."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%a %b %d %H:%M:%S")


class AdminError(MtaqError):
    """A request that cannot be carried out as asked (no selection, unknown action or queue ID)."""


@dataclass
class ActionResult:
    """What an action did: ``done`` queue IDs, ``skipped`` {queue ID: why}, as of log position ``position``."""

    action: str
    position: str
    done: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"action": self.action, "position": self.position, "done": self.done, "skipped": self.skipped}


# An action appends at most this many messages' records in one turn of the event loop, and stops a batch
# early after this much work (seconds), then commits the batch and lets the loop run (SMTP, deliveries).
ACTION_BATCH_MAX = 256
ACTION_BATCH_S = 0.01
VIEW_KEPT_S = 60.0  # a daemon keeps its listing view this long after the last use, then frees it


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a view is built: the fold makes a few objects per message, none
    of them garbage, and each collection of the old generation would walk them all again (about a third of
    the time of a 100,000-message listing). Nestable, from any thread; collection resumes afterwards."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


class _Stale(Exception):
    """A segment the view would go on from is gone (reclaimed): the view is read again from the start."""


def _note_damage(view: QueueView, problems: Iterable[Problem]) -> None:
    for p in problems:
        if p.kind != "torn-tail":
            view.damage.setdefault(p.segment, []).append(str(p))


def _view_of_segments(log: Log, end: Pos, view: QueueView | None = None) -> QueueView:
    """Fold every record of the log before ``end`` into ``view`` (runs in a thread; DATA frames are
    checksummed, not decoded): from the start of the log into a new view, or, given ``view``, from
    ``view.end`` on (the segments it read are not read again). Damage met (a frame that does not check out,
    not a torn tail) is noted in ``view.damage``. Raises _Stale when a segment ``view`` goes on from is gone."""
    with gc_paused():
        return _fold_segments(log, end, view)


def _fold_segments(log: Log, end: Pos, view: QueueView | None) -> QueueView:
    if view is None:
        view = QueueView(end=Pos(0, 0))
        start = Pos(0, 0)
    else:
        start = view.end
    for n in log.segments():
        if n < start.segment:
            continue
        if n > end.segment:
            break
        if n == start.segment and start.offset > SEGMENT_HEADER_BYTES:
            scan = _scan_rest(log, n, start.offset, end.offset if n == end.segment else None)
        else:
            try:
                buf = log.read_segment(n)
            except FileNotFoundError:  # reclaimed before the caller took Log.segments_kept: it held nothing live
                if start.segment:
                    raise _Stale(f"segment {n}") from None
                continue
            if n == end.segment:
                buf = buf[: end.offset]
            scan = scan_segment(n, buf, skip_data=True)
        apply = view.apply
        for pos, rec in scan.records:
            apply(pos, rec, pos)
        _note_damage(view, scan.problems)
    view.end = end
    return view


def _scan_rest(log: Log, n: int, offset: int, stop: int | None) -> SegmentScan:
    """The frames of segment ``n`` from ``offset`` (a frame boundary) to ``stop`` (or its end)."""
    try:
        f = log.fs.open(segment_path(log.directory, n))
    except FileNotFoundError:
        raise _Stale(f"segment {n}") from None
    try:
        header = decode_segment_header(f.pread(0, SEGMENT_HEADER_BYTES))
        size = f.size() if stop is None else stop
        buf = f.pread(offset, size - offset)
    except HeaderError:
        raise _Stale(f"segment {n}: header") from None  # read whole again (salvaged, reported)
    finally:
        f.close()
    return scan_frames(n, buf, offset, header.salt, skip_data=True)


def _catch_up(view: QueueView, log: Log) -> None:
    """Bring ``view`` forward to the log's current end (synchronous: call it in the loop, then act)."""
    end = log.end
    cur = LogCursor(log, view.end, on_corrupt=lambda p: _note_damage(view, [p]))
    while (found := cur.peek(end, lambda t: t != RecordType.DATA)) is not None:
        assert found is not False  # only with max_frames
        pos, rec = found
        cur.skip()
        view.apply(pos, rec, cur.pos)
    view.end = end


def _candidates(view: QueueView, selector: Selector) -> Iterable[Entry]:
    """The entries ``selector`` may choose: those of its queue IDs (looked up, not searched for), else all."""
    if selector.ids:
        return [view.entries[q] for q in dict.fromkeys(selector.ids) if q in view.entries]
    return view.entries.values()


@dataclass
class Listing:
    """A page of a listing: ``mails`` (``postqueue -j`` objects, in :func:`listing_key` order), the log
    ``position`` it is consistent as of, ``next`` (the cursor of the next page, None after the last), and
    ``damage`` (problems met in the log while reading it, one line each; empty when none)."""

    position: str
    mails: list[dict[str, Any]]
    next: str | None = None
    damage: list[str] = field(default_factory=list)
    raw: list[bytes] | None = None  # with page(raw=True): each mail as JSON bytes, and ``mails`` empty

    @property
    def count(self) -> int:
        return len(self.raw) if self.raw is not None else len(self.mails)


def cursor_of(mail: dict[str, Any]) -> str:
    """The paging cursor after ``mail`` (a listing object): ``ARRIVAL_TIME:QUEUE_ID``."""
    return f"{int(mail['arrival_time'])}:{mail['queue_id']}"


def parse_cursor(cursor: str) -> tuple[int, str]:
    """``ARRIVAL_TIME:QUEUE_ID`` as a listing key; raises ValueError naming what is wrong."""
    ts, sep, qid = cursor.partition(":")
    if not sep or not ts.isdigit() or not qid or len(qid) > 64:
        raise ValueError(f"expected a cursor ARRIVAL_TIME:QUEUE_ID (the next of a listing), got {cursor!r}")
    return int(ts), qid


def page_of(entries: list[Entry], view: QueueView, *, limit: int | None, after: tuple[int, str] | None,
            position: str, raw: bool = False) -> Listing:
    """The page of sorted ``entries`` after ``after`` (a listing key), at most ``limit`` of them; with
    ``raw`` as JSON bytes (kept in the view until the message changes) in ``raw`` instead of ``mails``."""
    if after is not None:
        entries = entries[bisect.bisect_right(entries, after, key=listing_key):]
    more = limit is not None and len(entries) > limit
    if limit is not None:
        entries = entries[:limit]
    nxt = None
    if more and entries:
        ts, qid = listing_key(entries[-1])
        nxt = f"{ts}:{qid}"
    with gc_paused():
        if raw:
            return Listing(position, [], nxt, raw=[view.rendered(e) for e in entries])
        return Listing(position, [e.as_json(view.reasons(e.queue_id)) for e in entries], nxt)


class AdminService:
    """The admin operations of a running daemon (used by the HTTP API and ``mtaq queue``)."""

    def __init__(self, queue: Queue, runners: list[Runner], clock: Any, spool: str, *, delay_max_s: float = 0.0) -> None:
        self.delay_max_s = delay_max_s  # the longest "delay" an administrator may ask (0: no limit)
        self.queue = queue
        self.runners = runners
        self.clock = clock
        self.spool = spool
        self._lock = asyncio.Lock()  # one admin action at a time (listings run freely)
        # Called at each flush (the daemon's dead destinations are forgotten: Postfix postqueue -f).
        self.on_flush: Callable[[], None] = lambda: None
        # The view of the last listing or action, brought forward from the log at the next one (read in
        # full only the first time, or when a segment it would go on from was reclaimed); freed VIEW_KEPT_S
        # after its last use. Changed and read only under _view_lock, so no reader sees it half-way.
        self._view: QueueView | None = None
        self._view_lock = asyncio.Lock()
        self._view_timer: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def _current_view(self) -> AsyncIterator[QueueView]:
        """The queue as of now, held (no other reader or refresh) while the caller uses it without awaiting:
        the cached view read forward in a thread up to the durable end, then caught up in the loop."""
        log = self.queue.log
        async with self._view_lock:
            view = self._view
            with log.segments_kept():  # no reclamation under the reading thread (issue 31.7)
                end = log.durable_end
                if view is not None and end > view.end:
                    segs = set(log.segments())
                    if any(k not in segs for k in range(view.end.segment, end.segment + 1)):
                        view = None  # reclaimed since: its conclusions would be missed
                    else:
                        # Not kept while the thread changes it: a cancelled request must not leave it half-read
                        self._view = None
                        try:
                            view = await asyncio.to_thread(_view_of_segments, log, end, view)
                        except _Stale:
                            view = None
                if view is None:
                    self._view = None
                    view = await asyncio.to_thread(_view_of_segments, log, end)
            _catch_up(view, log)
            self._view = view
            self._keep_view()
            yield view

    def _keep_view(self) -> None:
        if self._view_timer is not None:
            self._view_timer.cancel()
        self._view_timer = asyncio.get_running_loop().call_later(VIEW_KEPT_S, self._drop_view)

    def _drop_view(self) -> None:
        self._view_timer = None
        if self._view_lock.locked():
            self._keep_view()
        else:
            self._view = None

    async def view(self) -> QueueView:
        """A copy-free snapshot of the queue as of now (the cached view: read it without awaiting)."""
        async with self._current_view() as view:
            return view

    def _damage(self, view: QueueView) -> list[str]:
        """The damage noted in ``view``, in segments that still exist."""
        if not view.damage:
            return []
        segs = set(self.queue.log.segments())
        return [p for n, ps in sorted(view.damage.items()) if n in segs for p in ps]

    async def page(
        self, selector: Selector, *, limit: int | None = None, states: Collection[str] | None = None,
        after: tuple[int, str] | None = None, raw: bool = False,
    ) -> Listing:
        """Messages matching ``selector`` (all if it is empty) in listing order (arrival, then queue ID), as
        ``postqueue -j`` objects: those after the cursor key ``after`` (:func:`parse_cursor`), at most
        ``limit``; with the log position the page is consistent as of, the next page's cursor, and the
        damage met in the log (``raw``: the messages as JSON bytes in ``raw``, ``mails`` empty). ``states`` (when given) keeps only messages in those states. Across pages a
        message queued for the whole paging is listed exactly once (the key of a message never changes, and
        new mail arrives later than any cursor), whatever is added or removed meanwhile."""
        async with self._current_view() as view:
            entries = selector.select(_candidates(view, selector), self.clock())
            if states is not None:
                entries = [e for e in entries if e.state in states]
            listing = page_of(entries, view, limit=limit, after=after, position=str(view.end), raw=raw)
            listing.damage = self._damage(view)
            return listing

    async def list(
        self, selector: Selector, *, limit: int | None = None, states: Collection[str] | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """:meth:`page` from the first message: (position, mails)."""
        listing = await self.page(selector, limit=limit, states=states)
        return listing.position, listing.mails

    def size(self) -> dict[str, Any]:
        """Messages by state from the daemon's counters (no scan), and the log position they are as of."""
        return {**self.queue.counts.as_dict(), "position": str(self.queue.log.end)}

    async def show(self, queue_id: str) -> dict[str, Any]:
        """One message: its listing entry, envelope details and the header section of its content
        (``postcat -q``). Raises AdminError if the queue ID is not in the queue."""
        async with self._current_view() as view:
            return _details(view, queue_id, self.queue.read_body)

    async def act(
        self, action: str, selector: Selector, *, delay_s: float | None = None, states: Collection[str] | None = None
    ) -> ActionResult:
        """Apply ``action`` (delete, hold, release, flush, bounce, delay) to the selected messages; durable
        on return. ``delay`` parks them for ``delay_s`` seconds (at most ``delay_max_s``, the same limit as
        FUTURERELEASE). ``states`` (when given) narrows the selection to messages in those states (a queue ID
        named in ``selector.ids`` but in another state is reported as skipped). Raises AdminError for an
        unknown action, an empty selection or a delay out of bounds, StorageError if the log cannot be
        written (then nothing is reported done)."""
        if action not in ADMIN_ACTIONS:
            raise AdminError(f"unknown action {action!r}; expected one of {', '.join(ADMIN_ACTIONS)}")
        if selector.is_empty():
            raise AdminError("no messages selected: give queue IDs, ALL, or a filter")
        release_ts: float | None = None
        if action == "delay":
            if delay_s is None or delay_s < 0:
                raise AdminError("delay needs a number of seconds >= 0")
            if self.delay_max_s > 0 and delay_s > self.delay_max_s:
                raise AdminError(f"requested delay of {delay_s:.0f} seconds exceeds the maximum of "
                                 f"{self.delay_max_s:.0f} seconds (delay_max_s)")
            release_ts = self.clock() + delay_s
        if action == "flush":
            self.on_flush()
        async with self._lock:
            res, todo = await self._choose(action, selector, states)
            reserved = self.queue.reserved
            try:
                i = lsn = 0
                while i < len(todo):
                    i, batch_lsn = self._act_batch(action, todo, i, release_ts, res)
                    lsn = batch_lsn or lsn
                    if i < len(todo):
                        # Let the loop run: SMTP sessions and deliveries go on, and their group commits make
                        # the batches durable as they go (waiting for an fsync a batch made hold ALL of
                        # 20,000 take 17 s on a loaded machine instead of 3).
                        await asyncio.sleep(0)
                if lsn:
                    await self.queue.log.commit(lsn)
            finally:
                for e in todo:
                    reserved.discard(e.pos)
            return res

    def _act_batch(self, action: str, todo: Sequence[Entry], i: int, release_ts: float | None,
                   res: ActionResult) -> tuple[int, int]:
        """Append the action's records for ``todo[i:]`` in one turn of the loop: at most ACTION_BATCH_MAX
        messages, fewer once ACTION_BATCH_S seconds went by. Returns (the index to go on from, the LSN to
        commit; 0 when nothing was appended)."""
        reserved = self.queue.reserved
        t_end = time.perf_counter() + ACTION_BATCH_S
        lsn = 0
        stop = min(len(todo), i + ACTION_BATCH_MAX)
        while i < stop:
            e = todo[i]
            i += 1
            reserved.discard(e.pos)
            try:
                _rec, _pos, lsn = self.queue.admin(e.pos, e.envelope, action, release_ts=release_ts)
            except CorruptRecord as exc:
                res.skipped[e.queue_id] = f"message data unreadable: {exc}"
                continue
            self._out_of_runners_way(e)
            res.done.append(e.queue_id)
            if time.perf_counter() >= t_end:
                break
        return i, lsn

    async def _choose(self, action: str, selector: Selector,
                      states: Collection[str] | None) -> tuple[ActionResult, Sequence[Entry]]:
        """Select the messages the action applies to and reserve them (``Queue.reserved``: no worker starts
        them from now on); (the result with the skipped ones, the entries to act on, in order)."""
        async with self._current_view() as view:
            # From the view's catch-up to the reservation nothing awaits: no worker can start a selected message.
            res = ActionResult(action, str(view.end))
            chosen = selector.select(_candidates(view, selector), self.clock())
            if states is not None:
                for e in chosen:
                    if e.state not in states and e.queue_id in selector.ids:
                        res.skipped[e.queue_id] = f"message is {e.state}"
                chosen = [e for e in chosen if e.state in states]
            for qid in selector.ids:
                if qid not in view.entries:
                    res.skipped[qid] = "no such message in the queue"
            todo: list[Entry] = []
            reserved = self.queue.reserved
            for e in chosen:
                why = self._why_not(action, e)
                if why:
                    res.skipped[e.queue_id] = why
                    continue
                reserved.add(e.pos)
                todo.append(e)
            return res, todo

    @staticmethod
    def _why_not(action: str, e: Entry) -> str:
        if e.state == "active":
            return "delivery in progress; try again when it is over"
        if e.state not in _APPLIES[action]:
            return f"message is {e.state}"
        return ""

    def _out_of_runners_way(self, e: Entry) -> None:
        """The runner that would offer this envelope must skip it (the START is ahead of it)."""
        k = e.envelope.runner
        if k == PARKED or not self.runners:
            return
        r = self.runners[min(k, len(self.runners) - 1)]
        if e.pos >= r.position:
            r.garbage.add(e.pos)
            r.poke()  # it may be waiting for exactly this envelope to come due

    def flush_all(self) -> None:
        """``postqueue -f``: every runner offers all its envelopes now (the parked ones are not touched);
        dead destinations are tried again."""
        self.on_flush()
        for r in self.runners:
            r.flush()


def _details(view: QueueView, queue_id: str, read_body: Callable[[EnvelopeRecord], bytes]) -> dict[str, Any]:
    """The ``show`` object of ``queue_id`` in ``view``; raises AdminError if it is not in the queue."""
    e = view.entries.get(queue_id)
    if e is None:
        raise AdminError(f"{queue_id}: no such message in the queue")
    out = e.as_json(view.reasons(queue_id))
    env = e.envelope
    out |= {
        "position_as_of": str(view.end),
        "mail_params": [list(p) for p in env.mail_params],
        "client": env.client,
        "helo": env.helo,
        "generation": env.generation,
        "bounce_of": env.bounce_of,
        "recipients_detail": [
            {"address": r.address, "params": [list(p) for p in r.params], "outcome_unknown": r.unknown}
            for r in env.recipients
        ],
    }
    try:
        body = read_body(env)
        head, _, _ = body.partition(b"\r\n\r\n")
        msg = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(head + b"\r\n\r\n")
        out["headers"] = [[k, str(v)] for k, v in msg.items()]
    except (CorruptRecord, StorageError, OSError) as exc:
        out["headers_error"] = str(exc)
    return out


# --------------------------------------------------------------------------------------- daemon is down
def offline_view(spool: str) -> QueueView:
    """The queue as of the end of the log in ``spool``, read from disk (the daemon is not running)."""
    with gc_paused():
        return _offline_fold(spool)


def _offline_fold(spool: str) -> QueueView:
    fs = OsFileSystem()
    log_dir = os.path.join(spool, "log")
    view = QueueView()
    for n in list_segments(fs, log_dir):
        scan = scan_segment(n, fs.read_file(segment_path(log_dir, n)), skip_data=True)
        for pos, rec in scan.records:
            view.apply(pos, rec, pos)
        _note_damage(view, scan.problems)
        view.end = Pos(n, scan.valid_end)
    return view


def offline_show(spool: str, queue_id: str) -> dict[str, Any]:
    """:meth:`AdminService.show` read from disk (the daemon is not running). Raises AdminError if the queue ID
    is not in the queue."""
    view = offline_view(spool)
    fs = OsFileSystem()
    log_dir = os.path.join(spool, "log")

    def read_body(env: EnvelopeRecord) -> bytes:
        buf = fs.read_file(segment_path(log_dir, env.data.segment))
        for p, rec in scan_segment(env.data.segment, buf).records:
            if p == env.data and isinstance(rec, DataRecord) and rec.queue_id == env.queue_id:
                return rec.body
        raise CorruptRecord(f"{env.queue_id}: data reference {env.data} is not its DATA record")

    return _details(view, queue_id, read_body)


def offline_size(spool: str) -> dict[str, Any]:
    """Messages by state from the last checkpoint's counts plus the records after its head (the working
    suffix at most), without scanning the queue. Falls back to a full scan without a usable checkpoint;
    ``source`` says which."""
    fs = OsFileSystem()
    cp: Checkpoint | None
    cp, _why = read_checkpoint(fs, spool)
    log_dir = os.path.join(spool, "log")
    segs = list_segments(fs, log_dir)
    if cp is None or not cp.counts or (segs and cp.head.segment < segs[0]):
        view = offline_view(spool)
        return {**view.counts(), "position": str(view.end), "source": "full scan"}
    counts = QueueCounts.restore(cp.counts)
    end = cp.head
    envelopes: dict[Pos, EnvelopeRecord] = {}
    for n in segs:
        if n < cp.head.segment:
            continue
        buf = fs.read_file(segment_path(log_dir, n))
        scan = scan_segment(n, buf, skip_data=True)
        for pos, rec in scan.records:
            if pos < cp.head:
                continue
            if isinstance(rec, EnvelopeRecord):
                envelopes[pos] = rec
            counts.replay(rec, lambda p: envelopes.get(p) or _read_envelope_at(fs, log_dir, p))
        end = Pos(n, scan.valid_end)
    return {**counts.as_dict(), "position": str(end), "source": f"checkpoint at {cp.head} and the records after it"}


def _read_envelope_at(fs: OsFileSystem, log_dir: str, pos: Pos) -> EnvelopeRecord | None:
    try:
        buf = fs.read_file(segment_path(log_dir, pos.segment))
    except OSError:
        return None
    for p, rec in scan_segment(pos.segment, buf, skip_data=True).records:
        if p == pos:
            return rec if isinstance(rec, EnvelopeRecord) else None
    return None

