"""A crash-state explorer: every crash state of short workloads, enumerated, not sampled (issue 31).

The approach of ALICE (Pillai et al., OSDI 2014) and CrashMonkey/B3 (Mohan et al., OSDI 2018): run a short
*workload* of the real code (:class:`~mtaq.storage.log.Log`, :class:`~mtaq.queue.store.Queue`,
:func:`~mtaq.queue.recovery.recover`, the queue runners' cursors; ``Daemon.checkpoint`` and
``AdminService.act`` mirrored line for line, as this package may not import them, with a test that the
mirrors do exactly what the originals do) on the in-memory :class:`~mtaq.testing.crashfs.CrashFileSystem`,
take a snapshot of the file system after every operation (append, truncate, fsync, fsync_dir, create, rename, unlink), then enumerate the crash
states each snapshot allows, recover each with the real start (``Log.open``, ``recover``, the daemon's
first checkpoint), finish the queue, and check the promises of GUIDE §1 on what happened.

What is enumerated (bounds in :class:`Bounds`):

* **crash points**: every snapshot of the workload's run (after each operation, and before the first);
  in the runs after a crash, the operations of the start (``Log.open``, recovery, the first checkpoint)
  and the moment after it (``Bounds.later_points = "all"``: every operation of those runs too);
* **power cuts** at each point: the unsynced changes (:meth:`CrashFileSystem.pending`, writes, truncations
  and directory changes, in the order made) that reach the disk. Every subset when there are at most
  ``all_subsets_max`` of them; otherwise every in-order prefix (write-back stopped there), every
  "all but one" and every "only one" (out-of-order write-back: a later write survives an earlier one,
  which then reads as zeros), and none and all. With ``torn``, each in-order prefix also with the next
  write torn (its first half kept). Runs after a crash use ``later_all_subsets_max``;
* **kill -9** at each point (``kill``): the page cache keeps everything, durable or not, and the next
  run starts on it; a power cut in that run (the next crash) can still take what the killed run never
  fsync'd (issue 31 finding 1);
* **nested crashes**: up to ``crashes`` crashes in one history (a cut or kill in the workload, then one
  inside the recovery run that follows, ...); ``deepen`` says which crashes get a further one (all; kills;
  kills that left unsynced changes; cuts that left a hole), ``later_cuts=False`` only kills after the
  first. Each run that is not cut short finishes the queue.

A ``make test`` seed (tests/test_explorer.py) explores about 11,000 states in about a minute; a long run is
``bench/explore.py``. Costs: about 3 to 5 ms a state (one start, recovery and finish of a small queue).

Identical states are explored once: a state is the file system (files, durable contents and pending
changes) plus what the outside world saw so far (acknowledgements, deliveries, admin requests); the
count of distinct states is ``ExploreReport.states``.

**Finishing** (:meth:`Proc.finish`): the queue runners (real :class:`~mtaq.queue.runners.Runner` cursors
and positions, driven one pass at a time as ``Runner.run`` does, minus the waiting), the parked runner
(``Daemon._parked_runner``), and a delivery worker (``Daemon._worker`` and ``Daemon._attempt``, mirrored
step for step without logging) deliver everything due; held mail is released (``AdminService.act``);
when nothing is due the daemon's periodic ``Daemon.checkpoint`` runs and the clock jumps 61 s (or to the
next parked due time), until two such rounds pass idle. The next hop is :class:`FakeHop`,
**a fake for the internet**: its replies are fixed per recipient (``ok*`` 250, ``bad*`` 550, ``slow*``
451 at the first attempt and 250 after), and it remembers every message it accepted.

**Checked** (:func:`check`, separate from the generator: a new workload is one function):

* every acknowledged message (``receive()`` returned: the 250) has each recipient delivered, or bounced
  with a DSN, exactly once (``lost`` otherwise); unless an administrator asked to delete it;
* a recipient is delivered more than once only when it was *in flight* at a crash (the next hop said 250,
  its DELIVERY record not yet durable), at most once more per such crash (``delivered-twice``);
* no two DSNs for one recipient (``dsn-twice``); never delivered and bounced (``delivered-and-bounced``);
  a deliverable recipient of an acknowledged message is bounced only by an administrator's ``bounce``
  (``bounced-deliverable``: its DATA was fsync'd before the 250, so "unreadable" is wrong); a message never
  acknowledged may be bounced (recovery bounces when it cannot tell, issue 31 finding 3);
* a delivered body is the body sent, byte for byte (``body-differs``);
* a message acknowledged on hold (``header_checks`` HOLD) is delivered only after a release
  (``delivered-while-held``);
* recovery reports no corruption (only crashes happen here; fsync'd bytes never change:
  ``spurious-corruption``); the start and the finish raise nothing (``run-failed``); the queue drains
  (``stranded``: a live envelope no runner offers);
* ``mtaq log verify``'s logic (:func:`mtaq.storage.logtools.verify`) finds no problem (``log-unsound``).

A violation names its workload and the crashes that lead to it (:class:`Step`: run, operation index,
cut or kill, the ``seq`` numbers of the changes kept and torn); :func:`replay` runs exactly that history
again (queue IDs, salts and clocks are deterministic while the explorer runs, see :func:`deterministic`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import io
import itertools
import random
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.errors import CorruptRecord, StorageError
from mtaq.core.frame import scan_segment
from mtaq.core.records import PARKED, EnvelopeRecord, Outcome, Pos, RecordType, StartRecord
from mtaq.core.state import RetryPolicy
from mtaq.core.view import QueueView, Selector
from mtaq.queue import store
from mtaq.queue.recovery import RecoveryResult, recover
from mtaq.queue.runners import Dispatcher, Runner
from mtaq.queue.store import Queue
from mtaq.storage import log as log_module
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.cursor import LogCursor
from mtaq.storage.log import Log, SyncThread, scan_log
from mtaq.storage.logtools import verify
from mtaq.testing.crashfs import Change, CrashFileSystem, FsSnapshot

__all__ = [
    "WORKLOADS",
    "Bounds",
    "ExploreReport",
    "FakeHop",
    "Proc",
    "Step",
    "Violation",
    "check",
    "deterministic",
    "explore",
    "replay",
    "run_once",
]

SPOOL = "/spool"
LOG_DIR = "/spool/log"
SENDER = "s@example.org"
T0 = 1_800_000_000.0  # the clock of the first run (UTC seconds)
RUN_GAP_S = 2_000.0  # each run starts this much later than the one before (8 numbers per crash)
IDLE_JUMP_S = 61.0  # finishing: the clock jump when nothing is due (the retry interval is 60 s)
POLICY = RetryPolicy(intervals_s=(60.0,))
PARKED_COPIES_MAX = 1000  # as mtaq.daemon.process
# The spool reserve (Log.keep_reserve) the checkpoint makes: 4 KiB here instead of the daemon's RESERVE_BYTES
# (1 MiB): one append instead of sixteen, and no megabyte in every snapshot. The same kind of operations.
RESERVE_BYTES = 4096
_APPLIES = {  # as mtaq.admin.service: which states each action applies to
    "delete": {"incoming", "deferred", "delayed", "held"},
    "bounce": {"incoming", "deferred", "delayed", "held"},
    "hold": {"incoming", "deferred", "delayed"},
    "release": {"held"},
    "flush": {"incoming", "deferred", "delayed"},
    "delay": {"incoming", "deferred", "delayed"},
}


def _view_of_segments(log: Log, end: Pos) -> QueueView:
    """As ``mtaq.admin.service._view_of_segments``: every record of the log before ``end``, folded."""
    view = QueueView(end=end)
    for n in log.segments():
        if n > end.segment:
            break
        try:
            buf = log.read_segment(n)
        except FileNotFoundError:
            continue
        if n == end.segment:
            buf = buf[: end.offset]
        for pos, rec in scan_segment(n, buf, skip_data=True).records:
            view.apply(pos, rec, pos)
    view.end = end
    return view


def _catch_up(view: QueueView, log: Log) -> None:
    """As ``mtaq.admin.service._catch_up``: bring ``view`` forward to the log's current end."""
    end = log.end
    cur = LogCursor(log, view.end)
    while (found := cur.peek(end, lambda t: t != RecordType.DATA)) is not None:
        assert found is not False
        pos, rec = found
        cur.skip()
        view.apply(pos, rec, cur.pos)
    view.end = end


