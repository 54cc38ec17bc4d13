"""The queue: every change goes through here, appended to the log first, then to the in-memory working set.

What waits for an fsync and what does not (seed 001, GUIDE §3):

* receiving: DATA + ENVELOPE, then ``commit`` - the 250 comes after;
* delivery outcomes: DELIVERY, then ``commit`` - a recipient counts as done only after;
* START, FINISH, replacement envelopes and DSNs: appended, not waited for (book-keeping). An fsync covers a
  whole prefix, but a power cut before it can keep a later page and lose an earlier one (out-of-order
  write-back), so a conclusion can survive while the DSNs or the DATA copy appended just before it did
  not. Recovery therefore trusts a conclusion only when it is known durable or no unsynced hole lies within
  its attempt; otherwise it concludes the attempt again from the original envelope (mtaq.queue.recovery).

A replacement envelope gets a fresh copy of the DATA record, so that mail deferred for days never pins an
old segment (reclamation deletes a prefix of segments).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec

from mtaq.core.dsn import DsnRecipient, build_dsn
from mtaq.core.errors import CorruptRecord, QueueBusy, StorageError, StorageFatal, StorageFull
from mtaq.core.parking import ADMIN_ACTIONS, ADMIN_BOUNCE, COPY_FORWARD, Parked, QueueCounts, admin_conclusion
from mtaq.core.records import (
    PARKED,
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    RecordType,
    StartRecord,
    encode_data_prefix,
)
from mtaq.core.state import Attempt, Conclusion, DsnItem, RetryPolicy, WorkingSet, conclude, format_reply
from mtaq.storage.log import PIECE_BYTES, Log, storage_error
from mtaq.storage.spill import MEMORY_BYTES, BodyBuffer

__all__ = ["STREAM_BYTES_MIN", "Queue", "StoredBody", "far_data", "new_queue_id", "queue_id_shard", "set_queue_id_shard"]

STREAM_BYTES_MIN = 256 * 1024  # a body of this many bytes or more is sent from the log in pieces
DELIVERY_LINGER_S = 0.002
"""Seconds a DELIVERY record's fsync may wait for a commit that does not wait (a client's 250), so that one fsync
covers both (Log.commit ``linger_s``). A power cut in that time can deliver the recipients again, as in the
fsync itself; a kill -9 cannot (the page cache keeps what was written)."""


class StoredBody:
    """The body of the DATA record of ``env``, read from the log in pieces (issue 15.2).

    ``size`` is its length in bytes. :meth:`pieces` gives the body in order, in pieces of at most
    ``piece_bytes``; after the last piece it checks the record (queue ID, length, frame checksum) and
    raises CorruptRecord if it does not check out: a consumer (delivery) must not complete anything with
    the bytes before the iteration has ended without an error. StorageError on I/O errors.
    """

    __slots__ = ("_log", "_pos", "_prefix", "piece_bytes", "queue_id", "size")

    def __init__(self, log: Log, env: EnvelopeRecord, *, piece_bytes: int = PIECE_BYTES) -> None:
        self._log = log
        self._pos = env.data
        self.queue_id = env.queue_id
        self.size = env.size
        self._prefix = encode_data_prefix(env.queue_id, env.size)  # the payload before the body's bytes
        self.piece_bytes = piece_bytes

    def pieces(self, *, salt: int | None = None) -> Iterator[bytes]:
        """The body's pieces (see the class). With ``salt`` (:meth:`Log.salt_of` of its segment) the log is read
        through a handle of its own, so that this may run in another thread."""
        rest, seen = self._prefix, 0  # the prefix (msgpack array, tag, queue ID, length) must be what we expect
        for piece in self._log.read_payload(self._pos, int(RecordType.DATA), piece_bytes=self.piece_bytes, salt=salt):
            if rest:
                n = min(len(rest), len(piece))
                if piece[:n] != rest[:n]:
                    raise CorruptRecord(f"{self.queue_id}: data reference {self._pos} is not its DATA record")
                piece, rest = piece[n:], rest[n:]
                if not piece:
                    continue
            seen += len(piece)
            if seen > self.size:
                raise CorruptRecord(f"{self.queue_id}: DATA record at {self._pos} is longer than {self.size} bytes")
            yield piece
        if seen != self.size or rest:
            raise CorruptRecord(f"{self.queue_id}: DATA record at {self._pos} is {seen} bytes, not {self.size}")

    def verify(self) -> None:
        """Read the whole body once (in pieces) and check it. Raises CorruptRecord, StorageError."""
        for _piece in self.pieces():
            pass

    async def verify_yielding(self) -> None:
        """:meth:`verify`, letting the event loop run other tasks after each piece: checking a large body
        never stalls the other sessions of the process. Same errors."""
        for _piece in self.pieces():
            await asyncio.sleep(0)

def far_data(pos: Pos, env: EnvelopeRecord) -> bool:
    """True when the envelope at ``pos`` names DATA more than one segment before it: reclamation, which
    keeps only the segment before the earliest live envelope, must keep that DATA's segment explicitly."""
    return env.data.segment < pos.segment - 1


