"""The queue as of one log position: a fold over records (pure: no I/O), for listings and admin selection.

Feed :meth:`QueueView.apply` every record in log order, up to a position P; the view then holds every
message in the queue as of P (its live envelope, or its envelope under an open attempt, which is
*active*) and the last reply each recipient got. A listing built from it is consistent as of P, unlike
Postfix's ``mailq``, which walks directories while they change and can show a message twice or miss it
(GUIDE §4). The view can be brought forward by applying what came after P.

What must hold: a message is live as of P iff its newest envelope before P has no START before P, or
has one whose attempt has no FINISH and no replacement before P (then it is active), or an older envelope
of it has no START before P (recovery ended a newer one whose own START was lost: issue 31.2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mtaq.core.parking import state_of
from mtaq.core.records import DeliveryRecord, EnvelopeRecord, FinishRecord, Pos, Record, StartRecord

__all__ = ["Entry", "QueueView", "Selector", "listing_key"]


def listing_key(e: Entry) -> tuple[int, str]:
    """The order of a listing: arrival time (whole UTC seconds, as ``arrival_time`` shows it), then queue ID
    (which starts with its microseconds, so within a second it is the arrival order). Every shard's listing
    has this order, and a paging cursor names the key of the last message of a page."""
    env = e.envelope
    return (int(env.arrival_ts), env.queue_id)


@dataclass(slots=True)
class Entry:
    """One message in the view: its current envelope and where it is, and its state."""

    pos: Pos
    envelope: EnvelopeRecord
    state: str
    start: Pos | None = None  # the open attempt's START when active

    @property
    def queue_id(self) -> str:
        return self.envelope.queue_id

    def as_json(self, reasons: dict[int, str]) -> dict[str, Any]:
        """One object like ``postqueue -j``: queue_name, queue_id, arrival_time (UTC s), message_size,
        sender, recipients [{address, delay_reason}], plus state, release_time (delayed), position."""
        env = self.envelope
        state = self.state
        if reasons:
            rcpts = [{"address": r.address, "delay_reason": reasons[r.index]} if r.index in reasons
                     else {"address": r.address} for r in env.recipients]
        else:
            rcpts = [{"address": r.address} for r in env.recipients]
        pos = self.pos
        out: dict[str, Any] = {
            "queue_name": state,
            "queue_id": env.queue_id,
            "arrival_time": int(env.arrival_ts),
            "message_size": env.size,
            "sender": env.sender,
            "recipients": rcpts,
            "state": state,
            "attempts": env.attempts,
            "position": f"{pos.segment}:{pos.offset}",
        }
        if state == "delayed" or (state == "deferred" and env.not_before_ts > 0):
            out["release_time" if state == "delayed" else "next_attempt_time"] = round(env.not_before_ts, 3)
        return out


@dataclass
class QueueView:
    """Every message as of ``end`` (see the module docstring). ``apply`` records in log order."""

    end: Pos = field(default_factory=lambda: Pos(0, 0))
    entries: dict[str, Entry] = field(default_factory=dict)  # queue_id -> entry
    _by_start: dict[Pos, str] = field(default_factory=dict)  # open START -> queue_id
    # Envelopes no START has named yet, by queue ID. Normally one; two when recovery ended a replacement
    # whose START was lost (issue 31.2): the older one is live again once the newer one is ended.
    _unstarted: dict[str, dict[Pos, EnvelopeRecord]] = field(default_factory=dict)
    _reasons: dict[str, dict[int, str]] = field(default_factory=dict)  # queue_id -> index -> last reply
    # Damage met while reading the log into this view: segment -> problems (``Problem`` text), so that a
    # listing reports it (a listing never passes over damage silently). Kept while the segment exists.
    damage: dict[int, list[str]] = field(default_factory=dict)
    # queue_id -> its listing object as JSON bytes, made at a listing and dropped by any record of the message
    _rendered: dict[str, bytes] = field(default_factory=dict)

    def apply(self, pos: Pos, rec: Record, end: Pos) -> None:
        """Fold the record at ``pos`` (which ends at ``end``) into the view."""
        self.end = end
        if self._rendered and not isinstance(rec, FinishRecord):
            self._rendered.pop(getattr(rec, "queue_id", ""), None)
        if isinstance(rec, EnvelopeRecord):
            if rec.replaces is not None:
                self._by_start.pop(rec.replaces, None)
            self.entries[rec.queue_id] = Entry(pos, rec, state_of(rec))
            self._unstarted.setdefault(rec.queue_id, {})[pos] = rec
            for r in rec.recipients:
                if r.last_reply:
                    reasons = self._reasons.setdefault(rec.queue_id, {})
                    if r.index not in reasons:
                        reasons[r.index] = r.last_reply
        elif isinstance(rec, StartRecord):
            waiting = self._unstarted.get(rec.queue_id)
            if waiting is not None:
                waiting.pop(rec.envelope, None)
                if not waiting:
                    del self._unstarted[rec.queue_id]
            e = self.entries.get(rec.queue_id)
            if e is not None and e.pos == rec.envelope:
                e.state, e.start = "active", pos
                self._by_start[pos] = rec.queue_id
        elif isinstance(rec, DeliveryRecord):
            reasons = self._reasons.setdefault(rec.queue_id, {})
            for o in rec.outcomes:
                reasons[o.index] = f"{o.code} {o.enhanced} {o.text}".replace("  ", " ").strip()
        elif isinstance(rec, FinishRecord):
            qid = self._by_start.pop(rec.start, None)
            if qid is not None:
                self._rendered.pop(qid, None)
                left = self._unstarted.get(qid)
                if left:  # an older envelope of the message no START named: it is the live one again
                    lpos = max(left)
                    self.entries[qid] = Entry(lpos, left[lpos], state_of(left[lpos]))
                else:
                    self.entries.pop(qid, None)
                    self._reasons.pop(qid, None)

    def rendered(self, e: Entry) -> bytes:
        """``e.as_json(...)`` encoded as JSON (msgspec), kept until a record of the message changes it."""
        b = self._rendered.get(e.queue_id)
        if b is None:
            b = self._rendered[e.queue_id] = msgspec.json.encode(e.as_json(self.reasons(e.queue_id)))
        return b

    def reasons(self, queue_id: str) -> dict[int, str]:
        """The last reply per recipient index (deferrals and failures; ``delay_reason`` in listings)."""
        return self._reasons.get(queue_id, {})

    def counts(self) -> dict[str, int]:
        """Messages by state in this view (a full count; ``mtaq queue size`` uses the daemon's counters)."""
        out = {s: 0 for s in ("incoming", "active", "deferred", "delayed", "held")}
        for e in self.entries.values():
            out[e.state] += 1
        out["total"] = len(self.entries)
        return out


@dataclass(frozen=True)
class Selector:
    """Which messages an admin command acts on or lists (Postfix ``postsuper``/``exiqgrep`` filters).

    ``ids`` (exact queue IDs) or ``all`` (``ALL`` spelled out) choose the candidates; every other field
    narrows them: sender / recipient (case-insensitive substring of the address), domain (the recipient
    domain, after the last ``@``), held / deferred (state), older_than_s (arrival before now - that).
    """

    ids: tuple[str, ...] = ()
    all: bool = False
    sender: str | None = None
    recipient: str | None = None
    domain: str | None = None
    held: bool = False
    deferred: bool = False
    older_than_s: float | None = None

    def is_empty(self) -> bool:
        """True when it names nothing (an admin action needs IDs, ALL or a filter)."""
        return not (self.ids or self.all or self.sender or self.recipient or self.domain or self.held
                    or self.deferred or self.older_than_s is not None)

    def matches(self, e: Entry, now_ts: float) -> bool:
        env = e.envelope
        if self.ids and env.queue_id not in self.ids:
            return False
        if self.sender is not None and self.sender.lower() not in env.sender.lower():
            return False
        addrs = [r.address.lower() for r in env.recipients]
        if self.recipient is not None and not any(self.recipient.lower() in a for a in addrs):
            return False
        if self.domain is not None:
            d = self.domain.lower().lstrip("@")
            if not any(a.rpartition("@")[2] == d for a in addrs):
                return False
        if self.held and e.state != "held":
            return False
        if self.deferred and e.state != "deferred":
            return False
        return not (self.older_than_s is not None and env.arrival_ts > now_ts - self.older_than_s)

    def filters(self) -> bool:
        """True when something narrows the candidates (IDs or a filter): :meth:`matches` must be asked."""
        return bool(self.ids or self.sender or self.recipient or self.domain or self.held or self.deferred
                    or self.older_than_s is not None)

    def select(self, entries: Iterable[Entry], now_ts: float) -> list[Entry]:
        """Matching entries in listing order (:func:`listing_key`: arrival, then queue ID)."""
        if not self.filters():
            return sorted(entries, key=listing_key)
        return sorted((e for e in entries if self.matches(e, now_ts)), key=listing_key)

