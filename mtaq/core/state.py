"""Queue state rebuilt from records, and the end of a delivery attempt (pure: no clock, no I/O).

The state transitions of a message live here and only here (h11 ``_state.py`` habit)::

    record            message state before      after
    ----------------  ------------------------  -----------------------------------------------
    ENVELOPE gen 0    (absent)                  waiting  (incoming; due at not_before_ts)
    START             waiting                   active   (its envelope is now garbage)
    DELIVERY          active                    active   (outcomes of this attempt recorded)
    ENVELOPE gen n+1  active                    waiting  (deferred; replaces the START)
    FINISH            active                    (absent: left the queue)

Records are applied in log order. Since records refer only backwards, a reference to a message the state
does not know means its envelope lived in a segment already reclaimed; such records are counted as
``orphans`` and otherwise ignored. Anything else out of order is returned as a note (``apply`` never raises
for bad data: recovery must always finish, GUIDE I5).

``conclude`` decides what ends an attempt (seed 001): a FINISH when no recipient is left, else a replacement
envelope carrying the recipients left to retry. A recipient without a final outcome is one whose attempt
was interrupted by a crash: its outcome is *unknown* (GUIDE I4) and it is retried (at-least-once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    Record,
    SealRecord,
    StartRecord,
)

__all__ = ["Message", "QueueState", "RetryPolicy", "conclude", "format_reply"]

UNKNOWN_REPLY = "outcome unknown: delivery attempt interrupted by a crash"


@dataclass(slots=True)
class Message:
    """A message in the queue: its current envelope and, while active, the attempt's outcomes so far."""

    envelope: EnvelopeRecord
    envelope_pos: Pos
    start_pos: Pos | None = None
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    @property
    def queue_id(self) -> str:
        return self.envelope.queue_id

    @property
    def active(self) -> bool:
        """True between START and the FINISH or replacement envelope that concludes the attempt."""
        return self.start_pos is not None


@dataclass(slots=True)
class QueueState:
    """All messages in the queue, keyed by queue ID; rebuilt by applying records in log order."""

    messages: dict[str, Message] = field(default_factory=dict)
    orphans: int = 0
    records_applied: int = 0

    def apply(self, pos: Pos, record: Record) -> str | None:
        """Apply ``record`` found at ``pos``; return a note when it does not fit the state (else None)."""
        self.records_applied += 1
        if isinstance(record, (DataRecord, SealRecord)):
            return None
        qid = record.queue_id
        msg = self.messages.get(qid)
        if isinstance(record, EnvelopeRecord):
            if msg is None:
                # A replacement whose earlier records were reclaimed is live mail all the same.
                self.messages[qid] = Message(record, pos)
                return None
            note = None
            if record.replaces is None:
                note = f"{qid}: second original envelope at {pos}"
            elif msg.start_pos != record.replaces:
                note = f"{qid}: replacement at {pos} replaces {record.replaces}, active start is {msg.start_pos}"
            msg.envelope, msg.envelope_pos, msg.start_pos = record, pos, None
            msg.outcomes = {}
            return note
        if msg is None:
            self.orphans += 1
            return None
        if isinstance(record, StartRecord):
            note = None
            if msg.active:
                note = f"{qid}: START at {pos} while attempt {msg.start_pos} is active"
            elif record.envelope != msg.envelope_pos:
                note = f"{qid}: START at {pos} names envelope {record.envelope}, current is {msg.envelope_pos}"
            msg.start_pos = pos
            msg.outcomes = {}
            return note
        if isinstance(record, DeliveryRecord):
            if record.start != msg.start_pos:
                return f"{qid}: DELIVERY at {pos} for attempt {record.start}, active is {msg.start_pos}"
            for o in record.outcomes:
                msg.outcomes[o.index] = o
            return None
        if isinstance(record, FinishRecord):
            if record.start != msg.start_pos:
                return f"{qid}: FINISH at {pos} for attempt {record.start}, active is {msg.start_pos}"
            del self.messages[qid]
            return None
        return f"unexpected record {type(record).__name__} at {pos}"  # pragma: no cover - Record is closed

    def counts(self) -> dict[str, int]:
        """Messages by state: ``incoming`` (never tried), ``deferred`` (tried, waiting), ``active``."""
        c = {"incoming": 0, "deferred": 0, "active": 0}
        for m in self.messages.values():
            if m.active:
                c["active"] += 1
            elif m.envelope.attempts == 0:
                c["incoming"] += 1
            else:
                c["deferred"] += 1
        return c


class RetryPolicy(msgspec.Struct, frozen=True):
    """When to try again: ``intervals_s[k]`` seconds after attempt k+1 failed (the last interval repeats).

    RFC 5321 §4.5.4.1: the retry interval SHOULD be at least 30 minutes.
    """

    intervals_s: tuple[float, ...] = (1800.0, 3600.0, 7200.0, 14400.0)

    def delay_after(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th attempt (1-based) deferred."""
        if attempts < 1:
            return 0.0
        return self.intervals_s[min(attempts - 1, len(self.intervals_s) - 1)]


def format_reply(o: Outcome) -> str:
    """A reply as mail administrators read it: ``451 4.3.0 text``."""
    return " ".join(p for p in (str(o.code), o.enhanced, o.text) if p)


def conclude(msg: Message, now_ts: float, policy: RetryPolicy) -> EnvelopeRecord | FinishRecord:
    """The record that ends ``msg``'s active attempt: FINISH, or a replacement envelope (seed 001).

    Recipients with a ``deferred`` outcome, or with no outcome (crash: *unknown*), are carried over.
    A replacement is due ``policy.delay_after(attempts)`` seconds from ``now_ts`` (UTC seconds), or at
    once when some recipient's outcome is unknown (at-least-once: retry what may not have arrived).
    Raises ValueError when the message is not active.
    """
    if msg.start_pos is None:
        raise ValueError(f"{msg.queue_id}: no active attempt to conclude")
    env = msg.envelope
    left: list[Recipient] = []
    unknown = False
    for r in env.recipients:
        o = msg.outcomes.get(r.index)
        if o is None:
            left.append(msgspec.structs.replace(r, unknown=True, last_reply=UNKNOWN_REPLY))
            unknown = True
        elif o.status == "deferred":
            left.append(msgspec.structs.replace(r, unknown=False, last_reply=format_reply(o)))
    if not left:
        return FinishRecord(queue_id=env.queue_id, start=msg.start_pos, ts=now_ts)
    attempts = env.attempts + 1
    due = now_ts if unknown else now_ts + policy.delay_after(attempts)
    return msgspec.structs.replace(
        env,
        generation=env.generation + 1,
        not_before_ts=due,
        recipients=tuple(left),
        attempts=attempts,
        replaces=msg.start_pos,
    )
