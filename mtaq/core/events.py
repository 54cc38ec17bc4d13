"""Delivery events derived from the queue log (issue 37.1): pure, standard library and the record types only.

The log already holds every outcome durably; an exporter reads it forward (mtaq.daemon.exporter) and turns
each record into zero or more events with :class:`EventDeriver`. Nothing is written for the events: a
``received`` event is the generation-0 ENVELOPE, ``delivered``/``deferred``/``bounced`` are the outcomes of
a DELIVERY record, ``expired`` and ``outcome_unknown`` are read off the record that concludes an attempt
(FINISH or a replacement ENVELOPE), ``held``/``released``/``deleted`` off the conclusion of an
administrator's START, and ``dsn_queued`` is the first ENVELOPE of a DSN (``bounce_of`` set).

The schema is versioned (:data:`SCHEMA_VERSION`; docs/events.md, docs/event_schema.json). Every event has
``schema``, ``id``, ``event``, ``queue_id``, ``ts`` (UTC seconds, the record's time) and ``position`` (the
record's log position ``segment:offset``). ``id`` is stable across re-reads of the same record (a restart),
so a receiver drops duplicates by it (delivery is at least once).

What must always hold: events of one message come out in log order (the order of its records); the
deriver keeps only the attempts it saw start and has not seen concluded (a few per delivery worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.parking import ADMIN_BOUNCE
from mtaq.core.records import (
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Record,
    StartRecord,
)
from mtaq.core.state import format_reply

__all__ = ["EVENTS", "SCHEMA_VERSION", "EventDeriver"]

SCHEMA_VERSION = 1
EVENTS = ("received", "delivered", "deferred", "bounced", "expired", "dsn_queued", "held", "released",
          "deleted", "outcome_unknown")
_ADMIN_EVENT = {"hold": "held", "release": "released", "delete": "deleted"}
_STATUS = {"delivered": "sent", "deferred": "deferred", "failed": "bounced"}
_EVENT = {"delivered": "delivered", "deferred": "deferred", "failed": "bounced"}

Event = dict[str, Any]


@dataclass(slots=True)
class _Open:
    """An attempt (or administrator's action) whose START was read and whose conclusion was not yet."""

    envelope: EnvelopeRecord | None  # None: unreadable (reclaimed or damaged)
    admin: str
    ts: float  # the START's time, then the latest DELIVERY's: the time of a replacement that concludes it
    outcomes: dict[int, Outcome] = field(default_factory=dict)


class EventDeriver:
    """Turns records, in log order, into events (dicts of JSON values).

    ``read(pos)`` returns the record at a position (an envelope or START named by a later record) or raises
    (any exception: the fields it would give are left out, ``recipient`` then reads ``#INDEX``).
    ``category(code, enhanced, text)`` gives a reply's bounce category (mtaq.core.bounce_class).
    """

    def __init__(self, read: Callable[[Pos], Record], category: Callable[[int, str, str], str]) -> None:
        self.read = read
        self.category = category
        self.open: dict[Pos, _Open] = {}  # START position -> attempt

    def earliest_open(self) -> Pos | None:
        """The START of the oldest attempt seen starting and not yet concluded (None: none)."""
        return min(self.open) if self.open else None

    def _attempt(self, start: Pos) -> _Open:
        """The attempt started at ``start``; read from the log when its START was before where reading began."""
        o = self.open.get(start)
        if o is not None:
            return o
        env: EnvelopeRecord | None = None
        admin = ""
        ts = 0.0
        try:
            rec = self.read(start)
            if isinstance(rec, StartRecord):
                admin, ts = rec.admin, rec.ts
                e = self.read(rec.envelope)
                env = e if isinstance(e, EnvelopeRecord) else None
        except Exception:  # reclaimed or damaged: the events go out with what the record itself says
            env = None
        o = self.open[start] = _Open(env, admin, ts)
        return o

    def feed(self, pos: Pos, rec: Record) -> list[Event]:
        """The events of the record at ``pos`` (possibly none)."""
        if isinstance(rec, EnvelopeRecord):
            out: list[Event] = []
            if rec.replaces is not None:
                out = self._concluded(pos, rec.replaces, rec.queue_id, None, rec)
            elif rec.bounce_of:
                out.append(self._base("dsn_queued", pos, rec.queue_id, rec.arrival_ts)
                           | {"dsn_for": rec.bounce_of, "sender": rec.sender,
                              "recipients": [r.address for r in rec.recipients], "size": rec.size})
            elif rec.generation == 0:
                out.append(self._base("received", pos, rec.queue_id, rec.arrival_ts)
                           | {"sender": rec.sender, "recipients": [r.address for r in rec.recipients],
                              "size": rec.size, "client": rec.client, "helo": rec.helo,
                              "arrival_ts": rec.arrival_ts, "held": rec.held})
            return out
        if isinstance(rec, StartRecord):
            env: EnvelopeRecord | None
            try:
                e = self.read(rec.envelope)
                env = e if isinstance(e, EnvelopeRecord) else None
            except Exception:
                env = None
            self.open[pos] = _Open(env, rec.admin, rec.ts)
            return []
        if isinstance(rec, DeliveryRecord):
            o = self._attempt(rec.start)
            o.ts = max(o.ts, rec.ts)
            out = []
            for i, oc in enumerate(rec.outcomes):
                o.outcomes[oc.index] = oc
                ev = self._recipient(_EVENT[oc.status], pos, rec.queue_id, rec.ts, o.envelope, oc.index, i)
                ev |= {"relay": rec.relay, "status": _STATUS[oc.status], "reply": format_reply(oc),
                       "code": oc.code, "dsn": oc.enhanced, "tls": rec.tls or "none"}
                if oc.status != "delivered":
                    ev["category"] = self.category(oc.code, oc.enhanced, oc.text)
                out.append(ev)
            return out
        if isinstance(rec, FinishRecord):
            return self._concluded(pos, rec.start, rec.queue_id, rec.ts, None)
        return []

    def _concluded(self, pos: Pos, start: Pos, queue_id: str, ts: float | None,
                   replacement: EnvelopeRecord | None) -> list[Event]:
        o = self._attempt(start)
        del self.open[start]
        if ts is None:  # a replacement has no time of its own: its attempt's latest
            ts = o.ts
        env = o.envelope
        if o.admin in _ADMIN_EVENT:
            ev = self._base(_ADMIN_EVENT[o.admin], pos, queue_id, ts)
            if env is not None:
                ev |= {"sender": env.sender, "recipients": [r.address for r in env.recipients]}
            return [ev]
        if o.admin == "bounce":
            code, enhanced, text = ADMIN_BOUNCE
            out = []
            for i, r in enumerate(env.recipients if env is not None else ()):
                out.append(self._recipient("bounced", pos, queue_id, ts, env, r.index, i)
                           | {"relay": "none", "status": "bounced", "reply": f"{code} {enhanced} {text}",
                              "code": code, "dsn": enhanced, "tls": "none",
                              "category": self.category(code, enhanced, text)})
            return out
        if o.admin or env is None:
            return []  # flush, delay, copy forward, recovery's end: no event; nothing to compare with
        left = {r.index: r for r in replacement.recipients} if replacement is not None else {}
        out = []
        for i, r in enumerate(env.recipients):
            oc = o.outcomes.get(r.index)
            nr = left.get(r.index)
            if nr is not None:
                if nr.unknown:
                    out.append(self._recipient("outcome_unknown", pos, queue_id, ts, env, r.index, i)
                               | {"status": "unknown", "reply": nr.last_reply})
            elif oc is None or oc.status == "deferred":
                # Gone without a final reply: its lifetime ran out (4.4.7), or its data could not be read
                # (554 5.3.0, a bounce: then the reply was never written to a DELIVERY record).
                if oc is not None:
                    out.append(self._recipient("expired", pos, queue_id, ts, env, r.index, i)
                               | {"status": "expired", "reply": format_reply(oc), "code": oc.code, "dsn": "4.4.7",
                                  "category": "message_expired"})
                else:
                    out.append(self._recipient("bounced", pos, queue_id, ts, env, r.index, i)
                               | {"relay": "none", "status": "bounced",
                                  "reply": "554 5.3.0 message data unreadable in queue", "code": 554,
                                  "dsn": "5.3.0", "tls": "none",
                                  "category": self.category(554, "5.3.0", "message data unreadable in queue")})
        return out

    @staticmethod
    def _base(event: str, pos: Pos, queue_id: str, ts: float, sub: int | None = None) -> Event:
        eid = f"{queue_id}.{pos.segment}.{pos.offset}" + ("" if sub is None else f".{sub}")
        return {"schema": SCHEMA_VERSION, "id": eid, "event": event, "queue_id": queue_id, "ts": round(ts, 6),
                "position": str(pos)}

    def _recipient(self, event: str, pos: Pos, queue_id: str, ts: float, env: EnvelopeRecord | None,
                   index: int, sub: int) -> Event:
        ev = self._base(event, pos, queue_id, ts, sub)
        ev["recipient_index"] = index
        if env is None:
            ev["recipient"] = f"#{index}"
            return ev
        r = next((r for r in env.recipients if r.index == index), None)
        ev |= {"recipient": r.address if r is not None else f"#{index}", "sender": env.sender,
               "attempt": env.attempts + 1, "arrival_ts": env.arrival_ts,
               "delay": round(max(0.0, ts - env.arrival_ts), 3)}
        return ev

