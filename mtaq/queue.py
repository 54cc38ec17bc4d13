"""The queue: appends records to the log and applies them to the in-memory state, in that order.

Every change to the queue goes through here, so the state is always what the log says (a record is applied
only after it was appended). What waits for an fsync and what does not (seed 001, GUIDE §3):

* receiving: DATA + ENVELOPE, then ``commit`` - the 250 comes after;
* delivery outcomes: DELIVERY, then ``commit`` - a recipient counts as done only after;
* START, FINISH and replacement envelopes: appended, not waited for (book-keeping, recovered if lost).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence

from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    StartRecord,
)
from mtaq.core.state import Message, QueueState, RetryPolicy, conclude
from mtaq.errors import CorruptRecord
from mtaq.storage.log import Log

__all__ = ["Queue", "new_queue_id"]

_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
_last_us = 0


def new_queue_id(now_ts: float | None = None) -> str:
    """A queue ID that is never reused: 11 symbols of microseconds since the epoch + 4 random symbols."""
    global _last_us
    us = int((time.time() if now_ts is None else now_ts) * 1_000_000)
    if us <= _last_us:
        us = _last_us + 1
    _last_us = us
    n = (us << 20) | int.from_bytes(os.urandom(3), "big") & 0xFFFFF
    out = []
    for _ in range(15):
        out.append(_B32[n & 31])
        n >>= 5
    return "".join(reversed(out))


class Queue:
    """The log plus the state it implies. ``clock`` returns UTC seconds (injectable for tests)."""

    def __init__(
        self,
        log: Log,
        *,
        policy: RetryPolicy,
        clock: Callable[[], float] = time.time,
        state: QueueState | None = None,
    ) -> None:
        self.log = log
        self.state = state or QueueState()
        self.policy = policy
        self.clock = clock
        self.received = 0
        # Called with each new envelope once it is durable (the daemon logs `queued` and schedules it).
        self.on_durable: Callable[[EnvelopeRecord], None] = lambda env: None

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

        The message enters the queue state, and ``on_durable`` is called, only after the covering fsync,
        and even if the caller is cancelled meanwhile (an SMTP client that hangs up after its final dot):
        a durable message is always scheduled, a message that is not durable never is.
        Raises StorageFull / StorageError / StorageFatal (nothing acknowledged).
        """
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
        )
        env_pos, lsn = self.log.append(env)
        await asyncio.shield(self._settle(env_pos, env, lsn))
        return env

    async def _settle(self, pos: Pos, env: EnvelopeRecord, lsn: int) -> None:
        await self.log.commit(lsn)
        self.state.apply(pos, env)
        self.received += 1
        self.on_durable(env)

    def start(self, queue_id: str) -> Message:
        """Begin an attempt: append START (not waited for). Raises KeyError/ValueError if not startable."""
        msg = self.state.messages[queue_id]
        if msg.active:
            raise ValueError(f"{queue_id} is already being delivered")
        rec = StartRecord(queue_id=queue_id, envelope=msg.envelope_pos, ts=self.clock())
        pos, _ = self.log.append(rec)
        self.state.apply(pos, rec)
        return msg

    def read_body(self, msg: Message) -> bytes:
        """The message content. Raises CorruptRecord when the DATA record does not check out."""
        rec = self.log.read(msg.envelope.data)
        if not isinstance(rec, DataRecord) or rec.queue_id != msg.queue_id:
            raise CorruptRecord(f"{msg.queue_id}: data reference {msg.envelope.data} is not its DATA record")
        return rec.body

    async def record_outcomes(self, msg: Message, relay: str, outcomes: Sequence[Outcome]) -> None:
        """Append a DELIVERY record for ``outcomes`` and wait until it is durable (GUIDE I2)."""
        assert msg.start_pos is not None
        rec = DeliveryRecord(
            queue_id=msg.queue_id, start=msg.start_pos, ts=self.clock(), relay=relay, outcomes=tuple(outcomes)
        )
        pos, lsn = self.log.append(rec)
        self.state.apply(pos, rec)
        await self.log.commit(lsn)

    def conclude(self, msg: Message) -> EnvelopeRecord | FinishRecord:
        """End the active attempt: append FINISH or a replacement envelope (not waited for)."""
        rec = conclude(msg, self.clock(), self.policy)
        pos, _ = self.log.append(rec)
        self.state.apply(pos, rec)
        return rec

    def position_of(self, queue_id: str) -> Pos | None:
        msg = self.state.messages.get(queue_id)
        return None if msg is None else msg.envelope_pos
