"""Queue runners, one per retry interval plus one for new mail (seed 001), and the dispatcher.

Runner k reads the log forward from its position with a :class:`LogCursor`, looking only at envelopes
whose ``runner`` is k. Their due times follow log order (an envelope of runner k is due a fixed interval
after it was written), so the runner waits for the one in front of it and never keeps a list of deferred
mail in memory. An envelope in the runner's ``garbage`` set was started out of band (recovery found its
START ahead of the runner) and is skipped. The runner stops at the log's durable end: it never hands out
mail whose envelope is not durable.

The dispatcher is where runners meet the delivery workers. Each runner offers one envelope at a time and
waits until a worker takes it. Workers take alternately from the new-mail runner and from the deferred
runners (rotating among those), so waiting mail never blocks new mail, and the other way round (Postfix
alternates its incoming and deferred queues; seed 001 postscript).

What must always hold: a runner's position P means every envelope of that runner before P has a START
record appended. A worker *claims* an offer, appends the START, and only then *accepts* it; the runner
moves on only after the acceptance. If the START cannot be written (a full disk), the worker *declines*,
and the runner offers the same envelope again a little later. So a checkpoint taken from runner
positions, then fsync'd, never claims that an unstarted envelope was started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mtaq.core.errors import StorageError
from mtaq.core.frame import Problem
from mtaq.core.records import EnvelopeRecord, Pos
from mtaq.storage.cursor import LogCursor
from mtaq.storage.log import Log

__all__ = ["DEFERRED_SCAN_DELAY_S", "RUNNER_READ_RETRY_S", "Dispatcher", "Offer", "Runner"]

_SCAN_BUDGET = 512  # frames a runner reads before it lets other tasks run
_DECLINED_RETRY_S = 1.0
RUNNER_READ_RETRY_S = 1.0  # after a read error that can pass (EMFILE, EIO, ENOMEM): the runner tries again
# A deferred runner (k >= 1) that has read to the durable end reads again at most this long after the end
# moved (at once when flushed or poked): its envelopes fall due a retry interval after they were written.
DEFERRED_SCAN_DELAY_S = 0.2


class Declined(Exception):
    """A worker could not start the offered envelope (its START could not be appended)."""


@dataclass(slots=True)
class Offer:
    """One envelope offered by runner ``runner``; a worker claims it, then accepts or declines it."""

    runner: int
    pos: Pos
    envelope: EnvelopeRecord
    taken: asyncio.Future[None]
    claimed: bool = False

    def accept(self) -> None:
        """The START is appended: the runner may move past this envelope."""
        if not self.taken.done():
            self.taken.set_result(None)

    def decline(self) -> None:
        """The START could not be appended: the runner keeps its position and offers it again."""
        if not self.taken.done():
            self.taken.set_exception(Declined())


class Dispatcher:
    """Hands envelopes from runners to delivery workers, alternating new and deferred mail."""

    def __init__(self, runners: int) -> None:
        self._slots: list[Offer | None] = [None] * runners
        # Workers waiting for an offer, longest waiting first: an offer wakes one of them, not all (with an
        # asyncio.Event every idle worker woke for every message, found nothing and went back to sleep).
        self._idle: deque[asyncio.Future[None]] = deque()
        self._prefer_deferred = False
        self._next_deferred = 1
        self._nudges = 0  # idle workers woken by nudge() that take_or_nudge() has not answered yet

    async def offer(self, runner: int, pos: Pos, env: EnvelopeRecord) -> None:
        """Offer one envelope; return when a worker has started it (raises Declined if it could not)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slots[runner] = Offer(runner, pos, env, fut)
        self._wake_one()
        try:
            await fut
        finally:
            self._slots[runner] = None

    def _wake_one(self) -> None:
        idle = self._idle
        while idle:
            w = idle.popleft()
            if not w.done():  # done: cancelled while waiting
                w.set_result(None)
                return

    def _ready(self, k: int) -> Offer | None:
        s = self._slots[k]
        return s if s is not None and not s.claimed else None

    def _pick(self) -> Offer | None:
        n = len(self._slots)
        deferred = None
        for i in range(n - 1):  # rotate among the deferred runners 1..n-1
            k = 1 + (self._next_deferred - 1 + i) % (n - 1)
            if self._ready(k) is not None:
                deferred = k
                break
        new = self._ready(0)
        if deferred is not None and (self._prefer_deferred or new is None):
            self._prefer_deferred = False
            self._next_deferred = deferred % (n - 1) + 1
            return self._slots[deferred]
        if new is not None:
            self._prefer_deferred = True
        return new

    def nudge(self) -> None:
        """Wake one worker waiting in :meth:`take_or_nudge` without an offer (it returns None): work it
        holds back (a started attempt waiting for its destination, mtaq.daemon.process) can go on. Nothing
        when no worker waits: a busy one looks at that work when its delivery ends."""
        if any(not w.done() for w in self._idle):
            self._nudges += 1
            self._wake_one()

    async def take(self) -> Offer:
        """Wait for the next envelope and claim it. The caller appends its START, then calls
        :meth:`Offer.accept` (or :meth:`Offer.decline`), before awaiting anything."""
        while True:
            o = await self.take_or_nudge()
            if o is not None:
                return o

    async def take_or_nudge(self) -> Offer | None:
        """As :meth:`take`, but None when :meth:`nudge` woke this worker and no offer was there."""
        while True:
            o = self._pick()
            if o is not None:
                o.claimed = True
                return o
            if self._nudges:
                self._nudges -= 1
                return None
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(w)
            try:
                await w
            except asyncio.CancelledError:
                if w.done() and not w.cancelled():
                    self._wake_one()  # woken for an offer, then cancelled: another worker takes it
                raise