_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
_B32_PAIRS = [a + b for a in _B32 for b in _B32]  # the two symbols of each 10-bit value, 1,024 of them
_last_us = 0
_shard = -1


def set_queue_id_shard(shard: int | None) -> None:
    """In worker ``shard`` (0..15) of a sharded spool (mtaq.daemon.workers): the low 4 bits of every queue ID are
    ``shard``, so that IDs made by different worker processes can never be equal. None: IDs of no shard (all
    random low bits, as a one-worker daemon makes them; the default). Raises ValueError outside 0..15."""
    global _shard
    if shard is None:
        _shard = -1
        return
    if not 0 <= shard < 16:
        raise ValueError(f"shard {shard} out of range 0..15")
    _shard = shard


def new_queue_id(now_ts: float | None = None) -> str:
    """A queue ID that is never reused: 11 symbols of microseconds since the epoch + 4 random symbols."""
    global _last_us
    us = int((time.time() if now_ts is None else now_ts) * 1_000_000)
    if us <= _last_us:
        us = _last_us + 1
    _last_us = us
    n = (us << 20) | int.from_bytes(os.urandom(3), "big") & 0xFFFFF
    if _shard >= 0:
        n = (n & ~0xF) | _shard
    p = _B32_PAIRS  # the 15 symbols of the low 75 bits, most significant first: 5 bits, then 7 pairs of 10
    return (_B32[(n >> 70) & 31] + p[(n >> 60) & 1023] + p[(n >> 50) & 1023] + p[(n >> 40) & 1023]
            + p[(n >> 30) & 1023] + p[(n >> 20) & 1023] + p[(n >> 10) & 1023] + p[n & 1023])


def queue_id_shard(queue_id: str) -> int | None:
    """The shard in the low 4 bits of ``queue_id`` (see :func:`set_queue_id_shard`), or None when it is not
    a queue ID. IDs made without :func:`set_queue_id_shard` (a spool run by one worker with an older mtaq)
    carry random low bits: a caller that routes by shard looks for them in shard 0 too."""
    if len(queue_id) != 15:
        return None
    v = _B32.find(queue_id[-1].upper())
    return None if v < 0 else v & 0xF


def _param(params: Sequence[tuple[str, str]], key: str) -> str | None:
    for k, v in params:
        if k.upper() == key:
            return v
    return None