# ---------------------------------------------------------------------------------------------- determinism
class _Ids:
    """Queue IDs and segment salts that depend only on the run number and the order they are asked in."""

    run = 0
    count = 0
    salts = random.Random(0)

    @classmethod
    def begin(cls, run: int) -> None:
        cls.run, cls.count, cls.salts = run, 0, random.Random(run * 7919 + 1)

    @classmethod
    def queue_id(cls, now_ts: float | None = None) -> str:
        cls.count += 1
        n = (cls.run << 40) | cls.count
        alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
        return "".join(alphabet[(n >> (5 * i)) & 31] for i in reversed(range(15)))

    @classmethod
    def randbits(cls, k: int) -> int:
        return cls.salts.getrandbits(k)


class _FixedTime:
    """``time`` for mtaq.storage.log: a fixed ``time()`` (segment headers' ``created``), the rest as is."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def time() -> float:
        return T0


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """While it is entered: queue IDs (``mtaq.queue.store.new_queue_id``) and segment salts and header
    times (``mtaq.storage.log``) depend only on the run and the order of the calls, so that a history
    replays byte for byte. Restores the real ones on exit."""
    patches: list[tuple[types.ModuleType, str, object]] = [
        (store, "new_queue_id", _Ids.queue_id),
        (log_module, "secrets", types.SimpleNamespace(randbits=_Ids.randbits)),
        (log_module, "time", _FixedTime()),
    ]
    saved = [(mod, name, mod.__dict__[name]) for mod, name, _new in patches]
    for mod, name, new in patches:
        mod.__dict__[name] = new
    try:
        yield
    finally:
        for mod, name, old in saved:
            mod.__dict__[name] = old


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class Ack:
    """``receive()`` returned for message ``marker`` (the client got its 250) after ``t`` operations."""

    qid: str
    marker: int
    rcpts: tuple[str, ...]
    t: int
    held: bool = False  # queued on hold (header_checks HOLD, a milter's quarantine)


@dataclass(frozen=True, slots=True)
class Hop:
    """The next hop answered ``code`` for ``rcpt`` of message ``qid`` after ``t`` operations; its DELIVERY
    record was durable after ``durable_t`` operations (None: never in that run). A DSN (``bounce_of``)
    carries its report lines ``(final recipient, action, status)``. ``inflight``: a crash came between."""

    qid: str
    rcpt: str
    code: int
    t: int
    body_ok: bool
    bounce_of: str = ""
    rows: tuple[tuple[str, str, str], ...] = ()
    durable_t: int | None = None
    inflight: bool = False


@dataclass(frozen=True, slots=True)
class Request:
    """An administrator asked for ``action`` on ``qid`` after ``t`` operations (a crash may undo it)."""

    action: str
    qid: str
    t: int


@dataclass(frozen=True, slots=True)
class Reported:
    """A recovery reported damage (``kind``: corrupt) after ``t`` operations."""

    what: str
    t: int


@dataclass(frozen=True, slots=True)
class Crash:
    """The run ended here, after ``t`` operations: ``kind`` is ``cut`` (power loss) or ``kill`` (kill -9)."""

    kind: str
    t: int = 0


Event = Ack | Hop | Request | Reported | Crash


def _at_crash(events: Sequence[Event], k: int, kind: str) -> list[Event]:
    """The events of a run that happened before its crash after ``k`` operations, deliveries in flight
    marked, and the crash."""
    out: list[Event] = []
    for e in events:
        if e.t > k:
            continue
        if isinstance(e, Hop) and e.code // 100 == 2 and (e.durable_t is None or e.durable_t > k):
            e = replace(e, inflight=True)
        out.append(e)
    out.append(Crash(kind, k))
    return out


# ---------------------------------------------------------------------------------------------- the next hop
def _marker_of(body: bytes) -> int | None:
    if body.startswith(b"X-Explorer: m"):
        end = body.index(b"\r\n")
        return int(body[13:end])
    return None


def body_of(marker: int) -> bytes:
    """The body of test message ``marker`` (a few hundred bytes, distinct per marker)."""
    line = b"line %d of message %d, padding padding padding padding\r\n"
    return (b"X-Explorer: m%d\r\nSubject: m%d\r\n\r\n" % (marker, marker)
            + b"".join(line % (i, marker) for i in range(4)))


def _dsn_rows(body: bytes) -> tuple[tuple[str, str, str], ...]:
    """``(final recipient, action, status)`` of each recipient a DSN reports (RFC 3464 fields)."""
    rows: list[tuple[str, str, str]] = []
    final = action = ""
    for raw in body.replace(b"\r\n ", b" ").split(b"\r\n"):
        line = raw.decode("utf-8", "replace")
        if line.startswith("Final-Recipient:"):
            final = line.split(";", 1)[-1].strip()
        elif line.startswith("Action:"):
            action = line.split(":", 1)[1].strip()
        elif line.startswith("Status:") and final:
            rows.append((final, action, line.split(":", 1)[1].strip()))
            final = action = ""
    return tuple(rows)


class FakeHop:
    """A fake for the internet: the next hop, with replies fixed per recipient.

    ``ok*`` -> 250 2.0.0; ``bad*`` -> 550 5.1.1; ``slow*`` -> 451 4.3.0 when the envelope was never attempted
    (``attempts == 0``), 250 after; anything else (the sender, to whom DSNs go) -> 250.
    """

    @staticmethod
    def reply(address: str, env: EnvelopeRecord) -> tuple[int, str, str]:
        local = address.split("@", 1)[0]
        if local.startswith("bad"):
            return 550, "5.1.1", "no such user"
        if local.startswith("slow") and env.attempts == 0:
            return 451, "4.3.0", "try again later"
        return 250, "2.0.0", "ok"


# ---------------------------------------------------------------------------------------------- one run
class _Inline(concurrent.futures.ThreadPoolExecutor):
    """An executor that runs each call at once in the calling thread: the log's fsync rounds and recovery's
    reads (``asyncio.to_thread``) happen in order, without thread hand-offs (each run here is sequential:
    nothing else would run in the loop meanwhile)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut


_T = TypeVar("_T")


class _InlineSync(SyncThread):
    """A :class:`mtaq.storage.log.SyncThread` that runs each call at once in the calling thread, for the same
    reason as :class:`_Inline`."""

    def call(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut


class _Quiet:
    """A logger that says nothing (recovery, Daemon.checkpoint)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class Trace:
    """One file system through one or more runs (a workload may restart): a snapshot after every operation
    (``snaps[k]``: after ``k`` operations) and the events, stamped with the operation count."""

    def __init__(self, fs: CrashFileSystem, *, snapshots: bool, run: int) -> None:
        self.fs = fs
        self.base = len(fs.ops)  # operations before this trace (the crash that made ``fs``): not counted
        self.snaps: list[FsSnapshot] = []
        self.events: list[Event] = []
        self.start_end = 0  # operations when the first run's start (open, recovery, checkpoint) was done
        self.next_run = run
        self.results: list[RecoveryResult] = []
        if snapshots:
            self.snaps.append(fs.snapshot())
            fs.on_op = lambda _op: self.snaps.append(fs.snapshot())

    @property
    def t(self) -> int:
        """Operations of this trace so far: ``snaps[t]`` is the state now."""
        return len(self.fs.ops) - self.base


class Proc:
    """One run of the daemon on a :class:`CrashFileSystem`, as far as the queue goes: created by
    :meth:`start` (``Log.open``, ``Queue``, ``recover``, the runners, the first ``Daemon.checkpoint``), as
    ``Daemon.run`` does, without SMTP. Workloads call its steps; :meth:`finish` drains the queue.

    It can also serve as the ``self`` of the real ``Daemon.checkpoint`` and ``Daemon._copy_parked_forward``
    (it has the attributes they use: queue, runners, fs, cfg.spool_dir, archive, pickup, exporter, clock, log,
    checkpoints, reclaimed, _copy_failed), which is how tests/test_explorer.py checks the mirrors below.
    """

    def __init__(self, trace: Trace, segment_bytes_max: int) -> None:
        self.trace = trace
        self.fs = trace.fs
        self.run = trace.next_run
        trace.next_run += 1
        self.now = T0 + self.run * RUN_GAP_S
        self.segment_bytes_max = segment_bytes_max
        self.cfg = types.SimpleNamespace(spool_dir=SPOOL)
        self.archive = None
        self.pickup = None  # the maildrop pick-up (mtaq.edge.pickup): none in the explored runs
        self.exporter = None  # the event exporter (mtaq.daemon.exporter): no event_webhooks in the explored runs
        self.checkpoints = 0
        self.reclaimed = 0
        self._copy_failed: set[Pos] = set()
        self.log = _Quiet()
        self.runners: list[Runner] = []
        self.qids: dict[int, str] = {}  # marker -> queue ID, for the workloads

    def clock(self) -> float:
        return self.now

    async def start(self, receive_first: int | None = None) -> None:
        """``Daemon.run`` up to its first checkpoint. Raises what they raise. ``receive_first``: a message
        marker acknowledged after ``Log.open`` and before recovery (the daemon listens before it recovers)."""
        _Ids.begin(self.run)
        qlog, report = Log.open(self.fs, LOG_DIR, segment_bytes_max=self.segment_bytes_max)
        self.qlog = qlog
        qlog._syncer.shutdown(wait=False)
        qlog._syncer = _InlineSync()  # the fsync rounds in order, in this thread
        # The fake clock is the monotonic clock too: here time passes only by its jumps.
        self.queue = Queue(qlog, policy=POLICY, clock=self.clock, monotonic=self.clock,
                           reporting_mta="mx.explorer.test")
        # The daemon's DELIVERY linger (2 ms) only moves when a lone round starts, never what it covers.
        self.queue.delivery_linger_s = 0.0
        if receive_first is not None:
            await self.receive(receive_first, [f"ok{receive_first}@example.net"])
        res = await recover(self.queue, report, SPOOL, _Quiet())
        self.trace.results.append(res)
        for p in res.corrupt:
            self.trace.events.append(Reported(f"corrupt {p.segment}:{p.offset}-{p.end} {p.reason}", self.trace.t))
        n = POLICY.runners
        dispatcher = Dispatcher(n + 1)
        self.runners = [Runner(k, qlog, dispatcher, res.runners[k], res.garbage[k], runners=n, clock=self.clock,
                               monotonic=self.clock, interval_s=POLICY.delay_of(k)) for k in range(n)]
        await self.checkpoint()

    # The daemon's and the admin service's steps, mirrored line for line: mtaq.testing may not import
    # mtaq.daemon nor mtaq.admin (tests/test_architecture.py). tests/test_explorer.py runs the workloads
    # with the real Daemon.checkpoint, Daemon._copy_parked_forward and AdminService.act in their place and
    # checks that every file-system operation and every byte is the same.
    async def checkpoint(self) -> None:
        """``Daemon.checkpoint`` (no archive): copy parked mail forward, take the positions, fsync the log,
        write the checkpoint, delete wholly-garbage segments."""
        qlog, working = self.queue.log, self.queue.working
        await self._copy_parked_forward()
        head = qlog.end
        positions = tuple(r.position for r in self.runners)
        garbage = tuple(tuple(sorted(r.garbage)) for r in self.runners)
        suffix = working.earliest_start() or head
        parked = self.queue.parked
        pins = self.queue.data_pins
        true_garbage_end = min((*positions, working.earliest_envelope() or head, parked.earliest() or head, head,
                                *pins.values()))
        self.queue.revoked = {p for p in self.queue.revoked if p >= min(positions, default=head)}
        cp = Checkpoint(head=head, suffix=suffix, runners=positions, garbage=garbage, written_ts=self.clock(),
                        parked=tuple(sorted(parked.entries)), counts=self.queue.counts.snapshot(),
                        pins=tuple(sorted(pins.items())))
        await qlog.sync()
        try:
            await asyncio.to_thread(self._write_checkpoint, cp)
        except OSError:
            return
        self.checkpoints += 1
        with contextlib.suppress(OSError):
            await asyncio.to_thread(qlog.keep_reserve, RESERVE_BYTES,
                                    free_at_least=self.queue.minfree_bytes + 2 * RESERVE_BYTES)
        limit = true_garbage_end.segment - 1
        gone = qlog.delete_segments_before(limit)
        self.reclaimed += len(gone)

    def _write_checkpoint(self, cp: Checkpoint) -> None:
        """``Daemon._write_checkpoint``: on a full disk once more after giving up the reserve."""
        try:
            write_checkpoint(self.fs, self.cfg.spool_dir, cp)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.queue.log.release_reserve():
                raise
            write_checkpoint(self.fs, self.cfg.spool_dir, cp)

    async def _copy_parked_forward(self) -> None:
        """``Daemon._copy_parked_forward``: copy the parked envelopes that alone pin old segments."""
        q = self.queue
        qlog, parked = q.log, q.parked
        try:
            q.finish_open_copies()
        except StorageError:
            return
        if not parked.entries:
            return
        head = qlog.end
        positions = [r.position for r in self.runners]
        pinned_below = min((*positions, q.working.earliest_envelope() or head, head)).segment - 1
        old = sorted(p for p in parked.entries
                     if p.segment < pinned_below and p not in self._copy_failed)[:PARKED_COPIES_MAX]
        for pos in old:
            if pos not in parked:
                continue
            try:
                env = qlog.read(pos)
                if not isinstance(env, EnvelopeRecord):
                    raise CorruptRecord(f"{pos} is not an envelope")
                await q.copy_forward(pos, env)
            except CorruptRecord:
                self._copy_failed.add(pos)
            except StorageError:
                return

    async def act(self, action: str, selector: Selector, *, delay_s: float | None = None) -> None:
        """``AdminService.act`` (its checks of the request aside): view the queue as of the durable end,
        catch up to the end, append each chosen message's action, commit once."""
        release_ts: float | None = None
        if action == "delay":
            assert delay_s is not None
            release_ts = self.clock() + delay_s
        qlog = self.queue.log
        with qlog.segments_kept():
            view = await asyncio.to_thread(_view_of_segments, qlog, qlog.durable_end)
        _catch_up(view, qlog)
        lsn = 0
        for e in selector.select(view.entries.values(), self.clock()):
            if e.state == "active" or e.state not in _APPLIES[action]:
                continue
            try:
                _rec, _pos, lsn = self.queue.admin(e.pos, e.envelope, action, release_ts=release_ts)
            except CorruptRecord:
                continue
            k = e.envelope.runner  # AdminService._out_of_runners_way
            if k != PARKED and self.runners:
                r = self.runners[min(k, len(self.runners) - 1)]
                if e.pos >= r.position:
                    r.garbage.add(e.pos)
                    r.poke()
        if lsn:
            await qlog.commit(lsn)

    async def receive(self, marker: int, rcpts: Sequence[str], *, delay_s: float | None = None,
                      held: bool = False) -> str:
        """A client's message ``marker`` to ``rcpts`` (FUTURERELEASE ``delay_s``; ``held``: queued on hold, as
        a ``header_checks`` HOLD or a milter quarantine does); returns after the 250."""
        env = await self.queue.receive(SENDER, list(rcpts), body_of(marker),
                                       not_before_ts=None if delay_s is None else self.now + delay_s, held=held)
        self.trace.events.append(Ack(env.queue_id, marker, tuple(rcpts), self.trace.t, held))
        self.qids[marker] = env.queue_id
        return env.queue_id

    async def admin(self, action: str, marker: int, *, delay_s: float | None = None) -> None:
        """An administrator's ``action`` on message ``marker`` (:meth:`act`)."""
        qid = self.qids[marker]
        self.trace.events.append(Request(action, qid, self.trace.t))
        await self.act(action, Selector(ids=(qid,)), delay_s=delay_s)

    async def deliver_due(self) -> int:
        """One pass of every runner and of the parked runner: deliver what is due now. Returns how many
        envelopes were offered."""
        did = 0
        n = POLICY.runners
        q, qlog = self.queue, self.qlog
        for r in self.runners:  # Runner.run, without its waits: stop at the first envelope not yet due
            while True:
                found = r.cursor.peek_envelope(qlog.durable_end, runner=r.k)
                if found is None or found is False:
                    break
                pos, env = found
                assert isinstance(env, EnvelopeRecord)
                if min(env.runner, n - 1) != r.k or pos in r.garbage:
                    r.garbage.discard(pos)
                    r.cursor.skip()
                    continue
                if r._wait_s(env, r.monotonic()) > 0:  # as Runner.run: by the clock, bounded by the interval
                    break
                await self._work(r.k, pos, env)
                did += 1
                r.cursor.skip()
        for pos in [p for p in q.parked.due(self.now) if p < qlog.durable_end]:  # Daemon._parked_runner
            if pos not in q.parked:
                continue
            try:
                penv = qlog.read(pos)
            except (CorruptRecord, StorageError):
                q.parked.remove(pos)
                continue
            if not isinstance(penv, EnvelopeRecord):
                q.parked.remove(pos)
                continue
            await self._work(n, pos, penv)
            did += 1
        return did

    async def _work(self, slot: int, pos: Pos, env: EnvelopeRecord) -> None:
        """``Daemon._worker`` for one offer, then ``Daemon._attempt`` with :class:`FakeHop` as the relay."""
        q = self.queue
        if pos in q.revoked or (slot == POLICY.runners and pos not in q.parked):
            q.revoked.discard(pos)
            return
        body: bytes | None
        try:
            got = q.body_for_delivery(env, check=False)
            assert isinstance(got, bytes)  # bodies here are small: never streamed
            body, problem = got, ""
        except CorruptRecord as exc:
            body, problem = None, str(exc)
        except StorageError as exc:
            body, problem = None, f"temporary: {exc}"
        attempt = q.start(pos, env)
        rcpts = env.recipients
        if body is None:
            code, enhanced = (451, "4.3.0") if problem.startswith("temporary: ") else (554, "5.3.0")
            outcomes = [Outcome(index=r.index, status="deferred" if code < 500 else "failed", code=code,
                                enhanced=enhanced, text=problem) for r in rcpts]
            await q.record_outcomes(attempt, "none", outcomes)
        else:
            outcomes, hops = [], []
            for r in rcpts:
                code, enhanced, text = FakeHop.reply(r.address, env)
                status = "delivered" if code < 400 else "deferred" if code < 500 else "failed"
                outcomes.append(Outcome(index=r.index, status=status, code=code, enhanced=enhanced, text=text))  # type: ignore[arg-type]
                marker = _marker_of(body)
                ok = env.bounce_of != "" or (marker is not None and body == body_of(marker))
                hops.append(len(self.trace.events))
                self.trace.events.append(Hop(env.queue_id, r.address, code, self.trace.t, ok, env.bounce_of,
                                             _dsn_rows(body) if env.bounce_of else ()))
            await q.record_outcomes(attempt, "fake-hop", outcomes)
            for i in hops:
                self.trace.events[i] = replace(cast(Hop, self.trace.events[i]), durable_t=self.trace.t)
        try:
            q.conclude(attempt, body)
        except CorruptRecord as exc:
            for r in rcpts:
                o = attempt.outcomes.get(r.index)
                if o is None or o.status == "deferred":
                    attempt.outcomes[r.index] = Outcome(index=r.index, status="failed", code=554, enhanced="5.3.0",
                                                        text=f"message data unreadable in queue: {exc}")
            q.conclude(attempt, b"")
        # Not waited for: the round Queue.conclude asked for (sync_soon) runs at the next await, so the next
        # offer's START may come first (and roll the segment over), as in the daemon, whose worker goes back
        # to the dispatcher while that round runs in its thread.

    async def copy_forward(self, marker: int) -> None:
        """``Daemon._copy_parked_forward`` for one parked message: ``Queue.copy_forward``."""
        q = self.queue
        for pos, (qid, _due) in sorted(q.parked.entries.items()):
            if qid == self.qids[marker]:
                env = self.qlog.read(pos)
                assert isinstance(env, EnvelopeRecord)
                await q.copy_forward(pos, env)
                return
        raise AssertionError(f"message {marker} is not parked")

    async def finish(self, rounds_max: int = 60) -> bool:
        """Deliver or bounce everything: release held mail, run the runners, checkpoint and jump the clock
        when nothing is due; True when two idle rounds passed (the queue drained)."""
        idle = 0
        for _ in range(rounds_max):
            if any(due is None for _q, due in self.queue.parked.entries.values()):
                self.trace.events.append(Request("release", "*", self.trace.t))
                await self.act("release", Selector(held=True))
            if await self.deliver_due():
                idle = 0
                continue
            await self.checkpoint()
            self.now = max(self.now + IDLE_JUMP_S, self.queue.parked.next_due() or 0.0)
            idle += 1
            if idle >= 2:
                return True
        return False

    def close(self) -> None:
        if hasattr(self, "qlog"):
            self.qlog.close()


# ---------------------------------------------------------------------------------------------- workloads
Workload = Callable[[Proc], Awaitable[Proc]]


async def w_receive(p: Proc) -> Proc:
    """One message to a deliverable and an undeliverable recipient (the finish delivers and bounces)."""
    await p.receive(1, ["ok1@example.net", "bad1@example.net"])
    return p


async def w_defer(p: Proc) -> Proc:
    """A message deferred at its first attempt: DELIVERY, then a replacement envelope with a DATA copy."""
    await p.receive(1, ["slow1@example.net"])
    await p.deliver_due()
    return p


async def w_dsn(p: Proc) -> Proc:
    """An attempt that delivers one recipient and fails the other: DELIVERY, a DSN, FINISH."""
    await p.receive(1, ["ok1@example.net", "bad1@example.net"])
    await p.deliver_due()
    return p


async def w_hold_release(p: Proc) -> Proc:
    """Admin hold, then release (``AdminService.act``: START(admin) and a replacement, each committed)."""
    await p.receive(1, ["ok1@example.net"])
    await p.admin("hold", 1)
    await p.admin("release", 1)
    return p


async def w_held_at_receipt(p: Proc) -> Proc:
    """A message queued on hold at receipt (``header_checks`` HOLD: a parked generation-0 envelope), one
    queued as usual, then the administrator releases the held one."""
    await p.receive(1, ["ok1@example.net"], held=True)
    await p.receive(2, ["ok2@example.net"])
    await p.admin("release", 1)
    return p


async def w_delay_flush(p: Proc) -> Proc:
    """Admin delay (parked until a time), then flush (due now)."""
    await p.receive(1, ["ok1@example.net"])
    await p.admin("delay", 1, delay_s=30.0)
    await p.admin("flush", 1)
    return p


async def w_flush_deferred(p: Proc) -> Proc:
    """A deferred message flushed by the administrator (issue 31 finding 2's admin shape)."""
    await p.receive(1, ["slow1@example.net"])
    await p.deliver_due()
    await p.admin("flush", 1)
    return p


async def w_delete(p: Proc) -> Proc:
    """Admin delete of one of two messages (START(admin=delete), FINISH)."""
    await p.receive(1, ["ok1@example.net"])
    await p.receive(2, ["ok2@example.net"])
    await p.admin("delete", 1)
    return p


async def w_bounce(p: Proc) -> Proc:
    """Admin bounce: a DSN (5.4.7) for every recipient, then FINISH."""
    await p.receive(1, ["ok1@example.net", "ok2@example.net"])
    await p.admin("bounce", 1)
    return p


async def w_copy_forward(p: Proc) -> Proc:
    """A delayed (FUTURERELEASE) message copied forward: START(copy), DATA copy, replacement (finding 2)."""
    await p.receive(1, ["ok1@example.net"], delay_s=3000.0)
    await p.copy_forward(1)
    return p


async def w_rollover(p: Proc) -> Proc:
    """Small segments: a deferred attempt's DATA copy and replacement, then a roll-over (finding 1)."""
    await p.receive(1, ["slow1@example.net"])
    await p.receive(2, ["ok2@example.net"])
    await p.deliver_due()
    return p


async def w_checkpoint(p: Proc) -> Proc:
    """Small segments: deliveries, then ``Daemon.checkpoint`` (copy forward of parked mail, positions, log
    sync, checkpoint file, reclamation of wholly-garbage segments)."""
    await p.receive(1, ["ok1@example.net"], delay_s=3000.0)
    await p.receive(2, ["ok2@example.net"])
    await p.receive(3, ["slow3@example.net"])
    await p.deliver_due()
    await p.receive(4, ["ok4@example.net"])
    await p.deliver_due()
    await p.checkpoint()
    return p


async def w_restart(p: Proc) -> Proc:
    """A deferred message, a clean restart (kill -9, then the daemon's start on the same page cache), one
    more message in the new run."""
    await p.receive(1, ["slow1@example.net"])
    await p.deliver_due()
    p.fs.kill()
    p.trace.events[:] = _at_crash(p.trace.events, p.trace.t, "kill")
    p.close()
    q = Proc(p.trace, p.segment_bytes_max)
    await q.start()
    await q.receive(2, ["ok2@example.net"])
    return q


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload and the segment size it runs with."""

    fn: Workload
    segment_bytes_max: int = 4096


WORKLOADS: dict[str, WorkloadSpec] = {
    "receive": WorkloadSpec(w_receive),
    "defer": WorkloadSpec(w_defer),
    "dsn": WorkloadSpec(w_dsn),
    "hold_release": WorkloadSpec(w_hold_release),
    "held_at_receipt": WorkloadSpec(w_held_at_receipt),
    "delay_flush": WorkloadSpec(w_delay_flush),
    "flush_deferred": WorkloadSpec(w_flush_deferred),
    "delete": WorkloadSpec(w_delete),
    "bounce": WorkloadSpec(w_bounce),
    "copy_forward": WorkloadSpec(w_copy_forward),
    "rollover": WorkloadSpec(w_rollover, segment_bytes_max=1400),  # rolls at m2's START, after m1's conclusion
    "checkpoint": WorkloadSpec(w_checkpoint, segment_bytes_max=900),
    "restart": WorkloadSpec(w_restart),
}


# ---------------------------------------------------------------------------------------------- checker
@dataclass(frozen=True)
class Step:
    """One crash of a history: after ``op`` operations of run ``run`` (0: the workload's), a ``cut``
    keeping exactly the unsynced changes numbered ``keep`` (``torn``: (seq, bytes kept) of torn writes),
    or a ``kill``. ``changes`` describes the unsynced changes there (for the report only)."""

    run: int
    op: int
    kind: str
    keep: tuple[int, ...] = ()
    torn: tuple[tuple[int, int], ...] = ()
    changes: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        if self.kind == "kill":
            return f"run {self.run}: kill -9 after op {self.op}"
        kept = ",".join(f"#{s}" for s in self.keep) or "none"
        torn = "".join(f" torn #{s}:{n}B" for s, n in self.torn)
        return f"run {self.run}: power cut after op {self.op}, kept {kept}{torn} of [{'; '.join(self.changes)}]"


@dataclass(frozen=True)
class Violation:
    """A broken promise: ``kind`` (see the module docstring), what, and the history that leads to it."""

    workload: str
    kind: str
    detail: str
    path: tuple[Step, ...]

    def __str__(self) -> str:
        steps = " -> ".join(str(s) for s in self.path) or "no crash"
        return f"{self.workload}: {self.kind}: {self.detail} [{steps}]"


@dataclass
class Final:
    """What the checker needs besides the events: the log's state after the last run finished."""

    drained: bool = True
    failure: str = ""
    live: list[str] = field(default_factory=list)  # envelopes left live after the finish
    unsound: list[str] = field(default_factory=list)  # problems of `mtaq log verify`


def _final_state(fs: CrashFileSystem, drained: bool, failure: str) -> Final:
    out = Final(drained=drained, failure=failure)
    if failure:
        return out
    started: set[Pos] = set()
    envs: list[tuple[Pos, EnvelopeRecord]] = []
    for scan in scan_log(fs, LOG_DIR):
        for pos, rec in scan.records:
            if isinstance(rec, StartRecord):
                started.add(rec.envelope)
            elif isinstance(rec, EnvelopeRecord):
                envs.append((pos, rec))
    out.live = [f"{rec.queue_id} at {pos} (runner {rec.runner}{', held' if rec.held else ''})"
                for pos, rec in envs if pos not in started and not (rec.runner == PARKED and rec.held)]
    buf = io.StringIO()
    if verify(LOG_DIR, out=buf, fs=fs) != 0:
        out.unsound = [line[9:] for line in buf.getvalue().splitlines() if line.startswith("problem: ")]
    return out


def check(events: Sequence[Event], final: Final) -> list[tuple[str, str]]:
    """The promises of GUIDE §1 over one history: ``events`` (acknowledgements, deliveries, admin
    requests, reports, crashes, in order) and the ``final`` state. Returns ``(kind, detail)`` pairs."""
    out: list[tuple[str, str]] = []
    if final.failure:
        out.append(("run-failed", final.failure))
        return out
    acked: dict[str, Ack] = {}
    delivered: Counter[tuple[str, str]] = Counter()
    inflight: Counter[tuple[str, str]] = Counter()
    dsns: dict[tuple[str, str], set[str]] = {}
    bounced_by_admin: set[str] = set()
    deleted: set[str] = set()
    held: set[str] = set()  # acknowledged on hold: delivered only after a release (of it, or "*": all held)
    released: set[str] = set()
    for e in events:
        if isinstance(e, Ack):
            acked[e.qid] = e
            if e.held:
                held.add(e.qid)
        elif isinstance(e, Request):
            if e.action == "release":
                released.add(e.qid)
            (deleted if e.action == "delete" else bounced_by_admin if e.action == "bounce" else set()).add(e.qid)
        elif isinstance(e, Reported):
            out.append(("spurious-corruption", f"recovery reported {e.what}, but only crashes happened"))
        elif isinstance(e, Hop):
            if e.code // 100 == 2 and e.qid in held and not released & {e.qid, "*"}:
                out.append(("delivered-while-held", f"{e.qid} to {e.rcpt}: queued on hold, delivered before any release"))
            if e.code // 100 == 2:
                delivered[(e.qid, e.rcpt)] += 1
                inflight[(e.qid, e.rcpt)] += e.inflight
                if not e.body_ok:
                    out.append(("body-differs", f"{e.qid} to {e.rcpt}: the body delivered is not the one received"))
            for final_rcpt, action, status in e.rows:
                if action == "failed":
                    dsns.setdefault((e.bounce_of, final_rcpt), set()).add(f"{e.qid} ({status})")
    for key, n in sorted(delivered.items()):
        if n > 1 + inflight[key]:
            out.append(("delivered-twice", f"{key[0]} to {key[1]}: delivered {n} times, in flight at "
                        f"{inflight[key]} crash(es)"))
    for key, ids in sorted(dsns.items()):
        if len(ids) > 1:
            out.append(("dsn-twice", f"{key[0]} to {key[1]}: {len(ids)} DSNs: {', '.join(sorted(ids))}"))
        if delivered[key]:
            out.append(("delivered-and-bounced", f"{key[0]} to {key[1]}: delivered and bounced ({', '.join(sorted(ids))})"))
        if key[0] in acked and not key[1].startswith("bad") and key[0] not in bounced_by_admin:
            out.append(("bounced-deliverable", f"{key[0]} to {key[1]}: bounced ({', '.join(sorted(ids))}) "
                        "although the next hop takes it"))
    for qid, ack in sorted(acked.items()):
        for r in ack.rcpts:
            if not delivered[(qid, r)] and not dsns.get((qid, r)) and qid not in deleted:
                out.append(("lost", f"acknowledged {qid} (message {ack.marker}) to {r}: never delivered, no DSN"))
    if not final.drained:
        out.append(("stranded", "the queue did not drain"))
    for live in final.live:
        out.append(("stranded", f"live envelope {live} that no runner offered"))
    for problem in final.unsound:
        out.append(("log-unsound", problem))
    return out


# ---------------------------------------------------------------------------------------------- enumeration
@dataclass(frozen=True)
class Bounds:
    """How far :func:`explore` goes (see the module docstring). The defaults are the ``make test`` seed."""

    crashes: int = 2  # crashes per history (cuts and kills)
    all_subsets_max: int = 6  # every subset of the unsynced changes up to this many (in the workload's run)
    later_all_subsets_max: int = 3  # the same in the runs after a crash
    torn: bool = True  # each in-order prefix also with the next write half written
    kill: bool = True  # kill -9 (page cache kept) at each crash point too
    later_points: str = "start"  # crash points of runs after a crash: "start" or "all"
    later_families: bool = True  # after a crash, also the "all but one" / "only one" subsets past the bound
    later_torn: bool = True  # after a crash, torn writes too
    later_cuts: bool = True  # after a crash, power cuts too (False: only kill -9 in the runs after a crash)
    # Which crashes get a further crash in the next run: "all"; "kill" (kill -9 only); "kill-unsynced" (a
    # kill -9 that left unsynced changes in the page cache: the class of issue 31 finding 1); "unsynced"
    # (those, and power cuts that kept a change after losing an earlier one: holes recovery must repair);
    # "holes" (only those power cuts).
    deepen: str = "all"
    states_max: int = 0  # stop after this many distinct states (0: no limit)
    # In each run after a crash, a client's message is acknowledged between ``Log.open`` and recovery (the
    # daemon listens before it recovers): a crash in that run may leave new durable records past damage
    # the run's recovery never reached (the class of the stop-41 defect).
    later_receive: bool = False


def choices(changes: Sequence[Change], all_max: int, *, torn: bool, families: bool
            ) -> list[tuple[frozenset[int], tuple[tuple[int, int], ...]]]:
    """The power cuts to try over ``changes`` (the unsynced changes, in order): (kept seqs, torn writes)."""
    seqs = [c.seq for c in changes]
    out: dict[tuple[frozenset[int], tuple[tuple[int, int], ...]], None] = {}
    if len(seqs) <= all_max:
        for n in range(len(seqs) + 1):
            for sub in itertools.combinations(seqs, n):
                out[(frozenset(sub), ())] = None
    else:
        for i in range(len(seqs) + 1):
            out[(frozenset(seqs[:i]), ())] = None
        if families:
            for s in seqs:
                out[(frozenset(seqs) - {s}, ())] = None
                out[(frozenset((s,)), ())] = None
    if torn:
        for i, c in enumerate(changes):
            if c.kind == "write" and c.nbytes > 1:
                out[(frozenset(seqs[:i]), ((c.seq, c.nbytes // 2),))] = None
    return list(out)


@dataclass
class ExploreReport:
    """What :func:`explore` did: distinct ``states`` recovered and checked (per workload), states skipped
    as seen before, violations (every one; ``examples`` keeps the shortest few per kind), seconds."""

    states: int = 0
    duplicates: int = 0
    per_workload: dict[str, int] = field(default_factory=dict)
    violations: Counter[tuple[str, str]] = field(default_factory=Counter)  # (workload, kind) -> count
    examples: dict[tuple[str, str], list[Violation]] = field(default_factory=dict)
    seconds: float = 0.0
    truncated: bool = False  # states_max was reached

    def add(self, v: Violation, keep: int = 3) -> None:
        key = (v.workload, v.kind)
        self.violations[key] += 1
        ex = self.examples.setdefault(key, [])
        ex.append(v)
        ex.sort(key=lambda x: (len(x.path), sum(len(s.keep) for s in x.path), str(x)))
        del ex[keep:]

    def total(self) -> int:
        return sum(self.violations.values())

    def summary(self) -> dict[str, Any]:
        """JSON-able: counts, and the shortest example of each kind."""
        return {
            "states": self.states,
            "duplicates": self.duplicates,
            "per_workload": dict(self.per_workload),
            "violations": self.total(),
            "by_kind": {f"{w}:{k}": n for (w, k), n in sorted(self.violations.items())},
            "examples": [str(ex[0]) for _k, ex in sorted(self.examples.items())],
            "seconds": round(self.seconds, 2),
            "truncated": self.truncated,
        }


def _fs_key(fs: CrashFileSystem) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for path, data in sorted(fs.files().items()):
        h.update(path.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
    pending = fs.pending()
    if pending:  # a kill -9 left unsynced changes: what is durable matters too
        for path, data in sorted(fs.durable_snapshot().items()):
            h.update(b"D" + path.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
    for c in pending:
        h.update(f"{c.kind}{c.path}{c.offset}{c.nbytes}{c.size}{c.name}{c.new_name}".encode())
    for d in sorted(fs.dirs()):
        h.update(b"d" + d.encode())
    return h.digest()


class _Explorer:
    def __init__(self, bounds: Bounds, report: ExploreReport) -> None:
        self.bounds = bounds
        self.report = report
        self.seen: set[tuple[bytes, int, tuple[Event, ...]]] = set()

    def full(self) -> bool:
        return bool(self.bounds.states_max) and self.report.states >= self.bounds.states_max

    async def run_history(self, name: str, spec: WorkloadSpec, fs: CrashFileSystem, before: list[Event],
                          path: tuple[Step, ...], snapshots: bool) -> tuple[Trace, Final]:
        """One run from ``fs`` (the workload's when ``path`` is empty, else a start after the crashes of
        ``path``), finished; returns its trace and final state."""
        # Runs number 8 per crash (a workload may restart): queue IDs never repeat within a history.
        trace = Trace(fs, snapshots=snapshots, run=8 * len(path))
        proc = Proc(trace, spec.segment_bytes_max)
        failure, drained = "", False
        try:
            first = 100 + len(path) if path and self.bounds.later_receive else None
            await asyncio.wait_for(proc.start(first), 30)
            trace.start_end = trace.t
            if not path:
                proc = await asyncio.wait_for(spec.fn(proc), 30)
            drained = await asyncio.wait_for(proc.finish(), 60)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041 - a hang is a failure too
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            proc.close()
            fs.on_op = None
        assert not snapshots or len(trace.snaps) == trace.t + 1, "a snapshot after every operation"
        final = _final_state(fs, drained, failure)
        return trace, final

    async def state(self, name: str, spec: WorkloadSpec, fs: CrashFileSystem, before: list[Event],
                    path: tuple[Step, ...]) -> None:
        """Explore the state ``fs`` reached by ``path``: run, check, then its own crashes."""
        key = (_fs_key(fs), len(path), tuple(before))
        if key in self.seen:
            self.report.duplicates += 1
            return
        if self.full():
            self.report.truncated = True
            return
        self.seen.add(key)
        deeper = len(path) < self.bounds.crashes and (not path or self._deepens(path[-1], fs))
        trace, final = await self.run_history(name, spec, fs, before, path, deeper)
        self.report.states += 1
        self.report.per_workload[name] = self.report.per_workload.get(name, 0) + 1
        for kind, detail in check([*before, *trace.events], final):
            self.report.add(Violation(name, kind, detail, path))
        if deeper:
            await self.crashes_of(name, spec, trace, before, path)

    def _deepens(self, step: Step, fs: CrashFileSystem) -> bool:
        deepen = self.bounds.deepen
        if deepen == "all":
            return True
        if step.kind == "kill":
            return deepen == "kill" or (deepen in ("kill-unsynced", "unsynced") and bool(fs.pending()))
        if deepen not in ("unsynced", "holes"):
            return False
        seqs = [int(c.split()[0][1:]) for c in step.changes]
        kept = set(step.keep) | {s for s, _n in step.torn}
        lost = [i for i, x in enumerate(seqs) if x not in kept]
        return bool(lost) and any(x in kept for x in seqs[lost[0] + 1:])  # a hole: kept after lost

    async def crashes_of(self, name: str, spec: WorkloadSpec, trace: Trace, before: list[Event],
                         path: tuple[Step, ...]) -> None:
        """Every crash state of ``trace`` within the bounds, each explored by :meth:`state`."""
        b = self.bounds
        last = len(trace.snaps) - 1
        points = list(range(last + 1)) if not path or b.later_points == "all" else \
            sorted({*range(min(trace.start_end, last) + 1), last})
        all_max = b.all_subsets_max if not path else b.later_all_subsets_max
        run = len(path)
        for k in points:
            snap = trace.snaps[k]
            probe = CrashFileSystem.restore(snap)
            changes = probe.pending()
            described = tuple(str(c) for c in changes)
            cuts = choices(changes, all_max, torn=b.torn and (not path or b.later_torn),
                           families=not path or b.later_families) if not path or b.later_cuts else []
            for keep, torn in cuts:
                fs = CrashFileSystem.restore(snap)
                fs.crash_to(keep, dict(torn))
                step = Step(run, k, "cut", tuple(sorted(keep)), torn, described)
                await self.state(name, spec, fs, [*before, *_at_crash(trace.events, k, "cut")], (*path, step))
            if b.kill:
                step = Step(run, k, "kill")
                await self.state(name, spec, CrashFileSystem.restore(snap),
                                 [*before, *_at_crash(trace.events, k, "kill")], (*path, step))


def explore(workloads: Sequence[str] | None = None, bounds: Bounds | None = None) -> ExploreReport:
    """Enumerate and check the crash states of ``workloads`` (names in :data:`WORKLOADS`; all when None)
    within ``bounds``. Runs its own event loop; deterministic (see :func:`deterministic`)."""
    b = bounds or Bounds()
    report = ExploreReport()
    t0 = time.monotonic()

    async def go() -> None:
        ex = _Explorer(b, report)
        asyncio.get_running_loop().set_default_executor(_Inline(max_workers=1))
        for name in workloads or list(WORKLOADS):
            ex.seen.clear()
            await ex.state(name, WORKLOADS[name], CrashFileSystem(), [], ())

    with deterministic():
        asyncio.run(go())
    report.seconds = time.monotonic() - t0
    return report


def run_once(workload: str) -> CrashFileSystem:
    """Run ``workload`` and finish the queue, without a crash; return its file system (``ops`` records
    every operation). Deterministic (see :func:`deterministic`)."""
    spec = WORKLOADS[workload]

    async def go() -> CrashFileSystem:
        asyncio.get_running_loop().set_default_executor(_Inline(max_workers=1))
        trace = Trace(CrashFileSystem(), snapshots=False, run=0)
        proc = Proc(trace, spec.segment_bytes_max)
        try:
            await proc.start()
            proc = await spec.fn(proc)
            await proc.finish()
        finally:
            proc.close()
        return trace.fs

    with deterministic():
        return asyncio.run(go())


def replay(workload: str, path: Sequence[Step], bounds: Bounds | None = None) -> list[tuple[str, str]]:
    """Run the history of ``workload`` with exactly the crashes of ``path`` (from a :class:`Violation`) and
    return what :func:`check` finds at its end. ``bounds``: those of the exploration that found it (only
    ``later_receive`` matters here)."""
    spec = WORKLOADS[workload]

    async def go() -> list[tuple[str, str]]:
        asyncio.get_running_loop().set_default_executor(_Inline(max_workers=1))
        later = bounds.later_receive if bounds is not None else False
        ex = _Explorer(Bounds(crashes=0, later_receive=later), ExploreReport())
        fs = CrashFileSystem()
        before: list[Event] = []
        done: tuple[Step, ...] = ()
        for step in path:
            trace, _final = await ex.run_history(workload, spec, fs, before, done, True)
            snap = trace.snaps[step.op]
            fs = CrashFileSystem.restore(snap)
            if step.kind == "cut":
                fs.crash_to(step.keep, dict(step.torn))
            before = [*before, *_at_crash(trace.events, step.op, step.kind)]
            done = (*done, step)
        trace, final = await ex.run_history(workload, spec, fs, before, done, False)
        return check([*before, *trace.events], final)

    with deterministic():
        return asyncio.run(go())