class Runner:
    """Queue runner ``k``: finds due envelopes of runner k in the log and offers them to the dispatcher."""

    def __init__(
        self,
        k: int,
        log: Log,
        dispatcher: Dispatcher,
        position: Pos,
        garbage: set[Pos],
        *,
        runners: int,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
        on_corrupt: Callable[[Problem], None] | None = None,
        on_read_error: Callable[[StorageError], None] | None = None,
    ) -> None:
        self.k = k
        self.log = log
        self.dispatcher = dispatcher
        self.cursor = LogCursor(log, position, on_corrupt)
        self.garbage = garbage
        self.runners = runners
        self.clock = clock
        self.monotonic = monotonic
        # The retry interval of this runner's envelopes (seconds; 0 for new mail): no envelope is waited for
        # longer than this after the runner first saw it, whatever the wall clock says (None: no bound).
        self.interval_s = interval_s
        self.waiting_until: float | None = None
        self._poke = asyncio.Event()
        self._flush = False
        self._flush_until = Pos(0, 0)  # the log's end when flush() was called: envelopes before it are flushed
        self.offered = 0
        self.on_read_error = on_read_error or (lambda exc: None)

    @property
    def position(self) -> Pos:
        return self.cursor.pos

    def poke(self) -> None:
        """Re-read the clock now (a test that jumped its clock)."""
        self._poke.set()

    def flush(self) -> None:
        """Stop waiting: offer every envelope of this runner written before now (the log's end at this call)
        as if due now; envelopes written later keep their retry interval."""
        self._flush = True
        self._flush_until = self.log.end
        self._poke.set()

    def _wait_s(self, env: EnvelopeRecord, seen: float) -> float:
        """Seconds until ``env`` is due: by the wall clock (its ``not_before_ts``), but never longer than
        :attr:`interval_s` after the runner first saw it (``seen``, monotonic), so that a backward step of the
        wall clock holds mail for at most its retry interval, and the runner for new mail (interval 0) never
        waits: before, a step back of T held every new message behind the one in front for T (issue 31.8).
        A forward step makes mail due early: it is retried early, which is harmless (its expiry does not
        move: Queue.age_clock)."""
        wait = env.not_before_ts - self.clock()
        if self.interval_s is None:
            return wait
        return min(wait, seen + self.interval_s - self.monotonic())

    async def run(self) -> None:
        budget = _SCAN_BUDGET
        while True:
            end = self.log.durable_end
            try:
                found = self.cursor.peek_envelope(end, max_frames=_SCAN_BUDGET, runner=self.k)
            except StorageError as exc:
                # Out of file descriptors, an I/O error: the runner must not die (the daemon would exit and
                # restart into the same state). It keeps its position and reads again a little later.
                self.on_read_error(exc)
                await asyncio.sleep(RUNNER_READ_RETRY_S)
                continue
            if found is False:
                await asyncio.sleep(0)  # a long stretch of other records: let other tasks run
                continue
            if found is None:
                self._flush = False
                self._poke.clear()  # nothing left to re-read the clock for
                if self.log.durable_end <= end:
                    await self.log.durable_advanced()
                    if self.k > 0 and not self._poke.is_set():
                        # A deferred runner's envelopes are due an interval after they were written: it reads
                        # what became durable in batches, not after every commit (most frames are not its own).
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._poke.wait(), DEFERRED_SCAN_DELAY_S)
                continue
            pos, env = found
            assert isinstance(env, EnvelopeRecord)
            if min(env.runner, self.runners - 1) != self.k or pos in self.garbage:
                self.garbage.discard(pos)
                self.cursor.skip()
                budget -= 1
                if budget <= 0:
                    budget = _SCAN_BUDGET
                    await asyncio.sleep(0)
                continue
            seen = self.monotonic()
            while not (self._flush and pos < self._flush_until) and pos not in self.garbage and (
                wait := self._wait_s(env, seen)
            ) > 0:
                self.waiting_until = env.not_before_ts
                self._poke.clear()
                try:
                    await asyncio.wait_for(self._poke.wait(), wait)
                except TimeoutError:
                    pass
            self.waiting_until = None
            if pos in self.garbage:
                # Started meanwhile by an administrator's action (held, deleted, ...): not waited for any
                # longer, or this runner's position would keep every later segment for up to an interval.
                self.garbage.discard(pos)
                self.cursor.skip()
                continue
            try:
                await self.dispatcher.offer(self.k, pos, env)
            except Declined:
                await asyncio.sleep(_DECLINED_RETRY_S)
                continue
            self.offered += 1
            self.cursor.skip()