class Queue:
    """The log plus the working set it implies. ``clock`` returns UTC seconds, ``monotonic`` seconds that no
    clock step moves (both injectable for tests; see :meth:`age_clock`)."""

    def __init__(
        self,
        log: Log,
        *,
        policy: RetryPolicy,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        reporting_mta: str | None = None,
    ) -> None:
        self.log = log
        self.policy = policy
        self.clock = clock
        self.monotonic = monotonic
        self._wall0, self._mono0 = clock(), monotonic()
        self.reporting_mta = reporting_mta or socket.getfqdn()
        self.working = WorkingSet()
        self.received = 0
        # New mail is refused (452 4.3.1) while the spool has less than this many bytes free, so that
        # deliveries, which free space, can still write their records (Postfix's queue_minfree). 0: no floor.
        self.minfree_bytes = 0
        self.messages_max = 0  # back-pressure: 452 4.3.1 while the queue holds this many (0: no limit)
        self.commit_backlog_max = 0  # back-pressure: 451 4.3.2 while this many wait for an fsync (0: none)
        # A DSN returns at most this much of the original, else its header section only (0: no limit).
        self.bounce_size_limit_bytes = 50_000
        self.settling = 0  # received messages waiting for their covering fsync (the group commit backlog)
        # A body being received is kept in memory up to this many bytes, then in an unnamed temporary file
        # in the log's directory, and copied into the log in pieces (issue 13.4; see new_body).
        self.body_memory_bytes = MEMORY_BYTES
        self.stream_bytes_min = STREAM_BYTES_MIN  # bodies this large are delivered from the log in pieces
        self.delivery_linger_s = DELIVERY_LINGER_S
        self.counts = QueueCounts()  # messages by state (mtaq queue size)
        self.parked = Parked()  # held and delayed envelopes, which no runner reads
        # Envelopes an administrator's action started while a runner or the parked scheduler may still offer
        # them: a worker that takes such an offer drops it (the message was deleted, held, ... meanwhile).
        self.revoked: set[Pos] = set()
        # Envelopes an administrator's action selected and has not acted on yet (it appends in batches and
        # lets the loop run between them: mtaq.admin.service): no worker starts them (it declines the offer,
        # the runner offers it again later) and copy_forward leaves them alone. Empty outside an action.
        self.reserved: set[Pos] = set()
        # Live envelopes whose DATA could not be copied forward (a read error, a full disk): envelope position
        # -> the old DATA it names, more than a segment behind it. Reclamation keeps those segments until the
        # envelope is concluded again (Daemon.checkpoint; kept in the checkpoint, rebuilt by recovery).
        self.data_pins: dict[Pos, Pos] = {}
        # Copies forward whose START is appended but not their replacement (a full disk in between): START
        # position -> (the attempt, the DATA copy). See finish_open_copies.
        self._open_copies: dict[Pos, tuple[Attempt, Pos]] = {}
        # Called with each new envelope and its position once it is durable (the daemon logs `queued`).
        self.on_durable: Callable[[EnvelopeRecord, Pos], None] = lambda env, pos: None
        # Called with (START position, the envelope it names) for each START appended here: the event exporter
        # keeps that envelope's segment until it has read the START (mtaq.daemon.exporter; None: no exporter).
        self.on_start: Callable[[Pos, Pos], None] | None = None
        # Called for each DSN queued: (dsn envelope, original queue ID, kind).
        # (the DSN's envelope, the original's queue ID, its action, the recipients it reports) once queued
        self.on_dsn: Callable[[EnvelopeRecord, str, str, tuple[DsnItem, ...]], None] = lambda env, qid, kind, items: None
        # Returns a DSN this queue generated (first argument) as it is to be relayed, given the original message
        # as stored (second): the daemon gives DKIM signing here (mtaq.edge.dkim, RFC 6376; the queue does not
        # import the edge). Must not raise.
        self.sign: Callable[[bytes, bytes], bytes] = lambda message, original: message

    def age_clock(self) -> float:
        """The time (UTC seconds) at which a message's age is measured, for its lifetime and the delay
        warning: the wall clock, but never ahead of the wall clock at this queue's start plus the monotonic
        time elapsed since (issue 31.8). A forward step of the wall clock while the process runs therefore
        expires nothing early: expiry needs the wall clock *and* the elapsed time to agree. A backward step
        delays expiry by the step (never early). Across a restart the wall clock at the start is trusted
        (there is nothing else), and NTP's slewing (at most 500 ppm) can delay expiry by that fraction."""
        return min(self.clock(), self._wall0 + (self.monotonic() - self._mono0))

    async def receive(
        self,
        sender: str,
        recipients: Sequence[str],
        body: bytes | BodyBuffer,
        *,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
        client: str = "",
        helo: str = "",
        not_before_ts: float | None = None,
        queue_id: str = "",
        maildrop: str = "",
        held: bool = False,
    ) -> EnvelopeRecord:
        """Append a new message and return its envelope once it is durable (the caller may then say 250).

        ``body`` is the message as bytes, or a :class:`~mtaq.storage.spill.BodyBuffer` (from
        :meth:`new_body`) that is copied into the log in pieces, never whole in memory (issue 13.4); the
        caller closes the buffer.
        ``not_before_ts`` (UTC seconds) delays the first attempt (RFC 4865 FUTURERELEASE): the envelope is
        then parked until that time instead of going to the runner for new mail.
        ``queue_id``: the ID to give the message (made by :func:`new_queue_id` before, when the caller writes it
        into the message: the pick-up's ``Received:`` line); "" makes one. ``maildrop``: the maildrop file the
        message comes from (:attr:`EnvelopeRecord.maildrop`). ``held``: queued on hold (parked, ``held``; a
        ``header_checks`` HOLD), delivered only once an administrator releases it.

        ``on_durable`` runs once the covering fsync is done, even if the caller was cancelled meanwhile
        (an SMTP client that hangs up after its final dot). The queue runner for new mail sees the
        envelope only from then on: a message that is not durable is never delivered.
        Raises StorageFull / StorageError / StorageFatal (nothing acknowledged); StorageFull also when the
        spool has less than ``minfree_bytes`` + the message free.
        """
        if self.commit_backlog_max and self.settling >= self.commit_backlog_max:
            raise QueueBusy(f"{self.settling} messages wait for an fsync (commit_backlog_max)")
        if self.messages_max and self.counts.total() >= self.messages_max:
            raise StorageFull(f"the queue holds {self.counts.total()} messages (queue_messages_max)")
        if isinstance(body, BodyBuffer) and body.failure is not None:
            raise storage_error(body.failure, "temporary body file")
        size = body.size if isinstance(body, BodyBuffer) else len(body)
        if self.minfree_bytes and self.log.free_bytes() < self.minfree_bytes + size:
            raise StorageFull(f"spool free space below queue_minfree_bytes ({self.minfree_bytes} bytes)")
        env, pos, lsn = self._append_message(
            sender, recipients, body, mail_params, rcpt_params, client, helo, not_before_ts=not_before_ts,
            queue_id=queue_id, maildrop=maildrop, held=held,
        )
        # Settled by a callback at the end of the covering fsync round, which runs even if this caller is
        # cancelled meanwhile (the client hung up) and lets the 250 out one loop turn after the fsync, before
        # the delivery of the message starts (Log.when_durable).
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.settling += 1
        self.log.when_durable(lsn, functools.partial(self._settled, env, pos, done))
        await done
        return env

    def new_body(self) -> BodyBuffer:
        """A buffer for one message being received (give it to :meth:`receive`, then close it): memory
        per receiving session is bounded by :attr:`body_memory_bytes`, not by the message size."""
        return BodyBuffer(self.log.directory, memory_bytes=self.body_memory_bytes)

    def _append_message(
        self,
        sender: str,
        recipients: Sequence[str],
        body: bytes | BodyBuffer,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
        client: str = "",
        helo: str = "",
        bounce_of: str = "",
        not_before_ts: float | None = None,
        bounce_start: Pos | None = None,
        queue_id: str = "",
        maildrop: str = "",
        held: bool = False,
    ) -> tuple[EnvelopeRecord, Pos, int]:
        now = self.clock()
        delayed = not_before_ts is not None and not_before_ts > now
        qid = queue_id or new_queue_id(now)
        if isinstance(body, BodyBuffer) and body.spilled:
            size = body.size
            try:
                data_pos, _ = self.log.append_data(qid, body.pieces, size)
            except OSError as exc:  # the temporary file could not be read back: nothing was appended
                raise storage_error(exc, "temporary body file") from exc
        else:
            if isinstance(body, BodyBuffer):
                body = body.getvalue()
            size = len(body)
            data_pos, _ = self.log.append(DataRecord(queue_id=qid, body=body))
        rps = rcpt_params or [()] * len(recipients)
        env = EnvelopeRecord(
            queue_id=qid,
            generation=0,
            arrival_ts=now,
            not_before_ts=now,
            sender=sender,
            recipients=tuple(
                Recipient(index=i, address=a, params=tuple(p))
                for i, (a, p) in enumerate(zip(recipients, rps, strict=True))
            ),
            data=data_pos,
            size=size,
            mail_params=tuple(mail_params),
            client=client,
            helo=helo,
            bounce_of=bounce_of,
            bounce_start=bounce_start,
            runner=PARKED if delayed or held else 0,
            maildrop=maildrop,
            held=held,
        )
        if delayed:
            assert not_before_ts is not None
            env = msgspec.structs.replace(env, not_before_ts=not_before_ts)
        pos, lsn = self.log.append(env)
        self.counts.added(env)
        if delayed or held:
            self.parked.add(pos, env)
        return env, pos, lsn

    def _settled(self, env: EnvelopeRecord, pos: Pos, done: asyncio.Future[None], error: StorageFatal | None) -> None:
        self.settling -= 1
        if error is not None:
            if not done.done():
                done.set_exception(error)
            return
        self.received += 1
        try:
            self.on_durable(env, pos)
        finally:
            if not done.done():  # cancelled: the caller is gone, the message is queued all the same
                done.set_result(None)

    def start(self, envelope_pos: Pos, env: EnvelopeRecord, *, admin: str = "") -> Attempt:
        """Begin an attempt (or, with ``admin``, an administrator's action): append START (not waited for);
        from now the envelope is garbage."""
        rec = StartRecord(queue_id=env.queue_id, envelope=envelope_pos, ts=self.clock(), runner=env.runner, admin=admin)
        pos, _ = self.log.append(rec)
        if self.on_start is not None:
            self.on_start(pos, envelope_pos)
        self.counts.started(env)
        self.parked.remove(envelope_pos)
        return self.working.start(pos, envelope_pos, env)

    def admin(
        self, envelope_pos: Pos, env: EnvelopeRecord, action: str, *, release_ts: float | None = None
    ) -> tuple[EnvelopeRecord | FinishRecord, Pos, int]:
        """An administrator's ``action`` (one of ADMIN_ACTIONS) on the live envelope at ``envelope_pos``.

        Appends START (``admin=action``) and its conclusion back to back (FINISH, or a replacement with the
        DATA copied forward; ``bounce`` also queues the DSN first), and marks the envelope revoked so that
        an offer of it still on its way to a worker is dropped. Returns the concluding record, its position
        and the LSN to commit before reporting success. A replacement whose DATA cannot be copied for want of
        space or a read error names the old DATA (pinned until it is concluded again). Raises StorageError
        (nothing appended counts until committed), CorruptRecord if the data does not check out.
        """
        if action not in ADMIN_ACTIONS:
            raise ValueError(f"unknown admin action {action!r}")
        attempt = self.start(envelope_pos, env, admin=action)
        self.revoked.add(envelope_pos)
        return self.finish_admin(attempt, action, release_ts=release_ts)

    async def copy_forward(self, envelope_pos: Pos, env: EnvelopeRecord) -> Pos | None:
        """Copy the parked envelope at ``envelope_pos`` and its DATA to the end of the log, unchanged (held
        stays held, a delayed one keeps its due time; counts do not change). Returns the new envelope's
        position, or None when the envelope was no longer parked once its DATA had been read (an
        administrator's action or its due time came meanwhile; nothing appended).

        The DATA is read once, and checked, in a thread, before anything is appended (never in the event
        loop: a large held message does not hold up the SMTP sessions, issue 31.10). Then START(admin="copy"),
        the DATA copy and the replacement are appended as book-keeping, in that order (so that a hole that
        takes the copy lies within the attempt, and recovery concludes it again: docs/log_format.md).

        A full disk (issue 31.5): if the START does not fit, nothing is appended and the envelope stays
        parked; if the DATA copy does not fit, nothing of it is left and the envelope is put back at once,
        a replacement naming its old DATA (pinned, as a retry that could not copy its DATA), and the
        StorageError is raised after that; if the replacement does not fit either, the copy stays open (the
        message counts as active) and :meth:`finish_open_copies` (each checkpoint) appends it once there is
        room. Never an attempt that nothing concludes while the process runs.

        Raises CorruptRecord (the DATA does not check out; the message stays where it is), StorageError
        (StorageFull: a full disk; see above)."""
        salt = self.log.salt_of(env.data.segment)
        body = await asyncio.to_thread(self._read_checked, env, salt)
        failure: StorageError | None = None
        try:
            if envelope_pos not in self.parked or envelope_pos in self.reserved:
                return None  # an administrator's action has it (or had it meanwhile)
            attempt = self.start(envelope_pos, env, admin=COPY_FORWARD)  # StorageError: nothing appended
            self.revoked.add(envelope_pos)
            try:
                try:
                    if isinstance(body, bytes):
                        data_pos, _ = self.log.append(DataRecord(queue_id=env.queue_id, body=body))
                    else:
                        data_pos, _ = self.log.append_data(env.queue_id, body.pieces, body.size)
                except OSError as exc:  # the temporary copy could not be read back: nothing appended
                    raise storage_error(exc, "temporary body file") from exc
            except StorageFatal:
                raise
            except StorageError as exc:
                data_pos, failure = env.data, exc  # put back as it was: the old DATA, pinned
        finally:
            if isinstance(body, BodyBuffer):
                body.close()
        self._open_copies[attempt.start_pos] = (attempt, data_pos)
        pos = self.finish_open_copies()[-1]
        if failure is not None:
            raise failure
        return pos

    def finish_open_copies(self) -> list[Pos]:
        """Append the replacement of every copy forward whose START is in the log but whose replacement could
        not be appended (a full disk); return their positions, oldest first. Raises StorageError (those not
        done stay open: the working set keeps their envelopes; recovery completes them after a restart)."""
        done = []
        for start_pos, (attempt, data_pos) in sorted(self._open_copies.items()):
            _rec, pos, _lsn = self.finish_admin(attempt, COPY_FORWARD, data=data_pos)
            del self._open_copies[start_pos]
            done.append(pos)
        return done

    def _read_checked(self, env: EnvelopeRecord, salt: int) -> bytes | BodyBuffer:
        """The body of ``env``, read once through a handle of its own and checked (in a thread): bytes when
        smaller than :attr:`stream_bytes_min`, else a :class:`BodyBuffer` (memory up to
        :attr:`body_memory_bytes`, the rest in a temporary file) that the caller closes. Raises CorruptRecord,
        StorageError."""
        pieces = StoredBody(self.log, env).pieces(salt=salt)
        if env.size < self.stream_bytes_min:
            return b"".join(pieces)
        buf = self.new_body()
        try:
            for piece in pieces:
                buf.write(piece)
            if buf.failure is not None:
                raise storage_error(buf.failure, "temporary body file")
        except BaseException:
            buf.close()
            raise
        return buf

    def finish_admin(
        self, attempt: Attempt, action: str, *, release_ts: float | None = None, data: Pos | None = None
    ) -> tuple[EnvelopeRecord | FinishRecord, Pos, int]:
        """Conclude the admin action started as ``attempt`` (also used by recovery). See :meth:`admin`.
        ``data``: the DATA the replacement names, already appended (else it is copied here); a reference far
        behind the replacement is pinned (:attr:`data_pins`) until the message is concluded again."""
        env = attempt.envelope
        if action == "bounce":
            code, enhanced, text = ADMIN_BOUNCE
            for r in env.recipients:
                attempt.outcomes[r.index] = Outcome(index=r.index, status="failed", code=code, enhanced=enhanced, text=text)
            c, pos = self.conclude(attempt)
            return c.record, pos, self.log.appended_lsn
        if action == "delay" and release_ts is None:
            release_ts = self.clock()  # recovery completing a delay cut short: due now rather than lost
        rec = admin_conclusion(env, attempt.start_pos, action, self.clock(), release_ts)
        if isinstance(rec, EnvelopeRecord):
            if data is None:
                try:
                    data = self.copy_data(env)
                except StorageFatal:
                    raise
                except StorageError:
                    # A full disk or a read error (issue 31.5): the action still concludes, its replacement
                    # naming the old DATA (pinned below), rather than leave an attempt nothing concludes.
                    data = env.data
            rec = msgspec.structs.replace(rec, data=data)
        pos, lsn = self.log.append(rec)
        self.working.concluded(attempt.start_pos)
        self.data_pins.pop(attempt.envelope_pos, None)  # an admin action copies the DATA forward or ends it
        if isinstance(rec, EnvelopeRecord) and far_data(pos, rec):
            self.data_pins[pos] = rec.data  # its DATA could not be copied: that segment stays until it is concluded
        self.counts.concluded(rec if isinstance(rec, EnvelopeRecord) else None)
        if isinstance(rec, EnvelopeRecord) and rec.runner == PARKED:
            self.parked.add(pos, rec)
        return rec, pos, lsn

    def body_for_delivery(self, env: EnvelopeRecord, *, check: bool = True) -> bytes | StoredBody:
        """The message content to send: the bytes when smaller than :attr:`stream_bytes_min`, else a
        :class:`StoredBody` read from the log in pieces while it is sent (memory bounded by the piece size,
        not the message; issue 15.2). Either way the DATA record has been checked (its checksum in a
        streaming pass) before this returns; with ``check=False`` a StoredBody is not checked yet, and the
        caller must await :meth:`StoredBody.verify_yielding` before sending anything. Raises CorruptRecord,
        StorageError as :meth:`read_body`.
        """
        if env.size < self.stream_bytes_min:
            return self.read_body(env)
        body = StoredBody(self.log, env)
        if check:
            body.verify()
        return body

    def copy_data(self, env: EnvelopeRecord) -> Pos:
        """Append a copy of the DATA record of ``env`` (a large one in pieces: a checksum pass, then the
        copy, never held whole); return its position. Raises CorruptRecord (nothing appended),
        StorageError (nothing of the record left in the log)."""
        if env.size >= self.stream_bytes_min:
            pos, _ = self.log.append_data(env.queue_id, StoredBody(self.log, env).pieces, env.size)
        else:
            pos, _ = self.log.append(DataRecord(queue_id=env.queue_id, body=self.read_body(env)))
        return pos

    def read_body(self, env: EnvelopeRecord) -> bytes:
        """The message content. Raises CorruptRecord when the DATA record does not check out."""
        rec = self.log.read(env.data)
        if not isinstance(rec, DataRecord) or rec.queue_id != env.queue_id:
            raise CorruptRecord(f"{env.queue_id}: data reference {env.data} is not its DATA record")
        return rec.body

    async def record_outcomes(
        self, attempt: Attempt, relay: str, outcomes: Sequence[Outcome], *, remote_dsn: bool = False, tls: str = ""
    ) -> None:
        """Append a DELIVERY record for ``outcomes`` and wait until it is durable (GUIDE I2); its fsync waits up
        to ``delivery_linger_s`` for a client's commit to share. The record is appended before the first
        await, and the commit round fsyncs it even if the caller is cancelled while it waits (an abandoned
        attempt keeps the replies it had). Raises StorageFatal if that fsync failed."""
        rec = DeliveryRecord(
            queue_id=attempt.queue_id,
            start=attempt.start_pos,
            ts=self.clock(),
            relay=relay,
            outcomes=tuple(outcomes),
            remote_dsn=remote_dsn,
            tls=tls,
        )
        _pos, lsn = self.log.append(rec)
        self.working.delivery(rec)
        await self.log.commit(lsn, linger_s=self.delivery_linger_s)

    def conclude(self, attempt: Attempt, body: bytes | None = None) -> tuple[Conclusion, Pos]:
        """End ``attempt``: queue the DSNs it calls for, then append FINISH or a replacement envelope.

        ``body`` is the message content if the caller has it (else it is read when needed). Returns the
        conclusion (its record with the copied DATA reference) and the position of that record.
        """
        now = self.clock()
        c = conclude(attempt, now, self.policy, age_ts=self.age_clock())
        env = attempt.envelope
        rec = c.record
        copied: Pos | None = None
        if isinstance(rec, EnvelopeRecord) and body is None and not c.dsn_groups and env.size >= self.stream_bytes_min:
            # A large message retried later is copied forward in pieces (two passes: the checksum, then the
            # copy), never held whole. CorruptRecord leaves the log as it was; on a read error (EIO, EMFILE)
            # or a full disk the replacement names the old DATA.
            try:
                copied = self.copy_data(env)
            except StorageError:
                copied = None
        elif isinstance(rec, EnvelopeRecord) and body is None:
            # Read before anything is appended: CorruptRecord here leaves the log as it was, so a caller that
            # bounces the rest and concludes again does not queue this attempt's DSNs twice.
            try:
                body = self.read_body(env)
            except StorageError:
                body = None  # EIO, EMFILE: not copied forward this time; the replacement names the old DATA
        if c.dsn_groups[attempt.dsns_queued:]:
            original = body if body is not None else self._body_or_empty(env)
            for group in c.dsn_groups[attempt.dsns_queued:]:
                self._queue_dsn(env, group, original, now, attempt.start_pos)
                attempt.dsns_queued += 1
        if isinstance(rec, EnvelopeRecord):
            if body is not None:
                data_pos, _ = self.log.append(DataRecord(queue_id=env.queue_id, body=body))
                rec = msgspec.structs.replace(rec, data=data_pos)
            else:
                rec = msgspec.structs.replace(rec, data=copied if copied is not None else env.data)
            c = Conclusion(rec, c.failed, c.delayed, c.succeeded, c.expired)
        pos, _ = self.log.append(rec)
        self.working.concluded(attempt.start_pos)
        self.data_pins.pop(attempt.envelope_pos, None)
        if isinstance(rec, EnvelopeRecord) and far_data(pos, rec):
            self.data_pins[pos] = rec.data  # not copied forward: its segment must outlive the retry
        self.counts.concluded(rec if isinstance(rec, EnvelopeRecord) else None)
        if isinstance(rec, EnvelopeRecord) and rec.runner == PARKED:
            self.parked.add(pos, rec)
        if c.dsn_groups or isinstance(rec, EnvelopeRecord):
            # Runners read only durable records: a DSN or a retry must not wait for the next checkpoint.
            # A FINISH (the common case) rides on whatever fsync comes next.
            self.log.sync_soon()
        return c, pos

    def _body_or_empty(self, env: EnvelopeRecord) -> bytes:
        try:
            return self.read_body(env)
        except (CorruptRecord, StorageError):
            return b""

    def _queue_dsn(self, env: EnvelopeRecord, items: tuple[DsnItem, ...], original: bytes, now: float,
                   start: Pos) -> None:
        lifetime_end = env.arrival_ts + self.policy.lifetime_of(env)
        recips = [
            DsnRecipient(
                final_recipient=i.recipient.address,
                action=i.action,
                status=i.status,
                original_recipient=_param(i.recipient.params, "ORCPT"),
                diagnostic=f"smtp; {format_reply(i.outcome)}" if i.outcome is not None else None,
                last_attempt_ts=now,
                will_retry_until_ts=lifetime_end if i.action == "delayed" else None,
            )
            for i in items
        ]
        qid = new_queue_id(now)
        msg = build_dsn(
            reporting_mta=self.reporting_mta,
            sender=env.sender,
            recipients=recips,
            original=original,
            ret=(_param(env.mail_params, "RET") or "FULL").upper(),
            envid=_param(env.mail_params, "ENVID"),
            arrival_ts=env.arrival_ts,
            now_ts=now,
            queue_id=env.queue_id,
            message_id=f"{qid}@{self.reporting_mta}",
            size_limit=self.bounce_size_limit_bytes,
        )
        msg = self.sign(msg, original)
        dsn_env, _pos, _lsn = self._append_message("", [env.sender], msg, bounce_of=env.queue_id,
                                                   bounce_start=start)
        self.on_dsn(dsn_env, env.queue_id, items[0].action, items)
