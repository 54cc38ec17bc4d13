"""The working set, the retry schedule, and the end of a delivery attempt (pure: no clock, no I/O).

Seed 001 keeps almost nothing about queued mail in memory: deferred envelopes stay in the log, and the queue
runners find them there. What memory holds is the *working set*, the attempts that have started and are not
yet concluded. Their START records begin the working suffix that recovery must read. The transitions:

    record                        effect
    ----------------------------  ---------------------------------------------------------------
    ENVELOPE (runner k)           waiting for runner k (in the log only); due at not_before_ts
    START (names the envelope)    attempt enters the working set; the envelope is garbage from now
    DELIVERY (names the START)    outcomes of that attempt recorded (durable before they count)
    ENVELOPE replaces=START       attempt concluded; the replacement waits for its runner
    FINISH (names the START)      attempt concluded; nothing left

``conclude`` decides what ends an attempt: a FINISH when no recipient is left, otherwise a replacement
envelope with the recipients left to retry. It also decides which DSNs (RFC 3464) are due: failures
(5xx, or the queue lifetime ran out: 4.4.7), delay warnings, and success or relayed notices that
NOTIFY asked for (RFC 3461 §4.1). A recipient without a final outcome is one whose attempt a crash
interrupted. Its outcome is *unknown* (GUIDE I4), and it is retried at once by the runner for new mail
(at-least-once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mtaq.core.records import (
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
)

__all__ = [
    "UNKNOWN_REPLY",
    "Attempt",
    "Conclusion",
    "DsnItem",
    "RetryPolicy",
    "WorkingSet",
    "conclude",
    "format_reply",
    "notify_of",
]

UNKNOWN_REPLY = "outcome unknown: delivery attempt interrupted by a crash"


@dataclass(slots=True)
class Attempt:
    """A started, not yet concluded delivery attempt of the envelope at ``envelope_pos``."""

    envelope: EnvelopeRecord
    envelope_pos: Pos
    start_pos: Pos
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    remote_dsn: bool = False
    # DSN groups of the conclusion already queued: a conclusion that failed after queueing them (a full
    # disk at the replacement) is concluded again without queueing them twice.
    dsns_queued: int = 0

    @property
    def queue_id(self) -> str:
        return self.envelope.queue_id


@dataclass(slots=True)
class WorkingSet:
    """Attempts by the position of their START record (seed 001: the working messages)."""

    attempts: dict[Pos, Attempt] = field(default_factory=dict)

    def start(self, start_pos: Pos, envelope_pos: Pos, envelope: EnvelopeRecord) -> Attempt:
        a = Attempt(envelope=envelope, envelope_pos=envelope_pos, start_pos=start_pos)
        self.attempts[start_pos] = a
        return a

    def delivery(self, rec: DeliveryRecord) -> bool:
        """Record the outcomes of ``rec``; False when its attempt is not in the working set."""
        a = self.attempts.get(rec.start)
        if a is None:
            return False
        for o in rec.outcomes:
            a.outcomes[o.index] = o
        a.remote_dsn = a.remote_dsn or rec.remote_dsn
        return True

    def concluded(self, start_pos: Pos) -> Attempt | None:
        """Remove and return the attempt started at ``start_pos`` (None if it is not there)."""
        return self.attempts.pop(start_pos, None)

    def earliest_start(self) -> Pos | None:
        """The start of the working suffix (seed 001): the earliest START not yet concluded."""
        return min(self.attempts, default=None)

    def earliest_envelope(self) -> Pos | None:
        """The earliest envelope still needed by an attempt (true garbage ends before it)."""
        return min((a.envelope_pos for a in self.attempts.values()), default=None)

    def __len__(self) -> int:
        return len(self.attempts)


class RetryPolicy(msgspec.Struct, frozen=True):
    """The retry schedule and lifetimes, in seconds (RFC 5321 §4.5.4.1; Postfix's names).

    Runner 0 takes new mail. Runner k >= 1 takes mail deferred for the k-th time, after ``intervals_s[k-1]``
    seconds. The last runner also takes every later retry. ``maximal_queue_lifetime_s`` (5 days) and
    ``bounce_queue_lifetime_s`` (for mail from ``<>``) are when deferred mail is given up (4.4.7).
    ``delay_warning_time_s`` > 0 sends one delay DSN after that long (0: never).
    """

    intervals_s: tuple[float, ...] = (1800.0, 3600.0, 7200.0, 14400.0)
    maximal_queue_lifetime_s: float = 5 * 86400.0
    bounce_queue_lifetime_s: float = 5 * 86400.0
    delay_warning_time_s: float = 0.0

    @property
    def runners(self) -> int:
        """Number of queue runners: one for new mail plus one per retry interval."""
        return 1 + len(self.intervals_s)

    def runner_after(self, attempts: int) -> int:
        """The runner for mail deferred ``attempts`` (>= 1) times."""
        return max(1, min(attempts, len(self.intervals_s)))

    def delay_of(self, runner: int) -> float:
        """Seconds from deferral to the next attempt for mail of ``runner``."""
        return 0.0 if runner <= 0 else self.intervals_s[min(runner, len(self.intervals_s)) - 1]

    def lifetime_of(self, env: EnvelopeRecord) -> float:
        return self.bounce_queue_lifetime_s if env.sender == "" else self.maximal_queue_lifetime_s


def format_reply(o: Outcome) -> str:
    """A reply as mail administrators read it: ``451 4.3.0 text``."""
    return " ".join(p for p in (str(o.code), o.enhanced, o.text) if p)


def notify_of(r: Recipient) -> frozenset[str] | None:
    """The recipient's RFC 3461 NOTIFY set (None when not given: failures, and delays at our discretion)."""
    for k, v in r.params:
        if k.upper() == "NOTIFY":
            return frozenset(x.strip().upper() for x in v.split(",") if x.strip())
    return None


@dataclass(frozen=True, slots=True)
class DsnItem:
    """One recipient's line in a DSN: RFC 3464 Action and Status, and the reply behind it (if any)."""

    recipient: Recipient
    action: str  # failed | delayed | delivered | relayed
    status: str  # enhanced status code
    outcome: Outcome | None


@dataclass(frozen=True, slots=True)
class Conclusion:
    """What ends an attempt: the record to append, and the DSNs to send before it (from ``<>``)."""

    record: EnvelopeRecord | FinishRecord
    failed: tuple[DsnItem, ...] = ()
    delayed: tuple[DsnItem, ...] = ()
    succeeded: tuple[DsnItem, ...] = ()
    expired: tuple[Recipient, ...] = ()

    @property
    def dsn_groups(self) -> list[tuple[DsnItem, ...]]:
        """The DSN messages to send, one per kind, non-empty only."""
        return [g for g in (self.failed, self.delayed, self.succeeded) if g]


def conclude(attempt: Attempt, now_ts: float, policy: RetryPolicy, *, age_ts: float | None = None) -> Conclusion:
    """Decide how ``attempt`` ends, at ``now_ts`` (UTC seconds).

    ``age_ts`` (UTC seconds, default ``now_ts``) is the time the message's age is measured at, for the
    lifetime (expiry, 4.4.7) and the delay warning: the queue gives a time that a forward step of the wall
    clock does not move (issue 31.8; :meth:`mtaq.queue.store.Queue.age_clock`).

    Recipients left are those with a ``deferred`` outcome (unless the lifetime ran out: then they fail
    with 4.4.7) and those with no outcome (unknown: retried at once by runner 0). The replacement keeps
    the envelope's DATA reference; the caller may copy the data forward. DSNs go to the sender unless it
    is ``<>`` (a DSN is never sent to the null sender, RFC 3464 §2, RFC 5321 §4.5.5).
    """
    env = attempt.envelope
    left: list[Recipient] = []
    failed: list[DsnItem] = []
    succeeded: list[DsnItem] = []
    expired: list[Recipient] = []
    unknown = False
    age = (now_ts if age_ts is None else age_ts) - env.arrival_ts
    out_of_time = age >= policy.lifetime_of(env)
    for r in env.recipients:
        o = attempt.outcomes.get(r.index)
        notify = notify_of(r)
        if o is None:
            left.append(msgspec.structs.replace(r, unknown=True, last_reply=UNKNOWN_REPLY))
            unknown = True
        elif o.status == "deferred":
            if out_of_time:
                expired.append(r)
                if notify is None or "FAILURE" in notify:
                    failed.append(DsnItem(r, "failed", "4.4.7", o))
            else:
                left.append(msgspec.structs.replace(r, unknown=False, last_reply=format_reply(o)))
        elif o.status == "failed":
            if notify is None or "FAILURE" in notify:
                failed.append(DsnItem(r, "failed", o.enhanced or "5.0.0", o))
        elif notify is not None and "SUCCESS" in notify and not attempt.remote_dsn:
            # The next hop did not offer DSN: we report that we relayed it (RFC 3461 §6.2.6).
            succeeded.append(DsnItem(r, "relayed", o.enhanced or "2.0.0", o))
    if env.sender == "":
        failed, succeeded = [], []
    if not left:
        rec: EnvelopeRecord | FinishRecord = FinishRecord(queue_id=env.queue_id, start=attempt.start_pos, ts=now_ts)
        return Conclusion(rec, tuple(failed), (), tuple(succeeded), tuple(expired))
    attempts = env.attempts + 1
    runner = 0 if unknown else policy.runner_after(attempts)
    delayed: list[DsnItem] = []
    warn = (
        policy.delay_warning_time_s > 0
        and not env.warned
        and env.sender != ""
        and age >= policy.delay_warning_time_s
    )
    if warn:
        for r in left:
            notify = notify_of(r)
            if notify is None or "DELAY" in notify:
                o = attempt.outcomes.get(r.index)
                delayed.append(DsnItem(r, "delayed", (o.enhanced if o else "") or "4.0.0", o))
    replacement = msgspec.structs.replace(
        env,
        generation=env.generation + 1,
        not_before_ts=now_ts + policy.delay_of(runner),
        recipients=tuple(left),
        attempts=attempts,
        replaces=attempt.start_pos,
        runner=runner,
        warned=env.warned or bool(delayed) or warn,
    )
    return Conclusion(replacement, tuple(failed), tuple(delayed), tuple(succeeded), tuple(expired))
