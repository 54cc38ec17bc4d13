"""The queue: every change goes through here, appended to the log first, then to the in-memory working set.

What waits for an fsync and what does not (seed 001, GUIDE §3):

* receiving: DATA + ENVELOPE, then ``commit`` - the 250 comes after;
* delivery outcomes: DELIVERY, then ``commit`` - a recipient counts as done only after;
* START, FINISH, replacement envelopes and DSNs: appended, not waited for (book-keeping). The log is
  ordered and fsync covers a whole prefix, so a DSN appended before the conclusion that caused it is
  durable whenever that conclusion is; if both are lost, recovery concludes the attempt again.

A replacement envelope gets a fresh copy of the DATA record, so that mail deferred for days never pins an
old segment (reclamation deletes a prefix of segments).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Sequence

import msgspec

from mtaq.core.dsn import DsnRecipient, build_dsn
from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    Outcome,
    Pos,
    Recipient,
    StartRecord,
)
from mtaq.core.state import Attempt, Conclusion, DsnItem, RetryPolicy, WorkingSet, conclude, format_reply
from mtaq.errors import CorruptRecord, StorageFull
from mtaq.storage.log import Log

__all__ = ["Queue", "new_queue_id", "set_queue_id_shard"]

_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
_last_us = 0
_shard = -1


def set_queue_id_shard(shard: int) -> None:
    """In worker ``shard`` (0..15) of a sharded spool (mtaq.workers): the low 4 bits of every queue ID are
    ``shard``, so that IDs made by different worker processes can never be equal."""
    global _shard
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
    out = []
    for _ in range(15):
        out.append(_B32[n & 31])
        n >>= 5
    return "".join(reversed(out))


def _param(params: Sequence[tuple[str, str]], key: str) -> str | None:
    for k, v in params:
        if k.upper() == key:
            return v
    return None


class Queue:
    """The log plus the working set it implies. ``clock`` returns UTC seconds (injectable for tests)."""

    def __init__(
        self,
        log: Log,
        *,
        policy: RetryPolicy,
        clock: Callable[[], float] = time.time,
        reporting_mta: str | None = None,
    ) -> None:
        self.log = log
        self.policy = policy
        self.clock = clock
        self.reporting_mta = reporting_mta or socket.getfqdn()
        self.working = WorkingSet()
        self.received = 0
        # New mail is refused (452 4.3.1) while the spool has less than this many bytes free, so that
        # deliveries, which free space, can still write their records (Postfix's queue_minfree). 0: no floor.
        self.minfree_bytes = 0
        # Called with each new envelope and its position once it is durable (the daemon logs `queued`).
        self.on_durable: Callable[[EnvelopeRecord, Pos], None] = lambda env, pos: None
        # Called for each DSN queued: (dsn envelope, original queue ID, kind).
        self.on_dsn: Callable[[EnvelopeRecord, str, str], None] = lambda env, qid, kind: None

    async def receive(
        self,
        sender: str,
        recipients: Sequence[str],
        body: bytes,
        *,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
        client: str = "",
        helo: str = "",
    ) -> EnvelopeRecord:
        """Append a new message and return its envelope once it is durable (the caller may then say 250).

        ``on_durable`` runs once the covering fsync is done, even if the caller was cancelled meanwhile
        (an SMTP client that hangs up after its final dot). The queue runner for new mail sees the
        envelope only from then on: a message that is not durable is never delivered.
        Raises StorageFull / StorageError / StorageFatal (nothing acknowledged); StorageFull also when the
        spool has less than ``minfree_bytes`` + the message free.
        """
        if self.minfree_bytes and self.log.free_bytes() < self.minfree_bytes + len(body):
            raise StorageFull(f"spool free space below queue_minfree_bytes ({self.minfree_bytes} bytes)")
        env, pos, lsn = self._append_message(sender, recipients, body, mail_params, rcpt_params, client, helo)
        await asyncio.shield(self._settle(env, pos, lsn))
        return env

    def _append_message(
        self,
        sender: str,
        recipients: Sequence[str],
        body: bytes,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
        client: str = "",
        helo: str = "",
        bounce_of: str = "",
    ) -> tuple[EnvelopeRecord, Pos, int]:
        now = self.clock()
        qid = new_queue_id(now)
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
            size=len(body),
            mail_params=tuple(mail_params),
            client=client,
            helo=helo,
            bounce_of=bounce_of,
        )
        pos, lsn = self.log.append(env)
        return env, pos, lsn

    async def _settle(self, env: EnvelopeRecord, pos: Pos, lsn: int) -> None:
        await self.log.commit(lsn)
        self.received += 1
        self.on_durable(env, pos)

    def start(self, envelope_pos: Pos, env: EnvelopeRecord) -> Attempt:
        """Begin an attempt: append START (not waited for); from now the envelope is garbage."""
        rec = StartRecord(queue_id=env.queue_id, envelope=envelope_pos, ts=self.clock(), runner=env.runner)
        pos, _ = self.log.append(rec)
        return self.working.start(pos, envelope_pos, env)

    def read_body(self, env: EnvelopeRecord) -> bytes:
        """The message content. Raises CorruptRecord when the DATA record does not check out."""
        rec = self.log.read(env.data)
        if not isinstance(rec, DataRecord) or rec.queue_id != env.queue_id:
            raise CorruptRecord(f"{env.queue_id}: data reference {env.data} is not its DATA record")
        return rec.body

    async def record_outcomes(
        self, attempt: Attempt, relay: str, outcomes: Sequence[Outcome], *, remote_dsn: bool = False
    ) -> None:
        """Append a DELIVERY record for ``outcomes`` and wait until it is durable (GUIDE I2)."""
        rec = DeliveryRecord(
            queue_id=attempt.queue_id,
            start=attempt.start_pos,
            ts=self.clock(),
            relay=relay,
            outcomes=tuple(outcomes),
            remote_dsn=remote_dsn,
        )
        _pos, lsn = self.log.append(rec)
        self.working.delivery(rec)
        await self.log.commit(lsn)

    def conclude(self, attempt: Attempt, body: bytes | None = None) -> tuple[Conclusion, Pos]:
        """End ``attempt``: queue the DSNs it calls for, then append FINISH or a replacement envelope.

        ``body`` is the message content if the caller has it (else it is read when needed). Returns the
        conclusion (its record with the copied DATA reference) and the position of that record.
        """
        now = self.clock()
        c = conclude(attempt, now, self.policy)
        env = attempt.envelope
        if c.dsn_groups:
            if body is None:
                body = self._body_or_empty(env)
            for group in c.dsn_groups:
                self._queue_dsn(env, group, body, now)
        rec = c.record
        if isinstance(rec, EnvelopeRecord):
            if body is None:
                body = self.read_body(env)
            data_pos, _ = self.log.append(DataRecord(queue_id=env.queue_id, body=body))
            rec = msgspec.structs.replace(rec, data=data_pos)
            c = Conclusion(rec, c.failed, c.delayed, c.succeeded, c.expired)
        pos, _ = self.log.append(rec)
        self.working.concluded(attempt.start_pos)
        if c.dsn_groups or isinstance(rec, EnvelopeRecord):
            # Runners read only durable records: a DSN or a retry must not wait for the next checkpoint.
            # A FINISH (the common case) rides on whatever fsync comes next.
            self.log.sync_soon()
        return c, pos

    def _body_or_empty(self, env: EnvelopeRecord) -> bytes:
        try:
            return self.read_body(env)
        except CorruptRecord:
            return b""

    def _queue_dsn(self, env: EnvelopeRecord, items: tuple[DsnItem, ...], original: bytes, now: float) -> None:
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
        )
        dsn_env, _pos, _lsn = self._append_message("", [env.sender], msg, bounce_of=env.queue_id)
        self.on_dsn(dsn_env, env.queue_id, items[0].action)
